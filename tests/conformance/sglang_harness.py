"""SGLang's own HTTP server, on loopback, with only its TokenizerManager replaced by a recorder.

Runs in the SGLang conformance environment (.venv-sglang-conformance, built by scripts/setup.sh:
sglang installed without its CUDA dependencies, torch the CPU wheel), never in the project's venv::

    .venv-sglang-conformance/bin/python tests/conformance/sglang_harness.py [--drop-route PATH]… \
        -- <the argv after `python -m sglang.launch_server`, as build_sglang_servers made it>

What is SGLang's own code here, unchanged:
* the command line: parsed by SGLang's parser (`prepare_server_args`), so a flag the launcher
  builds that this release does not know fails the start (exit status 2, argparse's message);
* the FastAPI app, its request types (msgspec/pydantic validation of every body), its routes, its
  auth middleware (`--api-key` / `--admin-api-key`), its `/health`, its lifespan, all started by
  SGLang's `_setup_and_run_http_server` (uvicorn);
* the weight receiver: the model runner's `WeightUpdater.init_weights_update_group` (SGLang's
  `init_custom_process_group`), `receive_weights_from_distributed` (per tensor, and flattened
  buckets through `FlattenedTensorBucket.empty`, which checks alignment) and
  `destroy_weights_update_group`.

What the recorder stands in for (the TokenizerManager → scheduler → model runner path that needs a
GPU model): it records every call, holds generate requests while paused (as SGLang's tokenizer
does), answers a generate request with a reply of SGLang's shape, and follows the scheduler's rules
for a distributed update: only inside begin/end_weight_update (0.5.21+), weight_version recorded,
and `flush_cache` → one cache flush after the load. It adds one route, GET /_recorder, returning the
record and a SHA-256 of every received tensor's bytes.

Stubbed at module level (nothing else): `torchvision` — SGLang's multimodal model configs import
`torchvision.transforms` at import time; PyPI's torchvision wheels are built against CUDA torch and
fail to load beside the CPU torch (`operator torchvision::nms does not exist`), and no CPU wheel is
reachable from CI. transformers is told first that torchvision is absent, so nothing of ours or of
SGLang's HTTP/weight path uses the stub.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import hashlib
import importlib.machinery
import os
import sys
import tempfile
import threading
import time
import types


def _stub_torchvision() -> None:
    from transformers.utils import import_utils

    assert not import_utils.is_torchvision_available()  # cached before the stub exists

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"

    def unavailable(*a, **k):
        raise RuntimeError("torchvision is stubbed in the SGLang conformance harness (CUDA-only wheel)")

    def getattr_(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return unavailable

    mods = {}
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__getattr__ = getattr_
        sys.modules[name] = mods[name] = m
    mods["torchvision"].transforms = mods["torchvision.transforms"]
    mods["torchvision.transforms"].functional = mods["torchvision.transforms.functional"]
    mods["torchvision.transforms"].InterpolationMode = InterpolationMode
    mods["torchvision.transforms.functional"].InterpolationMode = InterpolationMode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drop-route", action="append", default=[],
                    help="remove this route from SGLang's app (a release without it)")
    ap.add_argument("sglang_argv", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    argv = args.sglang_argv[1:] if args.sglang_argv[:1] == ["--"] else args.sglang_argv

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # set by SGLang's launcher for --enable-metrics
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sglang-prom-")
    _stub_torchvision()

    import torch
    import torch.distributed as dist
    from fastapi.responses import ORJSONResponse
    from sglang.srt.entrypoints import http_server as hs
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import prepare_server_args

    # SGLang's own parser: an unknown flag exits 2 here with argparse's message.
    server_args = prepare_server_args(argv + ["--device", "cpu"])
    publish(server_args, role="tokenizer")

    # The model runner's default group (its TP group): one rank, as a t1 server has.
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='sglang-tp-')}",
                            rank=0, world_size=1)
    updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders={},
                            get_model=lambda: None, update_model_fields=lambda **k: None,
                            recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)

    rec = Recorder(server_args, updater, hs.ServerStatus)
    # A release without the session routes (< 0.5.21) loads updates without a session.
    rec.session_required = "/begin_weight_update" not in args.drop_route
    for path in args.drop_route:
        hs.app.router.routes[:] = [r for r in hs.app.router.routes if getattr(r, "path", None) != path]

    @hs.app.get("/_recorder")
    async def _recorder():
        return ORJSONResponse({"events": rec.events, "received": rec.received})

    hs._setup_and_run_http_server(server_args, rec, None, None, [{}], None)


def _sha(t) -> str:
    import torch

    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class Recorder:
    """Stands in for SGLang's TokenizerManager (see the module doc)."""

    def __init__(self, server_args, updater, server_status):
        self.server_args = server_args
        self.server_status = server_status.Starting  # SGLang's warm-up thread sets Up
        self.gracefully_exit = False
        self.is_generation = True
        self.last_receive_tstamp = 0.0
        self.rid_to_state: dict = {}
        self.events: list[dict] = []
        self.received: dict[str, dict] = {}  # name → {sha256, dtype, shape} of the last received tensor
        self.updater = updater
        self.session = False
        self.session_required = True
        self.paused = False
        self._unpaused: asyncio.Event | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name):
        # Attributes the app's OpenAI/Ollama/Anthropic handlers read at start-up (not under test).
        if name.startswith("__"):
            raise AttributeError(name)
        from unittest.mock import MagicMock

        m = MagicMock(name=f"TokenizerManager.{name}")
        object.__setattr__(self, name, m)
        return m

    def _event(self, kind: str, **kw) -> None:
        with self._lock:
            self.events.append({"kind": kind, "t": time.time(), **kw})

    def _unpaused_event(self) -> asyncio.Event:
        if self._unpaused is None:
            self._unpaused = asyncio.Event()
            self._unpaused.set()
        return self._unpaused

    def set_server_stop_hook(self, hook) -> None:
        pass

    # ----------------------------------------------------------------- control
    async def pause_generation(self, obj):
        self._event("pause", mode=getattr(obj, "mode", None))
        self.paused = True
        self._unpaused_event().clear()

    async def continue_generation(self, obj):
        self._event("continue")
        self.paused = False
        self._unpaused_event().set()

    async def flush_cache(self, timeout_s: float = 0.0):
        from sglang.srt.managers.io_struct import FlushCacheReqOutput

        self._event("flush", via="/flush_cache")
        return FlushCacheReqOutput(success=True, message="")

    async def release_memory_occupation(self, obj, request=None):
        # `obj` is SGLang's own ReleaseMemoryOccupationReqInput, parsed by its route from our body
        self._event("release_memory", type=type(obj).__name__, tags=obj.tags)

    async def resume_memory_occupation(self, obj, request=None):
        self._event("resume_memory", type=type(obj).__name__, tags=obj.tags)

    async def update_weights_from_tensor(self, obj, request=None):
        # `obj` is SGLang's own UpdateWeightsFromTensorReqInput, parsed by its route (base64 → bytes); the
        # payload is recorded, not loaded (SGLang's loader unpickles CUDA-IPC handles: a GPU's job)
        import json as _json

        from sglang.srt.utils.common import MultiprocessingSerializer

        payloads = []
        for b in obj.serialized_named_tensors:
            if obj.load_format is None:  # SGLang's own format: deserialised as its TP workers do
                named = MultiprocessingSerializer.deserialize(bytes(b))
                payloads.append([[n, list(t.shape), str(t.dtype).removeprefix("torch."), _sha(t)] for n, t in named])
            else:
                try:
                    payloads.append(_json.loads(bytes(b)))
                except ValueError:
                    payloads.append(None)
        self._event("update_tensor", type=type(obj).__name__, load_format=obj.load_format,
                    flush_cache=obj.flush_cache, weight_version=obj.weight_version, payloads=payloads,
                    abort_all_requests=obj.abort_all_requests, success=True)
        return True, "recorded"

    async def freeze_gc(self):  # SGLang's post-warm-up call
        pass

    # ----------------------------------------------------------------- generation
    async def generate_request(self, obj, request=None):
        sp = dict(obj.sampling_params or {}) if isinstance(obj.sampling_params, dict) else {}
        self._event("generate", rid=obj.rid, input_ids=obj.input_ids, sampling_params=sp, paused=self.paused)
        await self._unpaused_event().wait()  # SGLang holds new requests while paused
        n = int(sp.get("max_new_tokens") or 1)
        out = [(7 + i) % 100 for i in range(n)]
        self.last_receive_tstamp = time.time()
        yield {"text": "", "output_ids": out, "meta_info": {
            "id": obj.rid, "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(obj.input_ids or []), "completion_tokens": n, "cached_tokens": 0,
            "output_token_logprobs": [[-0.5, t, None] for t in out], "weight_version": self.weight_version()}}

    def create_abort_task(self, obj):
        return None

    def weight_version(self) -> str:
        v = self.server_args.weight_version
        for e in self.events:
            if e["kind"] == "update" and e["success"] and e["weight_version"] is not None:
                v = e["weight_version"]
        return v

    # ----------------------------------------------------------------- weights (SGLang's receiver)
    async def init_weights_update_group(self, obj, request=None):
        ok, msg = await asyncio.to_thread(self.updater.init_weights_update_group, obj.master_address,
                                          obj.master_port, obj.rank_offset, obj.world_size, obj.group_name,
                                          obj.backend)
        self._event("init_group", group_name=obj.group_name, rank_offset=obj.rank_offset,
                    world_size=obj.world_size, backend=obj.backend, success=ok)
        return ok, msg

    async def destroy_weights_update_group(self, obj, request=None):
        ok, msg = await asyncio.to_thread(self.updater.destroy_weights_update_group, obj.group_name)
        self._event("destroy_group", group_name=obj.group_name, success=ok)
        return ok, msg

    async def begin_weight_update(self, obj, request=None):
        self._event("begin")
        self.session = True
        return True, "Weight update session started."

    async def end_weight_update(self, obj, request=None):
        self._event("end")
        self.session = False
        return True, "Weight update session ended."

    async def update_weights_from_distributed(self, obj, request=None):
        # The scheduler's rule (0.5.21+): only inside a begin/end session.
        if self.session_required and not self.session:
            self._event("update", names=obj.names, success=False, weight_version=obj.weight_version,
                        flush_cache=obj.flush_cache, load_format=obj.load_format)
            return False, ("update_weights_from_distributed must run between begin_weight_update() and "
                           "end_weight_update()")
        try:
            weights = await asyncio.to_thread(self.updater.receive_weights_from_distributed, names=obj.names,
                                              dtypes=obj.dtypes, shapes=obj.shapes, group_name=obj.group_name,
                                              load_format=obj.load_format)
        except Exception as e:
            self._event("update", names=obj.names, success=False, weight_version=obj.weight_version,
                        flush_cache=obj.flush_cache, load_format=obj.load_format, error=str(e))
            return False, f"Failed to receive weights: {e}"
        for name, t in weights:
            self.received[name] = {"sha256": _sha(t), "dtype": str(t.dtype).removeprefix("torch."),
                                   "shape": list(t.shape)}
        self._event("update", names=obj.names, success=True, weight_version=obj.weight_version,
                    flush_cache=obj.flush_cache, load_format=obj.load_format)
        if obj.flush_cache:  # the scheduler's flush_cache_after_weight_update
            self._event("flush", via="update_weights_from_distributed")
        return True, "Succeeded to update parameter online."


if __name__ == "__main__":
    main()
