"""Built-in rewards, the custom loader, and RewardFn's isolation: timeouts, exceptions, no leaks."""

import asyncio
import os
import textwrap

import pytest

from areal_like.metrics import REWARD_TIMEOUTS
from areal_like.reward import (
    RewardFn,
    default_compute_score,
    gsm8k_compute_score,
    gsm8k_extract,
    last_boxed,
    load_custom_reward,
    math_compute_score,
)


def test_gsm8k():
    assert gsm8k_extract("so 3+4 = 7\n#### 1,234") == "1234"
    assert gsm8k_compute_score("work...\n#### 72", "72") == 1.0
    assert gsm8k_compute_score("the answer is 72", "72") == 0.0  # strict needs ####
    assert gsm8k_compute_score("the answer is 72.", "72", method="flexible") == 1.0
    assert gsm8k_compute_score("#### -3", "-3") == 1.0
    assert gsm8k_compute_score("#### 5", "6") == 0.0
    assert default_compute_score("openai/gsm8k", "#### 18", "18") == 1.0


def test_math():
    assert last_boxed(r"so \boxed{\frac{1}{2}} and \boxed{x^{2}}") == "x^{2}"
    assert math_compute_score(r"thus $\boxed{\dfrac{1}{2}}$", r"\frac{1}{2}") == 1.0
    assert math_compute_score(r"\boxed{\frac12}", r"\frac{1}{2}") == 1.0
    assert math_compute_score(r"\boxed{ 10 }", "10.0") == 1.0
    assert math_compute_score(r"\boxed{x = 3}", "3") == 1.0
    assert math_compute_score(r"\boxed{3}", "4") == 0.0
    assert math_compute_score("no box: 3", "3") == 0.0
    assert default_compute_score("lighteval/MATH", r"\boxed{7}", r"\boxed{7}") == 1.0


def test_exact_demo_and_fallback():
    assert default_compute_score("exact", " hi\n", "hi") == 1.0
    assert default_compute_score("exact_match", "hi!", "hi") == 0.0
    assert default_compute_score("areal_like/demo", "5", "5") == 1.0
    assert default_compute_score("areal_like/demo", "55", "5") == 0.5
    assert default_compute_score("areal_like/demo", "4", "5") == 0.0
    assert default_compute_score("areal_like/demo", "", "5") == 0.0
    assert default_compute_score("some/unknown", "a", "a") == 1.0  # exact match fallback


def _write(tmp_path, body, name="r.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def test_custom_loader_errors(tmp_path):
    p = _write(tmp_path, "def compute_score(ds, s, gt, ei):\n    return 1.0\ndef other(*a):\n    return 0\n")
    assert load_custom_reward(p)("x", "a", "a", {}) == 1.0
    with pytest.raises(AttributeError, match=r"r.py.*no function 'nope'.*custom_reward_function.name"):
        load_custom_reward(p, "nope")
    with pytest.raises(FileNotFoundError, match="missing.py"):
        load_custom_reward(str(tmp_path / "missing.py"))
    bad = _write(tmp_path, "import not_a_module_xyz\n", "bad.py")
    with pytest.raises(ImportError, match="bad.py.*failed to import"):
        load_custom_reward(bad)
    with pytest.raises(AttributeError, match="nope"):
        RewardFn(p, "nope")
    from areal_like.api.config import RewardFunctionConfig
    fn = RewardFn(RewardFunctionConfig(path=p, timeout_s=3.0))
    assert (fn.path, fn.name, fn.timeout_s) == (p, "compute_score", 3.0)
    assert not fn.runs_inline("areal_like/demo")  # a custom function scores every source, in the pool
    builtin = RewardFn(RewardFunctionConfig())
    assert builtin.runs_inline("areal_like/demo") and not builtin.runs_inline("openai/gsm8k")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); check its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


async def test_demo_builtin_runs_inline_others_in_the_pool():
    fn = RewardFn(timeout_s=30.0)
    try:
        assert await fn.score("areal_like/demo", "3", "3", {}) == 1.0
        assert fn.worker_pids() == []  # the demo's scorer runs in the event loop
        assert await fn.score("openai/gsm8k", "#### 3", "3", {}) == 1.0
        pids = fn.worker_pids()
        assert len(pids) == 1 and pids[0] != os.getpid()  # every other built-in in a worker process
    finally:
        await fn.close()
    assert not _alive(pids[0])


async def test_custom_scores_timeout_and_errors_without_leaks(tmp_path):
    p = _write(tmp_path, """
        import time
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            print("user output must not corrupt the reply stream")
            if solution_str == "hang":
                time.sleep(60)
            if solution_str == "boom":
                raise RuntimeError("kaboom")
            if solution_str == "dict":
                return {"score": 0.25, "acc": True}
            return float(solution_str == ground_truth) + extra_info.get("bonus", 0)
    """)
    fn = RewardFn(p, timeout_s=1.5, num_workers=2)
    assert not fn.runs_inline("x")
    before = REWARD_TIMEOUTS._value.get()
    try:
        assert await fn.score("x", "a", "a", {"bonus": 0.5}) == 1.5
        assert await fn.score("x", "dict", "a", {}) == 0.25
        assert await fn.score("x", "boom", "a", {}) == 0.0
        assert fn.num_errors == 1
        pids_before = set(fn.worker_pids())
        hung, ok = await asyncio.gather(fn.score("x", "hang", "a", {}), fn.score("x", "b", "b", {}))
        assert (hung, ok) == (0.0, 1.0)  # the other worker kept serving while one hung
        assert fn.num_timeouts == 1 and REWARD_TIMEOUTS._value.get() == before + 1
        dead = pids_before - set(fn.worker_pids())
        assert dead and not any(_alive(pid) for pid in dead)  # the stuck worker was ended
        assert await fn.score("x", "c", "c", {}) == 1.0  # replaced: still serving
        pids = fn.worker_pids()
        assert pids
    finally:
        await fn.close()
    assert not any(_alive(pid) for pid in pids) and fn.worker_pids() == []
