"""Issue 43 item 4 through `launcher run`: on-policy distillation. A teacher pool (`embedded[teacher]:d1`)
serves the demo teacher — a real model, the demo's tiny model trained on the next-digit task
(data/demo_teacher.py; its next-digit accuracy, recorded when it was built, is 1.0) — and a fresh student
learns the task from the teacher's logprobs of its own samples alone: `teacher.reward_weight=0`, so the
reward never enters training (it is still computed; validation scores held-out prompts with it)."""

import json
import os

import pytest
from conftest import launcher_run_killing

pytestmark = pytest.mark.integration

THRESHOLD = 0.9  # held-out accuracy the student must reach: the teacher's (1.0), less 0.1


def test_a_fresh_student_reaches_the_teachers_held_out_accuracy_from_its_logprobs_alone(tmp_path, demo_assets):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    # the teacher server killed at step 10: restarted on its port (launcher.max_restarts.teacher); the scorings
    # wait for it (the client's probe takes it back) or fail their group, which is retried
    rc, out = launcher_run_killing("teacher0", 10, run_dir, "--config", "configs/distill_demo.yaml",
                                   f"model.path={model}", f"data.train_files=[{data}]", "train.total_steps=300",
                                   "train.test_freq=5", "train.stop_reward=0.95")
    assert rc == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "reward_reached", summary
    assert summary["restart_counts"]["teacher"] == 1 and [r["role"] for r in summary["restarts"]] == ["teacher0"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # the teacher is what it says: trained to accuracy 1.0 on the task
    cfg = json.loads((run_dir / "config.json").read_text())
    with open(os.path.join(cfg["teacher"]["model_path"], "teacher_train.json")) as f:
        assert json.load(f)["accuracy"] == 1.0
    # every step distilled (the per-token reverse KL to the teacher falls as the student learns) with no reward
    # in the advantage (teacher.reward_weight=0)
    assert cfg["teacher"]["reward_weight"] == 0.0
    kl = [r["teacher_kl"] for r in rows]
    assert all(k is not None for k in kl) and kl[0] > 4.0 and sum(kl[-5:]) / 5 < 1.0, kl
    val = [(r["step"], r["val/all/mean@4"]) for r in rows if "val/all/mean@4" in r]
    assert val[0][1] < 0.3, val  # the fresh student does not know the task
    assert max(v for _, v in val) >= THRESHOLD, val  # held out: the teacher's accuracy, less 0.1
    # the teacher server is a role of the run: its /metrics is a Prometheus target of kind teacher
    targets = json.loads((run_dir / "prometheus_targets.json").read_text())
    assert [t["labels"]["kind"] for t in targets if t["labels"]["role"] == "teacher0"] == ["teacher"]
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    assert len(endpoints["teacher_servers"]) == 1 and endpoints["judge_servers"] == []
