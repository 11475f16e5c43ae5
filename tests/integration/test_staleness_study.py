"""examples/staleness_study.py end to end at toy size: two real `launcher tune`s side by side (decoupled
PPO and standard PPO, η = 1), each a real `launcher run` of configs/staleness_study.yaml on the
`demo:first-digit` task built in the test cache; then study.md, the figure and the last line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_study_runs_both_losses_and_writes_table_and_figure(tmp_path):
    out, fig = tmp_path / "study", tmp_path / "docs" / "study.png"
    steps = 4
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "staleness_study.py"), "--eta", "1",
                           "--steps", str(steps), "--seeds", "7", "--jobs", "2", "--last", "2", "--out", str(out),
                           "--figure", str(fig), "train.batch_size=2", "generation.n=4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    logs = "".join(p.read_text()[-3000:] for p in out.glob("*.log")) if out.exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + logs
    assert re.search(r"^staleness_study: mean reward over the run at η=1: recompute [0-9.]+, behaviour [0-9.]+$",
                     proc.stdout.splitlines()[-1]), proc.stdout[-1000:]
    md = (out / "study.md").read_text()
    for mode in ("decoupled PPO (proximal=recompute)", "standard PPO (proximal=behaviour)"):
        assert re.search(rf"^\| {re.escape(mode)} \| 1 \| [0-9.]+ ± 0\.000 \| [0-9.]+ ± 0\.000 \| ", md, re.M), md
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for mode in ("recompute", "behaviour"):
        run = out / f"{mode}-seed7" / "eta1"
        cfg = json.loads((run / "config.json").read_text())
        assert cfg["train"]["proximal"] == mode and cfg["seed"] == cfg["train"]["seed"] == 7 and cfg["rollout"]["max_staleness"] == 1
        assert cfg["data"]["train_files"][0].endswith("first-digit-train.parquet")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, steps + 1))
        assert all(0 <= r["staleness_mean"] <= r["staleness_max"] <= 1 for r in rows)
        assert all(r["optimizer_steps"] == 4 for r in rows)  # ppo_minibatches: 4 from the study's config
        assert (out / f"{mode}-seed7" / "tune.md").exists()
