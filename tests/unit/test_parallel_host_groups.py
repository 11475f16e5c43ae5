"""Which group each learner collective uses, and how followers wait for rank 0 (issue 23, items 6, 9).

On GPU the pool's device groups are NCCL, which takes CUDA tensors only: a CPU tensor on them fails
with "No backend type associated with device type cpu". These CPU tests reproduce that refusal by
building the device groups with the backend map "cuda:gloo" (no CPU half) — the layout is otherwise
built exactly as on GPU, host (gloo) groups beside the device ones — and run every CPU-side
collective of the learner on it: the step's groups broadcast, the trainer's dp sums, the barrier.

Followers (ranks > 0) must not wait for rank 0's data inside a collective: a 2-rank learner whose
rank 0 gets its first batch well after `train.collective_timeout_s` still trains; and a follower
whose rank 0 dies while it waits stops with an error naming rank 0.
"""

from __future__ import annotations

import os
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from areal_like.api.config import TrainConfig
from areal_like.api.net import free_port
from areal_like.data.tiny_model import build_tiny_model
from areal_like.learner.parallel.spawn import leave_pool, synthetic_groups
from conftest import RANK_START

TIMEOUT_S = 2.0  # train.collective_timeout_s of these pools: rank 0's delays below are several times it


def _init(rank: int, world: int, port: int, timeout_s: float) -> None:
    """The pool as the launcher starts it (env + init_pool_from_env, rank 0 hosting the store)."""
    os.environ.update(GLOO_SOCKET_IFNAME="lo", RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from areal_like.learner.parallel.spawn import init_pool_from_env

    assert init_pool_from_env(timeout_s) == rank


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), hidden_size=32, intermediate_size=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, seed=0)


def _run(target, world: int, *args) -> dict:
    """Start `world` ranks of `target(rank, world, port, q, *args)`; returns {rank: what it put}."""
    ctx = mp.get_context(RANK_START)
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, q, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    out = {}
    while not q.empty():
        rank, res = q.get()
        out[rank] = res
    for p in procs:
        if p.is_alive():
            p.kill()
    return out


# ---- item 6: CPU tensors never go to a device (NCCL on GPU) group ----------------------------------
def _host_rank(rank: int, world: int, port: int, q, model_dir: str) -> None:
    import torch.distributed as dist

    from areal_like.learner.parallel import LayoutSpec, ParallelLayout, broadcast_groups
    from areal_like.learner.trainer import Trainer

    try:
        _init(rank, world, port, 60)
        # device groups that refuse CPU tensors, as NCCL does; host groups gloo, as on GPU
        lay = ParallelLayout(LayoutSpec(dp=2), timeout_s=60, device_backend="cuda:gloo")
        res = {"backends": [dist.get_backend_config(g) for g in (lay.world_group, lay.dp_group, lay.host_world_group,
                                                                  lay.host_dp_group)]}
        try:
            dist.all_reduce(torch.ones(1), group=lay.dp_group)
            res["device_group_refuses_cpu"] = "accepted"
        except RuntimeError as e:
            res["device_group_refuses_cpu"] = str(e)
        groups, version = broadcast_groups(synthetic_groups(9) if rank == 0 else None, 7 if rank == 0 else -1, lay)
        res["groups"] = [t.traj_id for g in groups for t in g.trajectories]
        res["version"] = version
        tr = Trainer(model_dir, TrainConfig(collective_timeout_s=60), lay, temperature=0.9)
        # the trainer's dp sums of host-side stats (advantage moments, KL sums): float64 CPU tensors
        res["dp_sum"] = tr._dp_sum(torch.tensor([rank + 1.0, 10.0], dtype=torch.float64)).tolist()
        tr.barrier()  # the checkpoint's barriers
        res["ok"] = True
        q.put((rank, res))
        leave_pool()  # not a plain return: a rank may abort in the interpreter's finalization (exit_rank)
    except BaseException:
        q.put((rank, {"error": traceback.format_exc()}))


def test_cpu_side_collectives_use_the_host_groups_not_the_device_ones(model_dir):
    res = _run(_host_rank, 2, model_dir)
    assert set(res) == {0, 1}
    for rank, r in res.items():
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        # the stand-in refuses CPU tensors exactly as NCCL does on GPU
        assert "No backend type associated with device type cpu" in r["device_group_refuses_cpu"]
        assert r["groups"] == [t.traj_id for g in synthetic_groups(9) for t in g.trajectories]
        assert r["version"] == 7
        assert r["dp_sum"] == [3.0, 20.0]
        # device groups on the device's backend alone, host groups gloo for CPU tensors (as on GPU)
        assert r["backends"] == ["cuda:gloo", "cuda:gloo", "cpu:gloo,cuda:gloo", "cpu:gloo,cuda:gloo"]


def test_pool_backend_gives_cpu_tensors_gloo_beside_nccl():
    from areal_like.learner.parallel.layout import pool_backend

    assert pool_backend("cuda") == "cpu:gloo,cuda:nccl"
    assert pool_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match="device type 'xpu' not supported"):
        pool_backend("xpu")


# ---- item 9: followers wait for rank 0 outside collectives ----------------------------------------
def _late_first_batch_rank(rank: int, world: int, port: int, q, model_dir: str) -> None:
    import torch.distributed as dist

    from areal_like.learner.parallel import broadcast_groups
    from areal_like.learner.trainer import Trainer

    try:
        _init(rank, world, port, TIMEOUT_S)
        cfg = TrainConfig(collective_timeout_s=TIMEOUT_S, micro_batch_tokens=64, lr=1e-3)
        tr = Trainer(model_dir, cfg, "d2", temperature=0.9)
        stats = []
        for step in range(2):
            if rank == 0:
                # rank 0 waits for its batch (the buffer, a long first generation) far beyond the timeout
                time.sleep(2.5 * TIMEOUT_S)
            groups, version = broadcast_groups(synthetic_groups(100 + step) if rank == 0 else None, step, tr.layout)
            st = tr.train_step(groups, version)
            if step == 0:
                if rank == 0:
                    time.sleep(2.5 * TIMEOUT_S)  # a validation and a push before the checkpoint
                tr.layout.leader_ready("checkpoint")  # as main.py before a checkpoint
                tr.barrier()
            stats.append((st.loss, st.grad_norm, st.skipped))
        tr.barrier()  # the followers passed every wait: the store holds none of its keys any more
        store = dist.distributed_c10d._get_default_store()
        left = [k for n in (1, 2, 3) for k in (f"areal_like/leader/{n}", f"areal_like/leader/{n}/passed")
                if store.check([k])]
        q.put((rank, {"stats": stats, "keys_left": left}))
        leave_pool()  # not a plain return: a rank may abort in the interpreter's finalization (exit_rank)
    except BaseException:
        q.put((rank, {"error": traceback.format_exc()}))


def test_followers_outwait_a_first_batch_longer_than_the_collective_timeout(model_dir):
    res = _run(_late_first_batch_rank, 2, model_dir)
    assert set(res) == {0, 1}
    for rank, r in res.items():
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    assert res[0]["stats"] == res[1]["stats"]
    assert res[0]["keys_left"] == []
    assert len(res[0]["stats"]) == 2 and not any(s[2] for s in res[0]["stats"])


def _dead_leader_rank(rank: int, world: int, port: int, q) -> None:
    from areal_like.learner.parallel import LayoutSpec, ParallelLayout, broadcast_groups

    _init(rank, world, port, TIMEOUT_S)
    lay = ParallelLayout(LayoutSpec(dp=2), timeout_s=TIMEOUT_S)
    if rank == 0:
        time.sleep(2 * TIMEOUT_S)  # past the collective timeout, then dies before sending its batch
        q.put((0, "died"))
        os._exit(3)
    try:
        broadcast_groups(None, -1, lay)
        q.put((rank, "returned"))
    except RuntimeError as e:
        q.put((rank, str(e)))


def test_a_follower_names_rank0_when_it_dies_while_waiting():
    res = _run(_dead_leader_rank, 2)
    assert res[0] == "died"
    assert "rank 0 (the pool's leader" in res[1] and "is gone while this rank waited for it to send the next batch" \
        in res[1], res[1]
