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


def to_score(value: Any) -> float:
    """A user function's result → float: float/int/bool, or a dict with "score". NaN/inf → error."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward function returned a dict without 'score': keys {sorted(value)}")
        value = value["score"]
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score
