"""Validation during training, pure parts: mean@k / pass@k aggregation, the config checks and
aliases, the Prometheus gauge's key parsing, and the demo validation parquet."""

import pytest

from areal_like import metrics as M
from areal_like.api.config import ConfigError, load_config
from areal_like.rollout.evaluator import aggregate


def test_aggregate_mean_and_pass_per_data_source_and_all():
    samples = [
        # gsm8k: p1 has one right of 4 (passes), p2 none right
        ("gsm8k", "p1", 1.0), ("gsm8k", "p1", 0.0), ("gsm8k", "p1", 0.0), ("gsm8k", "p1", 0.0),
        ("gsm8k", "p2", 0.0), ("gsm8k", "p2", 0.0), ("gsm8k", "p2", 0.0), ("gsm8k", "p2", 0.0),
        # math: q1 all right; partial credit 0.5 never passes at threshold 1.0
        ("math", "q1", 1.0), ("math", "q1", 1.0), ("math", "q1", 1.0), ("math", "q1", 1.0),
        ("math", "q2", 0.5), ("math", "q2", 0.5), ("math", "q2", 0.0), ("math", "q2", 0.5),
    ]
    out = aggregate(samples, n=4, pass_threshold=1.0)
    assert out["val/gsm8k/mean@4"] == pytest.approx(1 / 8)
    assert out["val/gsm8k/pass@4"] == pytest.approx(0.5)
    assert out["val/math/mean@4"] == pytest.approx((1.0 + 1.5 / 4) / 2)
    assert out["val/math/pass@4"] == pytest.approx(0.5)
    assert out["val/all/mean@4"] == pytest.approx((0.25 + 0 + 1 + 0.375) / 4)
    assert out["val/all/pass@4"] == pytest.approx(0.5)
    assert set(out) == {f"val/{d}/{m}@4" for d in ("gsm8k", "math", "all") for m in ("mean", "pass")}
    # the threshold decides what passes
    assert aggregate(samples, n=4, pass_threshold=0.5)["val/math/pass@4"] == 1.0


def test_aggregate_all_wrong_data_source_and_empty_input():
    out = aggregate([("a", "x", 0.0), ("a", "x", 0.0), ("b", "y", 1.0), ("b", "y", 0.0)], n=2)
    assert out["val/a/mean@2"] == 0.0 and out["val/a/pass@2"] == 0.0
    assert out["val/b/mean@2"] == 0.5 and out["val/b/pass@2"] == 1.0
    assert out["val/all/mean@2"] == 0.25 and out["val/all/pass@2"] == 0.5
    assert aggregate([], n=4) == {}


def test_aggregate_uneven_samples_weight_prompts_equally():
    # a prompt that lost samples (failed generations) still counts once in mean@k
    out = aggregate([("d", "p", 1.0), ("d", "q", 0.0), ("d", "q", 0.0), ("d", "q", 0.0)], n=3)
    assert out["val/d/mean@3"] == pytest.approx(0.5)


def test_eval_config_defaults_and_verl_aliases():
    cfg = load_config(None)
    assert cfg.data.val_files == [] and cfg.train.test_freq == 0 and not cfg.train.val_before_train
    assert (cfg.eval.n, cfg.eval.max_new_tokens, cfg.eval.pass_threshold) == (4, None, 1.0)
    cfg = load_config(None, ["trainer.test_freq=5", "trainer.val_before_train=true", "data.val_files=[v.parquet]",
                             "actor_rollout_ref.rollout.val_kwargs.n=3",
                             "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
                             "actor_rollout_ref.rollout.val_kwargs.top_p=0.9"])
    assert cfg.train.test_freq == 5 and cfg.train.val_before_train
    assert (cfg.eval.n, cfg.eval.temperature, cfg.eval.top_p) == (3, 0.6, 0.9)


def test_eval_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"data\.val_files"):
        load_config(None, ["train.test_freq=2"])
    with pytest.raises(ConfigError, match=r"data\.val_files"):
        load_config(None, ["train.val_before_train=true"])
    with pytest.raises(ConfigError, match=r"train\.test_freq"):
        load_config(None, ["train.test_freq=-1"])
    with pytest.raises(ConfigError, match=r"eval\.n"):
        load_config(None, ["eval.n=0"])
    with pytest.raises(ConfigError, match=r"eval"):
        load_config(None, ["eval.nn=2"])  # unknown field in the new section
    load_config(None, ["train.test_freq=2", "data.val_files=[v.parquet]"])  # fine together


def test_set_val_metrics_parses_data_source_with_slashes():
    M.set_val_metrics({"val/areal_like/demo/mean@4": 0.25, "val/all/pass@4": 0.5, "val/version": 6.0,
                       "reward_mean": 9.0})
    get = M.REGISTRY.get_sample_value
    assert get("areal_like_val_score", {"data_source": "areal_like/demo", "metric": "mean@4"}) == 0.25
    assert get("areal_like_val_score", {"data_source": "all", "metric": "pass@4"}) == 0.5
    assert get("areal_like_val_score", {"data_source": "_", "metric": "version"}) == 6.0


def test_demo_validation_parquet_is_built_beside_and_distinct(tmp_path):
    from areal_like.data.dataset import read_verl_parquet
    from areal_like.data.demo_task import ensure_demo_assets

    train, val = tmp_path / "t.parquet", tmp_path / "v.parquet"
    ensure_demo_assets(None, str(train), n_train=32)
    ensure_demo_assets(None, None, val_file=str(val))  # the signature old callers use still works
    rows_t, rows_v = read_verl_parquet(str(train)), read_verl_parquet(str(val))
    assert len(rows_v) == 32
    assert {r["extra_info"]["split"] for r in rows_v} == {"val"}
    assert [r["prompt"] for r in rows_v] != [r["prompt"] for r in rows_t]
    mtime = val.stat().st_mtime_ns
    ensure_demo_assets(None, None, val_file=str(val))  # idempotent
    assert val.stat().st_mtime_ns == mtime
