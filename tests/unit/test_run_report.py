"""The run report (areal_like/metrics/report.py) on synthetic run directories: a finished run (summary.json,
config.json), one cut off mid-write (partial metrics.jsonl, no summary), rows that carry the optional
busy-fraction and buffer keys, and a learner restart that redid steps. `launcher report` on a real
run: tests/integration/test_trackers_report.py."""

from __future__ import annotations

import base64
import json
import os
import re

from areal_like.api.run_files import StepMetrics
from areal_like.metrics.report import load_run, time_axis, write_report

PNG = b"\x89PNG\r\n\x1a\n"


def _rows(n: int, *, incarnation: int = 0, start: int = 1, **extra) -> list[dict]:
    rows = []
    for s in range(start, start + n):
        val = {"val/all/mean@4": s / (n + start), "val/all/pass@4": 1.0, "val/version": s, "val/step": s} \
            if s % 3 == 0 else {}
        m = StepMetrics.from_row(dict(
            step=s, version=s, reward_mean=s / (n + start), staleness_max=s % 2, dropped_stale=int(s == 4),
            filtered=0, samples=16, step_s=0.05, push_s=0.02, pause_window_s=0.01, fetch_s=0.03, loss=0.1,
            grad_norm=1.0, clipfrac=0.0, approx_kl=0.0, behav_w_max=1.0, loss_tokens=16, skipped=False,
            incarnation=incarnation, val=val))
        rows.append({**m.to_row(), **extra})
    return rows


def _write(run_dir, rows, *, summary=None, config=None, tail: str = ""):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write(tail)
    if summary is not None:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f)
    if config is not None:
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(config, f)


def _images(html: str) -> dict[str, bytes]:
    """data-file → decoded PNG of every inline image."""
    out = {}
    for src, name in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"[^>]*data-file="([^"]+)"', html):
        out[name] = base64.b64decode(src)
    assert html.count("<img ") == len(out)
    return out


def _notes(html: str) -> dict[str, str]:
    return dict(re.findall(r'<h2 id="(\w+)">[^<]*</h2>\n<p class="note">([^<]*)</p>', html))


def test_finished_run(tmp_path):
    run = tmp_path / "run"
    _write(run, _rows(12), summary={"steps": 12, "final_version": 12, "samples_per_s": 150.0, "max_staleness": 1,
                                    "exit_reason": "completed", "buffer": {"dropped": {"stale": 1}}},
           config={"allocation": "embedded.d1p1t1+d1p1t1", "rollout": {"max_staleness": 2},
                   "train": {"batch_size": 2, "total_steps": 12}, "generation": {"n": 8}})
    path = write_report(str(run))
    assert path == str(run / "report.html")
    html = open(path, encoding="utf-8").read()
    images = _images(html)
    assert set(images) == {f"report/{n}.png" for n in ("reward", "validation", "samples_per_s", "staleness",
                                                      "seconds", "drops", "training")}
    for name, png in images.items():  # inline and on disk: the same PNG
        assert png.startswith(PNG)
        assert (run / name).read_bytes() == png
    assert "completed" in html and "η (rollout.max_staleness)" in html
    notes = _notes(html)
    # not in these rows: said so, no figure made up
    assert set(notes) == {"gen_busy_fraction", "buffer_depth"}, notes
    assert "Prometheus" in notes["gen_busy_fraction"] and "buffer_depth" in notes["buffer_depth"]
    assert load_run(str(run)).eta == 2  # config.json first


def test_partial_run_without_summary_and_a_cut_off_line(tmp_path):
    run = tmp_path / "run"
    _write(run, _rows(5), tail='{"step": 6, "version": 6, "rew')  # the learner was writing step 6
    html = open(write_report(str(run)), encoding="utf-8").read()
    assert ("No summary.json: the run is still going or was cut off. 5 step(s) recorded so far, the last is "
            "step 5") in html
    assert "1 line(s) of metrics.jsonl are not complete JSON rows" in html
    assert "No readable config.json" in html
    images = _images(html)
    assert "report/reward.png" in images and "report/staleness.png" in images
    assert "η is unknown" in html
    # the run goes on: the next report sees the new rows and the figure it can now make
    _write(run, _rows(8, start=1, buffer_depth=3, buffer_pending=1),
           summary={"steps": 8, "max_staleness": 1, "exit_reason": "completed"})
    html = open(write_report(str(run)), encoding="utf-8").read()
    assert "report/buffer_depth.png" in _images(html) and (run / "report" / "buffer_depth.png").exists()
    assert "No summary.json" not in html and load_run(str(run)).eta == 1


def test_optional_keys_restarts_and_empty_runs(tmp_path):
    run = tmp_path / "run"
    # incarnation 0 wrote steps 1..6, died; incarnation 1 resumed from the step-4 checkpoint and redid 5, 6
    rows = _rows(6, gen_busy_fraction=0.8) + _rows(4, start=5, incarnation=1, gen_busy_fraction=0.6)
    _write(run, rows)
    data = load_run(str(run))
    assert [r["step"] for r in data.rows] == list(range(1, 9))
    assert [r["incarnation"] for r in data.rows] == [0, 0, 0, 0, 1, 1, 1, 1]  # the redone steps replace
    t, label = time_axis(data.rows)
    assert t[0] > 0 and all(b > a for a, b in zip(t, t[1:])) and "Σ fetch + train + push" in label
    html = open(write_report(str(run)), encoding="utf-8").read()
    assert "report/gen_busy_fraction.png" in _images(html)
    assert (run / "report" / "gen_busy_fraction.png").exists()
    # rows with their own timestamps: a real wall-time axis
    t, label = time_axis([{**r, "time": 1000.0 + 2 * i} for i, r in enumerate(data.rows)])
    assert label == "wall time (s)" and t[1] - t[0] == 2.0
    # a run dir before the learner's first row: a report of notes, no crash
    empty = tmp_path / "empty"
    empty.mkdir()
    html = open(write_report(str(empty)), encoding="utf-8").read()
    assert "<img " not in html and "No step recorded yet" in html


def test_a_nan_staleness_row_is_skipped_not_fatal(tmp_path):
    """A row whose staleness_max is NaN (json writes NaN) must not cost the whole report."""
    run = tmp_path / "run"
    rows = _rows(4)
    rows[1]["staleness_max"] = float("nan")
    _write(run, rows)
    html = open(write_report(str(run)), encoding="utf-8").read()
    assert "report/staleness.png" in _images(html)
