"""In-memory weight handoff to co-located SGLang servers: CUDA-IPC handles through /update_weights_from_tensor.

When SGLang servers share the learner's GPUs (allocation `sglang:d4|fsdp:d4`), each learner rank hands
the server TP rank on *its own* GPU its own copy of each bucket (issue 40 item 3, as verl does): every rank
gets the bucket's full tensors (the all-gather a sharded push runs anyway, every rank keeping the result;
pipeline stages broadcast theirs), fills a buffer on its GPU (cast to the servers' dtype) and serializes
(name, tensor view) pairs in SGLang's `MultiprocessingSerializer` format — a `ForkingPickler` pickle,
base64 in JSON; rank 0 gathers the payloads (gloo) and posts, per server, the payload of the learner rank
on each of its TP ranks' GPUs (the plan's devices, `Endpoints.server_gpus` / `learner_gpus`). A CUDA
tensor pickles as a CUDA-IPC handle of the buffer's storage: no copy, no CUDA context on another GPU, no
cross-GPU traffic. The device goes as its UUID, as SGLang's `monkey_patch_torch_reductions` expects, so a
server whose `CUDA_VISIBLE_DEVICES` numbers the GPU differently still finds it. Each TP rank gets its own
pickle: SGLang deserialises only its rank's entry, and CUDA-IPC reference counting is per pickle.

```
 every rank r: bucket k's tensors (all-gathered) → fresh buffer on GPU r → synchronize → pickle_r
 rank 0: gather [pickle_0 … pickle_n-1] → POST /update_weights_from_tensor per server
         {serialized_named_tensors: [pickle of the rank on each TP rank's GPU], load_format: null,
          flush_cache: false, weight_version: v on the last bucket}  → replies → bucket k+1
```
One bucket in flight (SGLang loads before it replies). A buffer is never reused: SGLang replies once
its `load_weights` *enqueued* the copies, not when the GPU finished them, so each bucket gets a fresh
buffer and the rank drops it when the next bucket starts. torch's CUDA-IPC bookkeeping
(`CudaIPCSentData`: a shared reference counter per shared block) keeps a dropped block out of the
caching allocator until the server's process released its tensor — and its deleter synchronizes the
server's stream before it counts down — so the memory is reused only after the server's copy completed
(`torch.cuda.ipc_collect()` after each bucket returns those blocks). Without the plan's devices (a
direct caller) or with a one-rank learner, rank 0 alone fills the buckets for every server.
Inside SGLang's /begin_weight_update … /end_weight_update session (0.5.21+ refuses a tensor update outside one).
`load_format` stays null (SGLang's `model.load_weights`): its `flattened_bucket` format would need
SGLang's own metadata class in the pickle, which the learner (no sglang installed) cannot name.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

from areal_like import metrics
from areal_like.api.step_stats import PushResult
from areal_like.weights.admin import ServerAdmin, WeightPushError
from areal_like.weights.receive import parse_dtype, unflatten_bucket
from areal_like.weights.source import (WeightSource, as_source, fill_bucket, gather_in, meta_nbytes, plan_buckets,
                                       wire_dtype_of)

log = logging.getLogger(__name__)

_DEVICE_ARG = 6  # the device index among rebuild_cuda_tensor's arguments (SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX)


def _reduce_tensor_by_uuid(t: torch.Tensor):
    """torch's tensor reducer, the CUDA device named by UUID (SGLang's patched rebuild maps it back)."""
    fn, args = reductions.reduce_tensor(t)
    if t.is_cuda:
        args = (*args[:_DEVICE_ARG], str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid),
                *args[_DEVICE_ARG + 1:])
    return fn, args


class _Pickler(ForkingPickler):
    """ForkingPickler (torch registers its tensor/storage reducers there) with CUDA devices by UUID."""

    _extra_reducers = {**ForkingPickler._extra_reducers, torch.Tensor: _reduce_tensor_by_uuid,
                       torch.nn.Parameter: _reduce_tensor_by_uuid}


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(named, output_str=True)`, devices by UUID."""
    buf = io.BytesIO()
    _Pickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(named, output_str=True)`, devices by UUID."""
    buf = io.BytesIO()
    _Pickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


class BucketPacker:
    """One learner rank's side of the handoff: each bucket filled into a fresh buffer on the rank's device
    and serialized as views of it. The buffer is held until the next bucket starts (every server has
    answered this one by then) or `release()`; on CUDA torch's IPC reference counting then keeps it from
    the allocator until the servers released it (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self._held: torch.Tensor | None = None

    def pack(self, tensors: Iterator[tuple[str, torch.Tensor]], metas: list, dtype: torch.dtype | None,
             copies: int = 1) -> list[str]:
        """Bucket `metas` (its tensors as `tensors` yields them, in that order) as `copies` payloads (one
        per TP rank it goes to: CUDA-IPC reference counting is per pickle)."""
        self.release()
        nbytes = sum(meta_nbytes(m, dtype) for m in metas)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        fill_bucket(tensors, metas, buf, dtype)
        if buf.is_cuda:
            torch.cuda.current_stream(buf.device).synchronize()  # filled before another process reads it
        # the bucket's tensors as views of it: the receivers' own split (`unflatten_bucket`)
        views = list(unflatten_bucket(buf, [m[0] for m in metas], [wire_dtype_of(m[2], dtype) for m in metas],
                                      [list(m[1]) for m in metas]).items())
        self._held = buf
        return [serialize_named_tensors(views) for _ in range(copies)]

    def release(self) -> None:
        self._held = None
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # blocks the servers have released go back to the allocator


def tp_routes(server_gpus: list | None, learner_gpus: list | None, tp: list[int]) -> list[list[int]] | None:
    """Per server, the learner rank on each of its TP ranks' devices ((node, device) pairs of the plan);
    None without both lists (rank 0 serves every server). A device of a server that no learner rank shares,
    or two TP ranks given one learner rank, is an error naming the allocation's co-location."""
    if server_gpus is None or learner_gpus is None:
        return None
    rank_on = {tuple(g): r for r, g in enumerate(learner_gpus)}
    routes, taken = [], set()
    for j, (gpus, n) in enumerate(zip(server_gpus, tp)):
        if len(gpus) != n:
            raise ValueError(f"server {j}: {len(gpus)} devices for {n} TP ranks")
        route = []
        for r, g in enumerate(gpus):
            rank = rank_on.get(tuple(g))
            if rank is None or rank in taken:
                raise ValueError(
                    f"server {j}'s TP rank {r} is on device {tuple(g)}, which "
                    f"{'no learner rank' if rank is None else 'another TP rank'} shares: a co-located allocation "
                    f"gives every server device one learner rank (equal world sizes, e.g. sglang:d4|fsdp:d4)")
            taken.add(rank)
            route.append(rank)
        routes.append(route)
    return routes


class CudaIpcWeightPusher(ServerAdmin):
    """`weights.control.GenerationControl` for co-located SGLang servers (see the module docstring).
    `server_gpus`/`learner_gpus`: the plan's (node, device) of each server's TP ranks and of each learner
    rank — with both, each learner rank hands its own GPU's buffers to the server there."""

    def __init__(self, servers: list[str], *, tp_per_server: list[int] | None = None, bucket_bytes: int = 512 << 20,
                 timeout_s: float = 120.0, admin_api_key: str | None = None, dtype: str | torch.dtype | None = None,
                 server_gpus: list | None = None, learner_gpus: list | None = None):
        super().__init__(servers, timeout_s=timeout_s, admin_api_key=admin_api_key)
        self.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        self.bucket_bytes = bucket_bytes
        self.tp = tp_per_server or [1] * len(self.server_urls)
        if len(self.tp) != len(self.server_urls):
            raise ValueError("tp_per_server must have one entry per server URL")
        self.routes = tp_routes(server_gpus, learner_gpus, self.tp)
        self.learner_ranks = len(learner_gpus) if learner_gpus is not None else None
        self._packer: BucketPacker | None = None

    def _per_rank(self, src) -> bool:
        """Whether every learner rank packs its own buffers (a pool of several ranks with the plan's devices)."""
        ranks = getattr(src, "ranks", 1)
        if self.routes is None or ranks == 1:
            return False
        if ranks != self.learner_ranks or not hasattr(src, "hand_off"):
            raise WeightPushError(f"the learner pool has {ranks} ranks but the plan placed {self.learner_ranks}")
        return True

    async def update(self, weights: WeightSource | list[tuple[str, torch.Tensor]], version: int, *,
                     paused: bool = False) -> PushResult:
        """Hand `weights` over as `version`, bucket by bucket. `paused=False`: pause (abort) → buckets →
        /flush_cache → continue; `paused=True`: the caller holds the servers paused (a co-located phase,
        whose release flushed the cache) and continues them. On failure the servers stay paused."""
        if self._session is None:
            raise WeightPushError("update() before init(): call init() first")
        t0 = time.perf_counter()
        dt = self.dtype
        src = gather_in(as_source(weights), dt)
        meta = src.meta
        buckets = plan_buckets(meta, self.bucket_bytes, dt)
        per_rank = self._per_rank(src)
        packer = self._packer = self._packer or BucketPacker(src.device)
        if not paused:
            await self.pause("abort")
        t_paused = time.perf_counter()
        await self._begin_or_end("/begin_weight_update")
        total = 0
        try:
            for i, idx in enumerate(buckets):
                last = i == len(buckets) - 1
                metas = [meta[j] for j in idx]
                if per_rank:  # each rank's own buffer, for the TP ranks on its GPU
                    by_rank = await asyncio.to_thread(src.hand_off, idx, lambda ts, ms: packer.pack(ts, ms, dt)[0])
                    bodies = [[by_rank[r] for r in route] for route in self.routes]
                else:  # rank 0's buffer for every TP rank of every server
                    copies = await asyncio.to_thread(lambda idx=idx, metas=metas: packer.pack(
                        src.open(idx), metas, dt, copies=sum(self.tp)))
                    bodies = [copies[sum(self.tp[:j]):sum(self.tp[:j + 1])] for j in range(len(self.tp))]
                total += sum(meta_nbytes(m, dt) for m in metas)
                await asyncio.gather(*(self._post(url, "/update_weights_from_tensor", {
                    "serialized_named_tensors": body, "load_format": None, "flush_cache": False,
                    "abort_all_requests": False, "weight_version": str(version) if last else None})
                    for url, body in zip(self.server_urls, bodies)))
        finally:
            packer.release()
            if per_rank:
                src.end_hand_off()
        await self._begin_or_end("/end_weight_update")
        if not paused:
            await self._all("/flush_cache", {})
            await self.resume()
        t_end = time.perf_counter()
        metrics.PUSH_SECONDS.observe(t_end - t0)
        return PushResult(push_s=t_end - t0, pause_window_s=t_end - t_paused, bytes=total, buckets=len(buckets),
                          per_rank=per_rank)

    async def close(self) -> None:
        if self._packer is not None:
            self._packer.release()
        await super().close()
