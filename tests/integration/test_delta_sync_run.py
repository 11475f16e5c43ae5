"""`weights.sync=delta` through `launcher run` (issue 42): two bf16 embedded servers, 20 steps, every push
checked (`weights.check_every=1`: each server's per-tensor checksums equal those of a full push of the
version, or the push fails and the learner re-syncs). During the run a server is SIGKILLed (restarted,
re-synced with a full push) and the learner is SIGKILLed in the middle of a delta push — after a server
logged the update's first bucket and before any applied it — and restarts from its checkpoint: the torn
delta changes nothing, the new learner pushes the full weights, and every later push is again a delta
that checks out."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from conftest import launcher_finish, launcher_spawn

pytestmark = pytest.mark.integration

STEPS = 20


def _rows(run_dir) -> list[dict]:
    """metrics.jsonl's complete rows: read while the run writes, its last line may still be half written."""
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    *lines, partial = p.read_text().split("\n")  # `partial`: "" once the last row's newline is written
    return [json.loads(ln) for ln in lines if ln]


def _pids(run_dir) -> dict[str, int]:
    return json.loads((run_dir / "pids.json").read_text())["roles"]


def _wait(cond, proc, deadline, what):
    while not cond():
        assert proc.poll() is None, f"the run ended while waiting for {what}:\n{proc.communicate()[0][-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_delta_pushes_stay_bit_exact_through_a_server_restart_and_a_learner_killed_mid_push(tmp_path, demo_assets):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    proc = launcher_spawn(
        "run", "--config", "configs/demo.yaml", "--allocation", "embedded.d2p1t1+d1p1t1", "--run-dir", str(run_dir),
        f"model.path={model}", f"data.train_files=[{data}]", f"train.total_steps={STEPS}", "train.test_freq=0",
        "server.dtype=bfloat16", "weights.sync=delta", "weights.check_every=1", "train.save_freq=1",
        # one tensor per bucket: a delta push spans many broadcasts, so the learner's kill lands inside one
        "weights.bucket_mb=0.001", "weights.timeout_s=20", "launcher.max_restarts.server=1",
        "launcher.max_restarts.learner=3", "metrics.prometheus=false")
    torn: list[str] = []
    try:
        deadline = time.monotonic() + 300
        _wait(lambda: len(_rows(run_dir)) >= 4, proc, deadline, "step 4")
        pid = _pids(run_dir)["server1"]
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: _pids(run_dir).get("server1") != pid, proc, deadline, "server1's restart")
        _wait(lambda: len(_rows(run_dir)) >= 9, proc, deadline, "step 9")

        log = run_dir / "logs" / "server0.log"
        for _ in range(3):  # kill the learner right after server0 began receiving a delta; until one is torn
            seen = log.read_text().count("receiving a delta update")
            _wait(lambda: log.read_text().count("receiving a delta update") > seen, proc, deadline, "a delta push")
            pid = _pids(run_dir)["learner"]
            os.kill(pid, signal.SIGKILL)
            line = [ln for ln in log.read_text().splitlines() if "receiving a delta update" in ln][-1]
            base = line.split("from version ")[1].split()[0]
            _wait(lambda: _pids(run_dir).get("learner") != pid, proc, deadline, "the learner's restart")
            # torn: no server applied the update that started from `base` before the restarted learner's full push
            applied = f"applied a delta update from version {base} "
            if all(applied not in (run_dir / "logs" / f"server{i}.log").read_text() for i in (0, 1)):
                torn.append(base)
                break
        code, out = launcher_finish(proc, timeout=max(10.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert code == 0, out[-4000:]
    assert torn, "the learner was never killed inside a delta push (every kill landed after the apply)"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] == STEPS and summary["restart_counts"]["server"] == 1

    rows = _rows(run_dir)
    # every push was checked on both servers against a full push of its version (a mismatch fails the push)
    assert all(r["push_checked"] and r["push_checked"] >= 20 for r in rows), [(r["step"], r["push_checked"]) for r in rows]
    deltas = [r for r in rows if r["push_delta"]]
    fulls = [r["step"] for r in rows if not r["push_delta"]]
    # full: the first push, each restarted learner's first, and a step whose push re-synced the restarted
    # server; every other step sent its changes only
    assert 2 <= len(fulls) <= 2 + summary["restart_counts"]["learner"], fulls
    assert len(deltas) >= STEPS - len(fulls) - 1
    assert all(0 < r["push_changed"] <= 1 and r["push_bytes"] < max(f["push_bytes"] for f in rows if not f["push_delta"])
               for r in deltas)
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "re-formed the weight group" in learner_log  # the restarted server got the full weights


@pytest.mark.parametrize("training,mode", [("d2p1t1", "distributed"), ("d1p2t1", "distributed"), ("d2p1t1", "disk")])
def test_a_sharded_or_pipelined_learner_pushes_deltas_that_check_out(tmp_path, run_launcher, training, mode):
    """The diff opens the learner's weights as a full push does: gathered from dp shards (FSDP) or from the
    pipeline stages one tensor at a time on rank 0. Every push is checked against a full push's checksums.
    `weights.mode=disk`: each delta is a directory (delta.safetensors + delta.json) under the run dir (at the
    demo's lr 1e-3 most elements change every step: the bytes are measured at small lrs elsewhere)."""
    run_dir = tmp_path / "run"
    code, out = run_launcher(run_dir, "train.total_steps=6", "train.test_freq=0", "server.dtype=bfloat16",
                             "weights.sync=delta", "weights.check_every=1", "metrics.prometheus=false",
                             f"weights.mode={mode}", allocation=f"embedded.d1p1t1+{training}")
    assert code == 0, out[-4000:]
    rows = _rows(run_dir)
    assert [r["push_delta"] for r in rows] == [False] + [True] * 5, rows
    assert all(r["push_checked"] and r["push_checked"] >= 20 for r in rows)
    if mode == "disk":
        kept = sorted((run_dir / "weights_disk").iterdir())  # the newest two version dirs: deltas
        assert [sorted(os.listdir(d)) for d in kept] == [["delta.json", "delta.safetensors"]] * 2, kept
