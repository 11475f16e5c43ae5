"""Issue 43 item 3 through `launcher run`: a judge pool (`embedded[judge]:d1`) serves the demo judge — a
real model, the demo's tiny model trained to grade the next-digit task (data/demo_judge.py) — on a server
of its own, and the policy learns the task from the judge alone: half the reward is the built-in grading
(judge.score_rule=verdict), half a custom reward function that asks the judge itself through its
JudgeClient (examples/judge_reward/compute_score.py). The task's rule reward is never computed."""

import json

import pytest
from conftest import launcher_run_killing

pytestmark = pytest.mark.integration


def test_the_policy_learns_the_demo_from_the_judges_grades_alone(tmp_path, demo_assets):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    # the judge server killed at step 10: restarted on its port (launcher.max_restarts.judge); its gradings wait
    # for it (the client's probe takes it back) instead of failing
    rc, out = launcher_run_killing("judge0", 10, run_dir, "--config", "configs/judge_demo.yaml",
                                   f"model.path={model}", f"data.train_files=[{data}]", "train.total_steps=300",
                                   "train.stop_reward=0.8", "rollout.dump_dir=dump",
                                   "custom_reward_function.path=examples/judge_reward/compute_score.py",
                                   "judge.weight=0.5", "judge.rule_weight=0.5",
                                   "train.lr=2e-3")  # the criterion in ~75 steps instead of ~110 at the config's 1e-3
    assert rc == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restart_counts"]["judge"] == 1 and [r["role"] for r in summary["restarts"]] == ["judge0"], summary
    # the run ends at its criterion: the mean grade of the last 5 steps ≥ 0.8 (from ~0.01 at the start)
    assert summary["exit_reason"] == "reward_reached", summary
    assert summary["reward_first"] < 0.2 and summary["steps"] < 300, summary
    assert not any(summary["reward_failures"].values()), summary["reward_failures"]
    # The rewards are the judge's: 0.5 × p(Y) / (p(Y) + p(N)) + 0.5 × [its greedy verdict is Y] (the custom
    # function's), never the rule reward's 0 / 0.5 / 1 …
    graded = []
    for line in (run_dir / "dump" / "rollout0.jsonl").read_text().splitlines():
        for t in json.loads(line)["trajectories"]:
            answer = str((int(t["prompt_text"][-1]) + 1) % 10)
            graded.append((t["reward"], "".join(s["text"] for s in t["segments"]) == answer))
    assert any(r not in (0.0, 0.5, 1.0) for r, _ in graded)
    # … the two halves agree (the verdict is Y exactly where p(Y) > 0.5: reward > 0.75, or < 0.25) …
    assert all(r > 0.75 or r < 0.25 for r, _ in graded), [g for g in graded if 0.25 <= g[0] <= 0.75][:10]
    # … and they grade: right answers high, wrong ones low (the demo judge is not perfect: it was trained
    # on a sample of replies, and scores 100% on digits and three other replies, judge_train.json)
    wrong = [g for g in graded if (g[0] > 0.5) != g[1]]
    assert len(wrong) <= 0.01 * len(graded), wrong[:10]
    assert sum(right for _, right in graded) > 100
    # the judge server is a role of the run: its /metrics is a Prometheus target of kind judge
    targets = json.loads((run_dir / "prometheus_targets.json").read_text())
    assert [t["labels"]["kind"] for t in targets if t["labels"]["role"] == "judge0"] == ["judge"]
    assert "1 judge server(s) healthy" in out
    assert "reward = 0.5 × rule + 0.5 × judge" in (run_dir / "logs" / "rollout0.log").read_text()
