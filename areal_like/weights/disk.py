"""Trainer side of weight sync through the file system (`weights.mode=disk`).

The fallback when no process group can be formed between the learner and the servers (other
network, firewalled ports, a server build without distributed updates, SGLang with p > 1):

```
 write <out_dir>/v<version>/ (safetensors + config/tokenizer files; tmp dir + rename)   generation runs on
 pause(abort) all ──► POST /update_weights_from_disk {model_path, weight_version} to all ──► continue all
 delete all but the newest `keep` version dirs
```
A LoRA learner's push (`weights.adapter.AdapterWeights`) writes the adapter alone as a peft directory
and swaps the servers' run adapter with SGLang's /unload_lora_adapter + /load_lora_adapter instead.
A server that fails to load rolls back to its old weights (PROTOCOL.md), so a failed push leaves
every server serving a complete set of weights; this pusher then continues generation and raises.
Same interface as `WeightPusher` (`init`, `push`, `close`), so the learner does not care which one
it holds. This module does not decide when to push or which version comes next (the learner does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence

import torch

from areal_like import metrics
from areal_like.api.step_stats import PushResult
from areal_like.weights import delta as deltas_
from areal_like.weights import delta_sync
from areal_like.weights.adapter import ADAPTER_NAME, is_adapter, write_adapter_dir
from areal_like.weights.admin import ServerAdmin, WeightPushError
from areal_like.weights.delta import DELTA_FORMAT, DELTA_MANIFEST, DELTA_PREFIX, read_delta_dir  # noqa: F401 (re-exported)
from areal_like.weights.receive import parse_dtype
from areal_like.weights.safetensors_dir import SafetensorsDir, index_file, shard_files  # noqa: F401 (re-exported)
from areal_like.weights.source import WeightSource, as_source, gather_in, plan_buckets, wire_dtype_of

log = logging.getLogger(__name__)

# Files of an HF model dir that hold weights: never copied from `model_path` (ours replace them).
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth)$|.*\.safetensors\.index\.json$|.*\.bin\.index\.json$")
_VERSION_DIR = re.compile(r"^v(\d+)$")


def write_safetensors_shards(weights: WeightSource | Sequence[tuple[str, torch.Tensor]], out_dir: str, *,
                             dtype: torch.dtype | None = None, shard_bytes: int = 512 << 20,
                             write: bool = True, prefix: str = "model",
                             on_tensor: Callable[[str, torch.Tensor], None] | None = None) -> int:
    """The weights as HF safetensors files in `out_dir`, streamed: one file per shard of at most
    `shard_bytes` (`model-0000k-of-0000n.safetensors` + `model.safetensors.index.json`, as
    `save_pretrained` writes; one shard = `model.safetensors`), floating-point tensors cast to
    `dtype` (None = as they are) on their way to host memory. At most one shard plus the tensor in
    hand is held. With a gathering source every rank of the learner pool calls it (the gathers are
    collective) and only the one with `write` (rank 0) writes. `prefix` replaces `model` in the file
    names (a checkpoint's critic). `on_tensor(name, tensor)` sees each tensor as written (the delta
    sync's sent copy). `SafetensorsDir` reads them back. Returns the bytes written."""
    from safetensors.torch import save_file

    src = as_source(weights)
    meta = src.meta
    shards = plan_buckets(meta, shard_bytes, dtype, aligned=False)
    names = shard_files(len(shards), prefix)
    nbytes = 0
    weight_map: dict[str, str] = {}
    for fname, idx in zip(names, shards):
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, t in src.open(idx):
            if t is None or not write:  # a follower of the gathers, or nothing to write here
                continue
            # One cast per tensor, on its way to host memory (the servers load what they hold).
            t = t.detach().to("cpu", dtype=wire_dtype_of(t.dtype, dtype)).contiguous()
            # safetensors refuses tensors sharing storage (tied embeddings): give repeats their own copy.
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
            seen.add(ptr)
            tensors[name] = t
            if on_tensor is not None:
                on_tensor(name, t)
            weight_map[name] = fname
            nbytes += t.numel() * t.element_size()
            del t
        if write:
            save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        del tensors
    if write and len(shards) > 1:
        with open(os.path.join(out_dir, index_file(prefix)), "w") as f:
            json.dump({"metadata": {"total_size": nbytes}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return nbytes


def write_dir_atomically(out_dir: str, write: Callable[[str], int]) -> int:
    """`write(tmp)` fills a tmp dir beside `out_dir`, which is then renamed into place (an existing
    `out_dir` — the same version written again by a restarted learner — replaced); the tmp dir is
    removed on failure. Returns what `write` returns (bytes)."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        nbytes = write(tmp)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return nbytes


def write_hf_checkpoint(weights: WeightSource | Sequence[tuple[str, torch.Tensor]], out_dir: str,
                        model_path: str | None, dtype: torch.dtype | None = None,
                        shard_bytes: int = 512 << 20,
                        on_tensor: Callable[[str, torch.Tensor], None] | None = None) -> int:
    """Write `out_dir` atomically (`write_dir_atomically`): the weights as safetensors shards
    (`write_safetensors_shards`: floating-point ones cast to `dtype`, None = as they are) plus every
    non-weight file of `model_path` (config.json, tokenizer files). Returns bytes. A gathering
    source: every rank of the pool calls `write_safetensors_shards` alongside (rank 0 calls this)."""
    def write(tmp: str) -> int:
        nbytes = write_safetensors_shards(weights, tmp, dtype=dtype, shard_bytes=shard_bytes, on_tensor=on_tensor)
        if model_path:
            for fname in os.listdir(model_path):
                src = os.path.join(model_path, fname)
                if os.path.isfile(src) and not _WEIGHT_FILE.match(fname):
                    shutil.copy2(src, os.path.join(tmp, fname))
        return nbytes

    return write_dir_atomically(out_dir, write)


def write_delta_dir(out_dir: str, packed: delta_sync.Packed, base_version: int, version: int) -> int:
    """A delta update as a directory (atomically, `write_dir_atomically`): `delta.safetensors` holding each
    packed bucket (weights/delta.py's layout) as a uint8 tensor `bucket.<k>`, and the manifest `delta.json`
    (format, the version it applies to, the version it makes, each bucket's tensor descriptions). Returns
    the bytes of the buckets."""
    from safetensors.torch import save_file

    def write(tmp: str) -> int:
        save_file({f"bucket.{k}": buf for k, (_, buf) in enumerate(packed)},
                  os.path.join(tmp, f"{DELTA_PREFIX}.safetensors"), metadata={"format": "pt"})
        manifest = {"format": DELTA_FORMAT, "base_version": str(base_version), "version": str(version),
                    "buckets": [{"tensor": f"bucket.{k}", "deltas": described} for k, (described, _) in enumerate(packed)]}
        with open(os.path.join(tmp, DELTA_MANIFEST), "w") as f:
            json.dump(manifest, f)
        return sum(buf.numel() for _, buf in packed)

    return write_dir_atomically(out_dir, write)


class DiskWeightPusher(ServerAdmin):
    """Push weights as an HF checkpoint dir the servers load with /update_weights_from_disk."""

    def __init__(self, servers: list[str], *, out_dir: str, model_path: str | None = None, timeout_s: float = 300.0,
                 admin_api_key: str | None = None, api_key: str | None = None, keep: int = 2, dtype: str | torch.dtype | None = None,
                 shard_bytes: int = 512 << 20, sync: str = "full", check_every: int = 0, delta_route: str = "disk",
                 tp_per_server: Sequence[int] | None = None):
        super().__init__(servers, timeout_s=timeout_s, admin_api_key=admin_api_key, api_key=api_key)
        # How a delta dir reaches the servers: `disk` (our embedded servers: /update_weights_from_disk with
        # load_format "delta", staged while they generate) or `tensor` (SGLang: the dir's path to the delta loader
        # through /update_weights_from_tensor, weights/sglang_delta.py; one payload per TP rank, `tp_per_server`)
        if delta_route not in ("disk", "tensor"):
            raise ValueError(f"delta_route={delta_route!r}: use 'disk' (embedded servers) or 'tensor' (SGLang)")
        self.delta_route = delta_route
        self.tp_per_server = list(tp_per_server) if tp_per_server is not None else [1] * len(self.server_urls)
        if len(self.tp_per_server) != len(self.server_urls):
            raise ValueError(f"tp_per_server={self.tp_per_server}: one TP size per server ({len(self.server_urls)})")
        # `weights.sync=delta`: what the servers hold, as last written (host memory), and its version; a push
        # whose servers all hold it writes only the changed elements (`write_delta_dir`)
        self.sent = delta_sync.sent_copy(sync)
        self.check_every = check_every  # `weights.check_every`: every k-th push checked (delta_sync.check_servers)
        self.pushes = 0
        # The servers' dtype (`server.dtype`): floating-point tensors are written in it. None = as they are.
        self.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        if keep < 1:
            raise ValueError("keep must be ≥ 1: the newest version dir is the one the servers load")
        self.out_dir = os.path.abspath(out_dir)
        self.model_path = model_path
        self.keep = keep
        self.shard_bytes = shard_bytes  # safetensors file size (`weights.bucket_mb`): what one write holds
        self.last_adapter: str | None = None  # LoRA: the adapter dir the servers loaded last

    # ---------------------------------------------------------------- API
    async def init(self) -> None:
        """Open the HTTP session and the output dir (no process group in this mode)."""
        await super().init()
        os.makedirs(self.out_dir, exist_ok=True)

    def version_dir(self, version: int) -> str:
        return os.path.join(self.out_dir, f"v{version:08d}")

    async def update(self, weights: WeightSource | list[tuple[str, torch.Tensor]], version: int, *,
                     paused: bool = False) -> PushResult:
        """Write → pause → every server loads it → continue. Sets every server's weight_version to str(version).
        `paused=True`: the caller paused the servers and continues them (no pause, flush or continue here).
        `weights`: a `WeightSource` (streamed shard by shard) or a list of (name, tensor); a LoRA
        learner's adapter (`weights.adapter.AdapterWeights`) is written as a peft dir and swapped in as
        the servers' run adapter (`ServerAdmin.swap_adapter`).

        `sync="delta"`: once a full push recorded what the servers hold, a push to servers that all report
        that version writes only the changed elements (`_update_delta`); any other case or a failure makes
        the next push full. `check_every=k`: every k-th push is compared with a full push's checksums.

        On a failed load the servers keep (roll back to) their old weights; generation is continued
        and WeightPushError names the server."""
        if self._session is None:
            raise WeightPushError("update() before init(): call init() first")
        adapter = is_adapter(weights)
        t0 = time.perf_counter()
        return await delta_sync.push(self, weights, version, adapter,
                                     lambda: self._update_full(weights, version, paused, t0, adapter),
                                     lambda: self._update_delta(weights, version, paused, t0), self.shard_bytes)

    async def _update_full(self, weights, version: int, paused: bool, t0: float, adapter: bool) -> PushResult:
        """The whole weights (or the adapter) as a version dir; with `weights.sync=delta` each tensor is also
        kept as written."""
        path = self.version_dir(version)
        # Written before the pause: generation does not wait for the disk.
        if adapter:
            nbytes = await asyncio.to_thread(write_dir_atomically, path, lambda tmp: write_adapter_dir(
                weights, tmp, weights.adapter_config, dtype=self.dtype))
        else:
            record = self.sent.record if self.sent is not None else None
            nbytes = await asyncio.to_thread(write_hf_checkpoint, weights, path, self.model_path, self.dtype,
                                             self.shard_bytes, record)
        t_written = time.perf_counter()
        async with self.paused_unless(paused) as t_paused:
            if adapter:
                body = {"lora_name": ADAPTER_NAME, "lora_path": path}
                previous = {**body, "lora_path": self.last_adapter} \
                    if self.last_adapter and os.path.isdir(self.last_adapter) else None
                n = len(self.server_urls)
                await self.swap_adapters("/load_lora_adapter", [body] * n, [previous] * n, version, flush=not paused)
            else:
                await self._begin_or_end("/begin_weight_update")
                # Paused (abort): nothing runs, so flushing the cache is safe on every SGLang release.
                await self._all("/update_weights_from_disk", {"model_path": path, "load_format": None,
                                                              "abort_all_requests": False, "flush_cache": not paused,
                                                              "weight_version": str(version)})
                await self._begin_or_end("/end_weight_update")
        if adapter:
            self.last_adapter = path
        t_end = time.perf_counter()
        await asyncio.to_thread(self._prune, path)
        metrics.PUSH_SECONDS.observe(t_end - t0)
        return PushResult(push_s=t_end - t0, pause_window_s=t_end - t_paused, write_s=t_written - t0,
                          bytes=nbytes, buckets=1, path=path, adapter=adapter)

    async def _update_delta(self, weights, version: int, paused: bool, t0: float) -> PushResult:
        """The changed elements since `self.sent.version` (which every server holds) as a delta dir
        (`write_delta_dir`), diffed and written before the pause; each server reads and decodes it while it
        still generates (a body without `weight_version`: staged), then pause → each applies it in one
        engine call (the body that sets the version) → continue: the pause window is the apply."""
        sent = self.sent
        assert sent is not None and sent.version is not None
        base = sent.version
        src = gather_in(as_source(weights), self.dtype)
        path = self.version_dir(version)

        def diff_and_write() -> tuple[int, int, int, int]:
            packed, changed, numel = delta_sync.diff(sent, src, self.dtype, self.shard_bytes)
            return write_delta_dir(path, packed, base, version), len(packed), changed, numel

        nbytes, buckets, changed, numel = await asyncio.to_thread(diff_and_write)
        t_written = time.perf_counter()
        if self.delta_route == "tensor":
            # SGLang: its disk route loads whole checkpoints, so the dir's path goes to the delta loader through
            # /update_weights_from_tensor; each server reads the files inside the pause (weights/sglang_delta.py)
            from areal_like.weights import sglang_delta

            payload = sglang_delta.serialize(sglang_delta.path_named_tensors(path))
            async with self.paused_unless(paused) as t_paused:
                await self._begin_or_end("/begin_weight_update")
                await asyncio.gather(*(self._post(u, "/update_weights_from_tensor", {
                    "serialized_named_tensors": [payload] * tp, "load_format": sglang_delta.LOADER,
                    "flush_cache": not paused, "abort_all_requests": False, "weight_version": str(version)})
                    for u, tp in zip(self.server_urls, self.tp_per_server)))
                await self._begin_or_end("/end_weight_update")
        else:
            body = {"model_path": path, "load_format": "delta", "abort_all_requests": False, "flush_cache": False,
                    "weight_version": None}
            await self._all("/update_weights_from_disk", body)  # staged while the servers generate
            async with self.paused_unless(paused) as t_paused:
                await self._begin_or_end("/begin_weight_update")
                await self._all("/update_weights_from_disk", {**body, "flush_cache": not paused,
                                                              "weight_version": str(version)})
                await self._begin_or_end("/end_weight_update")
        t_end = time.perf_counter()
        sent.version = version  # every server applied it (the copy followed during the diff)
        await asyncio.to_thread(self._prune, path)
        metrics.PUSH_SECONDS.observe(t_end - t0)
        return PushResult(push_s=t_end - t0, pause_window_s=t_end - t_paused, write_s=t_written - t0, bytes=nbytes,
                          buckets=buckets, path=path, delta=True, changed=changed / max(1, numel))

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
