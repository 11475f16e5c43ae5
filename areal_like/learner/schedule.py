"""The learning-rate schedule: a pure function of the applied optimizer-step count.

Because it is pure, the checkpointed `optimizer_steps` counter *is* the scheduler state — nothing
else needs saving. Actor and critic each call it with their own base LR.
"""

from __future__ import annotations

import math

from areal_like.api.config import TrainConfig


def lr_at(cfg: TrainConfig, optimizer_step: int, warmup_steps: int | None = None, *, base_lr: float | None = None,
          total_steps: int | None = None) -> float:
    """LR of applied optimizer step `optimizer_step` (0-based): linear warm-up over `warmup_steps`
    (default `cfg.warmup_steps`), then `cfg.lr_schedule` — constant, or linear/cosine decay to
    lr·min_lr_ratio at `total_steps` optimizer steps (default `cfg.total_steps`; with PPO minibatches
    the trainer passes total_steps × ppo_epochs × ppo_minibatches). `base_lr` defaults to `cfg.lr`."""
    warm = cfg.warmup_steps if warmup_steps is None else warmup_steps
    base = float(cfg.lr if base_lr is None else base_lr)
    total = cfg.total_steps if total_steps is None else total_steps
    if warm > 0 and optimizer_step < warm:
        return base * (optimizer_step + 1) / warm
    if cfg.lr_schedule == "constant":
        return base
    span = max(total - warm, 1)
    progress = min(max(optimizer_step - warm, 0) / span, 1.0)
    floor = base * cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return floor + (base - floor) * (1.0 - progress)
    if cfg.lr_schedule == "cosine":
        return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown train.lr_schedule {cfg.lr_schedule!r}: use constant, linear or cosine")
