"""Staleness gate (DESIGN invariant 2) against a real redis-server.

Many asyncio producers — and separate OS processes — hammer the gate and the buffer while a simulated
learner consumes B groups per version and bumps v. A monitor checks accepted + running ≤ (η+v+1)·B
the whole time; the learner records each group's staleness (version at consume − version at start).

Run as a script (`python test_gate.py --produce ...`) this file is also the producer process.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.buffer.replay_buffer import ReplayBuffer
from areal_like.rollout.gate import GateTimeout, StalenessGate

pytestmark = pytest.mark.integration


def group(gid: str, version: int, producer: str = "") -> TrajectoryGroup:
    t = Trajectory.build(traj_id=f"{gid}-0", group_id=gid, prompt_id="p", prompt_ids=[1, 2], output_ids=[3, 4],
                         output_logprobs=[-0.1, -0.2], output_versions=[version, version], reward=1.0,
                         finish_reason="stop")
    return TrajectoryGroup(group_id=gid, prompt_id="p", trajectories=[t], created_at=time.time(), producer=producer)


async def produce(gate: StalenessGate, buf: ReplayBuffer, name: str, stop_version: int, gen_s: float,
                  fail_p: float, seed: int) -> int:
    """One rollout coroutine: acquire → 'generate' at the acquire-time version → add (or fail → release)."""
    rng = random.Random(seed)
    n = added = 0
    while True:
        slot = f"{name}-{n}"
        n += 1
        while True:
            d = await gate.try_acquire_detail_async(slot)
            if d.granted or d.version >= stop_version:
                break
            await asyncio.sleep(0.002)
        if d.version >= stop_version:
            if d.granted:
                await gate.release_async(slot)
            return added
        await asyncio.sleep(rng.uniform(0, gen_s))
        if rng.random() < fail_p:
            await gate.release_async(slot)  # a failed group frees its slot
            continue
        assert await buf.add_group_async(group(slot, d.version, producer=name), timeout_s=30)
        added += 1


def producer_main(url: str, stream: str, eta: int, b: int, stop_version: int, name: str, n_coros: int) -> None:
    async def run() -> None:
        gate = StalenessGate(url, stream=stream, max_staleness=eta, batch_size=b)
        buf = ReplayBuffer(url, stream=stream, block_ms=100)
        await buf.endpoint.async_client.incr(f"{{{stream}}}:test-ready")  # tell the learner we are up
        await asyncio.gather(*(produce(gate, buf, f"{name}.{i}", stop_version, 0.003, 0.05, hash((name, i)))
                               for i in range(n_coros)))
        await gate.aclose()
        await buf.aclose()

    asyncio.run(run())


class Monitor:
    """Polls the gate's atomic state and records every violation of accepted + running ≤ capacity."""

    def __init__(self, gate: StalenessGate, eta: int, b: int) -> None:
        self.gate, self.eta, self.b = gate, eta, b
        self.samples = 0
        self.violations: list[dict] = []

    def check(self, st: dict) -> None:
        self.samples += 1
        # (η + v + 1)·B, plus gate_credit: groups the learner dropped as stale and replaced
        assert st["capacity"] >= (self.eta + st["version"] + 1) * self.b
        if st["accepted"] + st["running"] > st["capacity"]:
            self.violations.append(st)


async def learn_async(buf: ReplayBuffer, gate: StalenessGate, b: int, versions: int, step_s: float,
                      observed: list[int], mon: Monitor) -> None:
    """Simulated learner: B groups per version, 'train', ack (commit), then publish v+1."""
    for v in range(versions):
        batch = []
        deadline = time.monotonic() + 20
        while len(batch) < b:
            assert time.monotonic() < deadline, f"learner starved at v={v}: {await gate.state_async()}"
            batch += await buf.read_async(b - len(batch), block_ms=100, consumer="learner-0")
        observed += [v - g.min_version for _, g in batch]
        mon.check(await gate.state_async())
        await asyncio.sleep(step_s)
        await buf.ack_async([e for e, _ in batch])
        await buf.run.set_version_async(v + 1)  # "weights landed on every server"


@pytest.mark.parametrize("eta", [0, 2])
async def test_gate_bound_with_many_asyncio_producers(redis_server, redis_stream, eta):
    b, versions, n_prod = 4, 12, 16
    url, s = redis_server.url, redis_stream
    gate = StalenessGate(url, stream=s, max_staleness=eta, batch_size=b)
    learner_buf = ReplayBuffer(url, stream=s, block_ms=100)
    prod_buf = ReplayBuffer(url, stream=s, block_ms=100)
    mon = Monitor(StalenessGate(url, stream=s, max_staleness=eta, batch_size=b), eta, b)
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            mon.check(await mon.gate.state_async())
            await asyncio.sleep(0.001)

    observed: list[int] = []
    watcher = asyncio.create_task(watch())
    producers = [asyncio.create_task(produce(gate, prod_buf, f"p{i}", versions, 0.003, 0.05, i))
                 for i in range(n_prod)]
    await asyncio.wait_for(learn_async(learner_buf, gate, b, versions, 0.015, observed, mon), 40)
    added = sum(await asyncio.wait_for(asyncio.gather(*producers), 20))
    stop.set()
    await watcher

    final = await gate.state_async()
    assert mon.violations == [] and mon.samples > 50
    assert final["running"] == 0 and final["accepted"] == added
    assert final["accepted"] <= (eta + versions + 1) * b
    assert len(observed) == versions * b
    if eta == 0:
        assert set(observed) == {0}  # synchronous RL through the same code path
        assert final["accepted"] == versions * b
    else:
        assert max(observed) <= eta
        assert max(observed) >= 1  # the run really was off-policy
    for x in (gate, learner_buf, prod_buf, mon.gate):
        await x.aclose()


@pytest.mark.parametrize("eta", [0, 2])
def test_gate_bound_across_os_processes(redis_server, redis_stream, eta, tmp_path):
    b, versions, n_procs, n_coros = 4, 10, 2, 4
    s = redis_stream
    url_no_pw = f"redis://127.0.0.1:{redis_server.port}/0"  # password travels in the env, not argv
    env = dict(os.environ, AREAL_LIKE_REDIS_PASSWORD=redis_server.password,
               PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    gate = StalenessGate(redis_server.url, stream=s, max_staleness=eta, batch_size=b)
    buf = ReplayBuffer(redis_server.url, stream=s, block_ms=100)
    mon = Monitor(StalenessGate(redis_server.url, stream=s, max_staleness=eta, batch_size=b), eta, b)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            mon.check(mon.gate.state())
            time.sleep(0.001)

    procs = []
    for i in range(n_procs):
        with open(tmp_path / f"p{i}.log", "w") as logf:  # the child keeps its own copy of the fd
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--produce", url_no_pw, s, str(eta), str(b), str(versions), f"proc{i}",
                 str(n_coros)], env=env, stdout=logf, stderr=subprocess.STDOUT))
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    observed, kept_staleness, dropped = [], [], 0
    producers_seen: set[str] = set()
    try:
        deadline = time.monotonic() + 30
        while int(buf.endpoint.client.get(f"{{{s}}}:test-ready") or 0) < n_procs:  # all processes hammering
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.02)
        for v in range(versions):
            batch = []
            deadline = time.monotonic() + 30
            while len(batch) < b:
                assert time.monotonic() < deadline, f"learner starved at v={v}: {gate.state()}"
                assert all(p.poll() in (None, 0) for p in procs), [(tmp_path / f"p{i}.log").read_text()
                                                                     for i in range(n_procs)]
                batch += buf.read(b - len(batch), block_ms=100, consumer="learner-0")
            observed += [v - g.min_version for _, g in batch]
            producers_seen |= {g.producer.split(".")[0] for _, g in batch}
            mon.check(gate.state())
            # consume-time guard with limit η: stragglers (if any) are dropped and counted
            keep, drop = buf.filter_stale(batch, v, eta)
            kept_staleness += [v - g.min_version for _, g in keep]
            dropped += len(drop)
            time.sleep(0.02)
            buf.ack([e for e, _ in keep])
            buf.run.set_version(v + 1)
        for p in procs:
            assert p.wait(timeout=30) == 0, (tmp_path / "p0.log").read_text()
    finally:
        done.set()
        t.join(5)
        for p in procs:
            if p.poll() is None:
                p.kill()  # our own child, by PID
                p.wait()
    final = gate.state()
    assert mon.violations == [] and mon.samples > 20
    # a stale drop hands its place back to the gate (the real learner reads a replacement)
    assert final["running"] == 0 and final["accepted"] <= (eta + versions + 1) * b + dropped
    assert producers_seen == {f"proc{i}" for i in range(n_procs)}
    assert max(kept_staleness) <= eta
    assert buf.stats()["dropped"].get("stale", 0) == dropped == sum(x > eta for x in observed)
    if eta == 0:
        assert set(observed) == {0} and dropped == 0  # strict for η = 0 whatever the scheduling
    else:
        # a straggler needs a producer process stalled for > η learner steps; the guard catches it
        assert dropped <= len(observed) // 10, observed
    for x in (gate, buf, mon.gate):
        x.close()


# ---- slot semantics ------------------------------------------------------------------------------
def test_slots_are_idempotent_and_freed_by_add_release_and_reap(redis_server, redis_stream):
    gate = StalenessGate(redis_server.url, stream=redis_stream, max_staleness=0, batch_size=2)
    buf = ReplayBuffer(redis_server.url, stream=redis_stream, block_ms=100)
    assert gate.try_acquire("a") and gate.try_acquire("a")  # retried acquire: still one slot
    assert gate.state() == {"version": 0, "accepted": 0, "running": 1, "capacity": 2}
    assert gate.try_acquire("b")
    assert not gate.try_acquire("c")  # 0 + 2 + 1 > (0 + 0 + 1)·2
    assert buf.add_group(group("a", 0))  # accept: running −1, accepted +1 in one script
    assert gate.state() == {"version": 0, "accepted": 1, "running": 1, "capacity": 2}
    assert not gate.try_acquire("c")
    assert gate.release("b") is True and gate.release("b") is False  # failed group; double release is a no-op
    assert gate.try_acquire("c")
    assert not buf.add_group(group("a", 0))  # duplicate add must not free someone's slot twice
    assert gate.state()["running"] == 1
    time.sleep(0.15)
    assert gate.reap(max_age_s=10) == 0
    assert gate.reap(max_age_s=0.1) == 1  # the worker holding "c" died
    assert gate.state() == {"version": 0, "accepted": 1, "running": 0, "capacity": 2}
    gate.close()
    buf.close()


def test_a_dead_workers_slots_are_freed_and_counted_lost_in_flight(redis_server, redis_stream):
    """What the launcher does before restarting rollout worker 1: its slots (w1-*) are freed, counted as
    lost_in_flight; worker 1's accepted group and worker 11's slots are untouched."""
    gate = StalenessGate(redis_server.url, stream=redis_stream, max_staleness=1, batch_size=4)
    buf = ReplayBuffer(redis_server.url, stream=redis_stream, block_ms=100)
    for slot in ("w1-0", "w1-1", "w1-2", "w11-0", "w0-5"):
        assert gate.try_acquire(slot)
    assert buf.add_group(group("w1-0", 0))  # accepted before the worker died: not in flight
    assert gate.state()["running"] == 4
    assert gate.release_worker(1) == 2
    assert gate.release_worker(1) == 0  # idempotent
    assert gate.state() == {"version": 0, "accepted": 1, "running": 2, "capacity": 8}
    assert buf.stats()["lost_in_flight"] == 2
    assert gate.try_acquire("w1-3")  # the restarted worker gets slots again
    gate.close()
    buf.close()


async def test_acquire_waits_for_the_learner_and_times_out_with_counters(redis_server, redis_stream):
    gate = StalenessGate(redis_server.url, stream=redis_stream, max_staleness=0, batch_size=1)
    buf = ReplayBuffer(redis_server.url, stream=redis_stream, block_ms=100)
    assert (await gate.acquire("g0", timeout_s=1)).granted
    await buf.add_group_async(group("g0", 0))
    with pytest.raises(GateTimeout, match=r"accepted 1 \+ running 0 \+ 1 > capacity 1 at v=0"):
        await gate.acquire("g1", timeout_s=0.2)
    waiter = asyncio.create_task(gate.acquire("g1", timeout_s=10))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await buf.run.set_version_async(1)  # learner consumed step 0 and published v=1
    d = await asyncio.wait_for(waiter, 5)
    assert d.granted and d.version == 1 and d.capacity == 2
    await gate.aclose()
    await buf.aclose()


if __name__ == "__main__" and sys.argv[1:2] == ["--produce"]:
    url_, stream_, eta_, b_, stop_, name_, n_ = sys.argv[2:9]
    producer_main(url_, stream_, int(eta_), int(b_), int(stop_), name_, int(n_))


def test_filtered_and_stale_groups_hand_their_place_back_to_the_gate(redis_server, redis_stream):
    """The learner drops an all-equal-reward group as `filtered` (DAPO dynamic sampling) or a group
    older than the consume-time limit as `stale`, and reads one more in its place; the drop credits
    the gate in the same ack, so the capacity grows by one and every step trains B groups while the
    learner still consumes B entries per version net. Other drop reasons credit nothing."""
    gate = StalenessGate(redis_server.url, stream=redis_stream, max_staleness=0, batch_size=3)
    buf = ReplayBuffer(redis_server.url, stream=redis_stream, block_ms=100)
    for k in range(3):
        assert gate.try_acquire(f"s{k}")
        assert buf.add_group(group(f"s{k}", 0))
    assert not gate.try_acquire("s3") and gate.state()["capacity"] == 3  # (η + v + 1)·B = 3, all taken
    (e0, _), (e1, _), (e2, _) = buf.read(3, 100, "learner-0")
    buf.drop([e0], "malformed")  # not replaced by the learner: no credit
    assert gate.state()["capacity"] == 3 and not gate.try_acquire("s3")
    buf.drop([e1], "filtered")
    buf.drop([e1], "filtered")  # a retried ack counts once
    assert gate.state()["capacity"] == 4
    buf.drop([e2], "stale")
    buf.drop([e2], "stale")
    assert gate.state()["capacity"] == 5
    assert gate.try_acquire("s3") and gate.try_acquire("s4")  # the replacements, at the same version
    assert not gate.try_acquire("s5")
    assert buf.stats()["dropped"] == {"malformed": 1, "stale": 1, "filtered": 1}
    gate.close()
    buf.close()


def test_waiters_wake_on_the_learners_version_bump(redis_server, redis_stream):
    """A closed gate's waiter (the rollout worker) wakes as soon as set_version lands, not after a poll."""
    gate = StalenessGate(redis_server.url, stream=redis_stream, max_staleness=0, batch_size=1)
    buf = ReplayBuffer(redis_server.url, stream=redis_stream, block_ms=100)

    async def scenario():
        assert await gate.wait_version_async(0.05) is False  # no bump: it returns at its timeout
        waiter = asyncio.ensure_future(gate.wait_version_async(30.0))
        await asyncio.sleep(0.1)  # the waiter is blocked in XREAD
        await asyncio.to_thread(buf.run.set_version, 3)
        assert await waiter is True  # woken by the bump's event (a timeout returns False)
        assert (await gate.state_async())["version"] == 3  # the SET landed before the event
        await gate.aclose()

    try:
        asyncio.run(scenario())
    finally:
        buf.close()
