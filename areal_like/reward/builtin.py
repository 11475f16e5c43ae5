"""Built-in verifiable rewards keyed by `data_source`, like verl's `default_compute_score`.

    data_source                               scorer (module)        score
    openai/gsm8k, gsm8k                       gsm8k (here)           1 if the number after the last "#### " is
                                                                     right (numerically: "2000.0", "72." and
                                                                     "2,000" are 2000/72 — verl compares strings,
                                                                     forgiving commas only); reward.format_score
                                                                     if "#### <number>" is there but wrong; 0
                                                                     without "####"
    lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
    HuggingFaceH4/MATH-500                    math (math_score.py)   1 if the last \\boxed{…} is equivalent to
                                                                     the ground truth under math-verify, else 0
    math_dapo, math_dapo_reasoning, math,
    aime*                                     math (math_score.py)   the text after the last "Answer:" (DAPO's
                                                                     format; a \\boxed{} alone scores 0, as in
                                                                     verl), math-verify equivalence. 0/1, not
                                                                     verl's math_dapo ±1
    searchR1_nq, searchR1_triviaqa, searchR1_popqa, searchR1_hotpotqa, searchR1_2wikimultihopqa,
    searchR1_musique, searchR1_bamboogle      Search-R1 EM (qa.py)   verl's: 0 without <answer>…</answer>; 1 if
                                                                     the last one matches a target after SQuAD
                                                                     normalisation (÷ 4 beyond 10 tags);
                                                                     reward.format_score if it does not
    nq, triviaqa, popqa, hotpotqa, qa_em      QA exact match (qa.py) as Search-R1 EM, but a completion with no
                                                                     tag is scored as a whole
    qa_f1                                     QA token F1 (qa.py)    best SQuAD F1 over the targets, in [0, 1]
    code, codecontests, apps, codeforces,
    taco, primeintellect                      code (code.py)         code_compute_score(solution_str,
                                                                     ground_truth, extra_info): unit tests run
                                                                     in a sandbox (float or {"score": …})
    areal_like/arithmetic                     gsm8k, flexible (here) 1 if the LAST number in the reply equals the
                                                                     ground truth numerically (verl's gsm8k
                                                                     method="flexible"); reward.format_score if
                                                                     it is another number; 0 with no number
    exact, exact_match                        exact (here)           1 if equal after stripping whitespace
    areal_like/demo                           demo (data/demo_task)  1 / 0.5 / 0 (see demo_task.py)
    anything else                             exact (here)           as exact, with a warning once per source

Where they run is fn.py's business: every built-in but the demo's runs in RewardFn's pool of reward
worker processes under `custom_reward_function.timeout_s`, like a user's function (math-verify and
code execution can take arbitrarily long). Nothing here knows about processes or timeouts; scorers
are plain functions `(solution_str, ground_truth, extra_info, format_score) -> float | dict`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from areal_like.data.arithmetic import ARITHMETIC_DATA_SOURCE
from areal_like.data.demo_task import DEMO_DATA_SOURCE, demo_compute_score
from areal_like.reward.math_score import last_boxed, math_compute_score
from areal_like.reward.qa import qa_em_score, qa_f1_score, search_r1_score

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_REWARDS", "CODE_DATA_SOURCES", "builtin_scorer", "default_compute_score", "exact_match_score",
    "gsm8k_compute_score", "gsm8k_extract", "last_boxed", "math_compute_score",
]

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
    """verl's gsm8k scorer: `score` if right, `format_score` if an answer was extracted but is wrong."""
    ans = gsm8k_extract(solution_str, method)
    if ans is None:
        return 0.0
    return score if _num_equal(ans, str(ground_truth).replace(",", "")) else format_score


def exact_match_score(solution_str: str, ground_truth: str) -> float:
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def code_score(solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None) -> Any:
    # Imported on use: the sandbox module is optional for every other data source (and heavier).
    from areal_like.reward.code import code_compute_score

    return code_compute_score(solution_str, ground_truth, extra_info)


ScoreFn = Callable[[str, Any, "dict[str, Any] | None", float], Any]
"""(solution_str, ground_truth, extra_info, format_score) -> float, or a dict with "score"."""

_GSM8K: ScoreFn = lambda s, gt, ei, fs: gsm8k_compute_score(s, gt, format_score=fs)
# The arithmetic task (data/arithmetic.py): verl's gsm8k scorer in its flexible mode — the last number of
# the reply; a reply without a number scores 0, a wrong number reward.format_score.
_GSM8K_FLEXIBLE: ScoreFn = lambda s, gt, ei, fs: gsm8k_compute_score(s, gt, method="flexible", format_score=fs)
_MATH: ScoreFn = lambda s, gt, ei, fs: math_compute_score(s, gt)
_MATH_DAPO: ScoreFn = lambda s, gt, ei, fs: math_compute_score(s, gt, answer_line=True)
_QA_EM: ScoreFn = lambda s, gt, ei, fs: qa_em_score(s, gt, format_score=fs)
_SEARCH_R1: ScoreFn = lambda s, gt, ei, fs: search_r1_score(s, gt, format_score=fs)
_QA_F1: ScoreFn = lambda s, gt, ei, fs: qa_f1_score(s, gt)
_CODE: ScoreFn = lambda s, gt, ei, fs: code_score(s, gt, ei)
_EXACT: ScoreFn = lambda s, gt, ei, fs: exact_match_score(s, gt)

CODE_DATA_SOURCES = ("code", "codecontests", "apps", "codeforces", "taco", "primeintellect")
SEARCH_R1_SOURCES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")
_QA_EM_SOURCES = ("nq", "triviaqa", "popqa", "hotpotqa", "qa_em")

BUILTIN_REWARDS: dict[str, ScoreFn] = {
    "openai/gsm8k": _GSM8K,
    ARITHMETIC_DATA_SOURCE: _GSM8K_FLEXIBLE,
    "gsm8k": _GSM8K,
    "lighteval/MATH": _MATH,
    "DigitalLearningGmbH/MATH-lighteval": _MATH,
    "HuggingFaceH4/MATH-500": _MATH,
    "math": _MATH_DAPO,  # verl routes "math" to math_dapo too
    "math_dapo": _MATH_DAPO,
    "math_dapo_reasoning": _MATH_DAPO,
    **dict.fromkeys(SEARCH_R1_SOURCES, _SEARCH_R1),
    **dict.fromkeys(_QA_EM_SOURCES, _QA_EM),
    "qa_f1": _QA_F1,
    **dict.fromkeys(CODE_DATA_SOURCES, _CODE),
    "exact": _EXACT,
    "exact_match": _EXACT,
    DEMO_DATA_SOURCE: lambda s, gt, ei, fs: demo_compute_score(s, gt),
}
"""Exact data_source names; `builtin_scorer` adds the "aime*" prefix (verl: aime24, aime2025, …)."""


def builtin_scorer(data_source: str) -> ScoreFn | None:
    """The scorer of a data_source, or None (the caller falls back to exact match)."""
    fn = BUILTIN_REWARDS.get(data_source)
    if fn is None and data_source.startswith("aime"):
        fn = _MATH_DAPO
    return fn


_warned_sources: set[str] = set()


def default_compute_score(data_source: str, solution_str: str, ground_truth: Any,
                          extra_info: dict[str, Any] | None = None, *, format_score: float = 0.0) -> Any:
    """verl's signature (plus `format_score`, from reward.format_score); a float, or a dict with
    "score" (the code scorer may return one). Unknown data sources fall back to exact match (warned
    once per source and process)."""
    fn = builtin_scorer(data_source)
    if fn is None:
        if data_source not in _warned_sources:
            _warned_sources.add(data_source)
            logger.warning("no built-in reward for data_source %r: using exact match; set "
                           "custom_reward_function.path to score it your way", data_source)
        return exact_match_score(solution_str, ground_truth)
    return fn(solution_str, ground_truth, extra_info, format_score)
