"""Trainer side of weight sync through the file system (`weights.mode=disk`).

The fallback when no process group can be formed between the learner and the servers (other
network, firewalled ports, a server build without distributed updates, SGLang with p > 1):

```
 write <out_dir>/v<version>/ (safetensors + config/tokenizer files; tmp dir + rename)   generation runs on
 pause(abort) all ──► POST /update_weights_from_disk {model_path, weight_version} to all ──► continue all
 delete all but the newest `keep` version dirs
```
A server that fails to load rolls back to its old weights (PROTOCOL.md), so a failed push leaves
every server serving a complete set of weights; this pusher then continues generation and raises.
Same interface as `WeightPusher` (`init`, `push`, `close`), so the learner does not care which one
it holds. This module does not decide when to push or which version comes next (the learner does).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import time

import torch

from areal_like import metrics
from areal_like.weights.admin import ServerAdmin, WeightPushError
from areal_like.weights.receive import parse_dtype

log = logging.getLogger(__name__)

# Files of an HF model dir that hold weights: never copied from `model_path` (ours replace them).
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth)$|.*\.safetensors\.index\.json$|.*\.bin\.index\.json$")
_VERSION_DIR = re.compile(r"^v(\d+)$")


def write_hf_checkpoint(named_tensors: list[tuple[str, torch.Tensor]], out_dir: str, model_path: str | None,
                        dtype: torch.dtype | None = None) -> int:
    """Write `out_dir` atomically (a tmp dir renamed into place): model.safetensors with the named
    tensors (floating-point ones cast to `dtype`, None = as they are) plus every non-weight file of
    `model_path` (config.json, tokenizer files). Returns bytes."""
    from safetensors.torch import save_file

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        nbytes = 0
        for name, t in named_tensors:
            # One cast per tensor, on its way to host memory (the servers load what they hold).
            t = t.detach().to("cpu", dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype).contiguous()
            # safetensors refuses tensors sharing storage (tied embeddings): give repeats their own copy.
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
            seen.add(ptr)
            tensors[name] = t
            nbytes += t.numel() * t.element_size()
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        if model_path:
            for fname in os.listdir(model_path):
                src = os.path.join(model_path, fname)
                if os.path.isfile(src) and not _WEIGHT_FILE.match(fname):
                    shutil.copy2(src, os.path.join(tmp, fname))
        if os.path.exists(out_dir):  # the same version written again (a restarted learner): replace it
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return nbytes


class DiskWeightPusher(ServerAdmin):
    """Push weights as an HF checkpoint dir the servers load with /update_weights_from_disk."""

    def __init__(self, servers: list[str], *, out_dir: str, model_path: str | None = None, timeout_s: float = 300.0,
                 admin_api_key: str | None = None, keep: int = 2, dtype: str | torch.dtype | None = None):
        super().__init__(servers, timeout_s=timeout_s, admin_api_key=admin_api_key)
        # The servers' dtype (`server.dtype`): floating-point tensors are written in it. None = as they are.
        self.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        if keep < 1:
            raise ValueError("keep must be ≥ 1: the newest version dir is the one the servers load")
        self.out_dir = os.path.abspath(out_dir)
        self.model_path = model_path
        self.keep = keep

    # ---------------------------------------------------------------- API
    async def init(self) -> None:
        """Open the HTTP session and the output dir (no process group in this mode)."""
        await super().init()
        os.makedirs(self.out_dir, exist_ok=True)

    def version_dir(self, version: int) -> str:
        return os.path.join(self.out_dir, f"v{version:08d}")

    async def push(self, named_tensors: list[tuple[str, torch.Tensor]], version: int) -> dict[str, float]:
        """Write → pause → every server loads it → continue. Sets every server's weight_version to str(version).

        On a failed load the servers keep (roll back to) their old weights; generation is continued
        and WeightPushError names the server."""
        if self._session is None:
            raise WeightPushError("push() before init(): call init() first")
        t0 = time.perf_counter()
        path = self.version_dir(version)
        # Written before the pause: generation does not wait for the disk.
        nbytes = await asyncio.to_thread(write_hf_checkpoint, named_tensors, path, self.model_path, self.dtype)
        t_written = time.perf_counter()
        await self._all("/pause_generation", {"mode": "abort"})
        t_paused = time.perf_counter()
        failure: BaseException | None = None
        try:
            await self._begin_or_end("/begin_weight_update")
            # Paused (abort): nothing runs, so flushing the cache is safe on every SGLang release.
            await self._all("/update_weights_from_disk", {"model_path": path, "load_format": None,
                                                          "abort_all_requests": False, "flush_cache": True,
                                                          "weight_version": str(version)})
            await self._begin_or_end("/end_weight_update")
        except BaseException as e:
            failure = e
        finally:
            # Every server serves a complete set (new, or old after its rollback): generation goes on.
            await self._all("/continue_generation", {})
        if failure is not None:
            raise failure
        t_end = time.perf_counter()
        await asyncio.to_thread(self._prune, path)
        metrics.PUSH_SECONDS.observe(t_end - t0)
        return {"push_s": t_end - t0, "pause_window_s": t_end - t_paused, "write_s": t_written - t0,
                "bytes": nbytes, "buckets": 1, "path": path}

    def _prune(self, current: str) -> None:
        """Keep `current` and the `keep` − 1 most recently written other version dirs; leftover tmp dirs
        go too. By write time, not version: a learner resumed from an older checkpoint writes lower
        versions than the dirs its previous incarnation left."""
        found = []
        for name in os.listdir(self.out_dir):
            full = os.path.join(self.out_dir, name)
            if ".tmp-" in name:
                shutil.rmtree(full, ignore_errors=True)
            elif _VERSION_DIR.match(name) and full != current:
                found.append((os.stat(full).st_mtime_ns, full))
        for _, full in sorted(found)[:max(0, len(found) - (self.keep - 1))]:
            shutil.rmtree(full, ignore_errors=True)
