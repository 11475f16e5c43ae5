"""The learner pool's pure pieces (layout arithmetic, stage split, dp share, LR schedule,
checkpoint policy) and one 4-rank gloo check that `ParallelLayout` builds the groups it claims and
that `broadcast_groups` moves TrajectoryGroups as msgpack bytes."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

from areal_like.api.config import TrainConfig
from areal_like.api.net import free_port
from areal_like.learner.checkpoint import CheckpointManager
from areal_like.learner.batching import dp_share
from areal_like.learner.parallel import LayoutSpec, ParallelLayout
from areal_like.learner.parallel.parallelize import stage_layer_ids
from areal_like.learner.parallel.spawn import synthetic_groups
from areal_like.learner.schedule import lr_at
from conftest import RANK_START


def test_spec_rank_order_is_tp_fastest_then_dp_then_pp():
    s = LayoutSpec(dp=2, pp=2, tp=2)
    assert s.world_size == 8
    assert [s.coords(r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                               (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(s.rank_of(*s.coords(r)) == r for r in range(8))


def test_spec_from_strings():
    assert LayoutSpec.from_string("d2p2") == LayoutSpec(dp=2, pp=2, tp=1)
    assert LayoutSpec.from_string("t2") == LayoutSpec(tp=2)
    assert LayoutSpec.from_string("d2p1t1") == LayoutSpec(dp=2)
    assert LayoutSpec.from_string("embedded.d1p1t1+d2p1t1") == LayoutSpec(dp=2)
    assert str(LayoutSpec(dp=2, pp=2)) == "d2p2t1"
    # expert parallel: e splits dp (no ranks of its own), read from the allocation's training side
    assert LayoutSpec.from_string("d4e2") == LayoutSpec(dp=4, ep=2) and LayoutSpec(dp=4, ep=2).world_size == 4
    assert LayoutSpec.from_string("embedded.d1+megatron:d2t2e2") == LayoutSpec(dp=2, tp=2, ep=2)
    assert str(LayoutSpec(dp=4, ep=2)) == "d4p1t1e2"
    with pytest.raises(ValueError, match=r"attn/ffn hybrid layouts are not implemented.*megatron:d4p1t1e2"):
        LayoutSpec.from_string("embedded.d1+megatron:(attn:d4|ffn:d2e2)")


def test_layout_checks_world_size_and_cp():
    with pytest.raises(ValueError, match="needs dp·pp·tp = 2 ranks but the process group has 1"):
        ParallelLayout(LayoutSpec(dp=2))
    with pytest.raises(ValueError, match="context parallel"):
        ParallelLayout(LayoutSpec(cp=2))
    with pytest.raises(ValueError, match=r"expert parallel e3 does not divide d×t = 4.*d2t2e4"):
        ParallelLayout(LayoutSpec(dp=2, tp=2, ep=3))
    single = ParallelLayout(LayoutSpec())
    assert (single.rank, single.pp_rank, single.dp_rank, single.tp_rank) == (0, 0, 0, 0)
    assert single.is_first_stage and single.is_last_stage


def test_stage_layer_ids_balanced_and_contiguous():
    assert [stage_layer_ids(5, 2, s) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [stage_layer_ids(4, 4, s) for s in range(4)] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="cannot fill"):
        stage_layer_ids(1, 2, 0)


def test_dp_share_partitions_and_balances_tokens():
    samples = [t for g in synthetic_groups(3, n_groups=3, n=5) for t in g.trajectories]
    shares = [dp_share(samples, list(range(len(samples))), 3, r) for r in range(3)]
    assert sorted(i for s in shares for i in s) == list(range(len(samples)))
    loads = [sum(samples[i].num_tokens for i in s) for s in shares]
    assert max(loads) - min(loads) <= max(t.num_tokens for t in samples)


def test_lr_schedule_warmup_then_decay():
    c = TrainConfig(lr=1.0, warmup_steps=2, lr_schedule="linear", total_steps=6, min_lr_ratio=0.5)
    assert [lr_at(c, s) for s in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5])
    cos = TrainConfig(lr=1.0, lr_schedule="cosine", total_steps=4)
    assert [lr_at(cos, s) for s in (0, 2, 4, 9)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    assert lr_at(TrainConfig(lr=0.1), 100) == 0.1


def test_checkpoint_manager_resume_modes(tmp_path, monkeypatch):
    from areal_like.learner import checkpoint

    class Fake:
        is_rank0 = True
        saved: list[str] = []
        layout = type("L", (), {"rank": 0, "world_size": 1})()

        def barrier(self):
            pass

    def fake_save(trainer, path, extra):
        os.makedirs(path)
        with open(os.path.join(path, checkpoint.META_FILE), "w") as f:
            f.write('{"format": 3, "files": {}}')
        trainer.saved.append(path)

    monkeypatch.setattr(checkpoint, "save_checkpoint", fake_save)
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda trainer, path: {"path": path})

    m = CheckpointManager(str(tmp_path / "c"), save_freq=2, keep=2)
    ln = Fake()
    assert m.resume(ln) is None  # auto with nothing saved: fresh start
    for step in range(1, 8):
        m.maybe_save(ln, step)
    assert [os.path.basename(p) for p in ln.saved] == ["step_00000002", "step_00000004", "step_00000006"]
    assert sorted(os.listdir(tmp_path / "c")) == ["latest", "step_00000004", "step_00000006"]  # keep=2
    assert m.resume(ln)["path"].endswith("step_00000006") and not m.rollback
    with pytest.raises(checkpoint.CheckpointError, match="resume_mode"):
        CheckpointManager(str(tmp_path / "c"), save_freq=0, resume_mode=str(tmp_path / "nope")).resume(ln)
    with pytest.raises(checkpoint.CheckpointError, match="steps in .*: 4, 6"):
        CheckpointManager(str(tmp_path / "c"), save_freq=0, resume_mode="5").resume(ln)
    explicit = str(tmp_path / "c" / "step_00000004")
    m = CheckpointManager(str(tmp_path / "c"), save_freq=0, resume_mode="4")  # a step number
    assert m.resume(ln)["path"] == explicit and m.rollback  # the newer one is set aside: one history
    assert sorted(os.listdir(tmp_path / "c")) == ["latest", "step_00000004", "step_00000006.rolled_back"]
    assert CheckpointManager(str(tmp_path / "c"), save_freq=0, resume_mode=explicit).resume(ln)["path"] == explicit
    m = CheckpointManager(str(tmp_path / "c"), save_freq=2, resume_mode="disable")
    assert m.resume(ln) is None and m.rollback
    assert sorted(os.listdir(tmp_path / "c")) == ["step_00000004.rolled_back", "step_00000006.rolled_back"]


def _groups_rank(rank: int, world: int, port: int, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    from areal_like.learner.parallel import broadcast_groups

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        lay = ParallelLayout(LayoutSpec(dp=2, tp=2), timeout_s=60)
        out = {}
        for name, group in (("dp", lay.dp_group), ("tp", lay.tp_group), ("pp", lay.pp_group)):
            t = torch.tensor([rank])
            gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, t, group=group)
            out[name] = sorted(int(x) for x in gathered)
        out["mesh"] = lay.mesh["tp"].size()
        groups, version = broadcast_groups(synthetic_groups(9) if rank == 0 else None, 7 if rank == 0 else -1, lay)
        out["groups"] = [t.traj_id for g in groups for t in g.trajectories]
        out["ids_equal"] = all((a.ids_np() == b.ids_np()).all() for ga, gb in zip(groups, synthetic_groups(9))
                               for a, b in zip(ga.trajectories, gb.trajectories))
        out["version"] = version
        # expert parallel over d2t2: e2 takes tp neighbours as an ep group, e4 the whole stage
        for ep in (2, 4):
            lay = ParallelLayout(LayoutSpec(dp=2, tp=2, ep=ep), timeout_s=60)
            for name, group in ((f"ep{ep}", lay.ep_group), (f"edp{ep}", lay.edp_group)):
                gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
                dist.all_gather(gathered, torch.tensor([rank]), group=group)
                out[name] = sorted(int(x) for x in gathered)
            out[f"ep{ep}_rank"] = (lay.edp_rank, lay.ep_rank, lay.submesh("ep").size())
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_layout_groups_on_four_gloo_ranks():
    port = free_port()
    ctx = mp.get_context(RANK_START)
    q = ctx.SimpleQueue()
    mp.start_processes(_groups_rank, args=(4, port, q), nprocs=4, start_method=RANK_START)
    res = dict(q.get() for _ in range(4))
    # d2t2: tp groups are neighbours {0,1},{2,3}; dp groups stride tp: {0,2},{1,3}; pp groups singletons
    assert res[0]["tp"] == [0, 1] and res[3]["tp"] == [2, 3]
    assert res[0]["dp"] == [0, 2] and res[1]["dp"] == [1, 3]
    assert res[2]["pp"] == [2] and res[0]["mesh"] == 2
    want = [t.traj_id for g in synthetic_groups(9) for t in g.trajectories]
    assert all(r["groups"] == want and r["ids_equal"] and r["version"] == 7 for r in res.values())
    # ep groups: consecutive ranks of the stage's d×t (tp fastest), edp groups the ranks holding the same experts
    assert [res[r]["ep2"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [res[r]["edp2"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [res[r]["ep2_rank"] for r in range(4)] == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    assert all(res[r]["ep4"] == [0, 1, 2, 3] and res[r]["edp4"] == [r] for r in range(4))


def _pool_rank(rank: int, world: int, port: int, q) -> None:
    os.environ.update(GLOO_SOCKET_IFNAME="lo", RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist

    from areal_like.learner.parallel.spawn import init_pool_from_env

    assert init_pool_from_env(60) == rank
    if rank == 0:  # which addresses listen on the store's port (/proc/net/tcp: hex ip:port, state 0A)
        with open("/proc/net/tcp") as f:
            rows = [ln.split() for ln in f.read().splitlines()[1:]]
        listening = [r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port]
        with open("/proc/net/tcp6") as f:
            rows6 = [ln.split() for ln in f.read().splitlines()[1:]]
        listening += [r[1] for r in rows6 if r[3] == "0A" and int(r[1].split(":")[1], 16) == port]
        q.put(listening)
    dist.barrier()
    dist.destroy_process_group()


def test_pool_store_listens_on_the_master_address_only():
    """The learner pool's TCPStore binds MASTER_ADDR (127.0.0.1), not every interface."""
    ctx = mp.get_context(RANK_START)
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_pool_rank, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs)
    assert q.get() == [f"0100007F:{port:04X}"]  # 127.0.0.1 only
