"""The model runner: an HF causal LM, the batch's KV cache, one decode step for every running row.

Everything here runs on ONE worker thread (the scheduler's executor); nothing here is thread-safe
and nothing here touches asyncio, HTTP or tokenization of requests.

KV layout (simple and correct first): one batched `DynamicCache` for all running rows, LEFT-padded
to a common length L. Per row we keep the attention mask (1 = real token, 0 = pad) and the position
of its next token, so RoPE positions stay per row. A decode step feeds one token per row.
- A joining request is prefilled alone (batch of 1, no padding → no fully-masked query rows), then
  its cache is left-padded and concatenated into the batch: O(B·L) copy, only on membership change.
- A leaving row is index-selected out; leading columns that became padding for every row are cut.
- Cost: DynamicCache appends with torch.cat, so each step copies the cache (O(B·L) per step). A
  preallocated paged cache with a custom attention kernel is the obvious next speed-up.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from areal_like.engine.sampling import sample_next
from areal_like.learner.logprobs import token_logprobs_from_logits

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
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # Prefill input: prompt + tokens generated before a retract (the runner drops the KV on retract).
    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


@dataclass
class StepOutput:
    seqs: list[Seq]  # rows that produced a token this step, in this order
    tokens: list[int]
    logprobs: list[float]
    finish: list[int]  # RUNNING | FINISH_STOP | FINISH_LENGTH per row
    prefill_tokens: int
    seconds: float


class ModelRunner:
    def __init__(self, model_path: str, *, device: str = "cpu", dtype: str = "float32", max_context_len: int = 512):
        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.max_context_len = max_context_len
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device).eval()
        self.config = self.model.config
        self.vocab_size = int(self.config.vocab_size)
        self.eos_token_ids = self._eos_ids()
        self._reset_batch()

    # ---------------------------------------------------------------- batch state
    def _reset_batch(self) -> None:
        self.rows: list[Seq] = []
        self.cache: DynamicCache | None = None
        dev = self.device
        self.mask_BL = torch.zeros(0, 0, dtype=torch.long, device=dev)
        self.next_pos_B = torch.zeros(0, dtype=torch.long, device=dev)  # position of the token fed next
        self.last_tok_B = torch.zeros(0, dtype=torch.long, device=dev)
        self.gen_count_B = torch.zeros(0, dtype=torch.long, device=dev)
        self._params_dirty = True

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

    def _rebuild_params(self) -> None:
        """Per-row sampling tensors; rebuilt only when membership changes."""
        dev, rows = self.device, self.rows
        self.temp_B = torch.tensor([s.temperature for s in rows], dtype=torch.float32, device=dev)
        self.top_p_B = torch.tensor([s.top_p for s in rows], dtype=torch.float32, device=dev)
        self.top_k_B = torch.tensor([s.top_k for s in rows], dtype=torch.long, device=dev)
        self.min_p_B = torch.tensor([s.min_p for s in rows], dtype=torch.float32, device=dev)
        self.seed_B = torch.tensor([s.seed for s in rows], dtype=torch.long, device=dev)
        self.max_new_B = torch.tensor([s.max_new_tokens for s in rows], dtype=torch.long, device=dev)
        self.min_new_B = torch.tensor([s.min_new_tokens for s in rows], dtype=torch.long, device=dev)
        width = max([len(s.stop_ids) for s in rows] + [1])
        self.stop_BS = torch.tensor([list(s.stop_ids) + [-1] * (width - len(s.stop_ids)) for s in rows],
                                    dtype=torch.long, device=dev).reshape(len(rows), width)
        self.needs_filter = any(s.top_p < 1.0 or s.top_k > 0 or s.min_p > 0.0 for s in rows)
        # Logprobs are computed per distinct temperature (usually one), never per row.
        temps: dict[float, list[int]] = {}
        for i, s in enumerate(rows):
            temps.setdefault(s.temperature, []).append(i)
        self.temp_groups = [(t, torch.tensor(ix, dtype=torch.long, device=dev)) for t, ix in temps.items()]
        self._params_dirty = False

    # ---------------------------------------------------------------- membership
    def release(self, seqs: list[Seq]) -> None:
        """Drop rows (finished, aborted, retracted). Unknown seqs are ignored."""
        if not seqs or not self.rows:
            return
        gone = {id(s) for s in seqs}
        keep = [i for i, s in enumerate(self.rows) if id(s) not in gone]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self._reset_batch()
            return
        keep_t = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self.mask_BL = self.mask_BL.index_select(0, keep_t)
        self.next_pos_B = self.next_pos_B.index_select(0, keep_t)
        self.last_tok_B = self.last_tok_B.index_select(0, keep_t)
        self.gen_count_B = self.gen_count_B.index_select(0, keep_t)
        # Leading columns that are padding in every remaining row can go.
        first = int(self.mask_BL.any(dim=0).long().argmax())  # host sync on membership change only
        kv = []
        for layer in self.cache.layers:
            kv.append((layer.keys.index_select(0, keep_t)[:, :, first:], layer.values.index_select(0, keep_t)[:, :, first:]))
        self.mask_BL = self.mask_BL[:, first:]
        self.cache = DynamicCache(kv, config=self.config)
        self._params_dirty = True

    def _join(self, seq: Seq, cache1: DynamicCache, length: int, first_tok: int) -> None:
        """Left-pad a freshly prefilled single-row cache into the batch."""
        dev = self.device
        new_mask = torch.ones(1, length, dtype=torch.long, device=dev)
        if self.cache is None or not self.rows:
            kv = [(layer.keys, layer.values) for layer in cache1.layers]
            mask = new_mask
        else:
            L = self.mask_BL.shape[1]
            T = max(L, length)
            kv = []
            for lb, l1 in zip(self.cache.layers, cache1.layers):
                kb, vb = _left_pad(lb.keys, T), _left_pad(lb.values, T)
                k1, v1 = _left_pad(l1.keys, T), _left_pad(l1.values, T)
                kv.append((torch.cat([kb, k1]), torch.cat([vb, v1])))
            mask = torch.cat([_left_pad(self.mask_BL, T), _left_pad(new_mask, T)])
        self.cache = DynamicCache(kv, config=self.config)
        self.mask_BL = mask
        self.rows.append(seq)
        self.next_pos_B = torch.cat([self.next_pos_B, torch.tensor([length], dtype=torch.long, device=dev)])
        self.last_tok_B = torch.cat([self.last_tok_B, torch.tensor([first_tok], dtype=torch.long, device=dev)])
        self.gen_count_B = torch.cat([self.gen_count_B, torch.tensor([len(seq.output_ids) + 1], dtype=torch.long, device=dev)])
        self._params_dirty = True

    # ---------------------------------------------------------------- compute
    @torch.inference_mode()
    def step(self, admit: list[Seq], drop: list[Seq]) -> StepOutput:
        """Drop `drop`, decode one token for every running row, prefill `admit` (first token each)."""
        t0 = time.perf_counter()
        self.release(drop)
        seqs: list[Seq] = []
        toks: list[torch.Tensor] = []
        lps: list[torch.Tensor] = []
        fins: list[torch.Tensor] = []
        if self.rows:
            if self._params_dirty:
                self._rebuild_params()
            B = len(self.rows)
            mask = torch.cat([self.mask_BL, torch.ones(B, 1, dtype=torch.long, device=self.device)], dim=1)
            out = self.model(input_ids=self.last_tok_B[:, None], attention_mask=mask,
                             position_ids=self.next_pos_B[:, None], past_key_values=self.cache, use_cache=True)
            self.cache = out.past_key_values
            self.mask_BL = mask
            self.next_pos_B = self.next_pos_B + 1
            logits_BV = out.logits[:, -1, :]
            tok_B, lp_B, fin_B = self._sample(logits_BV, self.next_pos_B, self.gen_count_B + 1,
                                              self.temp_B, self.top_p_B, self.top_k_B, self.min_p_B, self.seed_B,
                                              self.max_new_B, self.min_new_B, self.stop_BS, self.temp_groups,
                                              self.needs_filter)
            self.last_tok_B = tok_B
            self.gen_count_B = self.gen_count_B + 1
            seqs.extend(self.rows)
            toks.append(tok_B)
            lps.append(lp_B)
            fins.append(fin_B)
        prefill_tokens = 0
        for seq in admit:
            ids = seq.all_ids
            prefill_tokens += len(ids)
            tok, lp, fin, cache1 = self._prefill_one(seq, ids)
            seqs.append(seq)
            toks.append(tok)
            lps.append(lp)
            fins.append(fin)
            if int(fin[0]) == RUNNING:  # host sync per admitted request only
                self._join(seq, cache1, len(ids), int(tok[0]))
        if not seqs:
            return StepOutput([], [], [], [], 0, time.perf_counter() - t0)
        # One host sync per step for all rows' results.
        tokens = torch.cat(toks).tolist()
        logprobs = torch.cat(lps).tolist()
        finish = torch.cat(fins).tolist()
        return StepOutput(seqs, tokens, logprobs, finish, prefill_tokens, time.perf_counter() - t0)

    def _prefill_one(self, seq: Seq, ids: list[int]):
        dev = self.device
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        cache1 = DynamicCache(config=self.config)
        out = self.model(input_ids=input_ids, past_key_values=cache1, use_cache=True)
        logits_1V = out.logits[:, -1, :]
        pos = torch.tensor([len(ids)], dtype=torch.long, device=dev)  # position of the token being sampled
        gen_count = torch.tensor([len(seq.output_ids) + 1], dtype=torch.long, device=dev)
        width = max(len(seq.stop_ids), 1)
        stop = torch.tensor([list(seq.stop_ids) + [-1] * (width - len(seq.stop_ids))], dtype=torch.long, device=dev)
        one = lambda v, dt: torch.tensor([v], dtype=dt, device=dev)  # noqa: E731
        tok, lp, fin = self._sample(
            logits_1V, pos, gen_count, one(seq.temperature, torch.float32), one(seq.top_p, torch.float32),
            one(seq.top_k, torch.long), one(seq.min_p, torch.float32), one(seq.seed, torch.long),
            one(seq.max_new_tokens, torch.long), one(seq.min_new_tokens, torch.long), stop,
            [(seq.temperature, torch.zeros(1, dtype=torch.long, device=dev))],
            seq.top_p < 1.0 or seq.top_k > 0 or seq.min_p > 0.0)
        # Note: gen_count counts tokens of this request including ones generated before a retract.
        return tok, lp, fin, out.past_key_values

    def _sample(self, logits_BV, position_B, gen_count_B, temp_B, top_p_B, top_k_B, min_p_B, seed_B,
                max_new_B, min_new_B, stop_BS, temp_groups, needs_filter):
        """Sample, score (the shared logprob definition) and decide finish for every row at once."""
        tok_B = sample_next(logits_BV, temp_B, top_p_B, top_k_B, min_p_B, seed_B, position_B, needs_filter=needs_filter)
        if len(temp_groups) == 1:
            lp_B = token_logprobs_from_logits(logits_BV, tok_B, temp_groups[0][0])
        else:
            lp_B = torch.empty(tok_B.shape, dtype=torch.float32, device=tok_B.device)
            for t, ix in temp_groups:
                lp_B[ix] = token_logprobs_from_logits(logits_BV.index_select(0, ix), tok_B.index_select(0, ix), t)
        stop_hit = (tok_B[:, None] == stop_BS).any(dim=1) & (gen_count_B >= min_new_B)
        # position_B is where the sampled token sits; the context holds position+1 tokens after it.
        length_hit = (gen_count_B >= max_new_B) | (position_B + 1 >= self.max_context_len)
        fin_B = torch.where(stop_hit, FINISH_STOP, torch.where(length_hit, FINISH_LENGTH, RUNNING))
        return tok_B, lp_B, fin_B

    # ---------------------------------------------------------------- weights
    def named_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.state_dict(keep_vars=True))

    @torch.no_grad()
    def load_weights(self, named: dict[str, torch.Tensor]) -> None:
        """Copy tensors into the model, all or nothing: names and shapes are checked first, and a
        failure half-way restores the old values. The batch KV cache is kept (pause drains it)."""
        own = self.named_weights()
        unknown = [n for n in named if n not in own]
        if unknown:
            raise ValueError(f"unknown parameter names: {unknown[:5]}{' …' if len(unknown) > 5 else ''}")
        bad = [f"{n}: got {tuple(t.shape)}, model has {tuple(own[n].shape)}" for n, t in named.items()
               if tuple(t.shape) != tuple(own[n].shape)]
        if bad:
            raise ValueError(f"shape mismatch: {bad[:5]}")
        done: list[tuple[str, torch.Tensor]] = []
        try:
            for n, t in named.items():
                backup = own[n].detach().clone()
                own[n].data.copy_(t)  # copies across dtype/device
                done.append((n, backup))
        except Exception:
            for n, backup in done:
                own[n].data.copy_(backup)
            raise

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


def _left_pad(x: torch.Tensor, T: int) -> torch.Tensor:
    """Left-pad dim 2 (KV: B,H,L,D) or dim 1 (mask: B,L) with zeros to length T."""
    dim = 2 if x.dim() == 4 else 1
    n = T - x.shape[dim]
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([torch.zeros(shape, dtype=x.dtype, device=x.device), x], dim=dim)
