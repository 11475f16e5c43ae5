"""In-memory weight handoff to co-located SGLang servers: CUDA-IPC handles through /update_weights_from_tensor.

When SGLang servers share the learner's GPUs (allocation `sglang:d4|fsdp:d4`), learner rank 0 fills each
bucket on its device (cast to the servers' dtype) and sends, per server, one serialized list of
(name, tensor view) per TP rank of that server — SGLang's `MultiprocessingSerializer` format: a
`ForkingPickler` pickle, base64 in JSON. A CUDA tensor pickles as a CUDA-IPC handle of the bucket's
storage (no copy: every TP rank of the server opens the handle and loads its shard from it); the device
goes as its UUID, as SGLang's `monkey_patch_torch_reductions` expects, so a server whose
`CUDA_VISIBLE_DEVICES` numbers the GPU differently still finds it. Each TP rank gets its own pickle:
SGLang deserialises only its rank's entry, and CUDA-IPC reference counting is per pickle.

```
 rank 0: bucket k filled on the GPU → cuda synchronize → POST /update_weights_from_tensor
         {serialized_named_tensors: [pickle] × tp, load_format: null, flush_cache: false,
          weight_version: v on the last bucket}  → reply (SGLang loaded it) → bucket k+1
```
One bucket in flight (SGLang loads before it replies), two buffers alternated; inside SGLang's
/begin_weight_update … /end_weight_update session (0.5.21+ refuses a tensor update outside one).
`load_format` stays null (SGLang's `model.load_weights`): its `flattened_bucket` format would need
SGLang's own metadata class in the pickle, which the learner (no sglang installed) cannot name.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time
from multiprocessing.reduction import ForkingPickler

import torch
from torch.multiprocessing import reductions

from areal_like import metrics
from areal_like.weights.admin import ServerAdmin, WeightPushError
from areal_like.weights.push import FlatBuffers
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


class CudaIpcWeightPusher(ServerAdmin):
    """`weights.control.GenerationControl` for co-located SGLang servers (see the module docstring)."""

    def __init__(self, servers: list[str], *, tp_per_server: list[int] | None = None, bucket_bytes: int = 512 << 20,
                 timeout_s: float = 120.0, admin_api_key: str | None = None, dtype: str | torch.dtype | None = None):
        super().__init__(servers, timeout_s=timeout_s, admin_api_key=admin_api_key)
        self.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        self.bucket_bytes = bucket_bytes
        self.tp = tp_per_server or [1] * len(self.server_urls)
        if len(self.tp) != len(self.server_urls):
            raise ValueError("tp_per_server must have one entry per server URL")
        self._flat = FlatBuffers()  # two buffers alternated per bucket (the broadcast pusher's)

    async def update(self, weights: WeightSource | list[tuple[str, torch.Tensor]], version: int, *,
                     paused: bool = False) -> dict[str, float]:
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
        if not paused:
            await self.pause("abort")
        t_paused = time.perf_counter()
        await self._begin_or_end("/begin_weight_update")
        total = 0
        for i, idx in enumerate(buckets):
            last = i == len(buckets) - 1
            nbytes = sum(meta_nbytes(meta[j], dt) for j in idx)
            buf = self._flat.get(i, nbytes, src.device)

            def fill(buf=buf, idx=idx, nbytes=nbytes) -> list[tuple[str, torch.Tensor]]:
                fill_bucket(src.open(idx), [meta[j] for j in idx], buf, dt)
                if buf.is_cuda:
                    torch.cuda.current_stream(buf.device).synchronize()  # filled before another process reads it
                # the bucket's tensors as views of it: the receivers' own split (`unflatten_bucket`)
                return list(unflatten_bucket(buf[:nbytes], [meta[j][0] for j in idx],
                                             [wire_dtype_of(meta[j][2], dt) for j in idx],
                                             [list(meta[j][1]) for j in idx]).items())

            views = await asyncio.to_thread(fill)
            total += nbytes
            await asyncio.gather(*(self._post(url, "/update_weights_from_tensor", {
                "serialized_named_tensors": [serialize_named_tensors(views) for _ in range(tp)],
                "load_format": None, "flush_cache": False, "abort_all_requests": False,
                "weight_version": str(version) if last else None}) for url, tp in zip(self.server_urls, self.tp)))
            del views
        await self._begin_or_end("/end_weight_update")
        if not paused:
            await self._all("/flush_cache", {})
            await self.resume()
        if src.device.type == "cuda":
            self._flat = FlatBuffers()  # back to the caching allocator between handoffs: training reuses it
        t_end = time.perf_counter()
        metrics.PUSH_SECONDS.observe(t_end - t0)
        return {"push_s": t_end - t0, "pause_window_s": t_end - t_paused, "bytes": total, "buckets": len(buckets)}

    async def close(self) -> None:
        self._flat = FlatBuffers()
        await super().close()

