"""`GenerationControl`: what learner rank 0 does to the generation servers, as one typed handle.

The verbs (co-located mode, issue 27, composes them per step; a disaggregated run uses `update` alone):

    init / close          the admin HTTP session (and, for the distributed transport, the weight group)
    wait_servers          every server answers /health (a restarted one, started paused, counts)
    pause / resume        /pause_generation (abort | retract | in_place) and /continue_generation
    update(weights, v)    one weight update: pause → the transport's bytes → (flush) → continue; every
                          server then reports weight_version v. `paused=True`: the caller holds the
                          servers paused (a co-located phase) and continues them itself
    release_memory(tags)  SGLang's /release_memory_occupation: the servers free their KV cache and/or
                          weights (tags "kv_cache", "weights"; None = all) — paused servers only
    resume_memory(tags)   /resume_memory_occupation: allocate them again (released weights come back
                          without content: an update must land before generation continues)
    reform                after a server restarted or an update failed: wait for the servers and set
                          the transport up again; the caller updates next (which also continues)

Transports: `WeightPusher` (bucketed torch.distributed broadcast; NCCL to SGLang, gloo to our servers),
`DiskWeightPusher` (HF safetensors dirs + /update_weights_from_disk), and for co-located runs
`SharedMemoryWeightPusher` (our servers: shared-memory segments + /update_weights_from_tensor) and
`CudaIpcWeightPusher` (SGLang: CUDA-IPC handles + /update_weights_from_tensor), all `ServerAdmin`s, picked by
`weights.make_weight_pusher` from `weights.mode`. The learner's weight sync and serving phase
(learner/weight_sync.py, learner/serving.py) are written against this Protocol, not a class.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from areal_like.api.step_stats import PushResult

MEMORY_TAGS = ("kv_cache", "weights")  # SGLang's GPU_MEMORY_TYPE_KV_CACHE / _WEIGHTS (sglang.srt.constants)


@runtime_checkable
class GenerationControl(Protocol):
    server_urls: list[str]

    async def init(self) -> None: ...

    async def close(self) -> None: ...

    async def wait_servers(self, timeout_s: float | None = None, poll_s: float = 0.25) -> None: ...

    async def pause(self, mode: str = "abort") -> None: ...

    async def resume(self) -> None: ...

    async def update(self, weights: Any, version: int, *, paused: bool = False) -> PushResult: ...

    async def release_memory(self, tags: list[str] | None = None) -> None: ...

    async def resume_memory(self, tags: list[str] | None = None) -> None: ...

    async def reform(self) -> str: ...
