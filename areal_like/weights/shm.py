"""In-memory weight handoff for co-located runs (`weights.mode=memory`): shared memory on one host.

When generation and training share a machine's devices (allocation `embedded:d1|fsdp:d1`), the new
weights need no socket: learner rank 0 copies each tensor once — cast to the servers' dtype — into a
shared-memory segment (a file in `/dev/shm`, mapped by both processes), and every server copies it
from there into its parameters. No serialisation, no broadcast group, no receive buffers.

```
 learner rank 0                          /dev/shm/areal_like-<id>-<slot>        each server
 bucket k: fill_bucket ──(one copy)──►  [ t0 | t1 | … ]  ──(load_weights)──►  parameters
 POST /update_weights_from_tensor {serialized_named_tensors: [base64(JSON descriptor)],
                                   load_format: "areal_like_shm", weight_version: v on the last bucket}
```
Two segments alternate: bucket k+1 is filled into one while the servers load bucket k from the other
(the learner waits for bucket k's replies before it reuses its segment). The segments are created once
per learner incarnation (sized to the largest bucket, space reserved with `posix_fallocate` so a full
tmpfs is an error, never a SIGBUS) and removed by `close()`; a new incarnation first removes the ones
a killed one left (same `owner` prefix).

The route and its body are SGLang's (`UpdateWeightsFromTensorReqInput`: a list of base64 strings, one
per TP rank, plus `load_format`, `flush_cache`, `weight_version`); SGLang's own payload is a
`MultiprocessingSerializer` pickle of CUDA-IPC handles, which our servers refuse — the
`areal_like_shm` descriptor is JSON: segment path, and each tensor's name, dtype, shape and byte offset.
"""

from __future__ import annotations

import asyncio
import base64
import glob
import json
import logging
import os
import time
from typing import Any

import torch

from areal_like import metrics
from areal_like.api.step_stats import PushResult
from areal_like.weights.admin import ServerAdmin, WeightPushError
from areal_like.weights.receive import dtype_name, parse_dtype
from areal_like.weights.source import (WeightSource, as_source, fill_bucket, gather_in, meta_nbytes, plan_buckets,
                                       wire_dtype_of)

log = logging.getLogger(__name__)

LOAD_FORMAT = "areal_like_shm"  # `load_format` of /update_weights_from_tensor that names this descriptor
SHM_PREFIX = "areal_like-"  # every segment's file name starts with it; servers refuse any other path


def shm_dir() -> str:
    """Where the segments live: `$AREAL_LIKE_SHM_DIR`, else /dev/shm (tmpfs: memory, never disk)."""
    return os.environ.get("AREAL_LIKE_SHM_DIR") or "/dev/shm"


class _Segment:
    """One shared-memory file mapped as a uint8 tensor."""

    def __init__(self, path: str, nbytes: int) -> None:
        self.path, self.nbytes = path, nbytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)  # tmpfs full → ENOSPC here, not SIGBUS on a later write
            except OSError as e:
                raise WeightPushError(f"cannot reserve {nbytes / 2**20:.0f} MiB of shared memory in "
                                      f"{os.path.dirname(path)} ({e.strerror}): free memory there, lower "
                                      f"weights.bucket_mb, or set AREAL_LIKE_SHM_DIR") from None
        finally:
            os.close(fd)
        self.buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)

    def remove(self) -> None:
        self.buf = None  # type: ignore[assignment]
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def encode_descriptor(path: str, tensors: list[dict[str, Any]]) -> str:
    """The base64 string SGLang's HTTP schema wants in `serialized_named_tensors`, carrying JSON."""
    return base64.b64encode(json.dumps({"path": path, "tensors": tensors}).encode()).decode()


class ShmReader:
    """Server side: a descriptor → the named tensors, as views of the mapped segment (no copy here;
    the server's `load_weights` copies them into its parameters). Mappings are kept per segment path
    and inode, so a learner's two segments are mapped once per incarnation."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[int, int, torch.Tensor]] = {}  # path → (inode, size, mapping)

    def read(self, serialized: Any) -> list[tuple[str, torch.Tensor]]:
        """`serialized_named_tensors` of a request with load_format `areal_like_shm` → [(name, view)].
        ValueError names what is wrong (not one base64 JSON entry, a path outside the shm dir, a tensor
        outside the segment)."""
        if not isinstance(serialized, list) or len(serialized) != 1 or not isinstance(serialized[0], str):
            raise ValueError("serialized_named_tensors must be a list of one base64 string (this server has one "
                             "device: no TP ranks)")
        try:
            desc = json.loads(base64.b64decode(serialized[0], validate=True))
            path, tensors = str(desc["path"]), list(desc["tensors"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"serialized_named_tensors[0] is not a base64 JSON {LOAD_FORMAT} descriptor: {e}") from None
        real = os.path.realpath(path)
        root = os.path.realpath(shm_dir())
        if os.path.dirname(real) != root or not os.path.basename(real).startswith(SHM_PREFIX):
            raise ValueError(f"segment {path!r} is not an {SHM_PREFIX}* file of {root} (AREAL_LIKE_SHM_DIR): "
                             "the learner and this server must share that directory")
        st = os.stat(real)
        cached = self._maps.get(real)
        if cached is None or cached[0] != st.st_ino or cached[1] != st.st_size:
            self._maps[real] = (st.st_ino, st.st_size,
                                torch.from_file(real, shared=True, size=st.st_size, dtype=torch.uint8))
            self._forget_removed()
        buf = self._maps[real][2]
        out = []
        for t in tensors:
            try:
                name, dt, shape, off = str(t["name"]), parse_dtype(str(t["dtype"])), [int(s) for s in t["shape"]], int(t["offset"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"bad tensor entry {str(t)[:200]}: {e}") from None
            n = dt.itemsize
            for s in shape:
                n *= s
            if off < 0 or off + n > buf.numel() or off % dt.itemsize:
                raise ValueError(f"tensor {name!r} ({n} bytes at offset {off}) lies outside the {buf.numel()}-byte "
                                 f"segment {path} or is misaligned for {dt}")
            out.append((name, buf[off:off + n].view(dt).view(shape)))
        return out

    def _forget_removed(self) -> None:
        for p in [p for p in self._maps if not os.path.exists(p)]:
            del self._maps[p]


class SharedMemoryWeightPusher(ServerAdmin):
    """`weights.control.GenerationControl` over shared memory (see the module docstring)."""

    def __init__(self, servers: list[str], *, owner: str, bucket_bytes: int = 512 << 20, timeout_s: float = 120.0,
                 admin_api_key: str | None = None, dtype: str | torch.dtype | None = None):
        super().__init__(servers, timeout_s=timeout_s, admin_api_key=admin_api_key)
        self.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        self.bucket_bytes = bucket_bytes
        # `owner`: one run's learner (e.g. "<run id>-l"): its segments are `areal_like-<owner>-<incarnation pid>-<slot>`
        self.owner = owner
        self._segments: list[_Segment | None] = [None, None]

    async def init(self) -> None:
        """Open the HTTP session; remove segments a killed learner of this run left behind."""
        await super().init()
        for p in glob.glob(os.path.join(shm_dir(), f"{SHM_PREFIX}{self.owner}-*")):
            pid = p.rsplit("-", 2)[-2]
            if pid != str(os.getpid()):
                try:
                    os.unlink(p)
                    log.info("removed %s, left by an earlier learner", p)
                except FileNotFoundError:
                    pass

    def _segment(self, slot: int, nbytes: int) -> _Segment:
        seg = self._segments[slot]
        if seg is None or seg.nbytes < nbytes:
            if seg is not None:
                seg.remove()
            seg = _Segment(os.path.join(shm_dir(), f"{SHM_PREFIX}{self.owner}-{os.getpid()}-{slot}"), nbytes)
            self._segments[slot] = seg
        return seg

    async def update(self, weights: WeightSource | list[tuple[str, torch.Tensor]], version: int, *,
                     paused: bool = False) -> PushResult:
        """Hand `weights` over as `version`, bucket by bucket through the two segments.

        `paused=False`: pause (abort) → buckets → /flush_cache → continue, as the broadcast pusher.
        `paused=True`: the caller paused the servers (a co-located phase) and continues them itself; no
        flush (releasing the KV cache flushed it; a flush would be refused while resubmitted requests wait
        in the paused servers).
        On failure the servers stay paused, as with the broadcast pusher."""
        if self._session is None:
            raise WeightPushError("update() before init(): call init() first")
        t0 = time.perf_counter()
        dt = self.dtype
        src = gather_in(as_source(weights), dt)
        meta = src.meta
        buckets = plan_buckets(meta, self.bucket_bytes, dt)
        sizes = [sum(meta_nbytes(meta[j], dt) for j in idx) for idx in buckets]
        # one copy per tensor, into the segment (cast on the way); a gathering source one bucket at a time
        overlap = not src.gathers

        def fill(i: int) -> tuple[str, list[dict[str, Any]]]:
            idx = buckets[i]
            seg = self._segment(i % 2 if overlap else 0, max(sizes))
            fill_bucket(src.open(idx), [meta[j] for j in idx], seg.buf, dt)
            entries, off = [], 0
            for j in idx:
                name, shape, d = meta[j]
                entries.append({"name": name, "dtype": dtype_name(wire_dtype_of(d, dt)), "shape": list(shape),
                                "offset": off})
                off += meta_nbytes(meta[j], dt)
            return seg.path, entries

        next_fill = asyncio.ensure_future(asyncio.to_thread(fill, 0)) if buckets else None
        if not paused:
            await self.pause("abort")
        t_paused = time.perf_counter()
        await self._begin_or_end("/begin_weight_update")
        fill_s = load_s = 0.0
        pending: list[asyncio.Future] = []  # the previous bucket's replies (its segment is reused next)
        for i in range(len(buckets)):
            last = i == len(buckets) - 1
            t_f = time.perf_counter()
            if next_fill is None:
                next_fill = asyncio.ensure_future(asyncio.to_thread(fill, i))
            path, entries = await next_fill
            fill_s += time.perf_counter() - t_f
            body = {"serialized_named_tensors": [encode_descriptor(path, entries)], "load_format": LOAD_FORMAT,
                    "flush_cache": False, "abort_all_requests": False,
                    "weight_version": str(version) if last else None}
            t_l = time.perf_counter()
            replies = [asyncio.ensure_future(self._post(u, "/update_weights_from_tensor", body))
                       for u in self.server_urls]
            # the segment of bucket i+1 is the one bucket i−1 used: its loads must be over
            if pending:
                await asyncio.gather(*pending)
            next_fill = None
            if overlap and not last:
                next_fill = asyncio.ensure_future(asyncio.to_thread(fill, i + 1))
            if not overlap:
                await asyncio.gather(*replies)
                replies = []
            pending = replies
            load_s += time.perf_counter() - t_l
        if pending:
            await asyncio.gather(*pending)
        await self._begin_or_end("/end_weight_update")
        if not paused:
            await self._all("/flush_cache", {})
            await self.resume()
        t_end = time.perf_counter()
        metrics.PUSH_SECONDS.observe(t_end - t0)
        return PushResult(push_s=t_end - t0, pause_window_s=t_end - t_paused, bytes=sum(sizes),
                          buckets=len(buckets), fill_s=fill_s, load_s=load_s)

    async def close(self) -> None:
        """Remove the segments; close the HTTP session."""
        for seg in self._segments:
            if seg is not None:
                seg.remove()
        self._segments = [None, None]
        await super().close()
