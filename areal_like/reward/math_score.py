"""MATH-style answers checked with `math-verify` (symbolic equivalence: `\\frac{1}{2}` = `0.5` = `\\dfrac12`,
`x=3` = `3`, `\\{1,2\\}` = `\\{2,1\\}`, `x^2+2x+1` = `(x+1)^2`, …).

The completion's answer is its last `\\boxed{…}` — for DAPO/AIME-style sources instead the text after
the last "Answer:" (DAPO's prompt format; a `\\boxed{}` alone is no answer there, as in verl's
math_dapo: the format is part of what those prompts train); no answer scores 0. Equivalence is
math-verify's, more lenient than verl's string normalisation on notation only (`2,000` = `2000`,
`1/2` = `0.5`). Both sides are wrapped back in `\\boxed{}`
before parsing, as verl's math_verify scorer does, so math-verify reads exactly that answer and
never a number from the working.

Timeouts: math-verify bounds its own parse/verify with signal.alarm (5 s each by default), which
raises ValueError outside the main thread and turns a slow check into a silent 0. Both are turned
off here (`parsing_timeout=None`, `timeout_seconds=None`): built-ins run in RewardFn's worker
processes, whose `custom_reward_function.timeout_s` is the one timeout — it kills a stuck worker
(e.g. `\\boxed{9^{9^{9}}}`, a bignum sympy grinds on for minutes) and counts the call as a
`timeout`, as for a user's function. Called outside RewardFn, nothing bounds it.

The sympy-heavy import (~0.6 s) happens on first use; the reward worker does it at start-up so
that it never counts against a call's timeout.
"""

from __future__ import annotations

import logging
import re
from typing import Any

_CLIP_CHARS = 1200  # the answer is at the end; regexes/brace matching on long completions are slow


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once per process that its timeout is off; that is deliberate here (module doc)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())

_mv: Any = None  # (parse, verify, LatexExtractionConfig, ExprExtractionConfig) once imported


def load_math_verify() -> Any:
    """Import math-verify (sympy: slow) once; the reward worker calls this at start-up."""
    global _mv
    if _mv is None:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        _mv = (parse, verify, LatexExtractionConfig, ExprExtractionConfig)
    return _mv


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


_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)


def extract_math_answer(solution_str: str, answer_line: bool = False) -> str | None:
    """The last \\boxed{} answer; with `answer_line` (DAPO's format, as verl's math_dapo scores it) the
    text after the last "Answer:" instead — a \\boxed{} alone is then no answer."""
    s = solution_str[-_CLIP_CHARS:]
    if answer_line:
        found = _ANSWER_LINE.findall(s)
        ans = found[-1].strip().strip("$").rstrip(".").strip() if found else None
    else:
        ans = last_boxed(s)
    return ans if ans else None


def math_equal(pred: str, ground_truth: str) -> bool:
    """math-verify equivalence of two bare answers (no \\boxed); the ground truth may itself be boxed."""
    parse, verify, latex_cfg, expr_cfg = load_math_verify()
    gt = last_boxed(ground_truth) or ground_truth
    gold = parse("\\boxed{" + gt + "}", extraction_config=[latex_cfg()], parsing_timeout=None)
    if not gold:  # math-verify could not read the ground truth at all: fall back to the exact string
        return pred.strip() == gt.strip()
    target = parse("\\boxed{" + pred + "}", extraction_config=[latex_cfg(), expr_cfg()], parsing_timeout=None)
    return bool(target) and verify(gold, target, timeout_seconds=None)


def math_compute_score(solution_str: str, ground_truth: str, answer_line: bool = False) -> float:
    """1.0 if the completion's answer is equivalent to the ground truth, else 0.0 (verl's math scorer
    has no format credit; neither has this one)."""
    pred = extract_math_answer(solution_str, answer_line)
    if pred is None:
        return 0.0
    return 1.0 if math_equal(pred, str(ground_truth)) else 0.0
