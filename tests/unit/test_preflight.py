"""No silent fallbacks: every model and data path is checked before a run starts, demo names resolve
to the cache, and a path the user gives is never created (unit level; `launcher run` in
tests/integration/test_preflight_run.py)."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from areal_like.api.config import load_config
from launcher.preflight import PreflightError, resolve_and_check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cfg_with(*overrides):
    return load_config(os.path.join(ROOT, "configs/demo.yaml"), list(overrides))


def test_demo_names_resolve_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path / "cache"))
    cfg = cfg_with()
    resolve_and_check(cfg)
    assert cfg.model.path == str(tmp_path / "cache" / "demo" / "tiny-qwen2")
    assert os.path.isfile(os.path.join(cfg.model.path, "config.json"))
    assert cfg.data.train_files[0].startswith(str(tmp_path / "cache")) and os.path.isfile(cfg.data.train_files[0])
    assert cfg.data.val_files[0].startswith(str(tmp_path / "cache")) and os.path.isfile(cfg.data.val_files[0])
    with pytest.raises(PreflightError, match="demo:next-digit-val"):
        resolve_and_check(cfg_with("model.path=demo:tiny-llama"))  # the message lists the known names


@pytest.mark.parametrize("path,fix", [("Qwen/Qwen2.5-0.5B", "huggingface-cli download Qwen/Qwen2.5-0.5B"),
                                      ("/no/such/model_dir", "does not exist"),
                                      ("", "model.path is not set")])
def test_bad_model_path_is_refused_and_never_created(tmp_path, monkeypatch, path, fix):
    monkeypatch.chdir(tmp_path)
    cfg = cfg_with(f"model.path={path}" if path else "model.path=''")
    with pytest.raises(PreflightError, match="model.path") as e:
        resolve_and_check(cfg)
    assert fix in str(e.value)
    assert os.listdir(tmp_path) == []  # nothing built at the typo (or under ./Qwen)


def test_model_dir_without_config_or_tokenizer(tmp_path, demo_assets):
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match="no config.json"):
        resolve_and_check(cfg_with(f"model.path={tmp_path / 'empty'}"))
    model, _ = demo_assets
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(open(os.path.join(model, "config.json")).read())
    with pytest.raises(PreflightError, match="tokenizer"):
        resolve_and_check(cfg_with(f"model.path={bare}"))


def test_data_files_are_checked_for_existence_and_columns(tmp_path, demo_assets):
    model, data = demo_assets
    with pytest.raises(PreflightError, match=r"data.train_files\[1\]=.*missing.parquet does not exist"):
        resolve_and_check(cfg_with(f"model.path={model}", f"data.train_files=[{data},{tmp_path / 'missing.parquet'}]"))
    assert not (tmp_path / "missing.parquet").exists()
    wrong = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"question": ["1+1"], "reward_model": [{"ground_truth": "2"}]}), wrong)
    with pytest.raises(PreflightError, match=r"data.train_files\[0\].*no column 'prompt'.*data.prompt_key"):
        resolve_and_check(cfg_with(f"model.path={model}", f"data.train_files=[{wrong}]"))
    resolve_and_check(cfg_with(f"model.path={model}", f"data.train_files=[{wrong}]", "data.prompt_key=question",
                               "data.val_files=[]", "train.test_freq=0"))
    no_gt = tmp_path / "no_gt.parquet"
    pq.write_table(pa.table({"prompt": ["1+1"], "reward_model": [{"answer": "2"}]}), no_gt)
    with pytest.raises(PreflightError, match="ground_truth"):
        resolve_and_check(cfg_with(f"model.path={model}", f"data.val_files=[{no_gt}]"))
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_text("hello")
    with pytest.raises(PreflightError, match="not a parquet file"):
        resolve_and_check(cfg_with(f"model.path={model}", f"data.train_files=[{not_parquet}]"))
    with pytest.raises(PreflightError, match=r"data.train_files is empty"):
        resolve_and_check(cfg_with(f"model.path={model}", "data.train_files=[]"))
