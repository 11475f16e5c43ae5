"""The experiment trackers' one mapping (metrics.jsonl row → namespaced keys), the config they log
(secrets blanked), the `metrics.loggers` / `metrics.wandb.*` config keys, and that a failing tracker
never stops the learner. TensorBoard and W&B files of a real run: tests/integration/test_trackers_report.py."""

from __future__ import annotations

import math

import msgspec
import pytest

from areal_like.api.config import ConfigError, load_config
from areal_like.api.run_files import StepMetrics
from areal_like.metrics.loggers import (
    KEY_MAP,
    NAMESPACES,
    NOT_LOGGED,
    Logger,
    Loggers,
    loggable_config,
    make_loggers,
    namespaced,
)


def _row(**kw) -> StepMetrics:
    base = dict(step=3, version=3, reward_mean=0.5, staleness_max=1, dropped_stale=0, filtered=2, samples=32,
                step_s=0.5, push_s=0.25, pause_window_s=0.1, fetch_s=0.25, loss=-0.1, grad_norm=1.5, clipfrac=0.01,
                approx_kl=0.002, behav_w_min=0.9, behav_w_max=1.1, behav_tokens_capped=0, kl_ref=None,
                entropy=2.0, value_loss=None, adv_abs_mean=0.7, optimizer_steps=1, loss_tokens=100, skipped=False,
                incarnation=0, reward_failures={"timeout": 1, "exception": 0},
                val={"val/all/mean@4": 0.75, "val/areal_like/demo/pass@4": 1.0, "val/version": 3, "val/step": 3})
    base.update(kw)
    return StepMetrics.from_row(base)


def test_every_row_field_has_a_fixed_namespace():
    """Every field of the row names its tracker key or is listed as not logged (the annotations of
    api/step_stats.py and api/run_files.py; tests/unit/test_step_stats.py walks the values)."""
    from areal_like.api.run_files import row_fields

    for f in row_fields():
        if f.row is None or f.row in NOT_LOGGED or f.name in ("val", "reward_failures"):
            continue
        assert f.row in KEY_MAP, f"{f.name} has no tracker name: published(tracker=…) in its annotation"
        assert KEY_MAP[f.row].split("/")[0] in NAMESPACES


def test_namespaced_maps_a_full_row():
    out = namespaced(_row().to_row())
    assert "step" not in out and not any(k.startswith("other/") for k in out), out
    assert {k.split("/")[0] for k in out} <= set(NAMESPACES)
    assert out["train/loss"] == -0.1 and out["train/grad_norm"] == 1.5 and out["train/clipfrac"] == 0.01
    assert out["train/approx_kl"] == 0.002 and out["train/entropy"] == 2.0 and out["train/behav_w_max"] == 1.1
    assert out["train/version"] == 3.0 and out["train/skipped"] == 0.0
    assert out["rollout/reward_mean"] == 0.5 and out["rollout/samples"] == 32.0 and out["rollout/filtered"] == 2.0
    assert out["rollout/staleness_max"] == 1.0 and out["rollout/dropped_stale"] == 0.0
    assert out["rollout/reward_failures/timeout"] == 1.0
    assert out["perf/step_s"] == 0.5 and out["perf/push_s"] == 0.25 and out["perf/fetch_s"] == 0.25
    assert out["perf/pause_window_s"] == 0.1
    assert out["perf/samples_per_s"] == pytest.approx(32 / 1.0)  # samples / (fetch + step + push)
    assert out["perf/train_tokens_per_s"] == pytest.approx(100 / 0.5)
    # val/… keep their names (as metrics.jsonl and Prometheus name them)
    assert out["val/all/mean@4"] == 0.75 and out["val/areal_like/demo/pass@4"] == 1.0 and out["val/version"] == 3.0
    # None (no reference model, no critic) is left out, not logged as 0
    assert "train/kl_ref" not in out and "train/value_loss" not in out
    assert all(isinstance(v, float) for v in out.values())


def test_namespaced_buffer_nan_and_unknown_keys():
    row = {**_row(behav_w_min=float("nan"), pause_window_s=None).to_row(), "buffer_depth": 7, "buffer_pending": 2,
           "buffer_oldest_age_s": 1.5, "future_thing": 4, "note": "text"}
    out = namespaced(row)
    assert out["buffer/depth"] == 7.0 and out["buffer/pending"] == 2.0 and out["buffer/oldest_age_s"] == 1.5
    assert math.isnan(out["train/behav_w_min"])  # a statistic not computed stays NaN (faithful to the row)
    assert "perf/pause_window_s" not in out
    assert out["other/future_thing"] == 4.0  # not lost, but visibly outside the fixed namespaces
    assert "other/note" not in out and "note" not in out  # non-numeric values are not scalars


def test_namespaced_without_seconds_has_no_rates():
    out = namespaced({"step": 1, "samples": 4, "step_s": 0.0, "fetch_s": 0.0, "push_s": 0.0, "loss_tokens": 3})
    assert "perf/samples_per_s" not in out and "perf/train_tokens_per_s" not in out


def test_loggable_config_blanks_secrets():
    cfg = load_config(None, ["server.api_key=sk-123", "buffer.redis_url=redis://:hunter2@10.0.0.1:6379/0"])
    cfg.server.admin_api_key = "adm-456"
    out = loggable_config(cfg)
    text = msgspec.json.encode(out).decode()
    assert "sk-123" not in text and "adm-456" not in text and "hunter2" not in text
    assert out["server"]["api_key"] == "***" and out["server"]["admin_api_key"] == "***"
    assert out["buffer"]["redis_url"] == "redis://:***@10.0.0.1:6379/0"
    assert out["buffer"]["password_env"] == "AREAL_LIKE_REDIS_PASSWORD"  # a variable's name, not a secret
    assert out["rollout"]["max_staleness"] == cfg.rollout.max_staleness


def test_logger_config_keys():
    cfg = load_config(None)
    assert cfg.metrics.loggers == ["jsonl"] and cfg.metrics.wandb.mode == "online"
    cfg = load_config(None, ["metrics.loggers=[jsonl,tensorboard,wandb]", "metrics.wandb.mode=offline",
                             "metrics.wandb.project=p", "metrics.wandb.entity=team", "metrics.wandb.name=n"])
    assert cfg.metrics.loggers == ["jsonl", "tensorboard", "wandb"]
    w = cfg.metrics.wandb
    assert (w.mode, w.project, w.entity, w.name, w.dir) == ("offline", "p", "team", "n", None)
    with pytest.raises(ConfigError, match="metrics.loggers"):
        load_config(None, ["metrics.loggers=[tensorbord]"])
    with pytest.raises(ConfigError, match="metrics.wandb"):
        load_config(None, ["metrics.wandb.mode=sometimes"])


def test_jsonl_only_makes_no_tracker(tmp_path):
    cfg = load_config(None)
    lg = make_loggers(cfg, str(tmp_path))
    assert not lg and lg.loggers == []
    lg.log_row(_row().to_row())  # nothing to do, nothing written
    lg.close()
    assert list(tmp_path.iterdir()) == []


class _Recorder(Logger):
    name = "recorder"

    def __init__(self):
        self.seen: list[tuple[int, dict]] = []
        self.closed = False

    def log(self, step, values):
        self.seen.append((step, values))

    def close(self):
        self.closed = True


class _Broken(Logger):
    name = "broken"

    def log(self, step, values):
        raise OSError("disk full")


def test_a_failing_tracker_is_switched_off_not_fatal():
    errors: list[str] = []
    ok, bad = _Recorder(), _Broken()
    lg = Loggers([bad, ok], on_error=errors.append)
    lg.log_row(_row(step=1).to_row())
    lg.log_row(_row(step=2).to_row())
    assert [s for s, _ in ok.seen] == [1, 2]
    assert ok.seen[0][1] == namespaced(_row(step=1).to_row())  # every tracker gets the one mapping
    assert len(errors) == 1 and "broken" in errors[0] and "disk full" in errors[0] and "step 1" in errors[0]
    lg.close()
    assert ok.closed


def test_a_tracker_that_cannot_start_is_reported_and_left_out(tmp_path, monkeypatch):
    import areal_like.metrics.loggers as L

    def boom(*a, **kw):
        raise RuntimeError("no W&B login")

    monkeypatch.setattr(L, "WandbLogger", boom)
    errors: list[str] = []
    cfg = load_config(None, ["metrics.loggers=[wandb]"])
    lg = make_loggers(cfg, str(tmp_path), on_error=errors.append)
    assert not lg and len(errors) == 1 and "wandb" in errors[0] and "no W&B login" in errors[0]
