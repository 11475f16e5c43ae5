import os

import pytest

from areal_like.api.config import ConfigError, decode_config, encode_config, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_config_loads_and_round_trips():
    cfg = load_config(os.path.join(ROOT, "configs/demo.yaml"))
    assert decode_config(encode_config(cfg)) == cfg


def test_overrides_and_areal_aliases(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("max_head_offpolicyness: 3\nactor:\n  optimizer:\n    lr: 0.5\n")
    cfg = load_config(str(f), ["data.train_files=[a.parquet,b.parquet]", "generation.n=2", "train.lr=1e-4"])
    assert cfg.rollout.max_staleness == 3
    assert cfg.train.lr == pytest.approx(1e-4)  # the override wins over the file
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.generation.n == 2
    assert load_config(None, ["max_head_offpolicyness=0"]).rollout.max_staleness == 0


def test_unknown_key_names_key_and_file(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(f))
    assert "lrr" in str(e.value) and "bad.yaml" in str(e.value) and "train" in str(e.value)


def test_wrong_type_and_bad_values_name_the_setting():
    with pytest.raises(ConfigError, match="train.lr"):
        load_config(None, ["train.lr=fast"])
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        load_config(None, ["rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("no/such/file.yaml")
