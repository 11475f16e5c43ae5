"""Issue 41 item 1: a learner statistic is one field of `TrainStats` / `PushResult` (api/step_stats.py) and its
computation. Walks every field from the typed result to the four places it is published — the
metrics.jsonl row, the trackers' names, the Prometheus series, docs/metrics.md — so a field added
without its way out fails here, and nothing computed is dropped without a stated reason."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from areal_like import metrics as M
from areal_like.api.run_files import PUSH_FIELDS, RUN_FIELDS, TRAIN_FIELDS, StepMetrics
from areal_like.api.step_stats import PushResult, TrainStats
from areal_like.metrics.loggers import NOT_LOGGED, namespaced

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _distinct(fields, cls):
    """An instance whose every field holds its own recognisable value."""
    values = {}
    for i, f in enumerate(fields):
        t = f.type
        values[f.name] = (True if t == "bool" else f"s{i}" if t.startswith("str") else 100 + i if t.startswith("int")
                          else 1000.5 + i)
    return cls(**values), values


def _sample(name: str, labels: dict | None = None) -> float | None:
    return M.REGISTRY.get_sample_value(name, labels or {})


def test_every_field_reaches_the_row_the_trackers_and_its_series():
    stats, tv = _distinct(TRAIN_FIELDS, TrainStats)
    push, pv = _distinct(PUSH_FIELDS, PushResult)
    row = StepMetrics(step=7, version=7, train=stats, push=push).to_row()
    json.loads(json.dumps(row))  # the line metrics.jsonl gets
    tracked = namespaced(row)
    before = {f.name: _sample(f.prom.name + ("_total" if f.prom.kind == "counter" else "")
                              + ("_count" if f.prom.kind == "histogram" else ""),
                              dict([f.prom.label]) if f.prom.label else None) or 0.0
              for f in TRAIN_FIELDS if f.prom is not None}
    M.observe_train(stats)
    for fields, values in ((TRAIN_FIELDS, tv), (PUSH_FIELDS, pv)):
        for f in fields:
            v = values[f.name]
            if f.row is None:  # kept out of the row: its description says why
                assert f.row not in row and "Not in the row" in f.doc, f.name
                continue
            assert row[f.row] == v, (f.name, f.row)
            if f.tracker is None:
                assert f.row in NOT_LOGGED or not isinstance(v, (int, float)), f.name
            else:
                assert tracked[f.tracker] == float(v), (f.name, f.tracker)
            if f.prom is not None:
                labels = dict([f.prom.label]) if f.prom.label else None
                if f.prom.kind == "gauge":
                    assert _sample(f.prom.name, labels) == v, f.name
                elif f.prom.kind == "counter":
                    assert _sample(f.prom.name + "_total", labels) == before[f.name] + v, f.name
                else:
                    assert _sample(f.prom.name + "_count", labels) == before[f.name] + 1, f.name
                    assert _sample(f.prom.name + "_sum", labels) >= v, f.name


def test_a_row_round_trips_and_old_held_rows_still_load():
    stats, _ = _distinct(TRAIN_FIELDS, TrainStats)
    m = StepMetrics(step=3, version=3, staleness_mean=0.5, train=stats, push=PushResult(push_s=0.5, bytes=12),
                    val={"val/all/mean@4": 0.5}, reward_failures={"timeout": 2})
    back = StepMetrics.from_row(json.loads(json.dumps(m.to_row())))
    assert back.to_row() == m.to_row()
    # a checkpoint's held row from before TrainStats: flat, with nested val / reward_failures
    old = {"step": 4, "version": 4, "reward_mean": 0.25, "staleness_max": 1, "dropped_stale": 0, "samples": 8,
           "step_s": 0.1, "push_s": 0.2, "push_bytes": 99, "fetch_s": 0.0, "loss": -0.5, "grad_norm": 1.0,
           "clipfrac": 0.0, "approx_kl": 0.0, "behav_w_max": 1.0, "loss_tokens": 8, "skipped": False,
           "incarnation": 1, "reward_failures": {"timeout": 1}, "val": {"val/all/mean@4": 0.75}}
    m = StepMetrics.from_row(old)
    assert (m.train.reward_mean, m.train.num_samples, m.push.bytes, m.incarnation) == (0.25, 8, 99, 1)
    assert m.val == {"val/all/mean@4": 0.75} and m.reward_failures == {"timeout": 1}
    assert math.isnan(m.train.lr)  # not measured then


def test_row_keys_are_unique_and_trackers_too():
    rows = [f.row for f in RUN_FIELDS + TRAIN_FIELDS + PUSH_FIELDS if f.row is not None]
    assert len(rows) == len(set(rows))
    trackers = [f.tracker for f in RUN_FIELDS + TRAIN_FIELDS + PUSH_FIELDS if f.tracker is not None]
    assert len(trackers) == len(set(trackers))
    assert all(t.split("/")[0] in ("train", "rollout", "perf", "val") for t in trackers)


def test_the_trainer_returns_every_field():
    """`Trainer.train_step` sets each TrainStats field (none is left at a default by omission)."""
    import ast

    src = open(os.path.join(ROOT, "areal_like", "learner", "trainer.py"), encoding="utf-8").read()
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)
             and getattr(n.func, "id", None) == "TrainStats"]
    assert len(calls) == 1
    given = {k.arg for k in calls[0].keywords if k.arg}
    spread = next(k.value for k in calls[0].keywords if k.arg is None)  # **{k: st[k] for k in (...)}
    given |= {e.value for e in spread.generators[0].iter.elts}
    assert given == set(TrainStats.__struct_fields__)


def test_docs_metrics_md_is_generated_from_the_fields():
    spec = importlib.util.spec_from_file_location("gen_metrics_doc", os.path.join(ROOT, "scripts", "gen_metrics_doc.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8") as f:
        committed = f.read()
    assert committed == mod.render(), "docs/metrics.md is stale: run `.venv/bin/python scripts/gen_metrics_doc.py`"
    for f in RUN_FIELDS + TRAIN_FIELDS + PUSH_FIELDS:
        assert f"`{f.name}`" in committed


@pytest.mark.parametrize("cls", [TrainStats, PushResult])
def test_a_field_without_its_annotation_is_refused(cls):
    from typing import Annotated  # noqa: F401  (the subclass's annotations resolve in this module)

    from areal_like.api.step_stats import published_fields

    class Extra(cls, kw_only=True):
        new_stat: float = 0.0

    with pytest.raises(TypeError, match=r"Extra\.new_stat has no published\(\.\.\.\) annotation"):
        published_fields(Extra)
