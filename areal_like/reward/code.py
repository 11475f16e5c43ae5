"""Code reward: run the completion's last Python block against the task's tests, in the sandbox.

`ground_truth` is JSON (or the decoded dict) in one of two shapes:
    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}   stdin → stdout cases; score = fraction passed
    {"assert": "assert f(1) == 2\\n..."} / {"tests": ...}    test code appended to the solution; 1.0 or 0.0
A stdin case passes when the program exits cleanly and its stdout equals the expected output up to
surrounding whitespace and trailing spaces on each line.

This is synchronous and self-contained on purpose: it runs inside a reward worker *process*
(reward/fn.py), one call at a time. Cases run one after another, each in a fresh sandbox process
(~0.1 s each), all within one budget of `timeout_s` seconds, so the call ends before the reward pool's
own timeout (10 s by default) would kill the worker. A sandbox that cannot run at all (the OS refuses
the network namespace) raises instead of scoring 0.0, so a misconfigured host shows up as reward
failures with the reason, not as a policy that never learns.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from areal_like.tools.sandbox import run_python_sync

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PY_TAGS = ("python", "python3", "py")

SANDBOX_LIMITS = {"cpu_s": 10.0, "memory_mb": 1024, "file_mb": 16, "max_procs": 16, "network": False}
"""Per-case limits besides the wall clock (the remaining budget). Solutions need no network or forks."""


def extract_code(solution_str: str) -> str | None:
    """The last ```python block (```py, ```python3 too); without one, the last untagged ``` block.
    A block left unclosed (a truncated completion) does not count."""
    blocks = _FENCE.findall(solution_str or "")
    for tags in (_PY_TAGS, ("",)):
        chosen = [body for tag, body in blocks if tag.lower() in tags]
        if chosen:
            return chosen[-1]
    return None


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _as_text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value)
    return str(value)


def parse_ground_truth(ground_truth: Any) -> dict:
    """The ground truth as a dict of one of the accepted shapes, or ValueError saying which are."""
    gt = ground_truth
    if isinstance(gt, (str, bytes)):
        try:
            gt = json.loads(gt)
        except ValueError as e:
            raise ValueError(f"code reward: ground_truth is not JSON ({e}); expected "
                             '{"inputs": [...], "outputs": [...]} or {"assert": "test code"}') from None
    if not isinstance(gt, dict):
        raise ValueError(f"code reward: ground_truth must be a JSON object, got {type(gt).__name__}")
    if "fn_name" in gt:
        raise ValueError("code reward: call-based tests (fn_name) are not supported; convert them to "
                         '{"assert": "assert fn(args) == expected"}')
    if "inputs" in gt or "outputs" in gt:
        inputs, outputs = gt.get("inputs"), gt.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
            raise ValueError("code reward: ground_truth inputs and outputs must be lists of the same length")
        if not inputs:
            raise ValueError("code reward: ground_truth has no test cases (inputs is empty)")
        return {"inputs": [_as_text(x) for x in inputs], "outputs": [_as_text(x) for x in outputs]}
    for key in ("assert", "tests"):
        if key in gt:
            tests = gt[key]
            if isinstance(tests, list):
                tests = "\n".join(str(t) for t in tests)
            if not isinstance(tests, str) or not tests.strip():
                raise ValueError(f"code reward: ground_truth[{key!r}] must be test code (a string)")
            return {"tests": tests}
    raise ValueError(f"code reward: ground_truth has keys {sorted(gt)}; expected "
                     '{"inputs": [...], "outputs": [...]} or {"assert": "test code"} / {"tests": "test code"}')


def _run(code: str, deadline: float, stdin: str | None, output_chars: int):
    remaining = deadline - time.monotonic()
    if remaining < 0.05:
        return None  # budget spent: the case fails without running
    r = run_python_sync(code, timeout_s=remaining, output_chars=output_chars, stdin=stdin, **SANDBOX_LIMITS)
    if r.error in ("refused", "sandbox_error"):
        raise RuntimeError(f"code reward: the sandbox could not run the solution: {r.message}")
    return r


def code_compute_score(solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
                       timeout_s: float = 10.0) -> float:
    """Fraction of the test cases the completion's code passes (assert-style: 1.0 or 0.0); 0.0 without a
    code block. `timeout_s` bounds the whole call. `extra_info` is accepted for verl's signature."""
    del extra_info
    gt = parse_ground_truth(ground_truth)  # a malformed dataset row raises: it is not the policy's fault
    code = extract_code(solution_str)
    if code is None:
        return 0.0
    # keep a little of the budget for process start-up and clean-up, so the call returns (and removes its
    # scratch directories) before a reward pool with the same timeout kills the worker
    deadline = time.monotonic() + timeout_s - min(0.5, 0.1 * timeout_s)
    if "tests" in gt:
        r = _run(code + "\n\n" + gt["tests"] + "\n", deadline, None, 1024)
        return 1.0 if r is not None and r.error is None else 0.0
    passed = 0
    for stdin, expected in zip(gt["inputs"], gt["outputs"]):
        # room for the whole expected output: a longer one is wrong anyway, truncated or not
        r = _run(code, deadline, stdin, 2 * len(expected) + 256)
        if r is not None and r.error is None and _normalize(r.stdout) == _normalize(expected):
            passed += 1
    return passed / len(gt["inputs"])
