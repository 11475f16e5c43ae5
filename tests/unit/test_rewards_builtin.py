"""Built-in rewards for agentic RLVR: gsm8k's format score from the config, math-verify, QA EM/F1,
code routing, and built-ins running in RewardFn's worker pool under the same timeout as a custom
function. Pool tests use real worker processes (reward/_worker.py); nothing there is mocked — a
monkeypatch cannot reach another process, so failures and timeouts come from real inputs.
"""

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import types

import pytest

from areal_like.api.config import RewardFunctionConfig, RewardShapingConfig, load_config
from areal_like.reward import RewardFn, default_compute_score, math_compute_score
from areal_like.reward.qa import extract_answer, normalize_answer, parse_targets, qa_em_score, qa_f1_score

# Generous: a worker start (interpreter + math-verify's sympy, ~0.5 s idle) on a busy 2-CPU box.
_SLOW_OK = 60.0


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie still answers kill(0)
        return f.read().split(")")[-1].split()[0] != "Z"


# ---- gsm8k: reward.format_score reaches the scorer ----------------------------------------------
async def test_gsm8k_format_score_from_config_through_the_pool():
    cfg = load_config(None, ["reward.format_score=0.1", f"custom_reward_function.timeout_s={_SLOW_OK}",
                             "custom_reward_function.num_workers=2"])
    fn = RewardFn.from_config(cfg.custom_reward_function, cfg.reward)
    assert fn.format_score == 0.1
    try:
        right, wrong, unformatted = await asyncio.gather(
            fn.score("openai/gsm8k", "3 + 4 = 7\n#### 7", "7"),
            fn.score("openai/gsm8k", "3 + 4 = 8\n#### 8", "7"),
            fn.score("openai/gsm8k", "the answer is 7", "7"))
        assert (right, wrong, unformatted) == (1.0, 0.1, 0.0)
        assert fn.worker_pids() and os.getpid() not in fn.worker_pids()  # scored in worker processes
        assert sum(fn.failures.values()) == 0
    finally:
        await fn.close()
    default = RewardFn.from_config(RewardFunctionConfig(timeout_s=_SLOW_OK), RewardShapingConfig())
    try:
        assert default.format_score == 0.0  # verl's default
        assert await default.score("gsm8k", "#### 8", "7") == 0.0
    finally:
        await default.close()
    with pytest.raises(ValueError, match="reward.format_score"):
        RewardFn(format_score=float("nan"))


def test_gsm8k_notation_forgiven_format_not():
    """Numerically equal answers after "#### " count (verl compares strings: "2000.0" and "72." score
    0 there); without the "#### <number>" format there is no answer, as in verl."""
    for text, gt in (("#### 2,000", "2000"), ("#### 2000.0", "2000"), ("#### 72.", "72"), ("#### -3", "-3")):
        assert default_compute_score("openai/gsm8k", text, gt) == 1.0, text
    for text in ("#### $72", "The answer is 72", "####72"):
        assert default_compute_score("openai/gsm8k", text, "72") == 0.0, text


# ---- math-verify --------------------------------------------------------------------------------
@pytest.mark.parametrize("completion, gt, want", [
    (r"so $\boxed{0.5}$", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{2}", "2", 1.0),
    (r"\boxed{2}", r"\boxed{2}", 1.0),  # a boxed ground truth is unwrapped
    (r"\boxed{\dfrac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}", 1.0),
    (r"first \boxed{3}, finally \boxed{4}", "3", 0.0),  # the last box is the answer
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
    ("no box: 2", "2", 0.0),
    (r"\boxed{}", "2", 0.0),
])
def test_math_verify_equivalences(completion, gt, want):
    assert math_compute_score(completion, gt) == want
    assert default_compute_score("lighteval/MATH", completion, gt) == want


def test_math_sources_and_dapo_answer_line():
    for ds in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert default_compute_score(ds, r"\boxed{\frac{1}{2}}", "0.5") == 1.0
        assert default_compute_score(ds, "Answer: 0.5", "0.5") == 0.0  # MATH sources need \boxed{}
        assert default_compute_score(ds, r"\boxed{2,000}", "2000") == 1.0  # notation forgiven (verl: 0)
    # verl's math_dapo family ("math" included): the "Answer:" line is the format being trained
    for ds in ("math_dapo", "math_dapo_reasoning", "math", "aime24", "aime2025"):
        assert default_compute_score(ds, "work…\nAnswer: $\\frac{1}{2}$", "0.5") == 1.0
        assert default_compute_score(ds, "Answer: 17", "17") == 1.0
        assert default_compute_score(ds, r"\boxed{17}", "17") == 0.0  # verl: −1, [INVALID]
        assert default_compute_score(ds, "Answer: 16", "17") == 0.0


# ---- QA -----------------------------------------------------------------------------------------
def test_squad_normalisation_em_and_f1():
    assert normalize_answer("  The  Beatles!  ") == "beatles"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("Théâtre") == "théâtre"  # lower-case only; no accent stripping (SQuAD)
    assert extract_answer("<answer>Paris</answer> then <answer> Lyon </answer>") == "Lyon"
    assert extract_answer("no tag") is None
    # EM over a list of answers; format_score only for a well-formed wrong answer
    assert qa_em_score("<think>…</think><answer>the Beatles.</answer>", "Beatles") == 1.0
    assert qa_em_score("<answer>Rolling Stones</answer>", "Beatles", format_score=0.2) == 0.2
    assert qa_em_score("Rolling Stones", "Beatles", format_score=0.2) == 0.0
    assert qa_em_score("  Beatles ", "Beatles", format_score=0.2) == 1.0  # no tag: the whole completion
    # F1: token overlap after normalisation, best over the answers, no format credit
    assert qa_f1_score("<answer>the Eiffel Tower</answer>", "Eiffel Tower") == 1.0
    assert qa_f1_score("<answer>Eiffel</answer>", "Eiffel Tower") == pytest.approx(2 / 3)
    assert qa_f1_score("<answer>tower of Eiffel</answer>", '["Paris", "the Eiffel Tower"]') == pytest.approx(0.8)
    assert qa_f1_score("<answer>London</answer>", "Paris") == 0.0
    assert qa_f1_score("<answer>the</answer>", "a") == 1.0  # both empty after normalisation


def test_qa_ground_truth_forms():
    want = ["Beatles", "The Beatles"]
    assert parse_targets("Beatles") == ["Beatles"]
    assert parse_targets(json.dumps(want)) == want
    assert parse_targets({"target": want}) == want
    assert parse_targets(json.dumps({"target": want})) == want
    # the dataset loader str()s a parquet struct: {'target': [...]} in Python's repr
    assert parse_targets(str({"target": want})) == want
    assert parse_targets(("a", "b")) == ["a", "b"]
    assert parse_targets("[not json") == ["[not json"]  # a string that merely starts with a bracket
    with pytest.raises(ValueError, match="'target'"):
        parse_targets({"answers": want})
    for ds in ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
               "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle", "nq", "triviaqa", "hotpotqa"):
        assert default_compute_score(ds, "<answer>the beatles</answer>", str({"target": want})) == 1.0
        assert default_compute_score(ds, "<answer>Queen</answer>", str({"target": want}), format_score=0.1) == 0.1
    # verl's Search-R1 scorer: no tag, no score (the format is the signal); tag spam keeps a quarter
    gt = str({"target": want})
    assert default_compute_score("searchR1_nq", "the beatles", gt) == 0.0
    assert default_compute_score("searchR1_nq", "<answer>x</answer> … <answer>the beatles</answer>", gt) == 1.0
    assert default_compute_score("searchR1_nq", "<answer>x</answer>" * 11 + "<answer>Beatles</answer>", gt) == 0.25
    assert default_compute_score("nq", "the beatles", gt) == 1.0  # our own names: a bare answer counts
    assert default_compute_score("qa_f1", "<answer>Beatles band</answer>", "Beatles") == pytest.approx(2 / 3)


# ---- code: routed to areal_like.reward.code (written elsewhere) ---------------------------------
def test_code_sources_route_to_code_compute_score(monkeypatch):
    calls = []

    def fake(solution_str, ground_truth, extra_info):
        calls.append((solution_str, ground_truth, extra_info))
        return {"score": 0.75, "passed": 3}

    # The real module may not exist yet: an entry in sys.modules is what the lazy import finds first.
    monkeypatch.setitem(sys.modules, "areal_like.reward.code", types.SimpleNamespace(code_compute_score=fake))
    sources = ("code", "codecontests", "apps", "codeforces", "taco", "primeintellect")
    for ds in sources:
        assert default_compute_score(ds, "print(1)", '{"inputs": [""], "outputs": ["1"]}', {"i": 1}) == \
            {"score": 0.75, "passed": 3}
    assert calls == [("print(1)", '{"inputs": [""], "outputs": ["1"]}', {"i": 1})] * len(sources)


# ---- the pool: timeouts and failures of built-ins are counted like a custom function's ----------
async def test_builtin_timeout_is_counted_and_the_worker_replaced():
    """`\\boxed{9^{9^{9}}}` is a real pathological answer: sympy computes a 370-million-digit power for
    minutes. math-verify's own alarm is off, so only the pool's timeout_s ends it."""
    fn = RewardFn(timeout_s=2.0, num_workers=1, start_timeout_s=_SLOW_OK)
    try:
        assert await fn.score("lighteval/MATH", r"\boxed{2}", "2") == 1.0  # the worker is up (and warm)
        (pid,) = fn.worker_pids()
        t0 = time.monotonic()
        assert await fn.score("lighteval/MATH", r"\boxed{9^{9^{9}}}", "3") == 0.0
        assert time.monotonic() - t0 < 10  # ended at the timeout, not by sympy finishing
        assert fn.failures == {"exception": 0, "timeout": 1, "non_finite": 0, "not_a_number": 0}
        assert "took longer than 2s (custom_reward_function.timeout_s)" in fn.first_failures()["timeout"]
        assert "built-in default_compute_score" in fn.first_failures()["timeout"]
        assert not _alive(pid) and pid not in fn.worker_pids()  # killed ...
        fn.timeout_s = _SLOW_OK  # the replacement's start is not under test here
        assert await fn.score("lighteval/MATH", r"\boxed{\frac{1}{2}}", "0.5") == 1.0  # ... and replaced
        pids = fn.worker_pids()
    finally:
        await fn.close()
    assert not any(_alive(p) for p in pids)


async def test_builtin_exception_in_the_pool_is_counted_with_its_traceback():
    fn = RewardFn(timeout_s=_SLOW_OK, num_workers=1)
    try:
        # a QA ground truth dict without "target": the built-in raises in the worker
        assert await fn.score("searchR1_nq", "<answer>x</answer>", '{"answers": ["x"]}') == 0.0
        assert fn.failures["exception"] == 1
        text = fn.first_failures()["exception"]
        assert "built-in default_compute_score raised on data_source 'searchR1_nq'" in text
        assert "ValueError" in text and "'target'" in text and "parse_targets" in text
        assert await fn.score("searchR1_nq", "<answer>x</answer>", '{"target": ["x"]}') == 1.0  # still serving
    finally:
        await fn.close()


async def test_worker_sys_path_has_no_reward_folder(tmp_path):
    """`python _worker.py` would put areal_like/reward/ first on sys.path, where code.py would shadow
    the stdlib's `code` for the user's function and everything it imports."""
    p = tmp_path / "r.py"
    p.write_text(textwrap.dedent("""
        import os, sys
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            return float(not any(os.path.abspath(x or os.curdir) == solution_str for x in sys.path))
    """))
    fn = RewardFn(str(p), timeout_s=_SLOW_OK, num_workers=1)
    try:
        reward_dir = os.path.dirname(os.path.abspath(sys.modules["areal_like.reward.fn"].__file__))
        assert await fn.score("x", reward_dir, "") == 1.0
    finally:
        await fn.close()


def test_reward_package_imports_lazily():
    """A built-in worker imports areal_like.reward.builtin without fn.py's heavy imports."""
    code = ("import sys, areal_like.reward.builtin, areal_like.reward as r; "
            "assert 'areal_like.reward.fn' not in sys.modules and 'math_verify' not in sys.modules; "
            "assert sorted(r.__all__) == sorted(r._EXPORTS); "
            "assert all(getattr(r, n) is not None for n in r.__all__)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
