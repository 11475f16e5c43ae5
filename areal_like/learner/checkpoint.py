"""Checkpoints of the trainer: one format, one policy (where they go, when to save, what to resume).

    <checkpoint_dir>/step_00000012/     one checkpoint:
        model.safetensors                 the actor, full, HF names (usable with any layout); parameters
                                          as the optimizer holds them: the fp32 master with a 16-bit
                                          model.dtype (train.master_dtype), so a resume loses nothing.
                                          Over HF_SHARD_BYTES: model-0000k-of-0000n.safetensors + index
                                          (as save_pretrained), streamed from the shards file by file
        critic.safetensors                the critic (adv_estimator=gae), full, HF names + value head
                                          (critic-0000k-of-… + index when bigger)
        .metadata, __<r>_0.distcp         the AdamW state of actor and critic, sharded: one
                                          torch.distributed.checkpoint (DCP) file per rank holding its
                                          shards, keyed by HF name (`ShardedModel.optimizer_tensors`);
                                          DCP reshards on load, so a checkpoint resumes on another
                                          layout (another d, t, p, or train.dp_sharding)
        rank00000.pt …                    per rank: RNG and counters (weights_only-loadable); a rank
                                          the writing pool did not have reads rank 0's
        meta.json                         format, layout, counters, policy version, `extra`, and `files`:
                                          size and sha256 of every file above (the manifest) — written
                                          last: a directory without it is never a checkpoint
        hf/                               with train.export_hf: a complete HF model dir of the actor
                                          (or its converter's own export; hf_merged/ with
                                          train.export_merged: the model as its unconverted architecture)
    A model whose converter brings its own state format (`ModelConverter.own_format`, learner/converters.py)
    is saved, loaded, exported and pushed by that converter instead (its files in place of the model's,
    its AdamW state its trainable subset's); every converter kind with a `record_key` has that key in
    meta.json (its record, or null), and judges on resume whether this run can take the checkpoint.
    <checkpoint_dir>/latest             names the newest complete checkpoint; replaced atomically after it

`resume_mode`: "auto" resumes from `latest` if there is one (a fresh run otherwise), "disable" never
resumes, a step number (`90`) or a `step_*` name is that checkpoint of checkpoint_dir, anything else
is a checkpoint directory that must exist. `extra` carries what the trainer does not own — the
buffer's uncommitted entries, the policy version — as JSON.

Verified before use (issue 24): every file is checked against meta.json's manifest (size, sha256)
before anything is loaded. Under "auto" a checkpoint that fails is set aside (renamed
`step_*.corrupt`, kept for inspection) with a message naming it and what is wrong, and the previous
one is tried; none usable is an error naming the directory and how to start over. Resuming from a
checkpoint older than the buffer's committed step (that fallback, or an explicit older step) is a
rollback: `CheckpointManager.rollback` tells the learner to rewind the buffer's commit marker
(ReplayBuffer.recover(rollback=…)), and newer checkpoints are set aside (`step_*.rolled_back`) so
that pruning and later resumes see one history.

Every function here is collective for a multi-rank pool: call it on every rank. The directory must
be on a filesystem every rank sees (one node, or shared storage). The frozen reference model is not
saved: it is reloaded from `ref.path`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
import warnings
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from areal_like.api.config import TrainConfig
from areal_like.weights.disk import SafetensorsDir, write_safetensors_shards

log = logging.getLogger(__name__)

CKPT_FORMAT = 5
# 2: actor only (no critic); 2-3: optimizer state per rank in rank*.pt (same layout only); 5: model and
# critic in safetensors shards of HF_SHARD_BYTES with an index once they are bigger (4: one file each)
READABLE_FORMATS = (2, 3, 4, 5)
MODEL_FILE = "model.safetensors"
CRITIC_FILE = "critic.safetensors"
CRITIC_POOL_DIR = "critic_pool"  # a critic on its own pool: its checkpoint (same format), inside the actor's
HF_SHARD_BYTES = 1 << 30  # safetensors file size of checkpoints and train.export_hf (rank 0 holds one at a time)
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """No checkpoint can be resumed: the message names the directory, what is wrong and the fix."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


_DIGEST_SUFFIX = ".sha256"
_RANK_FILE = re.compile(r"^rank(\d{5})\.pt$")
_DCP_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # torch.distributed.checkpoint's file per writing rank


def _write_digest(path: str) -> None:
    """Each rank hashes the file it just wrote (page cache hot, all ranks at once) into a sidecar that
    `_manifest` folds into meta.json: rank 0 never reads the other ranks' optimizer state back."""
    with open(path + _DIGEST_SUFFIX, "w") as f:
        f.write(_sha256(path))


def _manifest(tmp: str) -> dict[str, list]:
    """{file name: [size, sha256]} of every plain file of a checkpoint being published (meta.json aside);
    a file's sidecar digest (`_write_digest`) is used, then removed."""
    out: dict[str, list] = {}
    for name in sorted(os.listdir(tmp)):
        full = os.path.join(tmp, name)
        if name == META_FILE or name.endswith(_DIGEST_SUFFIX) or not os.path.isfile(full):
            continue
        if os.path.isfile(full + _DIGEST_SUFFIX):
            with open(full + _DIGEST_SUFFIX) as f:
                digest = f.read().strip()
            os.remove(full + _DIGEST_SUFFIX)
        else:
            digest = _sha256(full)
        out[name] = [os.path.getsize(full), digest]
    return out


def verify_checkpoint(path: str, rank: int = 0, world: int = 1) -> str | None:
    """What is wrong with the checkpoint directory `path` (None: usable): meta.json readable and of a
    readable format, every file of its manifest present with its size, and the sha256 of this rank's
    part of the files: rank `rank` of a pool of `world` checks every per-rank file whose index ≡ rank mod
    world (the writing pool may have been larger) and every shared file (model, critic shards) whose
    position among them ≡ rank mod world — so the pool reads each file once, in parallel, and no rank
    hashes the whole model (issue 40 item 8: 16 ranks used to hash every model shard 16 times, each under
    the collective timeout); `_verified` makes the ranks agree. A checkpoint of an earlier build (no
    manifest) is checked for its files' presence only."""
    meta_path = os.path.join(path, META_FILE)
    try:
        with open(meta_path, "rb") as f:
            meta = msgspec.json.decode(f.read())
    except FileNotFoundError:
        return f"{META_FILE} is missing (an unfinished checkpoint)"
    except (OSError, msgspec.DecodeError) as e:
        return f"{META_FILE} is unreadable ({e})"
    if not isinstance(meta, dict):
        return f"{META_FILE} is not a JSON object"
    if meta.get("format") not in READABLE_FORMATS:
        return f"format {meta.get('format')}, this build reads {READABLE_FORMATS}"
    if meta.get("critic_pool"):  # the critic pool's part: a checkpoint of its own, verified the same way
        err = verify_checkpoint(os.path.join(path, CRITIC_POOL_DIR), rank, world)
        if err is not None:
            return f"{CRITIC_POOL_DIR}/: {err}"
    files = meta.get("files")
    if files is None:  # written before the manifest existed
        need = [MODEL_FILE, f"rank{rank:05d}.pt"] + ([CRITIC_FILE] if meta.get("critic") else [])
        missing = [n for n in need if not os.path.isfile(os.path.join(path, n))]
        return f"{', '.join(missing)} missing" if missing else None
    for name, (size, digest) in sorted(files.items()):
        full = os.path.join(path, name)
        try:
            actual = os.path.getsize(full)
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} is {actual} bytes, the manifest in {META_FILE} says {size}"
    shared = [n for n in sorted(files) if not (_RANK_FILE.match(n) or _DCP_FILE.match(n))]
    for name, (size, digest) in sorted(files.items()):
        per_rank = _RANK_FILE.match(name) or _DCP_FILE.match(name)
        owner = int(per_rank.group(1)) if per_rank else shared.index(name)
        if owner % max(world, 1) != rank:
            continue  # another rank checks it
        full = os.path.join(path, name)
        if _sha256(full) != digest:
            return f"{name} does not match its sha256 in {META_FILE} (corrupted)"
    return None
# Files of an HF dir that `save_pretrained` writes itself; everything else (tokenizer) is copied over.
_HF_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")


def publish_checkpoint_dir(tmp: str, path: str, meta_bytes: bytes, manifest: bool = False) -> None:
    """Finish a checkpoint written into `tmp`: meta.json last (fsynced), then swap `tmp` in as `path`.
    `manifest`: add `files` (size and sha256 of every file in `tmp`) to meta.json first.

    A directory without meta.json is never a checkpoint, so a crash at any point leaves either the
    old checkpoint or the new one, never a half-written one under `path`."""
    if manifest:
        meta = msgspec.json.decode(meta_bytes)
        meta["files"] = _manifest(tmp)
        meta_bytes = msgspec.json.encode(meta)
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


def _with_optimizer_state(trainer) -> list[str]:
    """The models whose AdamW state exists (an optimizer that never stepped has none)."""
    models = [("actor", trainer.actor), ("critic", trainer.critic)]
    return [prefix for prefix, m in models if m is not None and m.optimizer is not None and m.optimizer.state]


def _optimizer_tensors(trainer, prefixes: list[str], empty: bool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for prefix in prefixes:
        m = getattr(trainer, prefix)
        out.update(m.empty_optimizer_tensors(prefix) if empty else m.optimizer_tensors(prefix))
    return out


@contextlib.contextmanager
def _single_process_is_meant():
    """DCP warns on every save/load without torch.distributed even when told (no_dist=True): a
    one-process learner is the intent, so that one warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _save_optimizer(trainer, tmp: str) -> None:
    """The AdamW state of actor and critic as one DCP checkpoint in `tmp` (collective): each rank
    writes its own shards (`__<rank>_0.distcp`, hashed into its digest sidecar), rank 0 `.metadata`.
    Replicated tensors (dp under train.dp_sharding=none) are written once."""
    import torch.distributed.checkpoint as dcp

    tensors = _optimizer_tensors(trainer, _with_optimizer_state(trainer), empty=False)
    if not tensors:
        return  # before the first optimizer step: nothing to save
    L = trainer.layout
    with _single_process_is_meant():
        dcp.save(tensors, checkpoint_id=tmp, process_group=L.host_world_group if L.distributed else None,
                 no_dist=not L.distributed)
    for name in os.listdir(tmp):
        m = _DCP_FILE.match(name)
        if m and int(m.group(1)) == L.rank:
            _write_digest(os.path.join(tmp, name))


def _load_optimizer(trainer, path: str, prefixes: list[str]) -> None:
    """Fill this pool's AdamW state of `prefixes` (the models that had one) from `path`'s DCP files,
    resharded to this layout (collective)."""
    import torch.distributed.checkpoint as dcp

    if not prefixes:
        return
    tensors = _optimizer_tensors(trainer, prefixes, empty=True)
    L = trainer.layout
    with _single_process_is_meant():
        dcp.load(tensors, checkpoint_id=path, process_group=L.host_world_group if L.distributed else None,
                 no_dist=not L.distributed)
    for prefix in prefixes:
        getattr(trainer, prefix).set_optimizer_tensors(tensors, prefix)


def save_checkpoint(trainer, path: str, extra: dict[str, Any] | None = None) -> str:
    """Write `trainer`'s state to the directory `path` atomically (`<path>.tmp`, renamed by rank 0
    once every rank has written). `extra` must be JSON-encodable."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp"
    meta = {"format": CKPT_FORMAT, "layout": str(trainer.layout.spec), "step": trainer.step,
            "optimizer_steps": trainer.optimizer_steps, "version": trainer.version, "role": trainer.role,
            "model_path": trainer.model_path, "critic": trainer.critic is not None, "extra": extra or {},
            "critic_pool": trainer.critic_pool,
            "model_dtype": str(trainer.dtype).removeprefix("torch."), "master_dtype": trainer.cfg.master_dtype,
            "dp_sharding": trainer.dp_sharding, "optimizer_state": _with_optimizer_state(trainer),
            **(trainer.actor.conversion.records() if trainer.actor is not None else {})}
    meta_bytes = msgspec.json.encode(meta)  # fails early (before writing) on a non-JSON `extra`
    if trainer.is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if trainer.critic_pool:  # the critic pool writes its part into ours while we write the actor's
            trainer.remote_critic.send("save", path=os.path.join(tmp, CRITIC_POOL_DIR))
    trainer.barrier()  # the tmp dir exists
    # Full tensors, streamed from the shards one file at a time (rank 0 writes; the others join the gathers)
    for model, prefix in ((trainer.actor, "model"), (trainer.critic, "critic")):
        # a converter's own format (its files), else the full model: the master too (fp32 with a 16-bit model.dtype)
        if model is not None and not model.conversion.save(model, tmp, write=trainer.is_rank0):
            write_safetensors_shards(model.weights(), tmp, shard_bytes=HF_SHARD_BYTES, write=trainer.is_rank0,
                                     prefix=prefix)
    _save_optimizer(trainer, tmp)
    rng: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if trainer.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
    state = {"format": CKPT_FORMAT, "critic_optimizer_steps": trainer.critic.optimizer_steps if trainer.critic else 0,
             "rng": rng, "step": trainer.step, "optimizer_steps": trainer.optimizer_steps,
             "skipped_steps": trainer.skipped_steps, "version": trainer.version}
    torch.save(state, _rank_file(tmp, trainer.layout.rank))
    _write_digest(_rank_file(tmp, trainer.layout.rank))
    if trainer.is_rank0 and trainer.critic_pool:
        trainer.remote_critic.recv("saved", timeout_s=trainer.critic_cfg.timeout_s, what=f"write its part of {path}")
    trainer.barrier()  # every rank's file (and its digest) is written
    if trainer.is_rank0:
        publish_checkpoint_dir(tmp, path, meta_bytes, manifest=True)
    trainer.barrier()
    return path


def load_checkpoint(trainer, path: str) -> dict[str, Any]:
    """Restore weights, optimizer state, RNG and counters from `save_checkpoint`'s directory; returns
    `extra`. Every rank reads the full model files and keeps its own shard; the optimizer state
    (format 4) is resharded by DCP to this layout, whatever layout wrote it. Formats 2-3 (optimizer
    state per rank) resume under the layout and sharding that wrote them only."""
    with open(os.path.join(path, META_FILE), "rb") as f:
        meta = msgspec.json.decode(f.read())
    if meta.get("format") not in READABLE_FORMATS:
        raise ValueError(f"checkpoint {path}: format {meta.get('format')}, this build reads {READABLE_FORMATS}")
    sharded = meta["format"] >= 4  # optimizer state in DCP files: loads into any layout
    saved_sharding = meta.get("dp_sharding", "none")  # absent: written before train.dp_sharding (replicated)
    if not sharded and meta["layout"] != str(trainer.layout.spec):
        raise ValueError(f"checkpoint {path} was written by layout {meta['layout']} (format {meta['format']}: "
                         f"optimizer state per rank), this pool is {trainer.layout.spec}: resume with the same "
                         f"allocation training side (its model.safetensors is a full HF state dict usable with any layout)")
    if not sharded and (saved_sharding == "none") != (trainer.dp_sharding == "none"):
        raise ValueError(f"checkpoint {path} holds optimizer state of train.dp_sharding={saved_sharding} "
                         f"(layout {meta['layout']}), this pool shards as {trainer.dp_sharding}: resume with "
                         f"train.dp_sharding={saved_sharding}, or start a new run from its model.safetensors "
                         f"(model.path)")
    if trainer.is_rank0 and (meta["layout"], saved_sharding) != (str(trainer.layout.spec), trainer.dp_sharding):
        log.warning("checkpoint %s was written by layout %s (train.dp_sharding=%s); this pool is %s (%s): "
                    "its optimizer state is resharded on load", path, meta["layout"], saved_sharding,
                    trainer.layout.spec, trainer.dp_sharding)
    if meta.get("role", "actor") != trainer.role:
        raise ValueError(f"checkpoint {path} is a {meta.get('role', 'actor')} pool's, this pool trains the "
                         f"{trainer.role}: resume each pool from its own")
    if bool(meta.get("critic_pool", False)) != trainer.critic_pool:
        where = ("on a pool of its own (a critic component in the allocation)" if meta.get("critic_pool")
                 else "inside the actor's ranks, or not at all")
        raise ValueError(f"checkpoint {path} was written by a run whose critic trained {where}; this run's "
                         f"{'has' if trainer.critic_pool else 'has no'} critic pool: resume with the allocation "
                         f"that wrote it, or start a new run (train.resume_mode=disable)")
    has_critic = bool(meta.get("critic", False))
    if has_critic != (trainer.critic is not None):
        raise ValueError(f"checkpoint {path} {'has' if has_critic else 'has no'} critic but this run "
                         f"{'trains one' if trainer.critic is not None else 'does not'}: resume with the "
                         "same algorithm.adv_estimator, or start a new run (train.resume_mode=disable)")
    saved_master = meta.get("master_dtype")  # absent: written before train.master_dtype (state in model.dtype)
    if trainer.is_rank0 and (trainer.actor.master_dtype is not None if saved_master is None
                             else saved_master != trainer.cfg.master_dtype):
        log.warning("checkpoint %s: its master weights and AdamW state are %s; this run keeps them in %s "
                    "(train.master_dtype): converted on load", path,
                    saved_master or "in its model.dtype (written before train.master_dtype)", trainer.cfg.master_dtype)
    if trainer.actor is not None:
        trainer.actor.conversion.check_resume(meta, path)  # the converters' records against this run's
    # read tensor by tensor on the host (one full tensor in memory at a time), each rank keeping its shard
    for model, prefix in ((trainer.actor, "model"), (trainer.critic, "critic")):
        if model is not None and not model.conversion.load(model, path):  # its converter's format, or the full model
            model.load_full(SafetensorsDir(path, prefix), path)
    own = _rank_file(path, trainer.layout.rank)
    # a rank the writing pool did not have: rank 0's counters and RNG (the same on every rank)
    state = torch.load(own if os.path.isfile(own) else _rank_file(path, 0), map_location=trainer.device,
                       weights_only=True)
    if sharded:
        _load_optimizer(trainer, path, [p for p in meta.get("optimizer_state", []) if getattr(trainer, p, None)])
    else:
        trainer.actor.load_optimizer_state(state["optimizer"])
        if trainer.critic is not None:
            trainer.critic.load_optimizer_state(state["critic_optimizer"])
    if trainer.actor is not None:
        trainer.actor.optimizer_steps = int(state["optimizer_steps"])
    if trainer.critic is not None:
        trainer.critic.optimizer_steps = int(state["critic_optimizer_steps"])
    torch.set_rng_state(state["rng"]["cpu"].cpu())
    if trainer.device.type == "cuda" and "cuda" in state["rng"]:
        torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), trainer.device)
    trainer.step = int(state["step"])
    trainer.skipped_steps = int(state["skipped_steps"])
    trainer.version = int(state["version"])
    trainer.barrier()
    return dict(meta.get("extra", {}))


def export_hf(trainer, out_dir: str, *, merged: bool = False) -> str:
    """A complete HF model dir of the actor (config, safetensors shards in `model.dtype`, tokenizer
    files), written by rank 0 from the shards one file at a time (`weights.disk.write_safetensors_shards`:
    rank 0 never holds the whole model). Collective: every rank calls it.

    An actor whose converter has its own format: that converter's export (`ModelConverter.export`, in
    `model.dtype`) plus the tokenizer files; `merged`: the whole model as its unconverted architecture
    instead (`ModelConverter.plain_weights`)."""
    actor = trainer.actor
    if merged or not actor.conversion.export(actor, out_dir, dtype=trainer.dtype, write=trainer.is_rank0):
        if trainer.is_rank0:
            os.makedirs(out_dir, exist_ok=True)
            trainer.config.save_pretrained(out_dir)
        # the master: written in model.dtype, the model's own dtype
        write_safetensors_shards(actor.conversion.plain_weights(actor), out_dir, dtype=trainer.dtype,
                                 shard_bytes=HF_SHARD_BYTES, write=trainer.is_rank0)
    if trainer.is_rank0:
        for name in os.listdir(trainer.model_path):
            src = os.path.join(trainer.model_path, name)
            if name in _HF_MODEL_FILES or name.endswith((".safetensors", ".bin")) or not os.path.isfile(src):
                continue
            shutil.copy2(src, os.path.join(out_dir, name))
    trainer.barrier()
    return out_dir


def _verified(trainer, path: str) -> str | None:
    """`verify_checkpoint` on every rank, agreed: None only when every rank found its part usable (a
    MIN all-reduce on the host group), so every rank takes the same checkpoint."""
    err = verify_checkpoint(path, trainer.layout.rank, trainer.layout.world_size)
    layout = trainer.layout
    if getattr(layout, "distributed", False) and layout.world_size > 1:
        if err and not trainer.is_rank0:
            print(f"[learner rank {layout.rank}] checkpoint {path} is unusable: {err}", flush=True)
        ok = torch.tensor([0 if err else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=layout.host_world_group)
        if err is None and not int(ok.item()):
            err = "another rank's part of the checkpoint failed verification (that rank's log names it)"
    return err


class CheckpointManager:
    def __init__(self, root: str, *, save_freq: int, resume_mode: str | int = "auto", keep: int = 2,
                 export_hf: bool = False, export_merged: bool = False) -> None:
        if save_freq < 0:
            raise ValueError("train.save_freq must be ≥ 0 (0 = never): set train.save_freq=10")
        if keep < 1:
            raise ValueError("train.keep_checkpoints must be ≥ 1")
        self.root = os.path.abspath(root)
        self.save_freq = save_freq
        self.resume_mode = str(resume_mode)  # a step number arrives as an int from YAML/overrides
        self.keep = keep
        self.export_hf = export_hf
        self.export_merged = export_merged  # a converter's own export: also the merged model (hf_merged/)
        self.rollback = False  # set by `resume`
        self.resumed_from: str | None = None  # set by `resume`

    @classmethod
    def from_config(cls, cfg: TrainConfig, *, run_dir: str) -> "CheckpointManager":
        root = cfg.checkpoint_dir or os.path.join(run_dir, "checkpoints")
        return cls(root, save_freq=cfg.save_freq, resume_mode=cfg.resume_mode, keep=cfg.keep_checkpoints,
                   export_hf=cfg.export_hf, export_merged=cfg.export_merged)

    # ---- resume ---------------------------------------------------------------------------------
    def _latest_name(self) -> str | None:
        try:
            with open(os.path.join(self.root, "latest")) as f:
                return f.read().strip()
        except OSError:
            return None

    def latest(self) -> str | None:
        name = self._latest_name()
        if name is None:
            return None
        path = os.path.join(self.root, name)
        return path if os.path.isdir(path) else None

    def _step_names(self) -> list[str]:
        """The checkpoint directories of `root`, newest first."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return sorted((n for n in names if _STEP_DIR.match(n) and os.path.isdir(os.path.join(self.root, n))),
                      reverse=True)

    def candidates(self) -> list[str]:
        """What `auto` tries, in order: the checkpoint `latest` names, then every older one, newest first
        (all of them, newest first, when `latest` names none that exists)."""
        names = self._step_names()
        latest = self._latest_name()
        if latest in names:
            names = [n for n in names if n <= latest]
        return [os.path.join(self.root, n) for n in names]

    def _explicit_path(self) -> str:
        mode = self.resume_mode
        name = f"step_{int(mode):08d}" if mode.isdigit() else mode
        if _STEP_DIR.match(name):
            path = os.path.join(self.root, name)
            if not os.path.isdir(path):
                have = ", ".join(n[len("step_"):].lstrip("0") or "0" for n in reversed(self._step_names())) or "none"
                raise CheckpointError(f"train.resume_mode={mode!r}: no checkpoint {path} (steps in {self.root}: "
                                      f"{have}): set train.resume_mode to one of them, or auto")
            return path
        if not os.path.isdir(mode):
            raise CheckpointError(f"train.resume_mode={mode!r} is not a checkpoint directory: set "
                                  "train.resume_mode=auto, disable, a step number or an existing step_* path")
        return os.path.abspath(mode)

    def resume_path(self) -> str | None:
        """The checkpoint `resume_mode` names, unverified (see `resume` for the verified choice)."""
        if self.resume_mode == "disable":
            return None
        if self.resume_mode == "auto":
            return self.latest()
        return self._explicit_path()

    def _set_aside(self, names: list[str], suffix: str) -> list[str]:
        """Rank 0: rename checkpoints of `root` out of the way (kept, never pruned, never resumed)."""
        out = []
        for n in names:
            src = os.path.join(self.root, n)
            dst = f"{src}.{suffix}"
            k = 1
            while os.path.exists(dst):
                k += 1
                dst = f"{src}.{suffix}{k}"
            os.replace(src, dst)
            out.append(dst)
        return out

    def _point_latest(self, name: str | None) -> None:
        latest = os.path.join(self.root, "latest")
        if name is None:
            if os.path.exists(latest):
                os.remove(latest)
            return
        tmp = latest + ".tmp"
        with open(tmp, "w") as f:
            f.write(name)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, latest)

    def resume(self, trainer, *, explicit: bool = True, log=print) -> dict[str, Any] | None:
        """Load the checkpoint `resume_mode` names into `trainer`, verified first; its `extra`, or None
        (fresh start). Sets `self.rollback`: True when this start may be behind the buffer's committed
        step on purpose (an explicit step, `disable`, or a fallback past an unusable checkpoint) — the
        learner then rewinds the buffer (ReplayBuffer.recover(rollback=…)) instead of refusing.
        `explicit=False` (a restarted learner pool) resumes as `auto`: the explicit choice was the
        first start's, and that start pointed `latest` at it."""
        mode = self.resume_mode if explicit else "auto"
        self.rollback = False
        self.resumed_from = None  # the checkpoint loaded (a critic pool loads its part of it: learner/main.py)
        rank0 = trainer.is_rank0
        if mode == "disable":
            newer = self._step_names()
            self.rollback = bool(newer)
            trainer.barrier()
            if rank0 and newer:
                moved = self._set_aside(newer, "rolled_back")
                self._point_latest(None)
                log(f"train.resume_mode=disable: starting over from step 0; the existing checkpoints are set "
                    f"aside: {', '.join(moved)}")
            trainer.barrier()
            return None
        if mode == "auto":
            cands = self.candidates()
            if not cands:
                return None
            bad: list[tuple[str, str]] = []
            path = None
            for i, cand in enumerate(cands):
                err = _verified(trainer, cand)
                if err is None:
                    path = cand
                    break
                bad.append((cand, err))
                if rank0:
                    nxt = cands[i + 1] if i + 1 < len(cands) else None
                    log(f"checkpoint {cand} is unusable: {err}; "
                        + (f"falling back to the previous checkpoint {nxt}" if nxt else "no older checkpoint left"))
            trainer.barrier()  # every rank verified before any is renamed
            if path is None:
                listing = "; ".join(f"{p}: {e}" for p, e in bad)
                raise CheckpointError(
                    f"no usable checkpoint in {self.root} (run dir {os.path.dirname(self.root)}): {listing}. "
                    f"Resume from a checkpoint you restored there, or start over from step 0 with "
                    f"train.resume_mode=disable (the unusable ones are set aside), or use a new --run-dir")
            if bad:
                self.rollback = True
                if rank0:
                    moved = self._set_aside([os.path.basename(p) for p, _ in bad], "corrupt")
                    self._point_latest(os.path.basename(path))
                    log(f"resuming from {path} instead of {bad[0][0]}; the unusable checkpoint(s) are kept as "
                        f"{', '.join(moved)}")
                trainer.barrier()
        else:
            path = self._explicit_path()
            err = _verified(trainer, path)
            if err is not None:
                raise CheckpointError(f"train.resume_mode={self.resume_mode!r}: checkpoint {path} is unusable: {err}; "
                                      f"choose another (train.resume_mode=auto takes the newest usable one)")
            self.rollback = True
            trainer.barrier()
            if rank0 and os.path.dirname(path) == self.root:
                name = os.path.basename(path)
                newer = [n for n in self._step_names() if n > name]
                if newer:
                    moved = self._set_aside(newer, "rolled_back")
                    log(f"train.resume_mode={self.resume_mode}: rolling back to {path}; the newer checkpoints "
                        f"are set aside: {', '.join(moved)}")
                self._point_latest(name)  # a restarted pool resumes from here (or what it saved since)
            trainer.barrier()
        try:
            extra = load_checkpoint(trainer, path)
            self.resumed_from = path
            return extra
        except (CheckpointError, ValueError):  # ValueError: layout/critic mismatch, named already
            raise
        except Exception as e:  # a library error (torch, safetensors): name the checkpoint
            raise CheckpointError(f"checkpoint {path} could not be loaded: {type(e).__name__}: {e}") from e

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
        if self.export_merged and trainer.actor is not None and trainer.actor.conversion.format is not None:
            export_hf(trainer, os.path.join(path, "hf_merged"), merged=True)
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
