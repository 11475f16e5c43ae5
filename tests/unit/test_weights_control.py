"""Every transport is the learner's GenerationControl handle (weights/control.py): every verb the
co-located runtime composes exists on each, with the Protocol's names; nothing else in the package
talks to a server's admin routes."""

import inspect
import os
import re

import pytest

from areal_like.api.config import ConfigError, ExperimentConfig
from areal_like.engine.server import ADMIN_PATHS
from areal_like.weights import (MEMORY_TAGS, AdapterTensorPusher, CudaIpcWeightPusher, DiskWeightPusher, GenerationControl,
                                SharedMemoryWeightPusher, WeightPusher, make_weight_pusher)
from areal_like.api.run_files import Endpoints

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("make", [
    lambda tmp: WeightPusher(["http://127.0.0.1:9"], master_port=1),
    lambda tmp: DiskWeightPusher(["http://127.0.0.1:9"], out_dir=str(tmp), model_path=str(tmp)),
    lambda tmp: SharedMemoryWeightPusher(["http://127.0.0.1:9"], owner="x"),
    lambda tmp: CudaIpcWeightPusher(["http://127.0.0.1:9"], tp_per_server=[2]),
    lambda tmp: AdapterTensorPusher(["http://127.0.0.1:9"], tp_per_server=[2]),
])
def test_each_transport_is_a_generation_control(tmp_path, make):
    handle = make(tmp_path)
    assert isinstance(handle, GenerationControl)
    for verb in ("init", "close", "wait_servers", "pause", "resume", "update", "release_memory",
                 "resume_memory", "reform"):
        assert inspect.iscoroutinefunction(getattr(handle, verb)), verb
    assert "paused" in inspect.signature(handle.update).parameters  # the co-located phase holds the servers


# The transports (and their shared admin session and delta sync), the server that serves the routes, and the launcher's
# supervisor, which pauses a restarted SGLang server before the learner re-syncs it (it cannot import the
# torch-side transports).
ADMIN_CALLERS = {"areal_like/weights/admin.py", "areal_like/weights/push.py", "areal_like/weights/disk.py",
                 "areal_like/weights/delta_sync.py",
                 "areal_like/weights/shm.py", "areal_like/weights/ipc.py", "areal_like/weights/adapter_tensors.py",
                 "areal_like/engine/server.py", "areal_like/engine/admin_routes.py", "areal_like/engine/lora_routes.py",
                 "launcher/run.py"}


def test_only_the_transports_call_admin_routes():
    """The learner loop and the weight code reach the servers through the handle: no other module of the
    package names an admin route of the servers."""
    pattern = re.compile("|".join(re.escape(f'"{p}"') for p in sorted(ADMIN_PATHS)))
    found = {}
    for top in ("areal_like", "launcher"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                    with open(os.path.join(ROOT, rel)) as fh:
                        hits = pattern.findall(fh.read())
                    if hits and rel not in ADMIN_CALLERS:
                        found[rel] = sorted(set(hits))
    assert not found, f"admin routes called outside the transports: {found}"
    assert "/release_memory_occupation" in ADMIN_PATHS and "/update_weights_from_tensor" in ADMIN_PATHS


def _cfg(allocation: str, **weights) -> ExperimentConfig:
    cfg = ExperimentConfig(allocation=allocation)
    for k, v in weights.items():
        setattr(cfg.weights, k, v)
    return cfg


def test_weights_mode_auto_follows_the_allocation(tmp_path):
    ep = Endpoints(servers=["http://127.0.0.1:9"], learner_host="127.0.0.1")
    co = _cfg("embedded:d1|fsdp:d1")
    co.validate()
    assert co.resolved_weights_mode() == "memory"
    p = make_weight_pusher(co, ep, model_path="m", run_dir=str(tmp_path), weight_port=1, incarnation=0)
    assert isinstance(p, SharedMemoryWeightPusher) and p.bucket_bytes == int(co.weights.bucket_mb * 2**20)
    # co-located SGLang (the nccl backend): CUDA-IPC handles, one payload per TP rank of each server
    sg = _cfg("sglang:d2t2|fsdp:d4")
    sg.validate()
    ipc = make_weight_pusher(sg, Endpoints(servers=["http://a:1", "http://b:2"], weight_backend="nccl",
                                           server_devices=[[0, 1], [2, 3]]),
                             model_path="m", run_dir=str(tmp_path), weight_port=1, incarnation=0)
    assert isinstance(ipc, CudaIpcWeightPusher) and ipc.tp == [2, 2]
    dis = _cfg("embedded.d1p1t1+d1p1t1")
    assert dis.resolved_weights_mode() == "distributed"
    assert isinstance(make_weight_pusher(dis, ep, model_path="m", run_dir=str(tmp_path), weight_port=1,
                                         incarnation=0), WeightPusher)


def test_colocated_sglang_routes_each_tp_rank_to_the_learner_rank_on_its_gpu(tmp_path):
    """Issue 40 item 3: the launcher writes the plan's devices of a co-located SGLang run into endpoints.json,
    and learner rank 0's pusher hands TP rank r of server j the buffer of the learner rank on that device."""
    import msgspec

    from allocation import place
    from launcher.run import colocated_gpus

    server_gpus, learner_gpus = colocated_gpus(place("sglang:d2t2|fsdp:d4", None, 4))
    assert server_gpus == [[[0, 0], [0, 1]], [[0, 2], [0, 3]]] and learner_gpus == [[0, d] for d in range(4)]
    ep = Endpoints(servers=["http://a:1", "http://b:2"], weight_backend="nccl", server_devices=[2, 2],
                   server_gpus=server_gpus, learner_gpus=learner_gpus)
    ep = msgspec.json.decode(msgspec.json.encode(ep), type=Endpoints)  # as the learner reads the file
    cfg = _cfg("sglang:d2t2|fsdp:d4")
    ipc = make_weight_pusher(cfg, ep, model_path="m", run_dir=str(tmp_path), weight_port=1, incarnation=0)
    assert isinstance(ipc, CudaIpcWeightPusher) and ipc.routes == [[0, 1], [2, 3]]


@pytest.mark.parametrize("server_gpus,learner_gpus,match", [
    ([[[0, 0], [0, 1]]], [[0, 0], [0, 2]], "TP rank 1 is on device \\(0, 1\\), which no learner rank shares"),
    ([[[0, 0]], [[0, 0]]], [[0, 0]], "which another TP rank shares"),
    ([[[0, 0]]], [[0, 0]], "1 devices for 2 TP ranks"),
])
def test_a_server_device_without_its_own_learner_rank_is_refused(server_gpus, learner_gpus, match):
    tp = [len(g) for g in server_gpus] if "TP ranks" not in match else [2]
    with pytest.raises(ValueError, match=match):
        CudaIpcWeightPusher(["http://a:1"] * len(tp), tp_per_server=tp, server_gpus=server_gpus,
                            learner_gpus=learner_gpus)


@pytest.mark.parametrize("allocation,weights,match", [
    ("embedded:d1|fsdp:d1", {"mode": "distributed"}, "weights.mode=auto"),
    ("embedded:d1|fsdp:d1", {"mode": "disk"}, "co-located"),
    ("embedded.d1p1t1+d1p1t1", {"mode": "memory"}, "co-located allocation"),
    ("sglang:d2p2|fsdp:d4", {}, "tensor parallelism only"),
])
def test_colocated_settings_that_cannot_run_name_the_fix(allocation, weights, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(allocation, **weights).validate()


def test_memory_tags_are_sglangs():
    assert MEMORY_TAGS == ("kv_cache", "weights")  # sglang.srt.constants.GPU_MEMORY_TYPE_{KV_CACHE,WEIGHTS}


def test_colocated_roles_cannot_be_pinned_apart():
    cfg = _cfg("embedded:d1|fsdp:d1")
    cfg.launcher.cpu_affinity = {"server": "0", "learner": "0"}
    cfg.validate()  # equal lists are fine
    cfg.launcher.cpu_affinity = {"server": "0", "learner": "1"}
    with pytest.raises(ConfigError, match="launcher.cpu_affinity.server.*co-locates"):
        cfg.validate()
