"""A LoRA learner's adapter pushed by value into SGLang: `/load_lora_adapter_from_tensors`.

    rank 0 (learner)                                   each SGLang server (t TP ranks)
    adapter tensors (peft's saved names, server dtype)
      → pickle by value → base64, one copy per TP rank ─ pause(abort) ─► /unload_lora_adapter "policy"
      + sha256 per tensor                                                /load_lora_adapter_from_tensors
                                                                           {lora_name "policy", config_dict,
                                                                            serialized_named_tensors,
                                                                            expected_checksums}
                                                                         /update_weight_version
                                                       ◄─ flush, continue

Why a transport of its own: SGLang receives full weights over NCCL (/update_weights_from_distributed)
but has no such route for adapters, and an adapter is megabytes (Qwen2.5-0.5B, r 8, all linears:
8.8 MB in bf16), so `weights.mode=distributed` of a LoRA run with SGLang servers sends it in the
HTTP body — no shared filesystem needed (as `disk` does), no weight group.

The payload: a plain `pickle` of ``{name: CPU tensor}`` (each storage pickled by value, through
`torch.storage._load_from_bytes`), which SGLang's `MultiprocessingSerializer.deserialize` reads with
its SafeUnpickler (the storage loaded by `torch.load(weights_only=True)`); no CUDA-IPC handle, no file
descriptor, so it works across nodes. Every TP rank deserializes its own copy (index = tp rank) and
checks `expected_checksums` (SHA-256 of each tensor's bytes) before it loads: a corrupted or
mismatched adapter is refused on the server, naming the tensors.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from areal_like import metrics
from areal_like.api.step_stats import PushResult
from areal_like.weights.adapter import ADAPTER_NAME, adapter_file_tensors, is_adapter
from areal_like.weights.admin import ServerAdmin, WeightPushError
from areal_like.weights.by_value import serialize_tensors
from areal_like.weights.receive import parse_dtype

ROUTE = "/load_lora_adapter_from_tensors"


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a CPU tensor's bytes, as SGLang's `expected_checksums` check computes it."""
    return hashlib.sha256(t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


def serialize_adapter(tensors: dict[str, torch.Tensor]) -> str:
    """The base64 text of one `serialized_named_tensors` entry: the adapter's tensors by value (by_value.py)."""
    return serialize_tensors(tensors)


class AdapterTensorPusher(ServerAdmin):
    """Adapter-only pushes to SGLang servers through /load_lora_adapter_from_tensors (see the module doc).

    `tp_per_server[k]`: server k's tensor-parallel size — SGLang wants one payload per TP rank.
    `dtype`: the servers' dtype (`server.dtype`), what floating-point adapter tensors are cast to."""

    def __init__(self, servers: list[str], *, tp_per_server: Sequence[int] | None = None, timeout_s: float = 300.0,
                 admin_api_key: str | None = None, dtype: str | torch.dtype | None = None):
        super().__init__(servers, timeout_s=timeout_s, admin_api_key=admin_api_key)
        tp = list(tp_per_server) if tp_per_server is not None else [1] * len(self.server_urls)
        if len(tp) != len(self.server_urls) or any(t < 1 for t in tp):
            raise ValueError(f"tp_per_server={tp}: one TP size ≥ 1 per server ({len(self.server_urls)} servers)")
        self.tp_per_server = tp
        self.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        self._last: tuple[str, dict[str, Any], dict[str, str]] | None = None  # payload, config, checksums

    def _body(self, k: int, payload: str, config: dict[str, Any], sums: dict[str, str]) -> dict[str, Any]:
        return {"lora_name": ADAPTER_NAME, "config_dict": config, "serialized_named_tensors":
                [payload] * self.tp_per_server[k], "load_format": None, "expected_checksums": sums}

    async def update(self, weights: Any, version: int, *, paused: bool = False) -> PushResult:
        """Serialize the adapter → pause(abort) → every server swaps its run adapter for it
        (`ServerAdmin.swap_adapter`) → flush → continue; every server then reports weight_version
        str(version). `paused=True`: the caller paused the servers and continues them. Full weights
        are refused: this transport carries adapters only."""
        if self._session is None:
            raise WeightPushError("update() before init(): call init() first")
        if not is_adapter(weights):
            raise WeightPushError("the adapter transport (/load_lora_adapter_from_tensors) carries LoRA adapters "
                                  "only, but this push holds full weights: model.lora_rank must be > 0 for it")
        t0 = time.perf_counter()

        def serialize() -> tuple[str, dict[str, str], int]:
            tensors = adapter_file_tensors(weights, dtype=self.dtype)
            sums = {n: tensor_sha256(t) for n, t in tensors.items()}
            return serialize_adapter(tensors), sums, sum(t.numel() * t.element_size() for t in tensors.values())

        # Before the pause: generation does not wait for the pickling.
        payload, sums, nbytes = await asyncio.to_thread(serialize)
        config = weights.adapter_config
        t_ready = time.perf_counter()
        async with self.paused_unless(paused) as t_paused:
            ks = range(len(self.server_urls))
            await self.swap_adapters(ROUTE, [self._body(k, payload, config, sums) for k in ks],
                                     [None if self._last is None else self._body(k, *self._last) for k in ks],
                                     version, flush=not paused)
        self._last = (payload, config, sums)
        t_end = time.perf_counter()
        metrics.PUSH_SECONDS.observe(t_end - t0)
        return PushResult(push_s=t_end - t0, pause_window_s=t_end - t_paused, write_s=t_ready - t0,
                          bytes=nbytes, buckets=1, adapter=True)
