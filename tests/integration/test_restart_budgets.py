"""Issue 40 item 1 (restart budgets) through `launcher run`: `launcher.max_restarts.server` is a budget per
generation server, not one for the whole run — with 16 servers and a budget of 3, one flaky node must not
use up the restarts of the other 15. Two servers, budget 1: each is SIGKILLed once (by PID), one after
the other, and the run goes on to the end; summary.json lists both restarts, each the first of its own
server's budget (past it, the run ends naming that server's budget: `_on_death`).
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import launcher_finish, launcher_spawn

pytestmark = pytest.mark.integration


def _pids(run_dir) -> dict[str, int]:
    return json.loads((run_dir / "pids.json").read_text())["roles"]


def _steps(run_dir) -> int:
    p = run_dir / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def _wait(cond, proc, what: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the run ended while waiting for {what}: {proc.communicate()[0][-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _kill_and_wait_back(run_dir, proc, name: str) -> None:
    """SIGKILL role `name`, then wait until it runs again (a new pid) and the run trained 2 more steps."""
    old = _pids(run_dir)[name]
    os.kill(old, signal.SIGKILL)
    _wait(lambda: _pids(run_dir).get(name) not in (None, old), proc, f"{name} to be restarted")
    at = _steps(run_dir)
    _wait(lambda: _steps(run_dir) >= at + 2, proc, f"progress after {name} came back")


def test_each_server_has_its_own_restart_budget(tmp_path, demo_assets):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    proc = launcher_spawn("run", "--config", "configs/demo.yaml", "--allocation", "embedded.d2p1t1+d1p1t1",
                          "--run-dir", str(run_dir), f"model.path={model}", f"data.train_files=[{data}]",
                          "train.total_steps=24", "launcher.max_restarts.server=1", "weights.timeout_s=30",
                          "metrics.prometheus=false")
    try:
        _wait(lambda: _steps(run_dir) >= 3, proc, "the first steps")
        _kill_and_wait_back(run_dir, proc, "server0")
        _kill_and_wait_back(run_dir, proc, "server1")  # the whole-run budget of 1 was spent by server0
    finally:
        rc, out = launcher_finish(proc, timeout=300)
    assert rc == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 24
    restarts = [(r["role"], r["restart"], r["budget"], r["budget_scope"]) for r in summary["restarts"]]
    assert restarts == [("server0", 1, 1, "server0"), ("server1", 1, 1, "server1")], summary["restarts"]
    assert summary["restart_counts"]["server"] == 2
    assert "restart 1 of 1 for server0, launcher.max_restarts.server" in out
    assert "server1 is up again" in out



def test_servers_left_in_a_failed_nccl_push_are_restarted(tmp_path, demo_assets):
    """Issue 40 item 1, the launcher's half (the learner's half needs NCCL: `cuda_figures.sh`'s
    weight_group stage). SGLang's side of an NCCL weight group waits torch's default 30 minutes in a
    broadcast whose sender failed or died (tests/conformance checks SGLang's code for it), so:
      * a server the learner reports stuck after a failed push (Redis `restart_requests`) is restarted;
      * a learner that dies inside an NCCL push (rank 0's `push_in_flight` mark) takes every server with it:
        they are restarted with the learner pool, which re-syncs them.
    Both messages are written into the run's Redis (its own, given as buffer.redis_url) as rank 0 writes
    them on a GPU; the embedded servers here are real, and so are their restarts and re-syncs."""
    from areal_like.api.config import BufferConfig
    from areal_like.buffer.redis_server import RedisServer
    from areal_like.buffer.replay_buffer import ReplayBuffer

    model, data = demo_assets
    run_dir = tmp_path / "run"
    with RedisServer(str(tmp_path / "redis")) as redis:
        buf = ReplayBuffer.from_config(BufferConfig(), url=redis.url)
        proc = launcher_spawn("run", "--config", "configs/demo.yaml", "--allocation", "embedded.d2p1t1+d1p1t1",
                              "--run-dir", str(run_dir), f"model.path={model}", f"data.train_files=[{data}]",
                              f"buffer.redis_url={redis.url}", "train.total_steps=30", "train.save_freq=1",
                              "launcher.max_restarts.learner=1", "launcher.max_restarts.server=2",
                              "weights.timeout_s=30", "metrics.prometheus=false")
        try:
            _wait(lambda: _steps(run_dir) >= 3, proc, "the first steps")
            old = _pids(run_dir)
            buf.run.request_restart("server1", "stuck in an NCCL weight broadcast (test)")
            _wait(lambda: _pids(run_dir).get("server1") not in (None, old["server1"]), proc, "server1 to be restarted")
            at = _steps(run_dir)
            _wait(lambda: _steps(run_dir) >= at + 2, proc, "progress after server1 came back")
            old = _pids(run_dir)
            buf.run.mark_push({"version": 99, "backend": "nccl"})
            os.kill(old["learner"], signal.SIGKILL)
            # a role being restarted is absent from pids.json for a moment: wait for its new pid
            _wait(lambda: all(_pids(run_dir).get(n) not in (None, old[n]) for n in ("learner", "server0", "server1")),
                  proc,
                  "the learner and both servers to be restarted")
            assert buf.run.push_in_flight() is None  # taken by the launcher
        finally:
            rc, out = launcher_finish(proc, timeout=300)
            buf.close()
    assert rc == 0, out[-4000:]
    assert "the learner asks for a restart of server1: stuck in an NCCL weight broadcast (test)" in out
    assert "the learner died inside the NCCL push of version 99: restarting 2 server(s)" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 30
    roles = [r["role"] for r in summary["restarts"]]
    assert roles[0] == "server1" and roles[1] == "learner" and sorted(roles[2:]) == ["server0", "server1"], roles
