"""Reward failures are counted by kind, a hung reward never stalls a group, too many failures stop.

Real worker processes (reward/_worker.py) run every custom function here; nothing is mocked on the
isolation path.
"""

import asyncio
import math
import os
import textwrap
import time
from dataclasses import dataclass

import pytest

from areal_like.api.config import GenerationConfig, RewardFunctionConfig, RewardShapingConfig
from areal_like.data.dataset import PromptRecord
from areal_like.data.tiny_model import build_char_tokenizer
from areal_like.metrics import REWARD_FAILURES
from areal_like.reward import RewardFn, to_score
from areal_like.reward.custom import NonFiniteScore, NotANumber
from areal_like.reward.fn import FAILURE_KINDS
from areal_like.workflow import RLVRWorkflow


def _write(tmp_path, body, name="r.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def _prom(kind):
    return REWARD_FAILURES.labels(kind=kind)._value.get()


def test_to_score_kinds():
    assert to_score(1) == 1.0 and to_score(True) == 1.0 and to_score({"score": 0.5, "acc": 1}) == 0.5
    for bad in ("0.5", "yes", None, [1.0], {"acc": 1}, b"1", object()):
        with pytest.raises(NotANumber):
            to_score(bad)
    for bad in (math.nan, math.inf, -math.inf, {"score": math.nan}):
        with pytest.raises(NonFiniteScore):
            to_score(bad)
    assert FAILURE_KINDS == ("exception", "timeout", "non_finite", "not_a_number")


async def test_custom_failures_counted_by_kind(tmp_path):
    p = _write(tmp_path, """
        import math
        def helper(x):
            return 1 / x
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            if solution_str == "raise":
                return helper(0)
            if solution_str == "nan":
                return math.nan
            if solution_str == "inf":
                return {"score": float("inf")}
            if solution_str == "str":
                return "1.0"
            if solution_str == "none":
                return None
            if solution_str == "exit":
                import os
                os._exit(7)
            return 1.0
    """)
    seen = []
    fn = RewardFn(p, timeout_s=5.0, num_workers=2, on_failure=lambda k, t, first: seen.append((k, t, first)))
    before = {k: _prom(k) for k in FAILURE_KINDS}
    try:
        scores = await asyncio.gather(*(fn.score("my/ds", s, "x", {}) for s in
                                        ["ok", "raise", "nan", "inf", "str", "none", "raise", "ok", "exit"]))
        assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        # a worker that died (os._exit) counts as an exception; the pool still serves afterwards
        assert fn.failures == {"exception": 3, "timeout": 0, "non_finite": 2, "not_a_number": 2}
        assert await fn.score("my/ds", "ok", "x", {}) == 1.0
    finally:
        await fn.close()
    assert {k: _prom(k) - before[k] for k in FAILURE_KINDS} == fn.failures
    assert fn.num_errors == 7 and fn.num_timeouts == 0 and fn.scored == 10
    # the hook saw every failure; `first` once per kind
    assert len(seen) == 7 and sorted(k for k, _, first in seen if first) == ["exception", "non_finite", "not_a_number"]
    firsts = fn.first_failures()
    exc = firsts["exception"]
    # the first exception carries the user's traceback (their frames, their message), and names the function
    assert f"{p}:compute_score" in exc and "'my/ds'" in exc
    assert "Traceback" in exc and "in helper" in exc and "ZeroDivisionError: division by zero" in exc
    assert "_worker.py" not in exc
    assert "non-finite" in firsts["non_finite"] and "not a number" in firsts["not_a_number"]


async def test_inline_builtin_failures_counted(monkeypatch):
    """The inline path (the demo source only; the pool path is covered in test_rewards_builtin.py)."""
    import areal_like.reward.fn as fn_mod

    results = iter([math.nan, "1", 1.0])

    def fake(ds, s, gt, ei, format_score):
        if s == "boom":
            raise KeyError("no scorer")
        return next(results)

    monkeypatch.setattr(fn_mod, "default_compute_score", fake)
    fn = RewardFn()
    assert [await fn.score("areal_like/demo", s, "g") for s in ("a", "b", "c", "boom")] == [0.0, 0.0, 1.0, 0.0]
    assert fn.failures == {"exception": 1, "timeout": 0, "non_finite": 1, "not_a_number": 1}
    assert "KeyError" in fn.first_failures()["exception"] and "built-in" in fn.first_failures()["exception"]
    await fn.close()


# ---- a hung reward never stalls a group ----------------------------------------------------------
@dataclass
class _Res:
    output_ids: list
    output_logprobs: list
    output_versions: list
    finish_reason: str


class _Client:
    def __init__(self, tok):
        self.tok = tok

    async def generate(self, input_ids, *, rid, **kw):
        ids = self.tok.encode("hang" if int(rid.rsplit("-", 1)[1]) % 4 else "ok", add_special_tokens=False)
        return _Res(ids, [-0.5] * len(ids), [0] * len(ids), "length")


async def test_hung_reward_does_not_stall_a_group(tmp_path):
    """Three samples of four hang forever; 16 samples, 2 workers, timeout 1 s. Were only the calls timed
    (not the wait for a worker) the group would take ≥ 12 × 1 s / 2 workers = 6 s (the issue's 10 s
    timeout, 2 workers, 128 samples: 640 s); with the wait bounded too it takes ~2 × timeout. Every hung
    worker is killed; no process is left behind."""
    p = _write(tmp_path, """
        import time
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            if solution_str == "hang":
                time.sleep(3600)
            return 1.0
    """)
    tok = build_char_tokenizer(str(tmp_path / "tok"))
    fn = RewardFn.from_config(RewardFunctionConfig(path=p, timeout_s=1.0, num_workers=2), RewardShapingConfig())
    assert fn.num_workers == 2 and fn.max_failure_fraction == 0.5 and fn.failure_window == 256
    wf = RLVRWorkflow(_Client(tok), fn, GenerationConfig(n=16, max_new_tokens=4), tok, producer="p")
    record = PromptRecord(prompt_id="p:0", input_ids=tok.encode("12", add_special_tokens=False), ground_truth="1",
                          data_source="my/ds", extra_info={}, raw_prompt="12")
    started_pids = set()
    orig_start = fn._acquire

    async def spy():
        got = await orig_start()
        if not isinstance(got, tuple):
            started_pids.add(got.proc.pid)
        return got

    fn._acquire = spy
    t0 = time.monotonic()
    try:
        group = await asyncio.wait_for(wf.run_group(record, "g-0"), 30)
        wall = time.monotonic() - t0
    finally:
        await fn.close()
    rewards = [t.reward for t in group.trajectories]
    # hung samples score 0; a fine one queued behind hung workers for longer than the timeout too
    # (counted as a timeout, the price of the bound), but fine ones that got a worker score 1
    assert all(r == 0.0 for i, r in enumerate(rewards) if i % 4) and 1.0 in rewards
    assert fn.failures["timeout"] == rewards.count(0.0) >= 12 and fn.num_errors == 0
    assert wall < 5.5, f"the group took {wall:.1f}s: a hung reward stalled it"
    assert "waited 1s" in fn.first_failures()["timeout"] or "took longer than 1s" in fn.first_failures()["timeout"]
    assert started_pids and not any(_alive(pid) for pid in started_pids)  # hung workers killed, none leaked


# ---- too many failures ---------------------------------------------------------------------------
async def test_failure_fraction_stops_once_naming_the_function(tmp_path):
    p = _write(tmp_path, """
        def my_reward(data_source, solution_str, ground_truth, extra_info):
            if solution_str == "bad":
                raise ValueError("cannot parse " + solution_str)
            return 1.0
    """)
    limits = []
    fn = RewardFn(p, "my_reward", timeout_s=5.0, num_workers=2, max_failure_fraction=0.5, failure_window=8,
                  on_limit=limits.append)
    try:
        # 1 failure in 4 (25 %) for a long time: never stops
        for i in range(24):
            await fn.score("d", "bad" if i % 4 == 0 else "good", "g")
        assert limits == [] and fn.limit_message is None
        # then every call fails: past the limit as soon as 5 of the last 8 failed (> 0.5 × 8)
        n = 0
        while not limits and n < 20:
            await fn.score("d", "bad", "g")
            n += 1
        assert limits and n <= 5
        for _ in range(5):
            await fn.score("d", "bad", "g")
        assert len(limits) == 1  # reported once
    finally:
        await fn.close()
    msg = limits[0]
    assert f"{p}:my_reward" in msg and "reward.max_failure_fraction=0.5" in msg and "exception" in msg
    assert "ValueError: cannot parse bad" in msg


async def test_failure_fraction_one_never_stops(monkeypatch):
    import areal_like.reward.fn as fn_mod

    monkeypatch.setattr(fn_mod, "default_compute_score", lambda *a, **kw: math.nan)
    limits = []
    fn = RewardFn(max_failure_fraction=1.0, failure_window=4, on_limit=limits.append)
    for _ in range(12):
        assert await fn.score("areal_like/demo", "s", "g") == 0.0  # inline: the monkeypatch applies
    assert limits == [] and fn.failures["non_finite"] == 12


def test_bad_settings_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="custom_reward_function.num_workers"):
        RewardFn(RewardFunctionConfig(num_workers=0))
    with pytest.raises(ValueError, match="reward.max_failure_fraction"):
        RewardFn.from_config(RewardFunctionConfig(), RewardShapingConfig(max_failure_fraction=1.5))
    with pytest.raises(ValueError, match="reward.failure_window"):
        RewardFn.from_config(RewardFunctionConfig(), RewardShapingConfig(failure_window=0))
