"""`launcher tune` end to end: two real `launcher run`s (η = 0 and η = 2) on the demo assets, then
tune.md, tune.png and the printed recommendation; each run's summary.json carries the generation
servers' busy fraction scraped before they ended."""

from __future__ import annotations

import json
import re

import pytest
from conftest import launcher_finish, launcher_spawn

pytestmark = pytest.mark.integration


def test_tune_two_etas_writes_table_figure_and_recommendation(tmp_path, demo_assets):
    model, data = demo_assets
    out = tmp_path / "tune"
    steps = 8
    proc = launcher_spawn("tune", "--config", "configs/demo.yaml", "--eta", "0,2", "--steps", str(steps),
                          "--out", str(out), f"model.path={model}", f"data.train_files=[{data}]",
                          "data.val_files=[]", "train.test_freq=0", "train.batch_size=4", "generation.n=4")
    rc, text = launcher_finish(proc, timeout=240)
    assert rc == 0, text[-4000:]
    rec = re.search(r"^recommended η: (\d+) \(", text, re.M)
    assert rec, text[-2000:]
    assert int(rec.group(1)) in (0, 2)

    md = (out / "tune.md").read_text()
    for eta in (0, 2):
        assert re.search(rf"^\| {eta} \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| \d+ \| \d+", md, re.M), md
    assert f"**recommended η: {rec.group(1)} (" in md
    assert "Reference: η = 0." in md and "within noise" in md
    assert (out / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    for eta in (0, 2):
        run = out / f"eta{eta}"
        summary = json.loads((run / "summary.json").read_text())
        assert summary["steps"] == steps and summary["max_staleness"] == eta
        assert 0 <= summary["max_staleness_observed"] <= eta
        gen = summary["generation"]
        assert gen["servers_scraped"] == 1
        assert 0 < gen["busy_fraction"] <= 1, gen
        assert isinstance(gen["gate_refusals"], int)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert len(rows) == steps and all(isinstance(r["time"], float) for r in rows)
        assert all(a["time"] <= b["time"] for a, b in zip(rows, rows[1:]))
