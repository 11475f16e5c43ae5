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
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.max_completions_per_episode=0: must be ≥ 1"):
        load_config(None, ["rollout.multi_turn.max_completions_per_episode=0"])
    assert load_config(None, ["rollout.multi_turn.max_completions_per_episode=7"]).rollout.multi_turn \
        .max_completions_per_episode == 7


def test_restart_budgets_per_role(tmp_path):
    cfg = load_config(None, ["launcher.max_restarts.server=5", "train.save_freq=2"])
    b = cfg.launcher.max_restarts
    assert (b.learner, b.server, b.rollout, b.redis) == (0, 5, 3, 3)  # the others keep their defaults
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  save_freq: 1\nlauncher:\n  max_learner_restarts: 2\n  max_restarts:\n    redis: 0\n")
    b = load_config(str(f)).launcher.max_restarts  # this project's earlier key still means the learner's budget
    assert (b.learner, b.redis) == (2, 0)
    with pytest.raises(ConfigError, match=r"launcher.max_restarts.rollout=-1: use 0"):
        load_config(None, ["launcher.max_restarts.rollout=-1"])
    with pytest.raises(ConfigError, match="launcher.max_restarts.learner needs checkpoints.*train.save_freq"):
        load_config(None, ["launcher.max_restarts.learner=1", "train.save_freq=0"])
    with pytest.raises(ConfigError, match="max_restarts"):
        load_config(None, ["launcher.max_restarts.workers=1"])  # unknown role: named


def test_routing_replay_off_survives_yamls_boolean_reading(tmp_path):
    """`train.routing_replay: off` — YAML 1.1 reads a bare `off` as false; the option is the string "off",
    from the file and from an override alike; a typo is refused naming the choices."""
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  routing_replay: off\n")
    assert load_config(str(p)).train.routing_replay == "off"
    assert load_config(None, ["train.routing_replay=off"]).train.routing_replay == "off"
    assert load_config(None, ["train.routing_replay=rollout"]).train.routing_replay == "rollout"
    with pytest.raises(ConfigError, match="routing_replay"):
        load_config(None, ["train.routing_replay=r3"])
