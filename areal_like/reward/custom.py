"""Load a user's reward function from a Python file (verl's `custom_reward_function.path` + `.name`).

The function has verl's signature `compute_score(data_source, solution_str, ground_truth, extra_info)`
and returns a float, or a dict holding "score" (other keys are ignored here).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from typing import Any, Callable


def load_custom_reward(path: str, name: str = "compute_score") -> Callable[..., Any]:
    """Import `path` as a module (by file location, not by package name) and return its `name`."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom_reward_function.path={path!r} does not exist: point it at a .py file "
                                f"defining {name}(data_source, solution_str, ground_truth, extra_info)")
    mod_name = f"areal_like_custom_reward_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom_reward_function.path={path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(mod_name, None)
        raise ImportError(f"custom_reward_function.path={path!r} failed to import: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        have = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"custom_reward_function.path={path!r} defines no function {name!r} "
                             f"(callables there: {have}): set custom_reward_function.name=<one of them>")
    return fn


class ScoreError(ValueError):
    """A user function's result that is not a usable score; `kind` names the failure kind."""

    kind = "not_a_number"


class NotANumber(ScoreError):
    """The result is not a number (a string, None, a list, a dict without "score", …)."""

    kind = "not_a_number"


class NonFiniteScore(ScoreError):
    """The result is NaN or ±inf."""

    kind = "non_finite"


def to_score(value: Any) -> float:
    """A user function's result → float: float/int/bool (numpy/torch scalars too), or a dict with
    "score". A string (even "1.0"), None or anything float() refuses raises NotANumber; NaN/±inf
    raises NonFiniteScore (verl would fail on both when it writes the reward tensor)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise NotANumber(f"reward function returned a dict without 'score': keys {sorted(map(str, value))}")
        value = value["score"]
    if isinstance(value, (str, bytes, bytearray)) or value is None:
        raise NotANumber(f"reward function returned {type(value).__name__} {_short(value)}, not a number: "
                         "return a float (or a dict with a float 'score')")
    try:
        score = float(value)
    except (TypeError, ValueError) as e:
        raise NotANumber(f"reward function returned {type(value).__name__} {_short(value)}, not a number "
                         f"({type(e).__name__}: {e})") from None
    if not math.isfinite(score):
        raise NonFiniteScore(f"reward function returned a non-finite score {score}")
    return score


def _short(value: Any, n: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= n else r[: n - 1] + "…"
