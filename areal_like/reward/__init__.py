"""Verifiable rewards: built-ins keyed by data_source, a user's custom function, and `RewardFn`
(timeouts, process isolation for custom functions). See fn.py for what runs where."""

from areal_like.reward.builtin import (
    BUILTIN_REWARDS,
    default_compute_score,
    exact_match_score,
    gsm8k_compute_score,
    gsm8k_extract,
    last_boxed,
    math_compute_score,
)
from areal_like.reward.custom import load_custom_reward, to_score
from areal_like.reward.fn import RewardFn

__all__ = [
    "BUILTIN_REWARDS", "RewardFn", "default_compute_score", "exact_match_score", "gsm8k_compute_score",
    "gsm8k_extract", "last_boxed", "load_custom_reward", "math_compute_score", "to_score",
]
