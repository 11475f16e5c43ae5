"""Weight sync between the learner and generation servers: a separate process group, bucketed
broadcast (trainer side: `WeightPusher`; server side: `WeightReceiver`), or HF checkpoint dirs the
servers load from disk (`DiskWeightPusher`), or shared-memory segments a co-located learner fills
(`SharedMemoryWeightPusher`), or CUDA-IPC handles to co-located SGLang servers (`CudaIpcWeightPusher`), or —
a LoRA run's adapter to SGLang servers — the adapter by value in the HTTP body (`AdapterTensorPusher`).
`make_weight_pusher` picks one by `weights.mode`; each is the learner's
`GenerationControl` handle (control.py).

The names below are imported on first use (PEP 562): an SGLang server imports
`areal_like.weights.sglang_delta` (its delta loader) with torch alone, and must not need the
learner's dependencies (aiohttp, Prometheus) for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_like._lazy import lazy_exports

_EXPORTS = {
    "AdapterTensorPusher": "adapter_tensors", "MEMORY_TAGS": "control", "GenerationControl": "control",
    "DiskWeightPusher": "disk", "make_weight_pusher": "factory", "WeightGroup": "group",
    "init_weight_group": "group", "WeightPusher": "push", "WeightPushError": "push", "flatten_bucket": "push",
    "make_buckets": "push", "WeightReceiver": "receive", "unflatten_bucket": "receive",
    "CudaIpcWeightPusher": "ipc", "SharedMemoryWeightPusher": "shm",
}

__all__ = ["MEMORY_TAGS", "AdapterTensorPusher", "CudaIpcWeightPusher", "DiskWeightPusher", "GenerationControl",
           "SharedMemoryWeightPusher", "WeightGroup", "WeightPushError", "WeightPusher", "WeightReceiver",
           "flatten_bucket", "init_weight_group", "make_buckets", "make_weight_pusher", "unflatten_bucket"]

if TYPE_CHECKING:
    from areal_like.weights.adapter_tensors import AdapterTensorPusher
    from areal_like.weights.control import MEMORY_TAGS, GenerationControl
    from areal_like.weights.disk import DiskWeightPusher
    from areal_like.weights.factory import make_weight_pusher
    from areal_like.weights.group import WeightGroup, init_weight_group
    from areal_like.weights.ipc import CudaIpcWeightPusher
    from areal_like.weights.push import WeightPusher, WeightPushError, flatten_bucket, make_buckets
    from areal_like.weights.receive import WeightReceiver, unflatten_bucket
    from areal_like.weights.shm import SharedMemoryWeightPusher


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
