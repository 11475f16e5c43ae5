"""Issue 43 item 3 through `launcher run`: a judge pool (`embedded[judge]:d1`) serves the demo judge — a
real model, the demo's tiny model trained to grade the next-digit task (data/demo_judge.py) — on a server
of its own, and the policy learns the task from the judge's verdicts alone (judge.rule_weight = 0: the
task's rule reward is never computed)."""

import json

import pytest
from conftest import launcher_cli

pytestmark = pytest.mark.integration


def test_the_policy_learns_the_demo_from_the_judges_grades_alone(tmp_path, demo_assets):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    rc, out = launcher_cli("run", "--config", "configs/judge_demo.yaml", "--run-dir", str(run_dir),
                           f"model.path={model}", f"data.train_files=[{data}]", "train.total_steps=300",
                           "train.stop_reward=0.8", "rollout.dump_dir=dump", timeout=600)
    assert rc == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    # the run ends at its criterion: the mean grade of the last 5 steps ≥ 0.8 (from ~0.01 at the start)
    assert summary["exit_reason"] == "reward_reached", summary
    assert summary["reward_first"] < 0.2 and summary["steps"] < 300, summary
    assert not any(summary["reward_failures"].values()), summary["reward_failures"]
    # The rewards are the judge's grades: p(Y) / (p(Y) + p(N)), not the rule reward's 0 / 0.5 / 1 …
    graded = []
    for line in (run_dir / "dump" / "rollout0.jsonl").read_text().splitlines():
        for t in json.loads(line)["trajectories"]:
            answer = str((int(t["prompt_text"][-1]) + 1) % 10)
            graded.append((t["reward"], "".join(s["text"] for s in t["segments"]) == answer))
    assert any(r not in (0.0, 0.5, 1.0) for r, _ in graded)
    # … and they grade: right answers above 0.5, wrong ones below (the demo judge is not perfect: it was
    # trained on a sample of replies, and scores 100% on digits and three other replies, judge_train.json)
    wrong = [g for g in graded if (g[0] > 0.5) != g[1]]
    assert len(wrong) <= 0.01 * len(graded), wrong[:10]
    assert sum(right for _, right in graded) > 100
    # the judge server is a role of the run: its /metrics is a Prometheus target of kind judge
    targets = json.loads((run_dir / "prometheus_targets.json").read_text())
    assert [t["labels"]["kind"] for t in targets if t["labels"]["role"] == "judge0"] == ["judge"]
    assert "1 judge server(s) healthy" in out
    assert "reward = 0 × rule + 1 × judge" in (run_dir / "logs" / "rollout0.log").read_text()
