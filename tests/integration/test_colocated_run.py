"""Co-located mode (`embedded:d1|fsdp:d1`) through `launcher run`: the server and the learner take turns,
one phase each per step (generate → release → train → in-memory handoff → resume), at η = 0 (sync) and
η = 1 (colocate_async: the batch ends the generation phase, requests still generating continue after
the handoff). The demo learns in both; with the same seed a co-located η = 0 run trains exactly what a
disaggregated one does."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re

import pytest

from areal_like.weights.shm import SHM_PREFIX, shm_dir

pytestmark = pytest.mark.integration

COLOCATED = "embedded:d1|fsdp:d1"
PHASES = re.compile(r"co-located step: release [\d.]+ s → wake [\d.]+ s → train [\d.]+ s → handoff [\d.]+ s "
                    r"→ sleep [\d.]+ s → resume [\d.]+ s$", re.M)


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _trained(run_dir) -> list[list[str]]:
    return [sorted(e["groups"]) for e in map(json.loads, (run_dir / "trained.jsonl").read_text().splitlines())
            if e["event"] == "trained"]


@pytest.mark.parametrize("eta", [0, 1])
def test_colocated_demo_learns(tmp_path, run_launcher, eta):
    run_dir = tmp_path / "run"
    # the run ends at its criterion (train.stop_reward: the mean reward of the last 5 steps ≥ 0.8; the demo
    # passes 0.8 by step ~120–140), 300 steps at most
    rc, out = run_launcher(run_dir, "train.total_steps=300", "train.stop_reward=0.8", f"rollout.max_staleness={eta}",
                           "train.test_freq=20", allocation=COLOCATED, timeout=600)
    assert rc == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["exit_reason"] == "reward_reached" and steps < 300 and summary["reward_last"] >= 0.8, summary
    assert summary["max_staleness_observed"] <= eta, summary
    # every step: the server released its memory, the learner trained, handed the weights over, the
    # server resumed — in that order, logged by the learner
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert len(PHASES.findall(learner_log)) == steps, learner_log[-3000:]
    assert "weights.mode=memory" in learner_log
    server_log = (run_dir / "logs" / "server0.log").read_text()
    assert server_log.count("released ['kv_cache', 'weights']") == steps
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    assert any(r.get("val/all/mean@4") is not None for r in rows)  # validation runs between the phases
    # the handoff went through the run's shared-memory segments; the learner removed them at its end
    owner = hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]
    assert glob.glob(os.path.join(shm_dir(), f"{SHM_PREFIX}{owner}-*")) == []


def test_colocated_trains_what_a_disaggregated_run_trains(tmp_path, run_launcher):
    """Same seed, η = 0: co-located and disaggregated (gloo broadcast) train the same groups with the same
    rewards, and the same gradients and losses within float tolerance — the mode changes where things run,
    not what is trained."""
    runs = {}
    for name, alloc in (("colocated", COLOCATED), ("disaggregated", "embedded.d1p1t1+d1p1t1")):
        run_dir = tmp_path / name
        rc, out = run_launcher(run_dir, "train.total_steps=10", "rollout.max_staleness=0", "train.test_freq=0",
                               allocation=alloc)
        assert rc == 0, out[-4000:]
        runs[name] = run_dir
    co, dis = runs["colocated"], runs["disaggregated"]
    assert _trained(co) == _trained(dis) and len(_trained(co)) == 10
    for a, b in zip(_rows(co), _rows(dis), strict=True):
        assert a["step"] == b["step"] and a["reward_mean"] == b["reward_mean"] and a["samples"] == b["samples"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3, abs=1e-6)
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-4)
    assert "co-located step" in (co / "logs" / "learner.log").read_text()
    assert "co-located step" not in (dis / "logs" / "learner.log").read_text()
