"""Resume without waste: running the same command on the same run dir continues the rollout workers'
group numbers and prompt order, so no group is generated only to be discarded as already trained."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_rerun_continues_and_discards_no_group(tmp_path, run_launcher):
    run_dir = tmp_path / "run"
    common = ("train.batch_size=2", "generation.n=4", "train.save_freq=2", "train.test_freq=0")
    rc, out = run_launcher(run_dir, "train.total_steps=4", *common)
    assert rc == 0, out[-4000:]
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["buffer"]["duplicates"] == 0
    trained_first = [g for ln in (run_dir / "trained.jsonl").read_text().splitlines()
                     for g in json.loads(ln).get("groups", [])]

    rc, out = run_launcher(run_dir, "train.total_steps=8", *common)  # the same run dir: resume
    assert rc == 0, out[-4000:]
    second = json.loads((run_dir / "summary.json").read_text())
    assert second["steps"] == 8 and second["exit_reason"] == "completed"
    assert second["buffer"]["duplicates"] == 0, second  # nothing regenerated and discarded
    log = (run_dir / "logs" / "rollout0.log").read_text()
    assert "resuming at group w0-" in log, log[-2000:]
    trained = [g for ln in (run_dir / "trained.jsonl").read_text().splitlines()
               for g in json.loads(ln).get("groups", [])]
    assert len(trained) == len(set(trained)) == 8 * 2  # every step's groups, none twice
    assert set(trained_first) < set(trained)
