"""SGLang's own HTTP server, on loopback, with only its TokenizerManager replaced by a recorder.

Runs in the SGLang conformance environment (.venv-sglang-conformance, built by scripts/setup.sh:
sglang installed without its CUDA dependencies, torch the CPU wheel), never in the project's venv::

    .venv-sglang-conformance/bin/python tests/conformance/sglang_harness.py [--drop-route PATH]… \
        -- <the argv after `python -m sglang.launch_server`, as build_sglang_servers made it>

What is SGLang's own code here, unchanged:
* the command line: parsed by SGLang's parser (`prepare_server_args`), so a flag the launcher
  builds that this release does not know fails the start (exit status 2, argparse's message), then
  resolved and checked as SGLang's engine does before it launches (`resolve_once`,
  `check_server_args`: e.g. its LoRA checks);
* the FastAPI app, its request types (msgspec/pydantic validation of every body), its routes, its
  auth middleware (`--api-key` / `--admin-api-key`), its `/health`, its lifespan, all started by
  SGLang's `_setup_and_run_http_server` (uvicorn);
* the weight receiver: the model runner's `WeightUpdater.init_weights_update_group` (SGLang's
  `init_custom_process_group`), `receive_weights_from_distributed` (per tensor, and flattened
  buckets through `FlattenedTensorBucket.empty`, which checks alignment) and
  `destroy_weights_update_group`.

Delta weight sync (`--custom-weight-loader`, `weights.sync=delta`): the harness then also builds SGLang's own
model class for the model dir's config (its `Qwen2ForCausalLM`: stacked `qkv_proj` / `gate_up_proj`,
vocab-parallel embedding, each parameter with SGLang's weight loader; built on CPU at SGLang's dtype, one
TP rank) — no forward ever runs. Full pushes then load into it through SGLang's
`WeightUpdater.load_weights_from_distributed` after the receive (as the scheduler does), and a
`/update_weights_from_tensor` whose `load_format` is a registered custom loader runs SGLang's
`WeightUpdater.update_weights_from_tensor` on it (SGLang's SafeUnpickler, `dynamic_import` of the loader, the
loader on the model), inside the scheduler's begin/end session rule; `/_recorder` then also returns
the SHA-256 of every model parameter. Where the stand-in differs: a loader that raises would end a real
scheduler (and with it the server); here the request fails with the error and the server stays up.
One more module-level stub for this: `vllm._custom_ops` (SGLang's rotary-embedding module imports its
kernel for a non-CUDA platform at construction; no forward calls it).

LoRA (`--enable-lora`): the tokenizer side is SGLang's own — its `LoRARegistry`, and
TokenizerManager's own `load_lora_adapter`, `load_lora_adapter_from_tensors`, `unload_lora_adapter`
(duplicate names, waits for requests holding an adapter, LRU eviction) and `_validate_and_resolve_lora`
(a generate request's `lora_path` resolved after the pause wait, "never been loaded" refusals) bound to the
recorder. The scheduler's side is stood in for: by path, SGLang's `LoRAConfig` reads adapter_config.json
and the safetensors file is read; by tensors, SGLang's TP worker `load_lora_adapter_from_tensors` runs per
rank (its own deserializer and `expected_checksums` check); both then pass SGLang's
`LoRAManager.validate_new_adapter` against a pool of the server's `--max-lora-rank` /
`--lora-target-modules` (`LoRAMemoryPool.can_support`), and each tensor name must be one SGLang's loader
places (a layer id, or lm_head / embed_tokens). The record: each adapter's tensors' SHA-256, and per generate
request the adapter it resolved to.

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
    # What SGLang's engine runs before it launches anything: argument resolution and check_server_args
    # (e.g. check_lora_server_args). An assertion here exits non-zero, as the real server would.
    server_args.resolve_once()
    server_args.check_server_args()
    publish(server_args, role="tokenizer")

    # The model runner's default group (its TP group): one rank, as a t1 server has.
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='sglang-tp-')}",
                            rank=0, world_size=1)
    model, model_config = (_build_model(server_args, tempfile.mktemp(prefix="sglang-mp-"))
                           if server_args.custom_weight_loader else (None, None))
    updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=model_config,
                            custom_weight_loaders=list(server_args.custom_weight_loader or []),
                            get_model=lambda: model, update_model_fields=lambda *a, **k: None,
                            recapture_cuda_graph=lambda: None, get_model_runner=lambda: None)

    rec = Recorder(server_args, updater, hs.ServerStatus)
    if model is not None:  # what /model_info reads of the manager (the learner reads the weight version there)
        rec.model, rec.model_config = model, model_config
        rec.model_path = rec.served_model_name = server_args.model_path
    # A release without the session routes (< 0.5.21) loads updates without a session.
    rec.session_required = "/begin_weight_update" not in args.drop_route
    for path in args.drop_route:
        hs.app.router.routes[:] = [r for r in hs.app.router.routes if getattr(r, "path", None) != path]

    @hs.app.get("/_recorder")
    async def _recorder():
        params = {} if model is None else {n: {"sha256": _sha(p), "dtype": str(p.dtype).removeprefix("torch."),
                                               "shape": list(p.shape)} for n, p in model.named_parameters()}
        return ORJSONResponse({"events": rec.events, "received": rec.received, "params": params})

    hs._setup_and_run_http_server(server_args, rec, None, None, [{}], None)


def _build_model(server_args, init_file: str):
    """SGLang's own model class for the model dir's config, on CPU at SGLang's dtype, as TP rank 0 of 1 (see the
    module doc); returns it and its ModelConfig."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state
    from sglang.srt.model_loader.utils import get_model_architecture, set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, publish

    stub = types.ModuleType("vllm._custom_ops")
    stub.rotary_embedding = None  # imported by RotaryEmbedding.__init__ off CUDA; only a forward would call it
    sys.modules.setdefault("vllm", types.ModuleType("vllm"))
    sys.modules.setdefault("vllm._custom_ops", stub)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=None))
    parallel_state.init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                                distributed_init_method=f"file://{init_file}")
    parallel_state.initialize_model_parallel(backend="gloo")
    model_config = ModelConfig.from_server_args(server_args)
    cls, _ = get_model_architecture(model_config)
    with set_default_torch_dtype(model_config.dtype):
        model = cls(model_config.hf_config)
    return model, model_config


def _origin(t) -> int | None:
    """The pid of the process whose memory a received CPU tensor lives in: torch's `file_system` sharing
    names each segment /torch_<pid>_<random>_<n> after the process that created it (the sender)."""
    try:
        handle = t.untyped_storage()._share_filename_cpu_()[1].decode()
        return int(handle.split("_")[1])
    except Exception:
        return None


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
        self.model = None  # SGLang's model, built for --custom-weight-loader (see the module doc)
        self.session = False
        self.session_required = True
        self.paused = False
        self._unpaused: asyncio.Event | None = None
        self._lock = threading.Lock()
        self._init_lora()

    def _init_lora(self) -> None:
        from sglang.srt.lora.lora_manager import LoRAManager
        from sglang.srt.lora.lora_registry import LoRARegistry
        from sglang.srt.lora.mem_pool import LoRAMemoryPool
        from sglang.srt.lora.utils import get_normalized_target_modules
        from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
        from sglang.srt.managers.tokenizer_manager import TokenizerManager
        from sglang.srt.runtime_context import get_lora

        lora = get_lora()
        self.enable_lora = lora.enable_lora
        self.lora_registry = LoRARegistry(lora.lora_paths)
        self.lora_update_lock = asyncio.Lock()
        self.lora_ref_cache: dict = {}
        self.pending_lora_unloads: dict = {}
        self.adapters: dict[str, dict] = {}  # lora_id → {name, path, r, tensors: {name: sha256}} (the "ranks")
        for name in ("load_lora_adapter", "load_lora_adapter_from_tensors", "unload_lora_adapter",
                     "_unload_lora_adapter_locked"):
            setattr(self, name, types.MethodType(getattr(TokenizerControlMixin, name), self))
        for name in ("_validate_and_resolve_lora", "_resolve_lora_path"):
            setattr(self, name, types.MethodType(getattr(TokenizerManager, name), self))
        pool = types.SimpleNamespace(max_lora_rank=lora.max_lora_rank or 0, lora_added_tokens_size=0,
                                     target_modules=get_normalized_target_modules(lora.lora_target_modules or []))
        pool.can_support = types.MethodType(LoRAMemoryPool.can_support, pool)
        self._manager = types.SimpleNamespace(attn_dp_enabled=False, lora_refs={}, memory_pool=pool,
                                              num_pinned_loras=0, max_loras_per_batch=lora.max_loras_per_batch)
        self._manager.validate_new_adapter = types.MethodType(LoRAManager.validate_new_adapter, self._manager)

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

        if self.model is not None and obj.load_format in (self.updater.custom_weight_loaders or []):
            return await self._load_with_custom_loader(obj)
        payloads, origins = [], []
        for b in obj.serialized_named_tensors:
            if obj.load_format is None:  # SGLang's own format: deserialised as its TP workers do
                named = MultiprocessingSerializer.deserialize(bytes(b))
                payloads.append([[n, list(t.shape), str(t.dtype).removeprefix("torch."), _sha(t)] for n, t in named])
                origins.append(sorted({_origin(t) for _, t in named}))
            else:
                try:
                    payloads.append(_json.loads(bytes(b)))
                except ValueError:
                    payloads.append(None)
        self._event("update_tensor", type=type(obj).__name__, load_format=obj.load_format,
                    flush_cache=obj.flush_cache, weight_version=obj.weight_version, payloads=payloads, origins=origins,
                    abort_all_requests=obj.abort_all_requests, success=True)
        return True, "recorded"

    async def _load_with_custom_loader(self, obj):
        """What SGLang's scheduler does with an update from tensors, on TP rank 0: the session rule, SGLang's
        own deserializer on this rank's entry, the model runner's `update_weights_from_tensor` (which imports
        and calls the loader `load_format` names), the version recorded after success."""
        from sglang.srt.utils.common import MultiprocessingSerializer

        kw = dict(load_format=obj.load_format, weight_version=obj.weight_version, flush_cache=obj.flush_cache,
                  payloads=len(obj.serialized_named_tensors))
        if self.session_required and not self.session:
            self._event("update_tensor", success=False, error="outside a session", **kw)
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        try:
            named = MultiprocessingSerializer.deserialize(bytes(obj.serialized_named_tensors[0]))
            ok, msg = await asyncio.to_thread(self.updater.update_weights_from_tensor, named_tensors=named,
                                              load_format=obj.load_format)
        except Exception as e:  # a real scheduler would end here (see the module doc)
            self._event("update_tensor", success=False, error=f"{type(e).__name__}: {e}", **kw)
            return False, f"{type(e).__name__}: {e}"
        self._event("update_tensor", success=ok, error=None if ok else msg, **kw)
        if ok and obj.weight_version is not None:
            self._event("weight_version", type="update_weights_from_tensor", new_version=obj.weight_version,
                        abort_all_requests=False)
        if ok and obj.flush_cache:
            self._event("flush", via="update_weights_from_tensor")
        return ok, msg

    async def freeze_gc(self):  # SGLang's post-warm-up call
        pass

    # ----------------------------------------------------------------- generation
    async def generate_request(self, obj, request=None):
        if isinstance(obj.input_ids, list) and obj.input_ids and isinstance(obj.input_ids[0], list):
            # a batch (a teacher's scoring of a group): SGLang's own normalisation (per-item lists checked,
            # e.g. one logprob_start_len per sequence) and its own split into single requests
            obj.normalize_batch_and_arguments()
            outs = []
            for i in range(obj.batch_size):
                async for out in self.generate_request(obj[i], request):
                    outs.append(out)
            yield outs
            return
        sp = dict(obj.sampling_params or {}) if isinstance(obj.sampling_params, dict) else {}
        self._event("generate", rid=obj.rid, input_ids=obj.input_ids, sampling_params=sp, paused=self.paused,
                    return_logprob=obj.return_logprob, logprob_start_len=obj.logprob_start_len,
                    return_routed_experts=obj.return_routed_experts,
                    routed_experts_start_len=obj.routed_experts_start_len)
        await self._unpaused_event().wait()  # SGLang holds new requests while paused
        if obj.lora_path:  # as SGLang does: after the pause wait, SGLang's own resolution
            try:
                await self._validate_and_resolve_lora(obj)
            except ValueError as e:
                self._event("generate_refused", rid=obj.rid, lora_path=obj.lora_path, error=str(e))
                raise
            a = self.adapters.get(obj.lora_id, {})
            self._event("generate_lora", rid=obj.rid, lora_path=obj.lora_path, lora_id=obj.lora_id,
                        adapter_path=a.get("path"), tensors=a.get("tensors"))
            await self.lora_registry.release(obj.lora_id)
        n = int(sp["max_new_tokens"]) if sp.get("max_new_tokens") is not None else 1  # 0: scoring only
        out = [(7 + i) % 100 for i in range(n)]
        self.last_receive_tstamp = time.time()
        meta = {"id": obj.rid, "finish_reason": {"type": "length", "length": n},
                "prompt_tokens": len(obj.input_ids or []), "completion_tokens": n, "cached_tokens": 0,
                "output_token_logprobs": [[-0.5, t, None] for t in out], "weight_version": self.weight_version()}
        start = obj.logprob_start_len if isinstance(obj.logprob_start_len, int) else -1
        if obj.return_logprob and start is not None and start >= 0:  # SGLang's shape: the first token has none
            meta["input_token_logprobs"] = [[None if k == 0 else -0.25 - 0.01 * k, t, None]
                                            for k, t in enumerate(obj.input_ids or []) if k >= start]
        if obj.return_routed_experts:  # MoE routing replay: SGLang's own encoding of (positions, layers, top-k)
            import torch
            from sglang.srt.managers.detokenizer_manager import DetokenizerManager

            start = obj.routed_experts_start_len
            positions = torch.arange(start, len(obj.input_ids or []) + n - 1, dtype=torch.int32)  # [start, seqlen − 1)
            routes = (positions[:, None, None] * 7 + torch.arange(2, dtype=torch.int32)[None, :, None] * 3
                      + torch.arange(2, dtype=torch.int32)[None, None, :]) % 8  # 2 layers × top-2 of 8 experts
            meta["routed_experts"] = DetokenizerManager._b64_encode_per_request([routes])[0]
        yield {"text": "", "output_ids": out, "meta_info": meta}

    def create_abort_task(self, obj):
        return None

    def config_value(self, name: str):  # the manager's view of a config field (/model_info)
        return self.weight_version() if name == "weight_version" else getattr(self.server_args, name, None)

    def weight_version(self) -> str:
        v = self.server_args.weight_version
        for e in self.events:
            if e["kind"] == "update" and e["success"] and e["weight_version"] is not None:
                v = e["weight_version"]
            elif e["kind"] == "weight_version":
                v = e["new_version"]
        return v

    async def update_weight_version(self, obj):
        self._event("weight_version", type=type(obj).__name__, new_version=obj.new_version,
                    abort_all_requests=obj.abort_all_requests)

    # ----------------------------------------------------------------- LoRA (the scheduler's side)
    async def update_lora_adapter_communicator(self, obj):
        return [await asyncio.to_thread(self._lora_rank_side, obj)]

    def _lora_rank_side(self, obj):
        """What the scheduler's ranks do with a LoRA load/unload (see the module doc), recorded."""
        import json as _json

        from safetensors.torch import load_file
        from sglang.srt.lora.lora_config import LoRAConfig
        from sglang.srt.managers.io_struct import (LoadLoRAAdapterFromTensorsReqInput, LoadLoRAAdapterReqInput,
                                                   LoRAUpdateOutput)
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.layers.utils import get_layer_id
        from sglang.srt.utils.common import MultiprocessingSerializer

        kind = type(obj).__name__
        try:
            if isinstance(obj, LoadLoRAAdapterFromTensorsReqInput):
                per_rank = []
                for rank in range(len(obj.serialized_named_tensors)):
                    got = {}
                    worker = types.SimpleNamespace(
                        deserialize_own_rank=lambda payloads, rank=rank: MultiprocessingSerializer.deserialize(
                            payloads[rank]),
                        model_runner=types.SimpleNamespace(
                            load_lora_adapter_from_tensors=lambda ref, tensors, config, added, got=got: got.update(
                                ref=ref, tensors=tensors, config=config)))
                    with get_parallel().override(tp_rank=rank):
                        TpModelWorker.load_lora_adapter_from_tensors(worker, obj)  # checks expected_checksums
                    per_rank.append(got)
                got = per_rank[0]
                config = LoRAConfig.from_dict(obj.config_dict, obj.added_tokens_config)
                ref, tensors, path = obj.to_ref(), got["tensors"], "__tensor__"
                if any({n: _sha(t) for n, t in r["tensors"].items()} != {n: _sha(t) for n, t in tensors.items()}
                       for r in per_rank):
                    raise ValueError("the TP ranks' payloads differ")
            elif isinstance(obj, LoadLoRAAdapterReqInput):
                config = LoRAConfig(obj.lora_path)
                tensors = load_file(os.path.join(obj.lora_path, "adapter_model.safetensors"))
                ref, path = obj.to_ref(), obj.lora_path
            else:  # UnloadLoRAAdapterReqInput
                self.adapters.pop(obj.lora_id, None)
                self._manager.lora_refs.pop(obj.lora_id, None)
                self._event("lora_unload", type=kind, lora_name=obj.lora_name, success=True)
                return LoRAUpdateOutput(success=True, loaded_adapters={a["name"]: a["path"]
                                                                       for a in self.adapters.values()})
            self._manager.validate_new_adapter(config, ref)
            unplaced = [n for n in tensors if get_layer_id(n) is None and "lm_head" not in n
                        and "embed_tokens" not in n]
            if unplaced:
                raise ValueError(f"tensors SGLang's LoRA loader cannot place: {unplaced[:5]}")
            self._manager.lora_refs[ref.lora_id] = ref
            self.adapters[ref.lora_id] = {"name": ref.lora_name, "path": path, "r": config.r,
                                          "target_modules": sorted(config.target_modules),
                                          "tensors": {n: _sha(t) for n, t in tensors.items()},
                                          "dtypes": sorted({str(t.dtype).removeprefix("torch.")
                                                            for t in tensors.values()})}
            self._event("lora_load", type=kind, lora_name=ref.lora_name, lora_id=ref.lora_id, path=path,
                        config=_json.loads(_json.dumps(config.hf_config, default=str)), success=True)
            return LoRAUpdateOutput(success=True, loaded_adapters={a["name"]: a["path"] for a in self.adapters.values()})
        except Exception as e:  # as a rank reports a failed load
            self._event("lora_load", type=kind, lora_name=getattr(obj, "lora_name", None), success=False,
                        error=str(e))
            return LoRAUpdateOutput(success=False, error_message=str(e),
                                    loaded_adapters={a["name"]: a["path"] for a in self.adapters.values()})

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
        if self.model is not None:  # the scheduler loads what it received into the model
            ok, msg = await asyncio.to_thread(self.updater.load_weights_from_distributed, weights)
            if not ok:
                self._event("update", names=obj.names, success=False, weight_version=obj.weight_version,
                            flush_cache=obj.flush_cache, load_format=obj.load_format, error=msg)
                return False, msg
        self._event("update", names=obj.names, success=True, weight_version=obj.weight_version,
                    flush_cache=obj.flush_cache, load_format=obj.load_format)
        if obj.flush_cache:  # the scheduler's flush_cache_after_weight_update
            self._event("flush", via="update_weights_from_distributed")
        return True, "Succeeded to update parameter online."


if __name__ == "__main__":
    main()
