"""Built-in verifiable rewards keyed by `data_source`, like verl's `default_compute_score`.

    openai/gsm8k                         → gsm8k (answer after "####"; strict like verl, flexible = last number)
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500, math
                                         → math (last \\boxed{…}, light normalisation, numeric equality)
    exact, exact_match                   → exact match after stripping whitespace
    areal_like/demo                      → the demo task's scorer (areal_like/data/demo_task.py)
    anything else                        → exact match, with a warning once per data_source

All are pure functions on short strings (inputs are clipped), so they run in the rollout
worker's own process; only a user's custom function runs in isolated worker processes (fn.py).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from areal_like.data.demo_task import DEMO_DATA_SOURCE, demo_compute_score

logger = logging.getLogger(__name__)

# Regexes on very long completions are slow; the answer is at the end (verl clips to 300 chars too).
_CLIP_CHARS = 300

_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


def gsm8k_extract(solution_str: str, method: str = "strict") -> str | None:
    """The final answer: after the last "#### " (strict), or the last number in the text (flexible)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method {method!r}: use 'strict' or 'flexible'")
    s = solution_str[-_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(s)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for cand in reversed(_NUMBER.findall(s)):
        if cand not in ("", ".", ",", "-"):
            return cand.replace(",", "")
    return None


def _num_equal(a: str, b: str) -> bool:
    a, b = a.strip().rstrip("."), b.strip().rstrip(".")
    if a == b:
        return True
    try:
        return abs(float(a) - float(b)) < 1e-9 * max(1.0, abs(float(b)))
    except ValueError:
        return False


def gsm8k_compute_score(solution_str: str, ground_truth: str, method: str = "strict",
                        format_score: float = 0.0, score: float = 1.0) -> float:
    ans = gsm8k_extract(solution_str, method)
    if ans is None:
        return 0.0
    return score if _num_equal(ans, str(ground_truth).replace(",", "")) else format_score


def last_boxed(s: str) -> str | None:
    """Content of the last \\boxed{…} (or \\fbox{…}, or "\\boxed x"), braces matched; None if absent."""
    idx = max(s.rfind("\\boxed"), s.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = s[idx:]
    if rest.startswith("\\boxed ") and "{" not in rest.split(" ", 1)[1][:1]:
        return rest[len("\\boxed "):].split("$")[0].strip()
    start = rest.find("{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[start + 1:i]
    return None


_TEXT = re.compile(r"\\text\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")


def normalize_math(s: str) -> str:
    """Light normalisation (a subset of verl's/Hendrycks' strip_string): enough for short answers."""
    s = s.strip().replace("\n", "").rstrip(".")
    s = s.replace("\\!", "").replace("\\left", "").replace("\\right", "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("%", "").replace("$", "")
    s = _TEXT.sub(r"\1", s)
    s = s.replace(" ", "")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    if s.startswith("0.") is False and s.startswith("."):
        s = "0" + s
    if re.fullmatch(r"[a-zA-Z]=.+", s):  # "x=5" → "5"
        s = s.split("=", 1)[1]
    return s


def math_compute_score(solution_str: str, ground_truth: str) -> float:
    pred = last_boxed(solution_str[-_CLIP_CHARS * 4:])
    if pred is None:
        return 0.0
    gt = last_boxed(ground_truth) or ground_truth
    a, b = normalize_math(pred), normalize_math(gt)
    return 1.0 if a == b or _num_equal(a, b) else 0.0


def exact_match_score(solution_str: str, ground_truth: str) -> float:
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


ScoreFn = Callable[[str, str, "dict[str, Any] | None"], float]

BUILTIN_REWARDS: dict[str, ScoreFn] = {
    "openai/gsm8k": lambda s, gt, ei: gsm8k_compute_score(s, gt),
    "gsm8k": lambda s, gt, ei: gsm8k_compute_score(s, gt),
    "lighteval/MATH": lambda s, gt, ei: math_compute_score(s, gt),
    "DigitalLearningGmbH/MATH-lighteval": lambda s, gt, ei: math_compute_score(s, gt),
    "HuggingFaceH4/MATH-500": lambda s, gt, ei: math_compute_score(s, gt),
    "math": lambda s, gt, ei: math_compute_score(s, gt),
    "exact": lambda s, gt, ei: exact_match_score(s, gt),
    "exact_match": lambda s, gt, ei: exact_match_score(s, gt),
    DEMO_DATA_SOURCE: lambda s, gt, ei: demo_compute_score(s, gt),
}

_warned_sources: set[str] = set()


def default_compute_score(data_source: str, solution_str: str, ground_truth: str,
                          extra_info: dict[str, Any] | None = None) -> float:
    """verl's signature; unknown data sources fall back to exact match (warned once per source)."""
    fn = BUILTIN_REWARDS.get(data_source)
    if fn is None:
        if data_source not in _warned_sources:
            _warned_sources.add(data_source)
            logger.warning("no built-in reward for data_source %r: using exact match; set "
                           "custom_reward_function.path to score it your way", data_source)
        return exact_match_score(solution_str, ground_truth)
    return float(fn(solution_str, ground_truth, extra_info))
