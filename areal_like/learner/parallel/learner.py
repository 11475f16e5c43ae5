"""`ParallelLearner`: the decoupled-PPO train step run SPMD over a DP × PP × TP learner pool.

Every rank of the pool runs the same code on the same global batch of groups:

    groups (identical on every rank: rank 0 read them and `broadcast_groups` sent msgspec bytes)
      ─► advantages + global loss-token count           (every rank, host side: `batch_plan`)
      ─► this dp rank's share of the samples             (deterministic, token-balanced)
      ─► forward/backward: micro-batches (p1) or a 1F1B/GPipe pipeline schedule (p>1); TP inside
      ─► data-parallel gradient all-reduce (SUM: the loss is already / global loss tokens)
      ─► grad norm over tp shards and pp stages, clip ─► finite check (agreed by all ranks)
      ─► optimizer step on the local shards ─► stats reduced over dp and pp

π_prox: a train step is exactly one optimizer step, so the weights being differentiated *are*
π_prox's; the loss uses π_prox = π_θ.detach() (the single-process `Learner`'s `proximal="detach"`,
equal to its recompute mode up to float rounding) and saves the extra forward pass.

What this module does not do: no buffer reads (the caller passes groups), no weight transport
(`named_tensors_for_push` hands full tensors to rank 0's pusher), no process-group init.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from areal_like.api.config import TrainConfig
from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.learner.algorithms import decoupled_ppo_loss, entropy_from_logits
from areal_like.learner.logprobs import token_logprobs_from_logits
from areal_like.learner.parallel.layout import LayoutSpec, ParallelLayout
from areal_like.learner.parallel.parallelize import (
    DataParallelReducer,
    build_pipeline_schedule,
    local_tensor,
    parallelize_model,
    stage_layer_ids,
)
from areal_like.learner.trainer import (
    _DTYPES,
    _HF_MODEL_FILES,
    batch_plan,
    lr_at,
    pack_trajectories,
    publish_checkpoint_dir,
    step_skip_reason,
)

log = logging.getLogger(__name__)

CKPT_FORMAT = 2
CKPT_MODEL_FILE = "model.safetensors"
CKPT_META_FILE = "meta.json"
_SUM_STATS = ("loss", "clipfrac", "approx_kl", "ratio_mean", "behav_w_mean", "behav_frac_capped", "dual_clipfrac",
              "entropy")
_MAX_STATS = ("behav_w_max", "ratio_max")
_GROUPS_DECODER = msgspec.msgpack.Decoder(list[TrajectoryGroup])
_GROUPS_ENCODER = msgspec.msgpack.Encoder()


# ---- data: rank 0 reads, everyone trains ------------------------------------------------------
def broadcast_groups(groups: list[TrajectoryGroup] | None, version: int, layout: ParallelLayout
                     ) -> tuple[list[TrajectoryGroup], int]:
    """Rank 0's (groups, version) on every rank, as msgpack bytes (never pickle, DESIGN invariant 6).

    Two broadcasts over the pool's world group (size, then bytes), both under its timeout.
    """
    if not layout.distributed or layout.world_size == 1:
        assert groups is not None
        return groups, version
    if layout.rank == 0:
        payload = _GROUPS_ENCODER.encode(groups)
        header = torch.tensor([len(payload), version], dtype=torch.int64)
    else:
        header = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(header, src=0, group=layout.world_group)
    n, version = (int(x) for x in header.tolist())  # host sync: the payload size is needed to allocate
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if layout.rank == 0
           else torch.empty(n, dtype=torch.uint8))
    dist.broadcast(buf, src=0, group=layout.world_group)
    return (groups if layout.rank == 0 else _GROUPS_DECODER.decode(buf.numpy().tobytes())), version


def dp_share(samples: list[Trajectory], dp: int, dp_rank: int) -> list[int]:
    """Indices of the samples this dp rank trains on: longest first to the least-loaded rank (by
    tokens), ties to the lowest rank — deterministic, so every rank computes every share alike."""
    if dp == 1:
        return list(range(len(samples)))
    load = [0] * dp
    mine = []
    for i in sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens):
        r = min(range(dp), key=lambda k: (load[k], k))
        load[r] += samples[i].num_tokens
        if r == dp_rank:
            mine.append(i)
    return sorted(mine)


def _targets(mb) -> torch.Tensor:
    """(B, T−1, 4) float32 channels [next id, loss mask, π_behav, advantage] — one tensor, because a
    pipeline schedule splits exactly one `target` into micro-batches. Ids < 2^24: exact in fp32."""
    return torch.stack([mb.input_ids_BT[:, 1:].float(), mb.loss_mask_BT1, mb.logp_behav_BT1, mb.advantages_BT1], -1)


class ParallelLearner:
    """One rank of the learner pool. Construct it on every rank with the same arguments.

    `layout` is a `ParallelLayout` (already built on the pool's process group), a `LayoutSpec`, a
    layout string like "d2p1t1"/allocation string, or None (single process, no torch.distributed).
    """

    def __init__(
        self,
        model_path: str,
        train_cfg: TrainConfig,
        layout: ParallelLayout | LayoutSpec | str | None = None,
        *,
        temperature: float,
        device: str = "cpu",
        dtype: str = "float32",
        dual_clip_c: float | None = None,
        compute_entropy: bool = True,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported: use one of {sorted(_DTYPES)} (model.dtype)")
        if train_cfg.micro_batch_tokens < 2:
            raise ValueError("train.micro_batch_tokens must be ≥ 2: set train.micro_batch_tokens=8192")
        if not isinstance(layout, ParallelLayout):
            spec = layout if isinstance(layout, LayoutSpec) else (
                LayoutSpec() if layout is None else LayoutSpec.from_string(layout))
            layout = ParallelLayout(spec, timeout_s=train_cfg.collective_timeout_s,
                                    device_type=torch.device(device).type)
        self.layout = layout
        self.cfg = train_cfg
        self.model_path = model_path
        self.temperature = float(temperature)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.dual_clip_c = dual_clip_c
        self.compute_entropy = compute_entropy

        torch.manual_seed(train_cfg.seed)  # same seed on every rank: identical RNG streams
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device)
        model.eval()  # no dropout: train the sampled policy itself
        self.config = model.config
        self.pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        # Full-model names/shapes in push order (what `save_pretrained` writes), per owning stage.
        persistent = set(model.state_dict().keys())
        full = [(n, p) for n, p in model.named_parameters()]
        full += [(n, b) for n, b in model.named_buffers() if n in persistent]
        self._full_meta = [(n, tuple(t.shape), t.dtype, self._stage_of(n)) for n, t in full]

        # Parallelism, in the fixed order (parallelize.py): pp split → tp → dp (the reducer).
        self.stage_module = parallelize_model(model, layout)
        self._local = [(n.removeprefix("hf."), p) for n, p in self.stage_module.named_parameters()]
        self._local += [(n.removeprefix("hf."), b) for n, b in self.stage_module.named_buffers()
                        if n.removeprefix("hf.") in persistent]
        self.params = [p for _, p in self._local if isinstance(p, nn.Parameter) and p.requires_grad]
        self.reducer = DataParallelReducer(self.params, layout)
        betas = tuple(float(b) for b in train_cfg.adam_betas)
        if len(betas) != 2:
            raise ValueError(f"train.adam_betas must have 2 entries, got {train_cfg.adam_betas}")
        # foreach=False: DTensor and plain-tensor parameters share one param group.
        self.optimizer = torch.optim.AdamW(self.params, lr=lr_at(train_cfg, 0), betas=betas,  # type: ignore[arg-type]
                                           eps=train_cfg.adam_eps,
                                           weight_decay=train_cfg.weight_decay, foreach=False)
        self.step = 0
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.version = -1

    @property
    def is_rank0(self) -> bool:
        return self.layout.rank == 0

    def _stage_of(self, name: str) -> int:
        pp = self.layout.pp
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            return next(s for s in range(pp) if i in stage_layer_ids(self.config.num_hidden_layers, pp, s))
        if name.startswith("model.embed_tokens."):
            return 0
        if name.startswith(("model.norm.", "lm_head.")):
            return pp - 1
        if pp == 1:
            return 0
        raise ValueError(f"cannot place parameter {name!r} on a pipeline stage: use p1 for this model")

    # ---- the step -------------------------------------------------------------------------------
    def _loss_fn(self, acc: dict[str, torch.Tensor], loss_tokens: int):
        """loss(logits (B, T, V), targets (B, T−1, 4)) of one micro-batch; accumulates its stats."""

        def loss_fn(logits_BTV: torch.Tensor, tgt_BT1C: torch.Tensor) -> torch.Tensor:
            logits_BT1V = logits_BTV[:, :-1]
            ids_BT1, mask_BT1, behav_BT1, adv_BT1 = tgt_BT1C.unbind(-1)
            logp_BT1 = token_logprobs_from_logits(logits_BT1V, ids_BT1.long(), self.temperature)
            loss, st = decoupled_ppo_loss(
                logp_BT1, logp_BT1.detach(), behav_BT1, adv_BT1, mask_BT1,  # π_prox: see module docstring
                eps_clip_low=self.cfg.eps_clip_low, eps_clip_high=self.cfg.eps_clip_high,
                behav_imp_weight_cap=self.cfg.behav_imp_weight_cap, behav_mode=self.cfg.behav_imp_weight_mode,
                dual_clip_c=self.dual_clip_c, loss_tokens_global=loss_tokens,
            )
            frac = st["loss_tokens"] / max(loss_tokens, 1)
            acc["loss"] += loss.detach()
            for name in _SUM_STATS[1:-1]:
                acc[name] += st[name] * frac
            for name in _MAX_STATS:
                acc[name] = torch.maximum(acc[name], st[name])
            if self.compute_entropy:
                with torch.no_grad():
                    ent_BT1 = entropy_from_logits(logits_BT1V.detach(), self.temperature)
                    acc["entropy"] += (ent_BT1 * mask_BT1).sum() / max(loss_tokens, 1)
            return loss

        return loss_fn

    def forward_backward(self, samples: list[Trajectory], advantages_N: np.ndarray, loss_tokens: int
                         ) -> dict[str, torch.Tensor]:
        """Accumulate this rank's share of ∇L into `.grad` (before the dp all-reduce)."""
        zero = torch.zeros((), device=self.device)
        acc = {k: zero.clone() for k in _SUM_STATS + _MAX_STATS}
        loss_fn = self._loss_fn(acc, loss_tokens)
        mine = [samples[i] for i in dp_share(samples, self.layout.dp, self.layout.dp_rank)]
        adv_mine = advantages_N[dp_share(samples, self.layout.dp, self.layout.dp_rank)]
        if self.layout.pp == 1:
            if mine:
                for mb in pack_trajectories(mine, adv_mine, micro_batch_tokens=self.cfg.micro_batch_tokens,
                                            pad_id=self.pad_id, device=self.device):
                    loss_fn(self.stage_module(mb.input_ids_BT), _targets(mb)).backward()
            return acc
        self._pipeline_forward_backward(mine, adv_mine, loss_fn)
        return acc

    def _pipeline_forward_backward(self, mine: list[Trajectory], adv_mine: np.ndarray, loss_fn) -> None:
        """One pipeline schedule over this dp rank's share: one right-padded (B, T) batch split into
        n equal micro-batches (B padded with all-padding rows of loss mask 0, which add nothing)."""
        L = self.layout
        if mine:
            (mb,) = pack_trajectories(mine, adv_mine, micro_batch_tokens=1 << 62, pad_id=self.pad_id,
                                      device=self.device)
            ids_BT, tgt_BT1C = mb.input_ids_BT, _targets(mb)
        else:  # no samples on this dp rank: the pipeline still runs (stages must pair their sends)
            ids_BT = torch.full((1, 2), self.pad_id, dtype=torch.int64, device=self.device)
            tgt_BT1C = torch.zeros((1, 1, 4), device=self.device)
        B, T = ids_BT.shape
        n = self.cfg.pp_microbatches or max(L.pp, math.ceil(B * T / self.cfg.micro_batch_tokens))
        n = max(n, L.pp) if self.cfg.pp_schedule == "1f1b" else n
        pad_rows = (-B) % n
        if pad_rows:
            ids_BT = torch.cat([ids_BT, torch.full((pad_rows, T), self.pad_id, dtype=ids_BT.dtype, device=self.device)])
            tgt_BT1C = torch.cat([tgt_BT1C, torch.zeros((pad_rows, T - 1, 4), device=self.device)])
        schedule = build_pipeline_schedule(self.stage_module, L, n_microbatches=n, loss_fn=loss_fn,
                                           schedule=self.cfg.pp_schedule, device=self.device,
                                           microbatch_shape=(ids_BT.shape[0] // n, T))
        if L.is_first_stage:
            schedule.step(ids_BT)
        elif L.is_last_stage:
            schedule.step(target=tgt_BT1C)
        else:
            schedule.step()

    def _grad_norm_and_clip(self) -> torch.Tensor:
        """Global L2 norm of the full gradient (as `clip_grad_norm_` of one process), then clip.

        Σ‖g‖² = Σ_tp(sharded DTensor shards) + replicated (counted once) — then Σ over pp stages;
        dp ranks hold identical gradients after the all-reduce, so no dp sum.
        """
        from torch.distributed.tensor import DTensor

        L = self.layout
        sq_shard = torch.zeros((), device=self.device)
        sq_repl = torch.zeros((), device=self.device)
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_shard() for pl in g.placements):
                sq_shard += local_tensor(g).float().pow(2).sum()
            else:
                sq_repl += local_tensor(g).float().pow(2).sum()
        if L.tp > 1:
            dist.all_reduce(sq_shard, group=L.tp_group)
        total = sq_shard + sq_repl
        if L.pp > 1:
            dist.all_reduce(total, group=L.pp_group)
        norm = total.sqrt()
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip and self.cfg.grad_clip > 0 else float("inf")
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # the formula of clip_grad_norm_
        for p in self.params:
            if p.grad is not None:
                local_tensor(p.grad).mul_(coef)
        return norm

    def _reduce_stats(self, acc: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stats of the global batch: sums over dp and pp (only the last stage computed a loss)."""
        L = self.layout
        sums = torch.stack([acc[k] for k in _SUM_STATS])
        maxes = torch.stack([acc[k] for k in _MAX_STATS])
        for group, size in ((L.pp_group, L.pp), (L.dp_group, L.dp)):
            if size > 1:
                dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
                dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        return {**dict(zip(_SUM_STATS, sums)), **dict(zip(_MAX_STATS, maxes))}

    def train_step(self, groups: list[TrajectoryGroup], version: int) -> dict[str, Any]:
        """One optimizer step of the whole pool on `groups` (identical on every rank; see
        `broadcast_groups`). Returns the same stats dict as `Learner.train_step` on every rank.
        Gradients are left in `.grad` until the next step (zeroed at its start)."""
        t0 = time.perf_counter()
        L = self.layout
        # 1. fetch → advantages → count loss tokens (global) → this dp rank's share
        samples, rewards_N, advantages_N, loss_tokens = batch_plan(groups, self.cfg)
        # 2. forward/backward over micro-batches (pipeline schedule when p > 1)
        self.optimizer.zero_grad(set_to_none=True)
        acc = (self.forward_backward(samples, advantages_N, loss_tokens) if loss_tokens > 0
               else {k: torch.zeros((), device=self.device) for k in _SUM_STATS + _MAX_STATS})
        # 3. data-parallel gradient all-reduce (SUM), then global norm + clip
        self.reducer.all_reduce_grads()
        grad_norm = self._grad_norm_and_clip()
        dev_stats = self._reduce_stats(acc)
        # 4. finite check. Host sync: the ONLY one of the step — grad norm and all stats in one copy.
        #    Every rank holds the same reduced values, so every rank takes the same decision.
        names = list(dev_stats)
        fetched = torch.stack([grad_norm.float(), *[dev_stats[n].float() for n in names]]).tolist()
        grad_norm_f, stats = fetched[0], dict(zip(names, fetched[1:]))
        skip_reason = step_skip_reason(loss_tokens, grad_norm_f, stats["loss"])
        # 5. optimizer step on the local shards (or skip it, with the reason logged)
        lr = lr_at(self.cfg, self.optimizer_steps)
        if skip_reason:
            if L.rank == 0:
                log.warning("learner step %d (version %d): optimizer step skipped: %s", self.step, version, skip_reason)
            self.skipped_steps += 1
        else:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.optimizer.step()
            self.optimizer_steps += 1
        self.step += 1
        self.version = version
        # 6. stats
        min_versions = [g.min_version for g in groups if g.min_version >= 0]
        return {
            "loss": stats["loss"], "reward_mean": float(rewards_N.mean()), "reward_std": float(rewards_N.std()),
            "adv_abs_mean": float(np.abs(advantages_N).mean()), "grad_norm": grad_norm_f,
            **{k: stats[k] for k in ("clipfrac", "dual_clipfrac", "approx_kl", "ratio_mean", "ratio_max",
                                     "behav_w_mean", "behav_w_max", "behav_frac_capped", "entropy")},
            "lr": lr, "num_tokens": int(sum(t.num_tokens for t in samples)), "loss_tokens": loss_tokens,
            "num_groups": len(groups), "num_samples": len(samples),
            "version_lag_max": (version - min(min_versions)) if min_versions else -1,
            "skipped": bool(skip_reason), "skip_reason": skip_reason, "step": self.step,
            "step_s": time.perf_counter() - t0, "layout": str(L.spec),
        }

    # ---- full tensors on rank 0 -----------------------------------------------------------------
    def _gather_full(self, local: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Full unsharded tensors in `_full_meta` order on rank 0 ([] elsewhere). Collective: every
        rank calls it. DTensors are all-gathered over tp; stage s's (dp 0, tp 0) rank sends its
        tensors to rank 0 flattened (one message per dtype) over the pool's world group."""
        from torch.distributed.tensor import DTensor

        L = self.layout
        full_local = {}
        for name, _, _, stage in self._full_meta:  # same order on every tp rank: the all-gathers pair up
            if stage == L.pp_rank and name in local:
                t = local[name].detach()
                full_local[name] = (t.full_tensor() if isinstance(t, DTensor) else t).contiguous()
        if L.pp > 1:
            for s in range(1, L.pp):
                metas = [m for m in self._full_meta if m[3] == s]
                for dt in sorted({m[2] for m in metas}, key=str):
                    part = [m for m in metas if m[2] == dt]
                    if L.rank == 0:
                        flat = torch.empty(sum(math.prod(m[1]) for m in part), dtype=dt, device=self.device)
                        dist.recv(flat, src=L.stage_rank(s), group=L.world_group)
                        off = 0
                        for name, shape, _, _ in part:
                            k = math.prod(shape)
                            full_local[name] = flat[off:off + k].view(shape)
                            off += k
                    elif L.rank == L.stage_rank(s):
                        flat = torch.cat([full_local[m[0]].reshape(-1) for m in part])
                        dist.send(flat, dst=0, group=L.world_group)
        if L.rank != 0:
            return []
        return [(name, full_local[name]) for name, *_ in self._full_meta]

    def named_tensors_for_push(self) -> list[tuple[str, torch.Tensor]]:
        """HF-named FULL tensors on rank 0 (what `save_pretrained` writes, in the single-process
        `Learner`'s order); [] on every other rank. Collective: call it on every rank. On rank 0 the
        stage-0 tensors alias the live weights (tp=1): send them before the next `train_step`."""
        return self._gather_full(dict(self._local))

    def named_full_grads(self) -> list[tuple[str, torch.Tensor]]:
        """Full gradients (after dp reduction and clipping) on rank 0, HF names; for tests. Collective."""
        return self._gather_full({n: p.grad for n, p in self._local
                                  if isinstance(p, nn.Parameter) and p.grad is not None})

    # ---- export and checkpoints -----------------------------------------------------------------
    def save_hf(self, out_dir: str) -> str:
        """Complete HF model dir written by rank 0 (config, safetensors, tokenizer files). Collective."""
        tensors = self.named_tensors_for_push()
        if self.is_rank0:
            from safetensors.torch import save_file

            os.makedirs(out_dir, exist_ok=True)
            self.config.save_pretrained(out_dir)
            save_file({n: t.contiguous() for n, t in tensors}, os.path.join(out_dir, "model.safetensors"),
                      metadata={"format": "pt"})
            for name in os.listdir(self.model_path):
                src = os.path.join(self.model_path, name)
                if name in _HF_MODEL_FILES or name.endswith((".safetensors", ".bin")) or not os.path.isfile(src):
                    continue
                shutil.copy2(src, os.path.join(out_dir, name))
        self._barrier()
        return out_dir

    def _barrier(self) -> None:
        if self.layout.distributed and self.layout.world_size > 1:
            dist.barrier(group=self.layout.world_group)  # under the world group's timeout

    def save_checkpoint(self, path: str, extra: dict[str, Any] | None = None) -> str:
        """Collective. One directory: model.safetensors (full, HF names, by rank 0), one
        `rank{r}.pt` per rank (optimizer state of its shards, RNG, counters) and meta.json
        (layout, counters, policy version, `extra` — JSON: buffer offsets, dataloader cursor).
        Written to `<path>.tmp` and renamed by rank 0 once every rank has written (atomic).
        The directory must be on a filesystem every rank sees (one node, or shared storage)."""
        from safetensors.torch import save_file

        path = os.path.abspath(path)
        tmp = f"{path}.tmp"
        meta = {"format": CKPT_FORMAT, "layout": str(self.layout.spec), "step": self.step,
                "optimizer_steps": self.optimizer_steps, "version": self.version, "model_path": self.model_path,
                "extra": extra or {}}
        meta_bytes = msgspec.json.encode(meta)  # fails early (before writing) on a non-JSON `extra`
        tensors = self.named_tensors_for_push()
        if self.is_rank0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            save_file({n: t.contiguous() for n, t in tensors}, os.path.join(tmp, CKPT_MODEL_FILE),
                      metadata={"format": "pt"})
        self._barrier()  # the tmp dir exists
        torch.save(self._rank_state(), os.path.join(tmp, f"rank{self.layout.rank:05d}.pt"))
        self._barrier()  # every rank's file is written
        if self.is_rank0:
            publish_checkpoint_dir(tmp, path, meta_bytes)
        self._barrier()
        return path

    def _rank_state(self) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        osd = self.optimizer.state_dict()
        # weights_only-loadable: DTensor optimizer state → this rank's local shard
        osd["state"] = {k: {n: (v.to_local() if isinstance(v, DTensor) else v) for n, v in st.items()}
                        for k, st in osd["state"].items()}
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {"format": CKPT_FORMAT, "optimizer": osd, "rng": rng, "step": self.step,
                "optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps, "version": self.version}

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore weights, optimizer, RNG and counters from `save_checkpoint`'s dir (same layout);
        returns `extra`. Every rank reads the full model file and keeps its own shard."""
        from safetensors.torch import load_file
        from torch.distributed.tensor import DTensor, distribute_tensor

        with open(os.path.join(path, CKPT_META_FILE), "rb") as f:
            meta = msgspec.json.decode(f.read())
        if meta.get("format") != CKPT_FORMAT:
            raise ValueError(f"checkpoint {path}: format {meta.get('format')}, this build reads {CKPT_FORMAT}")
        if meta["layout"] != str(self.layout.spec):
            raise ValueError(f"checkpoint {path} was written by layout {meta['layout']}, this pool is "
                             f"{self.layout.spec}: resume with the same allocation training side "
                             f"(its model.safetensors is a full HF state dict usable with any layout)")
        full = load_file(os.path.join(path, CKPT_MODEL_FILE), device=str(self.device))
        with torch.no_grad():
            for name, t in self._local:
                if name not in full:
                    if self.tied and name == "lm_head.weight":
                        continue  # tied to model.embed_tokens.weight, loaded through it
                    raise KeyError(f"checkpoint {path} lacks {name}")
                if isinstance(t, DTensor):
                    shard = distribute_tensor(full[name], t.device_mesh, t.placements, src_data_rank=None)
                    t.to_local().copy_(shard.to_local())
                else:
                    t.copy_(full[name])
        state = torch.load(os.path.join(path, f"rank{self.layout.rank:05d}.pt"), map_location=self.device,
                           weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        for p in self.params:  # local shards back to DTensors like their parameter
            if isinstance(p, DTensor):
                st = self.optimizer.state.get(p, {})
                for k, v in list(st.items()):
                    if torch.is_tensor(v) and not isinstance(v, DTensor) and v.dim() > 0:
                        st[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False)
        torch.set_rng_state(state["rng"]["cpu"].cpu())
        if self.device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), self.device)
        self.step = int(state["step"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.version = int(state["version"])
        self._barrier()
        return dict(meta.get("extra", {}))

