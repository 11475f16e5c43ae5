"""Verifiable rewards: built-ins keyed by data_source, a user's custom function, and `RewardFn`
(timeouts and a pool of worker processes for every built-in but the demo's and for custom functions).
See fn.py for what runs where and builtin.py for the data_source table.

The names below are imported on first use (PEP 562): a reward worker process imports
`areal_like.reward.builtin` alone, and must not pay for fn.py's imports (Redis client, numpy,
Prometheus — ~0.4 s) at every start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from areal_like._lazy import lazy_exports

_EXPORTS = {
    "BUILTIN_REWARDS": "builtin", "default_compute_score": "builtin", "exact_match_score": "builtin",
    "gsm8k_compute_score": "builtin", "gsm8k_extract": "builtin",
    "last_boxed": "math_score", "math_compute_score": "math_score",
    "qa_em_score": "qa", "qa_f1_score": "qa", "search_r1_score": "qa",
    "load_custom_reward": "custom", "to_score": "custom",
    "RewardFn": "fn",
}

__all__ = [  # literal, for linters; a test checks it equals _EXPORTS
    "BUILTIN_REWARDS", "RewardFn", "default_compute_score", "exact_match_score", "gsm8k_compute_score",
    "gsm8k_extract", "last_boxed", "load_custom_reward", "math_compute_score", "qa_em_score", "qa_f1_score",
    "search_r1_score",
    "to_score",
]

if TYPE_CHECKING:
    from areal_like.reward.builtin import (
        BUILTIN_REWARDS, default_compute_score, exact_match_score, gsm8k_compute_score, gsm8k_extract)
    from areal_like.reward.custom import load_custom_reward, to_score
    from areal_like.reward.fn import RewardFn
    from areal_like.reward.math_score import last_boxed, math_compute_score
    from areal_like.reward.qa import qa_em_score, qa_f1_score, search_r1_score


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
