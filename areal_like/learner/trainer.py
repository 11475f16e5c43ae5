"""The single-process learner: one decoupled-PPO training step on a batch of trajectory groups.

    groups ─► flatten ─► advantages (per group) ─► pack (token budget) ─► count loss tokens
           ─► π_prox (no_grad, weights before the update) ─► forward/backward per micro-batch
           ─► clip ─► finite check ─► optimizer step ─► stats

Alignment (the trap of every RL trainer): the logits at position t predict token t+1, while a
`Trajectory` stores the behaviour logprob and loss mask of a token *at that token's own position*.
So every per-token quantity here lives on token positions 1..T−1 (suffix `_BT1`), and logits
0..T−2 are scored against ids 1..T−1. Position 0 has no prediction and is never a loss token.

Padding: batches are right-padded and run *without* an attention mask — with causal attention a
real token never attends to the padding after it, so a sequence's logits are the same padded or
not, and splitting a batch into micro-batches changes no gradient (tests check this to 1e-6).

Role: `Learner` is the plain single-process reference that the learner pool
(`learner/parallel`, which runs every training job, one rank included) is tested against for
numerical equivalence; the batching helpers here (`pack_trajectories`, `batch_plan`, `lr_at`) are
shared by both, so the two cannot drift apart in what they train on.

What this module does not do: no parallelism (the pool applies DP×PP×TP to the same plain HF model
from outside), no Redis, no weight push transport (it only hands out named tensors), no rollout.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np
import torch
from safetensors.torch import load_model, save_model

from areal_like.api.config import TrainConfig
from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.learner.algorithms import decoupled_ppo_loss, entropy_from_logits, grpo_advantages
from areal_like.learner.logprobs import token_logprobs_from_logits

log = logging.getLogger(__name__)

CKPT_MODEL_FILE = "model.safetensors"
CKPT_STATE_FILE = "trainer_state.pt"
CKPT_META_FILE = "meta.json"
CKPT_FORMAT = 1

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def step_skip_reason(loss_tokens: int, grad_norm: float, loss: float) -> str:
    """The finite check of a training step: why its optimizer step must be skipped ("" = it may run)."""
    if loss_tokens == 0:
        return "no loss tokens in the batch"
    if not np.isfinite(grad_norm):
        return f"non-finite grad norm ({grad_norm})"
    if not np.isfinite(loss):
        return f"non-finite loss ({loss})"
    return ""


def publish_checkpoint_dir(tmp: str, path: str, meta_bytes: bytes) -> None:
    """Finish a checkpoint written into `tmp`: meta.json last (fsynced), then swap `tmp` in as `path`.

    A directory without meta.json is never a checkpoint, so a crash at any point leaves either the
    old checkpoint or the new one, never a half-written one under `path`."""
    with open(os.path.join(tmp, CKPT_META_FILE), "wb") as f:
        f.write(meta_bytes)
        f.flush()
        os.fsync(f.fileno())
    old = f"{path}.old"
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
# Files of an HF dir that `save_pretrained` writes itself; everything else (tokenizer) is copied over.
_HF_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


@dataclass
class MicroBatch:
    """One right-padded forward/backward unit. Tensors are on the learner's device."""

    input_ids_BT: torch.Tensor  # (B, T) int64, padded with pad_id on the right
    loss_mask_BT1: torch.Tensor  # (B, T−1) float32: mask of tokens 1..T−1
    logp_behav_BT1: torch.Tensor  # (B, T−1) float32: π_behav of tokens 1..T−1 (server's logprobs)
    advantages_BT1: torch.Tensor  # (B, T−1) float32: sequence advantage broadcast over loss tokens
    rows: list[int]  # indices into the flattened sample list
    num_tokens: int  # real (unpadded) tokens


@dataclass
class PackedBatch:
    micro_batches: list[MicroBatch]
    num_tokens: int  # real tokens of the global batch
    loss_tokens: int  # loss tokens of the global batch (the loss denominator)
    num_samples: int
    num_groups: int
    rewards_N: np.ndarray  # float64 (N,)
    advantages_N: np.ndarray  # float32 (N,)
    version_lag_max: int  # policy version − oldest generated token's version; −1 if unknown


def pack_trajectories(
    samples: list[Trajectory], advantages_N: np.ndarray, *, micro_batch_tokens: int, pad_id: int, device: torch.device
) -> list[MicroBatch]:
    """Right-padded micro-batches whose padded size B×T_max stays within `micro_batch_tokens`.

    Samples are sorted by length (longest first, stable) and packed greedily, which keeps padding low
    and the split deterministic; a sample longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(samples)), key=lambda i: -samples[i].num_tokens)
    groups_of_rows: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        n = samples[i].num_tokens
        new_max = max(cur_max, n)
        if cur and new_max * (len(cur) + 1) > micro_batch_tokens:
            groups_of_rows.append(cur)
            cur, new_max = [], n
        cur.append(i)
        cur_max = new_max
    if cur:
        groups_of_rows.append(cur)

    out = []
    for rows in groups_of_rows:
        T = max(2, max(samples[i].num_tokens for i in rows))
        B = len(rows)
        ids = np.full((B, T), pad_id, dtype=np.int64)
        mask = np.zeros((B, T), dtype=np.float32)
        behav = np.zeros((B, T), dtype=np.float32)
        adv = np.zeros((B, T), dtype=np.float32)
        for b, i in enumerate(rows):
            t = samples[i]
            n = t.num_tokens
            ids[b, :n] = t.ids_np()
            mask[b, :n] = t.mask_np()
            behav[b, :n] = t.logprobs_np()
            adv[b, :n] = advantages_N[i]
        adv *= mask
        out.append(
            MicroBatch(
                input_ids_BT=torch.from_numpy(ids).to(device),
                # Drop position 0: it has no logit predicting it (see module docstring).
                loss_mask_BT1=torch.from_numpy(mask[:, 1:].copy()).to(device),
                logp_behav_BT1=torch.from_numpy(behav[:, 1:].copy()).to(device),
                advantages_BT1=torch.from_numpy(adv[:, 1:].copy()).to(device),
                rows=rows,
                num_tokens=sum(samples[i].num_tokens for i in rows),
            )
        )
    return out


def lr_at(cfg: TrainConfig, optimizer_step: int, warmup_steps: int | None = None) -> float:
    """LR of applied optimizer step `optimizer_step` (0-based): linear warm-up over `warmup_steps`
    (default `cfg.warmup_steps`), then `cfg.lr_schedule` — constant, or linear/cosine decay to
    lr·min_lr_ratio at `cfg.total_steps`. A pure function of the step count, so the checkpointed
    `optimizer_steps` counter *is* the scheduler state."""
    import math

    warm = cfg.warmup_steps if warmup_steps is None else warmup_steps
    base = float(cfg.lr)
    if warm > 0 and optimizer_step < warm:
        return base * (optimizer_step + 1) / warm
    if cfg.lr_schedule == "constant":
        return base
    span = max(cfg.total_steps - warm, 1)
    progress = min(max(optimizer_step - warm, 0) / span, 1.0)
    floor = base * cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return floor + (base - floor) * (1.0 - progress)
    if cfg.lr_schedule == "cosine":
        return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown train.lr_schedule {cfg.lr_schedule!r}: use constant, linear or cosine")


def batch_plan(groups: list[TrajectoryGroup], cfg: TrainConfig) -> tuple[list[Trajectory], np.ndarray, np.ndarray, int]:
    """Host side of a step, identical on every rank: (samples, rewards_N, advantages_N, loss tokens).

    Advantages need whole groups and the loss denominator is the *global* loss-token count, so every
    rank computes both over all groups before taking its data-parallel share.
    """
    if not groups:
        raise ValueError("train_step needs at least one group")
    samples = [t for g in groups for t in g.trajectories]
    group_index_N = np.repeat(np.arange(len(groups)), [len(g.trajectories) for g in groups])
    rewards_N = np.asarray([t.reward for t in samples], dtype=np.float64)
    # GRPO advantage per sequence (Dr.GRPO: no std division); tiny, so computed on the CPU.
    advantages_N = grpo_advantages(
        torch.from_numpy(rewards_N), torch.from_numpy(group_index_N), norm_std=cfg.adv_norm == "grpo"
    ).numpy()
    # Loss tokens of the global batch: the same [1:] slice the loss sees, counted on the host.
    loss_tokens = int(sum(int(t.mask_np()[1:].sum()) for t in samples))
    return samples, rewards_N, advantages_N, loss_tokens


class Learner:
    """Single-process decoupled-PPO learner on a plain HF causal LM (CPU or one CUDA device).

    One `train_step` is exactly one optimizer step on one global batch of groups; micro-batches only
    accumulate gradient. The model is kept in eval mode (no dropout), so the π_θ it trains is the
    same function the generation server samples from.
    """

    def __init__(
        self,
        model_path: str,
        train_cfg: TrainConfig,
        *,
        temperature: float,
        device: str = "cpu",
        dtype: str = "float32",
        warmup_steps: int = 0,
        proximal: Literal["recompute", "detach"] = "recompute",
        dual_clip_c: float | None = None,
        compute_entropy: bool = True,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported: use one of {sorted(_DTYPES)} (model.dtype)")
        if proximal not in ("recompute", "detach"):
            raise ValueError(f"proximal {proximal!r}: use 'recompute' or 'detach'")
        if train_cfg.micro_batch_tokens < 2:
            raise ValueError("train.micro_batch_tokens must be ≥ 2: set train.micro_batch_tokens=8192")
        self.cfg = train_cfg
        self.model_path = model_path
        self.temperature = float(temperature)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.warmup_steps = int(warmup_steps)
        self.proximal = proximal
        self.dual_clip_c = dual_clip_c
        self.compute_entropy = compute_entropy

        torch.manual_seed(train_cfg.seed)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device)
        self.model.eval()  # no dropout: train the sampled policy itself
        self.pad_id = self.model.config.pad_token_id if self.model.config.pad_token_id is not None else 0
        betas = tuple(float(b) for b in train_cfg.adam_betas)
        if len(betas) != 2:
            raise ValueError(f"train.adam_betas must have 2 entries, got {train_cfg.adam_betas}")
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self._lr_at(0),
            betas=betas,  # type: ignore[arg-type]
            eps=train_cfg.adam_eps,
            weight_decay=train_cfg.weight_decay,
        )
        self.step = 0  # train_step calls completed (skipped ones included: their groups are consumed)
        self.optimizer_steps = 0  # steps actually applied
        self.skipped_steps = 0
        self.version = -1  # policy version of the weights last trained

    is_rank0 = True  # the single-process learner is its own pool's rank 0 (CheckpointManager)

    # ---- schedule -------------------------------------------------------------------------------
    def _lr_at(self, optimizer_step: int) -> float:
        """See `lr_at`; the `warmup_steps` argument (if > 0) overrides `train.warmup_steps`."""
        return lr_at(self.cfg, optimizer_step, self.warmup_steps if self.warmup_steps > 0 else None)

    # ---- phases ---------------------------------------------------------------------------------
    def prepare_batch(self, groups: list[TrajectoryGroup], version: int) -> PackedBatch:
        """fetch → advantages → pack → count loss tokens (host side; no model call)."""
        samples, rewards_N, advantages_N, loss_tokens = batch_plan(groups, self.cfg)
        micro_batches = pack_trajectories(
            samples, advantages_N, micro_batch_tokens=self.cfg.micro_batch_tokens, pad_id=self.pad_id, device=self.device
        )
        min_versions = [g.min_version for g in groups if g.min_version >= 0]
        return PackedBatch(
            micro_batches=micro_batches,
            num_tokens=int(sum(t.num_tokens for t in samples)),
            loss_tokens=loss_tokens,
            num_samples=len(samples),
            num_groups=len(groups),
            rewards_N=rewards_N,
            advantages_N=advantages_N,
            version_lag_max=(version - min(min_versions)) if min_versions else -1,
        )

    def _token_logprobs(self, input_ids_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp_BT1, logits of positions 0..T−2): logprob of tokens 1..T−1, the server's definition."""
        logits_BTV = self.model(input_ids=input_ids_BT, use_cache=False).logits
        logits_BT1V = logits_BTV[:, :-1]
        return token_logprobs_from_logits(logits_BT1V, input_ids_BT[:, 1:], self.temperature), logits_BT1V

    @torch.no_grad()
    def compute_proximal_logprobs(self, batch: PackedBatch) -> list[torch.Tensor]:
        """π_prox of every micro-batch with the current weights, before this step's update."""
        return [self._token_logprobs(mb.input_ids_BT)[0].float() for mb in batch.micro_batches]

    def forward_backward(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        """Accumulate ∇L of the whole batch into `.grad` (no optimizer step); returns device-side stats.

        Each micro-batch's loss is already divided by the global loss-token count, so the sum of the
        micro-batch gradients is the full-batch gradient, whatever the split.
        """
        logp_prox_list = self.compute_proximal_logprobs(batch) if self.proximal == "recompute" else None
        dev = self.device
        zero = torch.zeros((), device=dev)
        acc = {k: zero.clone() for k in ("loss", "clipfrac", "approx_kl", "ratio_mean", "behav_w_mean",
                                          "behav_frac_capped", "dual_clipfrac", "entropy")}
        acc_max = {k: zero.clone() for k in ("behav_w_max", "ratio_max")}
        for k, mb in enumerate(batch.micro_batches):
            logp_BT1, logits_BT1V = self._token_logprobs(mb.input_ids_BT)
            # "detach": with one optimizer step per train_step the weights are still π_prox's here.
            logp_prox_BT1 = logp_prox_list[k] if logp_prox_list is not None else logp_BT1.detach()
            loss, st = decoupled_ppo_loss(
                logp_BT1,
                logp_prox_BT1,
                mb.logp_behav_BT1,
                mb.advantages_BT1,
                mb.loss_mask_BT1,
                eps_clip_low=self.cfg.eps_clip_low,
                eps_clip_high=self.cfg.eps_clip_high,
                behav_imp_weight_cap=self.cfg.behav_imp_weight_cap,
                behav_mode=self.cfg.behav_imp_weight_mode,
                dual_clip_c=self.dual_clip_c,
                loss_tokens_global=batch.loss_tokens,
            )
            loss.backward()
            # Token-weighted accumulation: per-micro-batch means × their loss tokens, / global count.
            frac = st["loss_tokens"] / max(batch.loss_tokens, 1)
            acc["loss"] += loss.detach()
            for name in ("clipfrac", "approx_kl", "ratio_mean", "behav_w_mean", "behav_frac_capped", "dual_clipfrac"):
                acc[name] += st[name] * frac
            for name in acc_max:
                acc_max[name] = torch.maximum(acc_max[name], st[name])
            if self.compute_entropy:
                with torch.no_grad():
                    ent_BT1 = entropy_from_logits(logits_BT1V.detach(), self.temperature)
                    acc["entropy"] += (ent_BT1 * mb.loss_mask_BT1).sum() / max(batch.loss_tokens, 1)
            del logits_BT1V, logp_BT1, loss
        return {**acc, **acc_max}

    # ---- the step -------------------------------------------------------------------------------
    def train_step(self, groups: list[TrajectoryGroup], version: int) -> dict[str, Any]:
        """One optimizer step on `groups`; see the module docstring for the phases.

        `version` is the policy version of the weights this step starts from (π_prox); the updated
        weights become version + 1 once the caller has pushed them (DESIGN invariant 1) — the learner
        only records it and reports `version_lag_max` = version − the oldest token version trained on.
        A step whose gradient is not finite (or that has no loss tokens) is skipped with a logged
        reason, leaving weights and optimizer state untouched; its groups still count as consumed.
        """
        t0 = time.perf_counter()
        # 1. fetch → advantages → pack → count loss tokens
        batch = self.prepare_batch(groups, version)
        # 2. π_prox + forward/backward per micro-batch (gradient accumulation)
        self.optimizer.zero_grad(set_to_none=True)
        dev_stats = self.forward_backward(batch) if batch.loss_tokens > 0 else {}
        # 3. clip (also gives the total norm; max_norm=inf when clipping is off)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip and self.cfg.grad_clip > 0 else float("inf")
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros((), device=self.device)
        )
        # 4. finite check. Host sync: the ONLY one of the step — grad norm and all stats in one copy.
        names = list(dev_stats)
        fetched = torch.stack([grad_norm.float(), *[dev_stats[n].float() for n in names]]).tolist()
        grad_norm_f, stats = fetched[0], dict(zip(names, fetched[1:]))
        skip_reason = step_skip_reason(batch.loss_tokens, grad_norm_f, stats.get("loss", 0.0))
        # 5. optimizer step (or skip it, with the reason logged)
        lr = self._lr_at(self.optimizer_steps)
        if skip_reason:
            log.warning("learner step %d (version %d): optimizer step skipped: %s", self.step, version, skip_reason)
            self.skipped_steps += 1
        else:
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            self.optimizer.step()
            self.optimizer_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.version = version
        # 6. stats
        r = batch.rewards_N
        out: dict[str, Any] = {
            "loss": stats.get("loss", 0.0),
            "reward_mean": float(r.mean()),
            "reward_std": float(r.std()),
            "adv_abs_mean": float(np.abs(batch.advantages_N).mean()),
            "grad_norm": grad_norm_f,
            "clipfrac": stats.get("clipfrac", 0.0),
            "dual_clipfrac": stats.get("dual_clipfrac", 0.0),
            "approx_kl": stats.get("approx_kl", 0.0),
            "ratio_mean": stats.get("ratio_mean", 1.0),
            "ratio_max": stats.get("ratio_max", 1.0),
            "behav_w_mean": stats.get("behav_w_mean", 1.0),
            "behav_w_max": stats.get("behav_w_max", 1.0),
            "behav_frac_capped": stats.get("behav_frac_capped", 0.0),
            "entropy": stats.get("entropy", 0.0),
            "lr": lr,
            "num_tokens": batch.num_tokens,
            "loss_tokens": batch.loss_tokens,
            "num_groups": batch.num_groups,
            "num_samples": batch.num_samples,
            "num_micro_batches": len(batch.micro_batches),
            "version_lag_max": batch.version_lag_max,
            "skipped": bool(skip_reason),
            "skip_reason": skip_reason,
            "step": self.step,
            "step_s": time.perf_counter() - t0,
        }
        return out

    # ---- weights out ----------------------------------------------------------------------------
    def named_tensors_for_push(self) -> list[tuple[str, torch.Tensor]]:
        """HF-named full tensors (detached, contiguous, model dtype, on the learner's device).

        Exactly the names `save_pretrained` writes: a tied lm_head is not repeated (named_parameters
        de-duplicates shared tensors, keeping `model.embed_tokens.weight`), persistent buffers are
        included, non-persistent ones (rotary inv_freq) are not. The tensors alias the live weights:
        send them before the next `train_step`.
        """
        persistent = set(self.model.state_dict().keys())
        out = [(n, p.detach().contiguous()) for n, p in self.model.named_parameters()]
        out += [(n, b.detach().contiguous()) for n, b in self.model.named_buffers() if n in persistent]
        return out

    def save_hf(self, out_dir: str) -> str:
        """Export a complete HF model dir (config, safetensors, tokenizer files copied from `model_path`)."""
        os.makedirs(out_dir, exist_ok=True)
        self.model.save_pretrained(out_dir, safe_serialization=True)
        for name in os.listdir(self.model_path):
            src = os.path.join(self.model_path, name)
            if name in _HF_MODEL_FILES or name.endswith((".safetensors", ".bin")) or not os.path.isfile(src):
                continue
            shutil.copy2(src, os.path.join(out_dir, name))
        return out_dir

    # ---- checkpoints ----------------------------------------------------------------------------
    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly; tensors and plain values only (weights_only-loadable)."""
        rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "format": CKPT_FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": rng,
            "step": self.step,
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "version": self.version,
        }

    def save_checkpoint(self, path: str, extra: dict[str, Any] | None = None) -> str:
        """Write a checkpoint directory atomically (tmp dir + rename): model.safetensors (HF names),
        trainer_state.pt (optimizer, RNG, counters; tensors and plain values only) and meta.json
        (counters + `extra`, which must be JSON-encodable: e.g. buffer offsets, the policy version)."""
        sd = self.state_dict_for_checkpoint()
        meta = {"format": CKPT_FORMAT, "step": self.step, "optimizer_steps": self.optimizer_steps,
                "version": self.version, "model_path": self.model_path, "extra": extra or {}}
        meta_bytes = msgspec.json.encode(meta)  # fails early (before writing) on a non-JSON `extra`
        path = os.path.abspath(path)
        tmp = f"{path}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_model(self.model, os.path.join(tmp, CKPT_MODEL_FILE))  # handles the tied embedding
        torch.save({k: v for k, v in sd.items() if k != "model"}, os.path.join(tmp, CKPT_STATE_FILE))
        publish_checkpoint_dir(tmp, path, meta_bytes)
        return path

    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore model, optimizer, RNG and counters from `save_checkpoint`'s dir; returns `extra`."""
        with open(os.path.join(path, CKPT_META_FILE), "rb") as f:
            meta = msgspec.json.decode(f.read())
        if meta.get("format") != CKPT_FORMAT:
            raise ValueError(f"checkpoint {path}: format {meta.get('format')}, this build reads {CKPT_FORMAT}")
        load_model(self.model, os.path.join(path, CKPT_MODEL_FILE), strict=True, device=str(self.device))
        state = torch.load(os.path.join(path, CKPT_STATE_FILE), map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["cpu"].cpu())
        if self.device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), self.device)
        self.step = int(state["step"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.version = int(state["version"])
        return dict(meta.get("extra", {}))
