"""Where roles go, as pure logic: the plan's devices per role, CUDA_VISIBLE_DEVICES, the Ray bundles
per node, and the config keys of the backends (the Ray runs themselves: tests/integration)."""

from __future__ import annotations

import pytest

from allocation import place
from areal_like.api.config import ConfigError, load_config
from areal_like.engine.sglang_args import build_sglang_servers
from launcher.procs import ProcessTable, role_devices
from launcher.ray_procs import RayBackendError, RayProcessTable, is_loopback


def test_role_devices_follow_the_plan():
    plan = place("sglang.d2p1t2+d4p1t1", nodes=1, devices_per_node=8)
    assert role_devices(plan, "server0") == (0, 1) and role_devices(plan, "server1") == (2, 3)
    assert [role_devices(plan, "learner" if r == 0 else f"learner{r}") for r in range(4)] == [(4,), (5,), (6,), (7,)]
    assert role_devices(plan, "rollout0") == ()


def test_each_learner_rank_sees_its_own_device_not_local_rank(tmp_path, monkeypatch):
    """Rank r of a multi-rank learner on the servers' node gets the plan's device, never device r."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    table = ProcessTable(str(tmp_path), plan=place("embedded.d2p1t1+d2p1t1"))
    assert table.device_env("server1") == {"CUDA_VISIBLE_DEVICES": "1"}
    assert table.device_env("learner") == {"CUDA_VISIBLE_DEVICES": "2"}
    assert table.device_env("learner1") == {"CUDA_VISIBLE_DEVICES": "3"}
    assert table.device_env("rollout0") == {}
    # a launcher under CUDA_VISIBLE_DEVICES=4,5,6,7: plan device i is the i-th visible one
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert table.device_env("learner1") == {"CUDA_VISIBLE_DEVICES": "7"}


def _nodes(n: int, g: int) -> list[dict]:
    return [{"NodeID": f"{k:02d}" * 28, "NodeManagerAddress": "127.0.0.1", "Alive": True, "Resources": {"GPU": g}}
            for k in range(n)]


def test_ray_bundles_one_group_per_node(tmp_path):
    plan = place("sglang.d4p1t2+d4p2t1", nodes=4, devices_per_node=4)
    table = RayProcessTable(str(tmp_path), plan, _nodes(4, 4), n_rollouts=3, device_resource="GPU",
                            placement_timeout_s=1, call_timeout_s=1)
    slots = table.slots
    # servers: t2 → two devices in one bundle, two servers per node on nodes 0 and 1
    assert [(slots[f"server{i}"].node, slots[f"server{i}"].devices) for i in range(4)] == [
        (0, (0, 1)), (0, (2, 3)), (1, (0, 1)), (1, (2, 3))]
    # learner ranks: one device each, on nodes 2 and 3
    ranks = ["learner", *(f"learner{r}" for r in range(1, 8))]
    assert {slots[r].node for r in ranks} == {2, 3} and all(len(slots[r].devices) == 1 for r in ranks)
    # rollout workers beside the servers, round robin
    assert [slots[f"rollout{k}"].node for k in range(3)] == [0, 0, 1]
    # bundle indices are unique within each node's group
    for node in range(4):
        idx = [s.bundle for s in slots.values() if s.node == node]
        assert sorted(idx) == list(range(len(idx)))


def test_ray_refuses_a_server_spanning_nodes(tmp_path):
    plan = place("sglang.d1p1t8+d2p1t1", nodes=3, devices_per_node=4)
    with pytest.raises(RayBackendError, match="spans nodes"):
        RayProcessTable(str(tmp_path), plan, _nodes(3, 4), n_rollouts=1, device_resource="GPU",
                        placement_timeout_s=1, call_timeout_s=1)


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.2") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("10.0.0.3") and not is_loopback("node-a")


def test_backend_config_keys(tmp_path):
    cfg = load_config("configs/demo.yaml", ["launcher.backend=ray", "launcher.ray.address=10.0.0.1:6379",
                                            "launcher.nccl_socket_ifname=ib0", "server.mem_fraction_static=0.8"])
    assert cfg.launcher.backend == "ray" and cfg.launcher.ray.address == "10.0.0.1:6379"
    with pytest.raises(ConfigError, match="launcher.backend"):
        load_config("configs/demo.yaml", ["launcher.backend=slurm"])
    with pytest.raises(ConfigError, match="server.mem_fraction_static"):
        load_config("configs/demo.yaml", ["server.mem_fraction_static=1.5"])


def test_sglang_gets_the_model_dtype_and_memory_fraction():
    plan = place("sglang.d1p1t1+d1p1t1")
    (srv,) = build_sglang_servers(plan, model_path="/m", ports=[30000], seeds=1, dtype="bfloat16",
                                  mem_fraction_static=0.85)
    argv = list(srv.processes[0].argv)
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.85"
