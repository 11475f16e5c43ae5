"""`train.stop_reward`: the rule the learner ends a run by and the launcher's summary names, and its keys'
errors. The run itself (a learns test ending at its criterion) is in tests/integration/test_lora_run.py,
test_colocated_run.py and test_learner_memory_run.py."""

import math

import pytest

from areal_like.api.config import ConfigError, load_config
from areal_like.api.run_files import reward_reached


def test_the_window_mean_must_reach_the_target():
    assert reward_reached([0.9] * 4, 0.8, 5) is None  # fewer steps than the window: never
    assert reward_reached([0.0] + [0.9] * 4, 0.8, 5) is None  # mean 0.72
    assert reward_reached([0.0] + [0.9] * 5, 0.8, 5) == pytest.approx(0.9)  # only the last 5 count
    assert reward_reached([0.8] * 5, 0.8, 5) == pytest.approx(0.8)  # reaching is enough
    assert reward_reached([1.0] * 4 + [math.nan], 0.8, 5) is None  # a NaN step does not end a run
    assert reward_reached([1.0] * 10, None, 5) is None  # off


def test_keys_default_off_and_bad_values_name_the_key():
    cfg = load_config(None, [])
    assert cfg.train.stop_reward is None and cfg.train.stop_reward_window == 5
    cfg = load_config(None, ["train.stop_reward=0.8", "train.stop_reward_window=3"])
    assert cfg.train.stop_reward == 0.8 and cfg.train.stop_reward_window == 3
    with pytest.raises(ConfigError, match=r"train\.stop_reward_window=0 must be ≥ 1"):
        load_config(None, ["train.stop_reward_window=0"])
    with pytest.raises(ConfigError, match=r"train\.stop_reward=nan must be a finite reward"):
        load_config(None, ["train.stop_reward=nan"])
