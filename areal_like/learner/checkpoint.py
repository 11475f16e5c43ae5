"""Checkpoint policy of a training run: where checkpoints go, when to save, what to resume from.

    <checkpoint_dir>/step_00000012/   one checkpoint (the learner's own format: model, optimizer,
    <checkpoint_dir>/latest            RNG, counters, policy version, `extra`); `latest` names the
                                       newest complete one and is replaced atomically after it

`resume_mode`: "auto" resumes from `latest` if there is one (a fresh run otherwise), "disable" never
resumes, anything else is a checkpoint directory that must exist. `extra` carries what the learner
does not own — the buffer's committed position, the dataloader cursor — as JSON.

Works with the single-process `Learner` and the `ParallelLearner` alike (both have
`save_checkpoint`, `load_checkpoint`, `save_hf`, `is_rank0`); with a pool, call every method on
every rank. What this module does not do: it does not decide what `extra` holds.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

from areal_like.api.config import TrainConfig

_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointManager:
    def __init__(self, root: str, *, save_freq: int, resume_mode: str = "auto", keep: int = 2,
                 export_hf: bool = False) -> None:
        if save_freq < 0:
            raise ValueError("train.save_freq must be ≥ 0 (0 = never): set train.save_freq=10")
        if keep < 1:
            raise ValueError("train.keep_checkpoints must be ≥ 1")
        self.root = os.path.abspath(root)
        self.save_freq = save_freq
        self.resume_mode = resume_mode
        self.keep = keep
        self.export_hf = export_hf

    @classmethod
    def from_config(cls, cfg: TrainConfig, *, run_dir: str) -> "CheckpointManager":
        root = cfg.checkpoint_dir or os.path.join(run_dir, "checkpoints")
        return cls(root, save_freq=cfg.save_freq, resume_mode=cfg.resume_mode, keep=cfg.keep_checkpoints,
                   export_hf=cfg.export_hf)

    # ---- resume ---------------------------------------------------------------------------------
    def latest(self) -> str | None:
        try:
            with open(os.path.join(self.root, "latest")) as f:
                name = f.read().strip()
        except FileNotFoundError:
            return None
        path = os.path.join(self.root, name)
        return path if os.path.isdir(path) else None

    def resume_path(self) -> str | None:
        if self.resume_mode == "disable":
            return None
        if self.resume_mode == "auto":
            return self.latest()
        if not os.path.isdir(self.resume_mode):
            raise FileNotFoundError(f"train.resume_mode={self.resume_mode!r} is not a checkpoint directory: "
                                    "set train.resume_mode=auto, disable or an existing step_* path")
        return self.resume_mode

    def resume(self, learner) -> dict[str, Any] | None:
        """Load the checkpoint `resume_mode` names into `learner`; its `extra`, or None (fresh start)."""
        path = self.resume_path()
        return None if path is None else learner.load_checkpoint(path)

    # ---- save -----------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.save_freq > 0 and step % self.save_freq == 0

    def maybe_save(self, learner, step: int, extra: dict[str, Any] | None = None, *, force: bool = False) -> str | None:
        return self.save(learner, step, extra) if force or self.should_save(step) else None

    def save(self, learner, step: int, extra: dict[str, Any] | None = None) -> str:
        name = f"step_{step:08d}"
        path = os.path.join(self.root, name)
        if learner.is_rank0:
            os.makedirs(self.root, exist_ok=True)
        learner.save_checkpoint(path, extra)  # collective for a pool; atomic rename inside
        if self.export_hf:
            learner.save_hf(os.path.join(path, "hf"))
        if learner.is_rank0:
            tmp = os.path.join(self.root, "latest.tmp")
            with open(tmp, "w") as f:
                f.write(name)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.root, "latest"))  # only now is the new checkpoint "the" one
            self._prune(keep_name=name)
        return path

    def _prune(self, keep_name: str) -> None:
        steps = sorted(n for n in os.listdir(self.root) if _STEP_DIR.match(n))
        for n in steps[:-self.keep]:
            if n != keep_name:
                shutil.rmtree(os.path.join(self.root, n), ignore_errors=True)
