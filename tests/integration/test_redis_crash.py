"""redis-server is SIGKILLed mid-run and restarted on the same port; the run goes on (issue 5 item 3).

Asyncio producers (gate slot → "generate" → add_group) run in one thread, a learner-like consumer
(read → "train" → commit → set_version) in another; the main thread kills Redis twice and restarts it.

Two crash modes:
  * "kill": SIGKILL only. Everything Redis wrote to the kernel survives (AOF), nothing is lost; the
    clients must reconnect with backoff and detect the restart.
  * "kill+lose": SIGKILL, then the AOF is cut back to its size ~0.7 s before the kill — what a machine
    crash does to the last unsynced second under `appendfsync everysec`. Redis comes back without
    the last groups, slot grants, deliveries and commits; the producers' journals re-add the groups,
    the learner's journal re-commits its commits, the gates re-assert their slots.

Either way: every produced group id is trained exactly once, and the re-done work is counted.
"""

from __future__ import annotations

import asyncio
import glob
import os
import random
import threading
import time

import pytest

from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.buffer.redis_client import RedisEndpoint
from areal_like.buffer.redis_server import RedisServer
from areal_like.buffer.replay_buffer import ReplayBuffer
from areal_like.rollout.gate import StalenessGate

pytestmark = pytest.mark.integration

N_PRODUCERS, PER_PRODUCER, B, ETA = 4, 150, 8, 4
STREAM = "crash"


def group(gid: str, version: int) -> TrajectoryGroup:
    t = Trajectory.build(traj_id=f"{gid}-0", group_id=gid, prompt_id="p", prompt_ids=[1, 2, 3], output_ids=[4] * 16,
                         output_logprobs=[-0.1] * 16, output_versions=[version] * 16, reward=1.0, finish_reason="stop")
    return TrajectoryGroup(group_id=gid, prompt_id="p", trajectories=[t], created_at=time.time())


def endpoint(url: str) -> RedisEndpoint:
    # a short backoff cap so the test does not sit out a 2 s sleep after the server is back
    return RedisEndpoint(url, retries=6, backoff_base_s=0.02, backoff_cap_s=0.3, reconnect_timeout_s=30)


class AofSampler(threading.Thread):
    """Records (time, size) of the AOF increment file every 50 ms, to cut it back after a kill."""

    def __init__(self, srv: RedisServer) -> None:
        super().__init__(daemon=True)
        self.srv, self.samples, self.stop = srv, [], threading.Event()

    def path(self) -> str:
        files = sorted(glob.glob(str(self.srv.dir / "appendonlydir" / "*.incr.aof")))
        assert files, f"no AOF increment file in {self.srv.dir}"
        return files[-1]

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic(), os.path.getsize(self.path())))
            except (OSError, AssertionError):
                pass
            time.sleep(0.05)

    def lose_last(self, seconds: float) -> int:
        """Truncate the AOF to its size `seconds` ago; returns the bytes cut."""
        cut_t = time.monotonic() - seconds
        size = max([s for t, s in self.samples if t <= cut_t], default=0)
        path = self.path()
        before = os.path.getsize(path)
        os.truncate(path, size)
        return before - size


def run_producers(url: str, produced: list[str], errors: list[BaseException]) -> dict:
    async def one(buf: ReplayBuffer, gate: StalenessGate, name: str, rng: random.Random) -> None:
        for k in range(PER_PRODUCER):
            gid = f"{name}-{k}"
            d = await gate.acquire(gid, timeout_s=60)
            await asyncio.sleep(rng.uniform(0, 0.012))  # "generate"
            await buf.add_group_async(group(gid, d.version), timeout_s=60)
            produced.append(gid)

    async def main() -> dict:
        ep = endpoint(url)
        buf = ReplayBuffer(stream=STREAM, block_ms=200, endpoint=ep)  # hooks: re-add, then re-assert
        gate = StalenessGate(stream=STREAM, max_staleness=ETA, batch_size=B, endpoint=ep)
        await asyncio.gather(*(one(buf, gate, f"p{i}", random.Random(i)) for i in range(N_PRODUCERS)))
        out = {"restarts": ep.restarts}
        await buf.aclose()
        return out

    try:
        return asyncio.run(main())
    except BaseException as e:  # noqa: BLE001 — re-raised by the test thread
        errors.append(e)
        return {}


def run_learner(url: str, trained: list[str], stop: threading.Event, errors: list[BaseException], out: dict) -> None:
    try:
        buf = ReplayBuffer(stream=STREAM, block_ms=200, endpoint=endpoint(url))
        step = 0
        while not stop.is_set():
            entries = buf.read(B, consumer="L")
            if not entries:
                continue
            trained.extend(g.group_id for _, g in entries)  # "train"
            step += 1
            buf.commit([(e, g.group_id) for e, g in entries], step, consumer="L")
            buf.run.set_version(step)
        out["restarts"] = buf.endpoint.restarts
        out["held"] = buf.held("L")
        buf.close()
    except BaseException as e:  # noqa: BLE001
        errors.append(e)


@pytest.mark.parametrize("mode", ["kill", "kill+lose"])
def test_run_survives_redis_sigkill_and_restart(tmp_path, mode):
    total = N_PRODUCERS * PER_PRODUCER
    with RedisServer(tmp_path / "redis") as srv:
        sampler = AofSampler(srv)
        sampler.start()
        produced: list[str] = []
        trained: list[str] = []
        errors: list[BaseException] = []
        prod_out: dict = {}
        learn_out: dict = {}
        stop = threading.Event()
        prod = threading.Thread(target=lambda: prod_out.update(run_producers(srv.url, produced, errors)), daemon=True)
        learn = threading.Thread(target=run_learner, args=(srv.url, trained, stop, errors, learn_out), daemon=True)
        learn.start()
        prod.start()
        cut = []
        try:
            for at in (total // 4, total // 2):  # two crashes, mid-run
                deadline = time.monotonic() + 30
                while len(produced) < at:
                    assert not errors and time.monotonic() < deadline, errors or f"stuck at {len(produced)}"
                    time.sleep(0.01)
                srv.kill()
                if mode == "kill+lose":
                    cut.append(sampler.lose_last(0.7))
                time.sleep(0.3)  # clients see connection refused and back off
                srv.restart()
            prod.join(60)
            assert not prod.is_alive() and not errors, errors
            deadline = time.monotonic() + 30
            while len(set(trained)) < total and time.monotonic() < deadline and not errors:
                time.sleep(0.02)
        finally:
            stop.set()
            learn.join(10)
            sampler.stop.set()
        assert not errors, errors

        st = ReplayBuffer(srv.url, stream=STREAM).stats()
        gate = StalenessGate(srv.url, stream=STREAM, max_staleness=ETA, batch_size=B)
        dups = sorted({g for g in trained if trained.count(g) > 1})
        assert dups == [], f"trained twice: {dups[:10]} ({st})"
        assert sorted(trained) == sorted(produced) and len(produced) == total, st  # none silently missing
        c = gate.endpoint.client
        left = [(e.decode(), dict(f).get(b"i"), dict(f).get(b"r")) for e, f in c.xrange(f"{{{STREAM}}}:stream")]
        assert st["lost_after_restart"] == 0 and st["depth"] == 0 and st["pending"] == 0, (
            st, left, learn_out.get("held"), c.xpending_range(f"{{{STREAM}}}:stream", "learner", "-", "+", 20))
        assert gate.state()["running"] == 0  # every slot ended as accepted (or re-asserted, then accepted)
        assert prod_out["restarts"] == 2 and learn_out["restarts"] == 2
        if mode == "kill+lose":
            assert all(c > 0 for c in cut), cut
            # the lost second held adds, commits, or both: what was redone is counted
            assert st["readded_after_restart"] + st["recommitted_after_restart"] > 0, st
        print(f"\n{mode}: {total} groups, AOF cut {cut} bytes, readded {st['readded_after_restart']}, "
              f"recommitted {st['recommitted_after_restart']}, dropped {st['dropped']}, duplicates {st['duplicates']}")
        gate.close()
