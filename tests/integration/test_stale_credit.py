"""A step never trains fewer than B groups: the learner's fetch replaces every group the consume-time
guard drops as stale (and every DAPO-filtered one), and each such drop hands its place back to the
staleness gate in the same atomic ack (gate_credit) — real redis-server, the real `Coordinator`."""

from __future__ import annotations

import time

import pytest

from areal_like.api.config import (AlgorithmConfig, BufferConfig, ExperimentConfig, RolloutConfig, TrainConfig)
from areal_like.api.run_files import Endpoints
from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.buffer.replay_buffer import ReplayBuffer
from areal_like.learner.main import Coordinator
from areal_like.rollout.gate import StalenessGate

pytestmark = pytest.mark.integration


def group(gid: str, version: int, rewards=(1.0, 0.0)) -> TrajectoryGroup:
    trajs = [Trajectory.build(traj_id=f"{gid}-{k}", group_id=gid, prompt_id="p", prompt_ids=[1, 2], output_ids=[3, 4],
                              output_logprobs=[-0.1, -0.2], output_versions=[version, version], reward=r,
                              finish_reason="stop") for k, r in enumerate(rewards)]
    return TrajectoryGroup(group_id=gid, prompt_id="p", trajectories=trajs, created_at=time.time(), producer="t")


def coordinator(tmp_path, monkeypatch, redis_server, stream: str, **algorithm) -> Coordinator:
    monkeypatch.setenv("AREAL_LIKE_REDIS_URL", redis_server.url)
    cfg = ExperimentConfig(rollout=RolloutConfig(max_staleness=1), train=TrainConfig(batch_size=3),
                           buffer=BufferConfig(stream=stream, block_ms=100), algorithm=AlgorithmConfig(**algorithm))
    # The pusher is built but never used here (no server is contacted before start()).
    return Coordinator(cfg, Endpoints(servers=["http://127.0.0.1:9"]), str(tmp_path), 0, weight_port=1,
                       metrics_port=None)


def test_stale_drop_credits_the_gate_atomically(redis_server, redis_stream):
    gate = StalenessGate(redis_server.url, stream=redis_stream, max_staleness=0, batch_size=2)
    buf = ReplayBuffer(redis_server.url, stream=redis_stream, block_ms=100)
    for k, v in enumerate((0, 0)):
        assert gate.try_acquire(f"g{k}") and buf.add_group(group(f"g{k}", v))
    assert gate.state()["capacity"] == 2 and not gate.try_acquire("g2")
    buf.run.set_version(1)  # capacity 4: two more at v=1
    for k in (2, 3):
        assert gate.try_acquire(f"g{k}") and buf.add_group(group(f"g{k}", 1))
    assert not gate.try_acquire("g4")
    entries = buf.read(4, 100, "learner-0")
    keep, dropped = buf.filter_stale(entries, current_version=1, max_staleness=0)
    assert [g.group_id for _, g in dropped] == ["g0", "g1"] and len(keep) == 2
    buf.filter_stale(dropped, current_version=1, max_staleness=0)  # a retried ack credits nothing more
    st = buf.stats()
    assert st["dropped"] == {"stale": 2}
    assert gate.state()["capacity"] == 4 + 2  # (η + v + 1)·B + the two stale drops
    assert gate.try_acquire("g4") and gate.try_acquire("g5") and not gate.try_acquire("g6")
    # policy keep trains them anyway: counted stale_kept, no credit
    assert buf.add_group(group("g4", 0))
    got = buf.read(1, 100, "learner-0")
    keep, dropped = buf.filter_stale(got, current_version=1, max_staleness=0, policy="keep")
    assert len(keep) == 1 and not dropped and gate.state()["capacity"] == 6
    gate.close()
    buf.close()


async def test_fetch_returns_b_kept_groups_when_some_were_stale(tmp_path, monkeypatch, redis_server, redis_stream):
    """B = 3, consume-time limit η = 1, learner at v = 3: groups started at v ≤ 1 are stale. fetch
    reads until it holds 3 fresh groups; the 3 stale ones are dropped, counted and credited."""
    coord = coordinator(tmp_path, monkeypatch, redis_server, redis_stream)
    buf = coord.buffer
    versions = {"a": 0, "b": 3, "c": 1, "d": 2, "e": 0, "f": 3, "g": 3}
    for gid, v in versions.items():
        assert buf.add_group(group(gid, v))
    before = buf.stats()
    batch = await coord.fetch(3, lambda: False)
    assert [g.group_id for g in batch.groups] == ["b", "d", "f"]  # B kept groups, in stream order
    assert len(batch.ids) == 3 and batch.dropped_stale == 3 and batch.filtered == 0
    st = buf.stats()
    assert st["dropped"] == {"stale": 3}
    assert st["depth"] == 1  # "g" was never read: exactly the replacements needed
    gate = StalenessGate(redis_server.url, stream=redis_stream, max_staleness=1, batch_size=3)
    credit = gate.state()["capacity"] - (1 + st["version"] + 1) * 3
    assert credit == 3 and before["dropped"] == {}
    gate.close()
    buf.close()


async def test_fetch_replaces_stale_and_filtered_groups_together(tmp_path, monkeypatch, redis_server, redis_stream):
    coord = coordinator(tmp_path, monkeypatch, redis_server, redis_stream, filter_groups=True,
                        filter_groups_max_extra=8)
    buf = coord.buffer
    for gid, v, rewards in (("a", 0, (1.0, 0.0)), ("b", 2, (1.0, 1.0)), ("c", 2, (0.0, 1.0)), ("d", 1, (1.0, 0.0)),
                            ("e", 2, (1.0, 0.0)), ("f", 2, (0.5, 0.0)), ("g", 2, (0.0, 1.0))):
        assert buf.add_group(group(gid, v, rewards))
    batch = await coord.fetch(2, lambda: False)  # limit 1 at v=2: "a" stale, "b" all-equal rewards
    assert [g.group_id for g in batch.groups] == ["c", "d", "e"]
    assert batch.dropped_stale == 1 and batch.filtered == 1
    assert buf.stats()["dropped"] == {"stale": 1, "filtered": 1}
    gate = StalenessGate(redis_server.url, stream=redis_stream, max_staleness=1, batch_size=3)
    assert gate.state()["capacity"] == (1 + 0 + 1) * 3 + 2
    gate.close()
    buf.close()


async def test_fetch_stops_when_asked(tmp_path, monkeypatch, redis_server, redis_stream):
    coord = coordinator(tmp_path, monkeypatch, redis_server, redis_stream)
    calls = []
    assert await coord.fetch(0, lambda: calls.append(1) or len(calls) > 2) is None  # empty stream: polls, then stops
    coord.buffer.close()
