"""Validation during training, end to end: a real `launcher run` of configs/demo.yaml with
`data.val_files` and `train.test_freq` — real redis-server, embedded server, learner and rollout processes.

Every test_freq steps the weights pushed after that step are evaluated by rollout worker 0 while the
servers hold exactly that version; the results (`val/…`) land in metrics.jsonl.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.integration


def test_validation_metrics_every_test_freq_steps(tmp_path, run_launcher):
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, "train.total_steps=6", "train.test_freq=2", "train.batch_size=2",
                           "data.val_files=[demo:next-digit-val]", "generation.n=4", "train.val_before_train=true")
    assert rc == 0, out[-4000:]
    val = json.loads((run_dir / "config.json").read_text())["data"]["val_files"][0]
    assert val.startswith(os.environ["AREAL_LIKE_CACHE"]) and os.path.isfile(val)  # the demo name, resolved
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    val_rows = [r for r in rows if "val/all/mean@4" in r]
    # version 0 (val_before_train) in step 1's row; the versions pushed after steps 2, 4, 6 each in
    # the row of the step that produced it
    assert [r["step"] for r in val_rows] == [1, 2, 4, 6], out[-3000:]
    assert [r["val/version"] for r in val_rows] == [0, 2, 4, 6]
    assert [r["val/step"] for r in val_rows] == [0, 2, 4, 6]
    for r in val_rows:
        for key in ("val/all/pass@4", "val/areal_like/demo/mean@4", "val/areal_like/demo/pass@4"):
            assert 0.0 <= r[key] <= 1.0, (key, r)
        assert r["val/samples"] == 32 * 4  # every prompt of the demo validation set, eval.n = 4 each
        assert r["val/version_mismatch_tokens"] == 0  # the servers held the requested version throughout
    assert sum(1 for r in rows for k in r if k == "val/version") == 4  # no other row carries validation
    log = (run_dir / "logs" / "rollout0.log").read_text()
    assert log.count("validated version") == 4, log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["steps"] == 6
