"""Checkpoints of the trainer: one format, one policy (where they go, when to save, what to resume).

    <checkpoint_dir>/step_00000012/     one checkpoint:
        model.safetensors                 the actor, full, HF names (usable with any layout)
        critic.safetensors                the critic (adv_estimator=gae), full, HF names + value head
        rank00000.pt …                    per rank: optimizer state of its shards (actor, critic),
                                          RNG, counters (tensors and plain values: weights_only-loadable)
        meta.json                         format, layout, counters, policy version, `extra` — written
                                          last: a directory without it is never a checkpoint
        hf/                               with train.export_hf: a complete HF model dir of the actor
    <checkpoint_dir>/latest             names the newest complete checkpoint; replaced atomically after it

`resume_mode`: "auto" resumes from `latest` if there is one (a fresh run otherwise), "disable" never
resumes, anything else is a checkpoint directory that must exist. `extra` carries what the trainer
does not own — the buffer's uncommitted entries, the policy version — as JSON.

Every function here is collective for a multi-rank pool: call it on every rank. The directory must
be on a filesystem every rank sees (one node, or shared storage). The frozen reference model is not
saved: it is reloaded from `ref.path`.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import msgspec
import torch

from areal_like.api.config import TrainConfig

CKPT_FORMAT = 3
READABLE_FORMATS = (2, 3)  # 2: the actor-only format of earlier builds (no critic)
MODEL_FILE = "model.safetensors"
CRITIC_FILE = "critic.safetensors"
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
# Files of an HF dir that `save_pretrained` writes itself; everything else (tokenizer) is copied over.
_HF_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def publish_checkpoint_dir(tmp: str, path: str, meta_bytes: bytes) -> None:
    """Finish a checkpoint written into `tmp`: meta.json last (fsynced), then swap `tmp` in as `path`.

    A directory without meta.json is never a checkpoint, so a crash at any point leaves either the
    old checkpoint or the new one, never a half-written one under `path`."""
    with open(os.path.join(tmp, META_FILE), "wb") as f:
        f.write(meta_bytes)
        f.flush()
        os.fsync(f.fileno())
    old = f"{path}.old"
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank{rank:05d}.pt")


def save_checkpoint(trainer, path: str, extra: dict[str, Any] | None = None) -> str:
    """Write `trainer`'s state to the directory `path` atomically (`<path>.tmp`, renamed by rank 0
    once every rank has written). `extra` must be JSON-encodable."""
    from safetensors.torch import save_file

    path = os.path.abspath(path)
    tmp = f"{path}.tmp"
    meta = {"format": CKPT_FORMAT, "layout": str(trainer.layout.spec), "step": trainer.step,
            "optimizer_steps": trainer.actor.optimizer_steps, "version": trainer.version,
            "model_path": trainer.model_path, "critic": trainer.critic is not None, "extra": extra or {}}
    meta_bytes = msgspec.json.encode(meta)  # fails early (before writing) on a non-JSON `extra`
    actor = trainer.named_tensors_for_push()
    critic = trainer.critic.gather_full(dict(trainer.critic.local), trainer.device) if trainer.critic else []
    if trainer.is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        save_file({n: t.contiguous() for n, t in actor}, os.path.join(tmp, MODEL_FILE), metadata={"format": "pt"})
        if trainer.critic is not None:
            save_file({n: t.contiguous() for n, t in critic}, os.path.join(tmp, CRITIC_FILE), metadata={"format": "pt"})
    trainer.barrier()  # the tmp dir exists
    rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if trainer.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
    state = {"format": CKPT_FORMAT, "optimizer": trainer.actor.optimizer_state(),
             "critic_optimizer": trainer.critic.optimizer_state() if trainer.critic else None,
             "critic_optimizer_steps": trainer.critic.optimizer_steps if trainer.critic else 0,
             "rng": rng, "step": trainer.step, "optimizer_steps": trainer.actor.optimizer_steps,
             "skipped_steps": trainer.skipped_steps, "version": trainer.version}
    torch.save(state, _rank_file(tmp, trainer.layout.rank))
    trainer.barrier()  # every rank's file is written
    if trainer.is_rank0:
        publish_checkpoint_dir(tmp, path, meta_bytes)
    trainer.barrier()
    return path


def load_checkpoint(trainer, path: str) -> dict[str, Any]:
    """Restore weights, optimizer state, RNG and counters from `save_checkpoint`'s directory (same
    layout); returns `extra`. Every rank reads the full model files and keeps its own shard."""
    from safetensors.torch import load_file

    with open(os.path.join(path, META_FILE), "rb") as f:
        meta = msgspec.json.decode(f.read())
    if meta.get("format") not in READABLE_FORMATS:
        raise ValueError(f"checkpoint {path}: format {meta.get('format')}, this build reads {READABLE_FORMATS}")
    if meta["layout"] != str(trainer.layout.spec):
        raise ValueError(f"checkpoint {path} was written by layout {meta['layout']}, this pool is "
                         f"{trainer.layout.spec}: resume with the same allocation training side "
                         f"(its model.safetensors is a full HF state dict usable with any layout)")
    has_critic = bool(meta.get("critic", False))
    if has_critic != (trainer.critic is not None):
        raise ValueError(f"checkpoint {path} {'has' if has_critic else 'has no'} critic but this run "
                         f"{'trains one' if trainer.critic is not None else 'does not'}: resume with the "
                         "same algorithm.adv_estimator, or start a new run (train.resume_mode=disable)")
    trainer.actor.load_full(load_file(os.path.join(path, MODEL_FILE), device=str(trainer.device)), path)
    if trainer.critic is not None:
        trainer.critic.load_full(load_file(os.path.join(path, CRITIC_FILE), device=str(trainer.device)), path)
    state = torch.load(_rank_file(path, trainer.layout.rank), map_location=trainer.device, weights_only=True)
    trainer.actor.load_optimizer_state(state["optimizer"])
    trainer.actor.optimizer_steps = int(state["optimizer_steps"])
    if trainer.critic is not None:
        trainer.critic.load_optimizer_state(state["critic_optimizer"])
        trainer.critic.optimizer_steps = int(state["critic_optimizer_steps"])
    torch.set_rng_state(state["rng"]["cpu"].cpu())
    if trainer.device.type == "cuda" and "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), trainer.device)
    trainer.step = int(state["step"])
    trainer.skipped_steps = int(state["skipped_steps"])
    trainer.version = int(state["version"])
    trainer.barrier()
    return dict(meta.get("extra", {}))


def export_hf(trainer, out_dir: str) -> str:
    """A complete HF model dir of the actor written by rank 0 (config, safetensors, tokenizer files)."""
    from safetensors.torch import save_file

    tensors = trainer.named_tensors_for_push()
    if trainer.is_rank0:
        os.makedirs(out_dir, exist_ok=True)
        trainer.config.save_pretrained(out_dir)
        save_file({n: t.contiguous() for n, t in tensors}, os.path.join(out_dir, MODEL_FILE), metadata={"format": "pt"})
        for name in os.listdir(trainer.model_path):
            src = os.path.join(trainer.model_path, name)
            if name in _HF_MODEL_FILES or name.endswith((".safetensors", ".bin")) or not os.path.isfile(src):
                continue
            shutil.copy2(src, os.path.join(out_dir, name))
    trainer.barrier()
    return out_dir


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

    def resume(self, trainer) -> dict[str, Any] | None:
        """Load the checkpoint `resume_mode` names into `trainer`; its `extra`, or None (fresh start)."""
        path = self.resume_path()
        return None if path is None else load_checkpoint(trainer, path)

    # ---- save -----------------------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        return self.save_freq > 0 and step % self.save_freq == 0

    def maybe_save(self, trainer, step: int, extra: dict[str, Any] | None = None, *, force: bool = False) -> str | None:
        return self.save(trainer, step, extra) if force or self.should_save(step) else None

    def save(self, trainer, step: int, extra: dict[str, Any] | None = None) -> str:
        name = f"step_{step:08d}"
        path = os.path.join(self.root, name)
        if trainer.is_rank0:
            os.makedirs(self.root, exist_ok=True)
        save_checkpoint(trainer, path, extra)  # collective; atomic rename inside
        if self.export_hf:
            export_hf(trainer, os.path.join(path, "hf"))
        if trainer.is_rank0:
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
