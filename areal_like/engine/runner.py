"""The model runner: an HF causal LM, a slot KV cache, one decode step for every running row.

Everything here runs on ONE worker thread (the scheduler's executor); nothing here is thread-safe
and nothing here touches asyncio, HTTP or tokenization of requests.

KV layout: `SlotKV`, one preallocated buffer per layer of shape (slots, kv_heads, capacity, head_dim).
Running row i lives in slot i (rows are kept compact in slots 0..B-1) and stores the key/value of
its token at absolute position p at index p, so RoPE positions and cache indices stay per row.
```
 decode step:  write each row's new K/V at its own position (one index_put per layer, no copy)
               attend over slots[:B, :, :max_pos+1] (a view) with a (B,1,1,L) bool mask pos ≤ own pos
 join:         admitted prompts are prefilled together (left-padded, one forward), then their K/V
               are written into their slots; the n samples of one prompt share ONE prefill row
               (prefix reuse: the prompt's K/V is copied into the n slots)
 leave:        the last row moves into the freed slot (O(L) copy per leaving row, not per step)
```
The capacity grows by doubling up to --max-context-len, so memory follows the longest live row.
The model's own forward runs unchanged (its attention calls `past_key_values.update`); we pass a
prepared 4D mask so no per-step mask building happens inside transformers (sdpa attention only).

Per step there is exactly one device→host transfer: tokens, logprobs, finish codes (and the top
logprobs when a row asked for them) are packed into one float64 tensor.

Logprobs keep the one shared definition (`log_softmax(logits / T)` of the raw logits, PROTOCOL.md):
penalties and the min_new_tokens EOS mask shape what is *sampled*, like top-p/top-k, but do not
renormalise the reported logprobs — so the learner's recomputation matches exactly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_like.engine.lora import LoraSlots
from areal_like.weights.adapter import base_layer_name, is_lora_name
from areal_like.weights.delta import apply_all as apply_deltas
from areal_like.engine.sampling import GREEDY_EPS, apply_penalties, sample_next

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Row finish codes returned by `step` (one int per produced token; decided on the device in batch).
RUNNING, FINISH_STOP, FINISH_LENGTH = 0, 1, 2


@dataclass(eq=False)  # identity semantics: a Seq is a row handle, used as a dict key
class Seq:
    """One sequence being generated. Owned by the scheduler; the runner reads the sampling fields."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # EOS (unless ignore_eos) + stop_token_ids
    seed: int = 0  # derived per sample; int64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_logprobs_num: int = 0  # top-k logprobs to report per output token
    stop_strs: tuple[str, ...] = ()  # checked by the scheduler's text_stop hook (tokenization lives there)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # per output token: (logprobs, token ids) of the top `top_logprobs_num` tokens
    output_top: list[tuple[list[float], list[int]]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens whose K/V came from another row's prefill (n>1 groups)
    # --enable-lora: the adapter this row runs with — the name the request gave (`lora_path`) and the
    # runner's slot (peft adapter name) it resolved to at admission; None = the base model
    lora_name: str | None = None
    lora: str | None = None
    # return_routed_experts (MoE): the experts the routers chose at each position the engine ran, from
    # position 0 — chunks of (positions, layers × top-k) int32 arrays; the first recording of a position
    # is kept (a re-prefill after a retract does not replace it)
    return_routes: bool = False
    routes: list = field(default_factory=list)
    routes_n: int = 0

    # Prefill input: prompt + tokens generated before a retract (the runner drops the KV on retract).
    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def has_penalty(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass
class StepOutput:
    seqs: list[Seq]  # rows that produced a token this step, in this order
    tokens: list[int]
    logprobs: list[float]
    finish: list[int]  # RUNNING | FINISH_STOP | FINISH_LENGTH per row
    prefill_tokens: int
    seconds: float
    top: list | None = None  # per row: (top logprobs, top ids) for rows with top_logprobs_num > 0, else None


class SlotKV:
    """Preallocated per-slot KV for all layers; duck-types the `Cache.update` the HF attention calls.

    Two modes, set by the runner before each forward:
    - decode: `update` writes the (B, H, 1, D) new K/V at `pos_B` of slots 0..B-1 and returns views
      of the first `kv_len` positions;
    - prefill: `update` writes the left-padded (P, H, T, D) K/V of the prompts into their slots
      (`dst_slots` ← prefill row `src_rows`, aligned to position 0) and returns the prompts' own K/V.
    """

    def __init__(self, num_layers: int, slots: int, kv_heads: int, head_dim: int, dtype, device, capacity: int,
                 max_capacity: int):
        self.num_layers, self.slots, self.kv_heads, self.head_dim = num_layers, slots, kv_heads, head_dim
        self.dtype, self.device, self.max_capacity = dtype, device, max_capacity
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._alloc(min(capacity, max_capacity))
        self.mode = "decode"
        self.n_rows = 0
        self.kv_len = 0
        self.pos_B: torch.Tensor | None = None
        self.gather_PT: torch.Tensor | None = None  # prefill: source index of slot position t for row p
        self.src_rows: torch.Tensor | None = None
        self.dst_slots: torch.Tensor | None = None

    def _alloc(self, capacity: int) -> None:
        shape = (self.slots, self.kv_heads, capacity, self.head_dim)
        old_k, old_v, old_cap = self.k, self.v, self.capacity
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        for i in range(len(old_k)):
            self.k[i][:, :, :old_cap] = old_k[i]
            self.v[i][:, :, :old_cap] = old_v[i]
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def free(self) -> None:
        """Drop every layer's tensors (release_memory_occupation); `ensure`/`_alloc` allocate again."""
        self.k, self.v, self.capacity = [], [], 0

    def ensure(self, length: int) -> None:
        """Make room for positions [0, length); doubling keeps the copies amortised."""
        if length > self.capacity:
            self._alloc(min(self.max_capacity, max(length, 2 * self.capacity)))

    def move(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy slots `src` → `dst` (disjoint index sets), positions [0, length)."""
        for k, v in zip(self.k, self.v):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        k, v = self.k[layer_idx], self.v[layer_idx]
        if self.mode == "decode":
            B = self.n_rows
            rows_B = torch.arange(B, device=k.device)
            k[rows_B, :, self.pos_B] = key_states[:, :, 0]  # (B, H, D) at each row's own position
            v[rows_B, :, self.pos_B] = value_states[:, :, 0]
            return k[:B, :, :self.kv_len], v[:B, :, :self.kv_len]
        # prefill: realign the left-padded rows to position 0, then copy into the target slots
        P, H, T, D = key_states.shape
        idx = self.gather_PT[:, None, :, None].expand(P, H, T, D)
        k_al, v_al = key_states.gather(2, idx), value_states.gather(2, idx)
        k[self.dst_slots, :, :T] = k_al.index_select(0, self.src_rows)
        v[self.dst_slots, :, :T] = v_al.index_select(0, self.src_rows)
        return key_states, value_states


class ModelRunner:
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_context_len: int = 512,
                 max_batch_size: int = 64, max_prefill_tokens: int = 4096, fp32_lm_head: bool = False,
                 max_lora_rank: int = 0, lora_target_modules: list[str] | None = None, max_loras_per_batch: int = 8):
        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.max_context_len = max_context_len
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # sdpa: the prepared 4D bool masks below are in sdpa's convention (True = attend)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype,
                                                          attn_implementation="sdpa").to(self.device).eval()
        if fp32_lm_head:  # --enable-fp32-lm-head (model.fp32_lm_head): the learner computes its logits the same way
            from areal_like.learner.logprobs import fp32_lm_head as _fp32

            _fp32(self.model.lm_head, cache_weight=True)  # cast once per weight update, not per step
        self.config = self.model.config
        # Qwen2-style models take masks per layer type (a dict skips their own mask building); others
        # (Llama) return a prepared 4D mask as-is from create_causal_mask.
        per_type = getattr(self.config, "layer_types", None) is not None
        self._mask = (lambda m: {"full_attention": m}) if per_type else (lambda m: m)
        self.vocab_size = int(self.config.vocab_size)
        self.eos_token_ids = self._eos_ids()
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.kv = SlotKV(cfg.num_hidden_layers, max_batch_size, kv_heads, head_dim, self.dtype, self.device,
                         capacity=128, max_capacity=max_context_len)
        S, dev = max_batch_size, self.device
        f32, i64 = torch.float32, torch.long
        # Per-slot state, written at join, moved on leave, sliced [:B] in the decode step.
        self.st = {
            "last_tok": torch.zeros(S, dtype=i64, device=dev), "next_pos": torch.zeros(S, dtype=i64, device=dev),
            "gen_count": torch.zeros(S, dtype=i64, device=dev), "temp": torch.ones(S, dtype=f32, device=dev),
            "top_p": torch.ones(S, dtype=f32, device=dev), "top_k": torch.full((S,), -1, dtype=i64, device=dev),
            "min_p": torch.zeros(S, dtype=f32, device=dev), "seed": torch.zeros(S, dtype=i64, device=dev),
            "max_new": torch.zeros(S, dtype=i64, device=dev), "min_new": torch.zeros(S, dtype=i64, device=dev),
            "freq": torch.zeros(S, dtype=f32, device=dev), "pres": torch.zeros(S, dtype=f32, device=dev),
            "rep": torch.ones(S, dtype=f32, device=dev),
        }
        self.stop_SW = torch.full((S, 1), -1, dtype=i64, device=dev)  # stop ids per slot, −1 padded
        self.counts_SV: torch.Tensor | None = None  # generated-token counts, allocated at the first penalty row
        self.rows: list[Seq] = []  # rows[i] lives in slot i
        self.slot_of: dict[int, int] = {}  # id(seq) → slot
        self.join_pos: list[int] = [0] * S  # next_pos at join …
        self.join_step: list[int] = [0] * S  # … and the step counter then: pos = join_pos + steps since
        self.steps = 0
        self.max_next_pos = 0  # host copy of max(next_pos[:B]): the decode attention length − 1
        self._released_shapes: list[tuple[torch.nn.Parameter, tuple[int, ...]]] = []  # weights while released
        self._flags_dirty = True
        # --enable-lora: peft adapters (slots) in the model; rows of more distinct adapters than
        # --max-loras-per-batch wait in `deferred` (admitted by the scheduler, prefilled later)
        self.lora = LoraSlots(self.model, max_rank=max_lora_rank, target_modules=lora_target_modules or []) \
            if max_lora_rank > 0 else None
        self.max_loras_per_batch = max_loras_per_batch
        self.deferred: list[Seq] = []
        # MoE: each router's chosen experts, captured in the forwards of rows that asked for them
        from areal_like.learner.moe import find_routers, routing_shape

        self.routers = find_routers(self.model)
        self.route_shape = routing_shape(self.config) if self.routers else (0, 0)
        self._captured: dict[int, torch.Tensor] | None = None
        for layer, router in self.routers:
            router.register_forward_hook(lambda _m, _a, out, layer=layer: self._capture(layer, out))

    def _eos_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        for src in (getattr(self.model, "generation_config", None), self.config):
            eos = getattr(src, "eos_token_id", None) if src is not None else None
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def _rebuild_flags(self) -> None:
        """Host-side facts about the batch that let the step skip work; only on membership change."""
        rows = self.rows
        self.needs_filter = any(s.top_p < 1.0 or s.top_k > 0 or s.min_p > 0.0 for s in rows)
        self.all_greedy = all(s.temperature < GREEDY_EPS for s in rows)
        self.any_penalty = any(s.has_penalty for s in rows)
        self.any_min_new = any(s.min_new_tokens > len(s.output_ids) for s in rows)
        self.top_n = max([s.top_logprobs_num for s in rows] + [0])
        self.any_routes = bool(self.routers) and any(s.return_routes for s in rows)  # capture the routed experts
        self._flags_dirty = False

    # ---------------------------------------------------------------- membership
    def release(self, seqs: list[Seq]) -> None:
        """Drop rows (finished, aborted, retracted); the last rows move into the freed slots."""
        if self.deferred and seqs:
            ids = {id(s) for s in seqs}
            self.deferred = [s for s in self.deferred if id(s) not in ids]
        gone = sorted({self.slot_of[id(s)] for s in seqs if id(s) in self.slot_of}, reverse=True)
        if not gone:
            return
        self._release_rows(gone)
        if self.lora is not None:
            self.lora.collect(self.lora_in_use())

    def _release_rows(self, gone: list[int]) -> None:
        perm = list(range(len(self.rows)))  # perm[i] = original slot of the row now at i
        for slot in gone:
            last = len(perm) - 1
            perm[slot] = perm[last]
            perm.pop()
            self.slot_of.pop(id(self.rows[slot]), None)
            self.rows[slot] = self.rows[last]
            self.rows.pop()
            self.join_pos[slot], self.join_step[slot] = self.join_pos[last], self.join_step[last]
        moves = [(src, dst) for dst, src in enumerate(perm) if src != dst]  # src ≥ new B > dst: disjoint
        if moves:
            src = torch.tensor([m[0] for m in moves], dtype=torch.long, device=self.device)
            dst = torch.tensor([m[1] for m in moves], dtype=torch.long, device=self.device)
            for t in self.st.values():
                t[dst] = t[src]
            self.stop_SW[dst] = self.stop_SW[src]
            if self.counts_SV is not None:
                self.counts_SV[dst] = self.counts_SV[src]
            self.kv.move(src, dst, self.max_next_pos + 1)
            for d in dst.tolist():
                self.slot_of[id(self.rows[d])] = d
        self.max_next_pos = max([self._pos(i) for i in range(len(self.rows))] + [0])
        self._flags_dirty = True

    def _pos(self, slot: int) -> int:
        return self.join_pos[slot] + self.steps - self.join_step[slot]

    def _assign(self, seqs: list[Seq]) -> torch.Tensor:
        """Give each admitted seq a slot and write its sampling parameters there."""
        dev = self.device
        first = len(self.rows)
        if first + len(seqs) > self.max_batch_size:
            raise RuntimeError(f"{first + len(seqs)} rows exceed --max-batch-size {self.max_batch_size}")
        slots = list(range(first, first + len(seqs)))
        for slot, s in zip(slots, seqs):
            self.rows.append(s)
            self.slot_of[id(s)] = slot
        dst = torch.tensor(slots, dtype=torch.long, device=dev)
        vals = {"temp": [s.temperature for s in seqs], "top_p": [s.top_p for s in seqs],
                "top_k": [s.top_k for s in seqs], "min_p": [s.min_p for s in seqs], "seed": [s.seed for s in seqs],
                "max_new": [s.max_new_tokens for s in seqs], "min_new": [s.min_new_tokens for s in seqs],
                "freq": [s.frequency_penalty for s in seqs], "pres": [s.presence_penalty for s in seqs],
                "rep": [s.repetition_penalty for s in seqs],
                "gen_count": [len(s.output_ids) + 1 for s in seqs]}  # counts tokens from before a retract too
        for k, v in vals.items():
            self.st[k][dst] = torch.tensor(v, dtype=self.st[k].dtype, device=dev)
        width = max(len(s.stop_ids) for s in seqs)
        if width > self.stop_SW.shape[1]:
            pad = torch.full((self.max_batch_size, width - self.stop_SW.shape[1]), -1, dtype=torch.long, device=dev)
            self.stop_SW = torch.cat([self.stop_SW, pad], dim=1)
        W = self.stop_SW.shape[1]
        self.stop_SW[dst] = torch.tensor([list(s.stop_ids) + [-1] * (W - len(s.stop_ids)) for s in seqs],
                                         dtype=torch.long, device=dev)
        if self.counts_SV is None and any(s.has_penalty for s in seqs):
            self.counts_SV = torch.zeros(self.max_batch_size, self.vocab_size, dtype=torch.float32, device=dev)
        if self.counts_SV is not None:
            self.counts_SV[dst] = 0.0
            for slot, s in zip(slots, seqs):
                if s.output_ids:  # tokens generated before a retract still count
                    self.counts_SV[slot].index_add_(0, torch.tensor(s.output_ids, device=dev),
                                                    torch.ones(len(s.output_ids), device=dev))
        self._flags_dirty = True
        return dst

    # ---------------------------------------------------------------- compute
    def lora_in_use(self) -> set[str]:
        """The adapter slots of the running rows (and of rows waiting for --max-loras-per-batch)."""
        return {s.lora for s in self.rows + self.deferred if s.lora is not None}

    def _lora_admit(self, admit: list[Seq]) -> list[Seq]:
        """The seqs of `admit` (after earlier deferred ones) whose adapters fit --max-loras-per-batch
        distinct adapters next to the running rows; the rest wait in `deferred` for a later step."""
        queue = self.deferred + admit
        if self.lora is None or not any(s.lora for s in queue):
            self.deferred = []
            return queue
        active = {s.lora for s in self.rows if s.lora is not None}
        now, later = [], []
        for s in queue:
            if s.lora is None or s.lora in active or len(active) < self.max_loras_per_batch:
                if s.lora is not None:
                    active.add(s.lora)
                now.append(s)
            else:
                later.append(s)
        self.deferred = later
        return now

    @torch.inference_mode()
    def step(self, admit: list[Seq], drop: list[Seq]) -> StepOutput:
        """Drop `drop`, decode one token for every running row, prefill `admit` (first token each)."""
        t0 = time.perf_counter()
        self.release(drop)
        if admit or self.deferred:
            admit = self._lora_admit(admit)
        seqs: list[Seq] = []
        parts: list[tuple] = []  # (tok, lp, fin, top_vals, top_ids) per phase
        if self.rows:
            if self._flags_dirty:
                self._rebuild_flags()
            seqs.extend(self.rows)
            parts.append(self._decode())
        prefill_tokens = 0
        if admit:
            prefill_tokens, part = self._prefill(admit)
            seqs.extend(admit)
            parts.append(part)
        if not seqs:
            return StepOutput([], [], [], [], 0, time.perf_counter() - t0)
        return self._collect(seqs, parts, prefill_tokens, t0)

    def _collect(self, seqs, parts, prefill_tokens, t0) -> StepOutput:
        """The step's ONE device→host transfer: every row's token, logprob, finish code (and top-k)."""
        k = max(p[3].shape[1] if p[3] is not None else 0 for p in parts)
        cols = []
        for tok, lp, fin, tv, ti in parts:
            n = tok.shape[0]
            c = [tok.double()[:, None], lp.double()[:, None], fin.double()[:, None]]
            if k:
                tv = tv if tv is not None else torch.zeros(n, 0, device=tok.device)
                ti = ti if ti is not None else torch.zeros(n, 0, device=tok.device)
                padw = k - tv.shape[1]
                c += [torch.nn.functional.pad(tv.double(), (0, padw)), torch.nn.functional.pad(ti.double(), (0, padw))]
            cols.append(torch.cat(c, dim=1))
        packed = torch.cat(cols).cpu()  # host sync (the only one of a step without admissions)
        tokens = packed[:, 0].long().tolist()
        logprobs = packed[:, 1].float().tolist()
        finish = packed[:, 2].long().tolist()
        top = None
        if k:
            vals, ids = packed[:, 3:3 + k].float().tolist(), packed[:, 3 + k:].long().tolist()
            top = [(vals[i][:s.top_logprobs_num], ids[i][:s.top_logprobs_num]) if s.top_logprobs_num else None
                   for i, s in enumerate(seqs)]
        return StepOutput(seqs, tokens, logprobs, finish, prefill_tokens, time.perf_counter() - t0, top)

    # ---- routed experts (MoE; --enable-return-routed-experts) ---------------------------------------
    def _capture(self, layer: int, out) -> None:
        if self._captured is not None:
            self._captured[layer] = out[-1]  # (tokens, top-k) expert ids

    def _start_capture(self, on: bool) -> bool:
        self._captured = {} if on else None
        return on

    def _take_captured(self) -> torch.Tensor:
        """(tokens, layers × top-k) int32 ids of the forward just run (dense layers 0), on the host: one
        device→host copy per forward, only in steps whose rows asked for routes."""
        L, k = self.route_shape
        first = next(iter(self._captured.values()))
        out = torch.zeros(first.shape[0], L, k, dtype=torch.int32, device=first.device)
        for layer, ids in self._captured.items():
            out[:, layer, :] = ids
        self._captured = None
        return out.reshape(first.shape[0], L * k).cpu()

    @staticmethod
    def _add_routes(seq: Seq, start: int, rows) -> None:
        """Routes of positions [start, start + len(rows)) of `seq`: the ones it lacks are appended."""
        skip = seq.routes_n - start
        if skip < 0:
            raise RuntimeError(f"request {seq.rid}: routes of position {start} recorded before those of "
                               f"{seq.routes_n}")
        if skip < len(rows):
            new = rows[skip:]
            seq.routes.append(new.numpy() if hasattr(new, "numpy") else new)
            seq.routes_n += len(new)

    def _decode(self):
        B, st, kv = len(self.rows), self.st, self.kv
        pos_B = st["next_pos"][:B]
        kv_len = self.max_next_pos + 1
        kv.ensure(kv_len)
        kv.mode, kv.n_rows, kv.pos_B, kv.kv_len = "decode", B, pos_B, kv_len
        mask_B11L = (torch.arange(kv_len, device=self.device)[None, :] <= pos_B[:, None])[:, None, None, :]
        capture = self._start_capture(self.any_routes)
        with self.adapters([s.lora for s in self.rows]):
            out = self.model(input_ids=st["last_tok"][:B, None], position_ids=pos_B[:, None],
                             attention_mask=self._mask(mask_B11L), past_key_values=kv, use_cache=True)
        if capture:  # the fed token of row b sits at position pos_B[b]
            ids, positions = self._take_captured(), pos_B.tolist()
            for b, seq in enumerate(self.rows):
                if seq.return_routes:
                    self._add_routes(seq, positions[b], ids[b:b + 1])
        logits_BV = out.logits[:, -1, :]
        pos_B = pos_B + 1  # where the sampled token sits
        res = self._sample(logits_BV, slice(0, B), pos_B, st["gen_count"][:B])
        st["next_pos"][:B] = pos_B
        st["last_tok"][:B] = res[0]
        st["gen_count"][:B] += 1
        self.steps += 1
        self.max_next_pos += 1
        return res

    def _prefill(self, admit: list[Seq]):
        """Prefill admitted seqs: one row per distinct prompt (n samples share it), left-padded and
        chunked by --max-prefill-tokens; returns (prefill tokens, sample results in `admit` order)."""
        dev = self.device
        dst_all = self._assign(admit)
        self._rebuild_flags()
        # (prompt, adapter slot) → indices into admit: samples share a prefill row only under one adapter
        groups: dict[tuple[tuple[int, ...], str | None], list[int]] = {}
        for i, s in enumerate(admit):
            groups.setdefault((tuple(s.all_ids), s.lora), []).append(i)
        logits_rows: list[torch.Tensor | None] = [None] * len(admit)
        prefill_tokens = 0
        chunk: list[tuple[tuple[int, ...], list[int]]] = []
        items = list(groups.items())
        for n, item in enumerate(items):
            chunk.append(item)
            T = max(len(p) for (p, _), _ in chunk)
            nxt = len(items[n + 1][0][0]) if n + 1 < len(items) else 0
            if n + 1 == len(items) or (len(chunk) + 1) * max(T, nxt) > self.max_prefill_tokens:
                prefill_tokens += self._prefill_chunk(chunk, dst_all, logits_rows, admit)
                chunk = []
        for members in groups.values():
            for j in members[1:]:
                admit[j].cached_tokens = len(admit[j].all_ids)
        logits_NV = torch.stack(logits_rows)
        lens = [len(s.all_ids) for s in admit]
        pos_N = torch.tensor(lens, dtype=torch.long, device=dev)  # position of the token being sampled
        res = self._sample(logits_NV, dst_all, pos_N, self.st["gen_count"][dst_all])
        st = self.st
        st["next_pos"][dst_all] = pos_N
        st["last_tok"][dst_all] = res[0]
        st["gen_count"][dst_all] += 1
        for slot, L in zip(dst_all.tolist(), lens):
            self.join_pos[slot], self.join_step[slot] = L, self.steps
        self.max_next_pos = max([self.max_next_pos] + lens)
        return prefill_tokens, res

    def _prefill_chunk(self, chunk, dst_all, logits_rows, admit: list[Seq]) -> int:
        dev = self.device
        T = max(len(p) for (p, _), _ in chunk)
        pad = [T - len(p) for (p, _), _ in chunk]
        ids_PT = torch.tensor([[0] * d + list(p) for d, ((p, _), _) in zip(pad, chunk)], dtype=torch.long,
                              device=dev)
        pad_P = torch.tensor(pad, dtype=torch.long, device=dev)
        t_T = torch.arange(T, device=dev)
        pos_PT = (t_T[None, :] - pad_P[:, None]).clamp_(min=0)
        # causal, real keys only; a padding query attends to itself so no row is fully masked (NaN)
        causal_TT = t_T[None, :] <= t_T[:, None]
        mask_P1TT = (causal_TT[None] & (t_T[None, None, :] >= pad_P[:, None, None])) | torch.eye(T, dtype=torch.bool,
                                                                                                  device=dev)[None]
        src_rows, dst_slots = [], []
        for p, (_, members) in enumerate(chunk):
            for j in members:
                src_rows.append(p)
                dst_slots.append(int(dst_all[j]))
        kv = self.kv
        kv.ensure(T)
        kv.mode = "prefill"
        kv.gather_PT = (t_T[None, :] + pad_P[:, None]).clamp_(max=T - 1)  # slot position t ← padded index t+pad
        kv.src_rows = torch.tensor(src_rows, dtype=torch.long, device=dev)
        kv.dst_slots = torch.tensor(dst_slots, dtype=torch.long, device=dev)
        members_of = [[admit[j] for j in members] for _, members in chunk]  # each row's seqs (their routes)
        capture = self._start_capture(bool(self.routers) and any(s.return_routes for ms in members_of for s in ms))
        try:
            with self.adapters([lora for (_, lora), _ in chunk]):
                out = self.model(input_ids=ids_PT, position_ids=pos_PT,
                                 attention_mask=self._mask(mask_P1TT[:, None]),
                                 past_key_values=kv, use_cache=True, logits_to_keep=1)
        finally:
            kv.mode = "decode"
        if capture:  # row p's prompt sits at padded columns [pad_p, T): positions 0 … len − 1
            ids_PTW = self._take_captured().reshape(len(chunk), T, -1)
            for p, ms in enumerate(members_of):
                for seq in ms:
                    if seq.return_routes:
                        self._add_routes(seq, 0, ids_PTW[p, pad[p]:])
        last_PV = out.logits[:, -1, :]
        for p, (_, members) in enumerate(chunk):
            for j in members:
                logits_rows[j] = last_PV[p]
        return int(sum(len(p) for (p, _), _ in chunk))

    def _sample(self, logits_BV: torch.Tensor, rows, position_B: torch.Tensor, gen_count_B: torch.Tensor):
        """Sample, score (the shared logprob definition) and decide finish for every row at once.

        rows: slice or index tensor into the per-slot state; position_B: where the sampled token sits;
        gen_count_B: how many tokens the row has generated once this one is counted."""
        st = self.st
        logits_BV = logits_BV.float()
        temp_B, stop_BS, min_new_B = st["temp"][rows], self.stop_SW[rows], st["min_new"][rows]
        sample_BV = logits_BV
        if self.any_penalty:
            sample_BV = apply_penalties(sample_BV, self.counts_SV[rows], st["freq"][rows], st["pres"][rows],
                                        st["rep"][rows])
        if self.any_min_new:  # stop tokens cannot be sampled before min_new_tokens
            block_BS = (gen_count_B < min_new_B)[:, None] & (stop_BS >= 0)
            hits_BV = torch.zeros_like(sample_BV).scatter_add_(1, stop_BS.clamp(min=0), block_BS.float())
            sample_BV = sample_BV.masked_fill(hits_BV > 0, float("-inf"))
        tok_B = sample_next(sample_BV, temp_B, st["top_p"][rows], st["top_k"][rows], st["min_p"][rows],
                            st["seed"][rows], position_B, needs_filter=self.needs_filter, all_greedy=self.all_greedy)
        # the shared definition (areal_like.learner.logprobs): raw logits / T, T < eps counts as 1
        t_B = torch.where(temp_B < GREEDY_EPS, torch.ones_like(temp_B), temp_B)
        logp_BV = torch.log_softmax(logits_BV / t_B[:, None], dim=-1)
        lp_B = logp_BV.gather(-1, tok_B[:, None]).squeeze(-1)
        top_v = top_i = None
        if self.top_n:
            top_v, top_i = logp_BV.topk(min(self.top_n, logp_BV.shape[-1]), dim=-1)
        if self.counts_SV is not None:
            self.counts_SV[rows] = self.counts_SV[rows].scatter_add(1, tok_B[:, None], torch.ones_like(lp_B)[:, None])
        stop_hit = (tok_B[:, None] == stop_BS).any(dim=1) & (gen_count_B >= min_new_B)
        # position_B is where the sampled token sits; the context holds position+1 tokens after it.
        length_hit = (gen_count_B >= st["max_new"][rows]) | (position_B + 1 >= self.max_context_len)
        fin_B = torch.where(stop_hit, FINISH_STOP, torch.where(length_hit, FINISH_LENGTH, RUNNING))
        return tok_B, lp_B, fin_B, top_v, top_i

    # ---------------------------------------------------------------- memory (release / resume)
    @property
    def weights_nbytes(self) -> int:
        """Bytes the parameters hold now (0 while released; tied parameters counted once)."""
        return sum(p.numel() * p.element_size() for p in self.base_parameters())

    def base_parameters(self) -> list[torch.nn.Parameter]:
        """The model's own parameters (tied ones once), never a LoRA adapter's."""
        return [p for n, p in self.model.named_parameters() if not is_lora_name(n)]

    def release_memory(self, tags: set[str]) -> dict[str, int]:
        """SGLang's release_memory_occupation: free the KV cache (`kv_cache`) and/or the weights
        (`weights`: each parameter's data becomes an empty tensor, its shape remembered; tied
        parameters are one Parameter, freed once). No row may be running. Returns the bytes freed."""
        if self.rows:
            raise RuntimeError(f"{len(self.rows)} request(s) still hold KV cache rows: pause with mode abort or "
                               "retract before releasing memory")
        freed: dict[str, int] = {}
        if "kv_cache" in tags and self.kv.k:
            freed["kv_cache"] = self.kv.nbytes
            self.kv.free()
        if "weights" in tags and not self._released_shapes:
            n = 0
            # buffers (rotary inv_freq) stay: they are small and no weight update restores them; LoRA
            # adapters stay too (small, and a base weight update does not restore them)
            for p in self.base_parameters():
                self._released_shapes.append((p, tuple(p.shape)))
                n += p.numel() * p.element_size()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            cache = getattr(self.model.lm_head, "fp32_weight_cache", None)
            if cache is not None and cache[0] is not None:  # --enable-fp32-lm-head's fp32 copy
                n += cache[0].numel() * cache[0].element_size()
                cache[0], cache[1] = None, -1
            freed["weights"] = n
        return freed

    def resume_memory(self, tags: set[str]) -> dict[str, int]:
        """resume_memory_occupation: allocate what `release_memory` freed. Resumed weights hold no
        defined values (as SGLang's without a CPU backup): a weight update must land before generating."""
        got: dict[str, int] = {}
        if "kv_cache" in tags and not self.kv.k:
            self.kv._alloc(min(128, self.kv.max_capacity))
            got["kv_cache"] = self.kv.nbytes
        if "weights" in tags and self._released_shapes:
            for p, shape in self._released_shapes:
                p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
            got["weights"] = self.weights_nbytes
            self._released_shapes = []
        return got

    # ---------------------------------------------------------------- weights
    def named_weights(self) -> dict[str, torch.Tensor]:
        """The base weights by HF name (peft's `.base_layer` dropped; adapter tensors left out)."""
        return {base_layer_name(n): t for n, t in self.model.state_dict(keep_vars=True).items() if not is_lora_name(n)}

    # ---------------------------------------------------------------- LoRA
    def adapters(self, slots: list[str | None]):
        """Context: forwards inside run batch row i with adapter slot `slots[i]` (None: the base)."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.rows(slots)

    def load_lora(self, config: dict, tensors: dict[str, torch.Tensor], where: str) -> str:
        """A new adapter slot from an adapter_config dict and its tensors; ValueError, nothing changed,
        when they do not fit the server's LoRA settings or the model."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
        return self.lora.add(config, tensors, where)

    def free_lora(self, slot: str) -> None:
        """Free `slot` now, or when the last running row using it leaves."""
        if self.lora is not None:
            self.lora.free(slot, self.lora_in_use())

    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Copy tensors into the model, all or nothing: names, shapes and dtypes are checked before
        anything is written, and once they pass a same-shape floating-point `copy_` cannot fail short
        of a device fault (which breaks the engine anyway). No per-push backup clone: on the weight
        push hot path it doubled the copy and faulted in fresh memory every time. The batch KV cache
        is kept (pause drains it)."""
        own = self.named_weights()
        unknown = [n for n in named if n not in own]
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}{' …' if len(unknown) > 5 else ''}")
        bad = [f"{n}: got {tuple(t.shape)}, model has {tuple(own[n].shape)}" for n, t in named.items()
               if tuple(t.shape) != tuple(own[n].shape)]
        bad += [f"{n}: got dtype {t.dtype}, model has {own[n].dtype}" for n, t in named.items()
                if t.is_floating_point() != own[n].is_floating_point()]
        if bad:
            raise ValueError(f"shape/dtype mismatch: {bad[:5]}")
        with torch.no_grad():
            for n, t in named.items():
                own[n].copy_(t)  # copies across dtype/device

    @torch.no_grad()
    def apply_weight_deltas(self, deltas) -> None:
        """Overwrite the changed elements of a delta update (`weights.delta.TensorDelta`s), all or nothing:
        names, shapes and kinds are checked before anything is written; then each tensor's changed elements
        are assigned (cast to the parameter's dtype as `load_weights`' `copy_` casts), never computed."""
        own = self.named_weights()
        unknown = [d.name for d in deltas if d.name not in own]
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}{' …' if len(unknown) > 5 else ''}")
        bad = [f"{d.name}: got {d.shape}, model has {tuple(own[d.name].shape)}" for d in deltas
               if d.shape != tuple(own[d.name].shape)]
        bad += [f"{d.name}: got dtype {d.dtype}, model has {own[d.name].dtype}" for d in deltas
                if d.dtype.is_floating_point != own[d.name].is_floating_point()]
        if bad:
            raise ValueError(f"shape/dtype mismatch: {bad[:5]}")
        # generation is paused meanwhile: the apply may use every CPU this server runs on
        threads = len(os.sched_getaffinity(0)) if self.device.type == "cpu" else 1
        apply_deltas({d.name: own[d.name].data for d in deltas}, deltas, threads=threads)

    def load_weights_from_disk(self, model_path: str) -> None:
        """Load every tensor of an HF safetensors checkpoint dir; the model is untouched on failure."""
        from safetensors.torch import load_file

        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"model path {model_path!r} is not a directory")
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {model_path!r}")
        named: dict[str, torch.Tensor] = {}
        for f in files:
            named.update(load_file(os.path.join(model_path, f)))
        own = self.named_weights()
        missing = [n for n in own if n not in named and not _is_tied(n, self.config)]
        if missing:
            raise ValueError(f"checkpoint {model_path!r} lacks {missing[:5]}")
        self.load_weights({n: t for n, t in named.items() if n in own})
        self.model_path = model_path


def _is_tied(name: str, config) -> bool:
    return name == "lm_head.weight" and bool(getattr(config, "tie_word_embeddings", False))
