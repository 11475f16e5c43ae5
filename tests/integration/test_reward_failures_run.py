"""Reward failures reach the run's Redis counters (what the launcher and the learner read), and a reward
that always raises stops a real `launcher run` with a message naming the function."""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from areal_like.buffer.replay_buffer import ReplayBuffer
from areal_like.reward import RewardFn
from areal_like.reward.report import FailureReporter

pytestmark = pytest.mark.integration


async def test_worker_failures_reach_the_counters(redis_server, redis_stream, tmp_path):
    p = tmp_path / "r.py"
    p.write_text(textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info):
            if solution_str == "raise":
                raise RuntimeError("reward exploded on " + solution_str)
            if solution_str == "nan":
                return float("nan")
            if solution_str == "str":
                return "good"
            return 1.0
    """))
    buf = ReplayBuffer(redis_server.url, stream=redis_stream, block_ms=100)
    other = ReplayBuffer(redis_server.url, stream=redis_stream, block_ms=100)  # e.g. the launcher's
    assert other.run.reward_failures() == {"exception": 0, "timeout": 0, "non_finite": 0, "not_a_number": 0}
    reporters = []
    fns = []
    try:
        for k in range(2):  # two rollout workers of one run
            rep = FailureReporter(buf, producer=f"rollout{k}", interval_s=0.1)
            fn = RewardFn(str(p), timeout_s=5.0, num_workers=2, on_failure=rep.record)
            reporters.append(rep)
            fns.append(fn)
        stop = asyncio.Event()
        tasks = [asyncio.create_task(r.run(stop)) for r in reporters]
        await asyncio.gather(*(fns[0].score("d", s, "g") for s in ["raise", "nan", "ok", "raise"]),
                             *(fns[1].score("d", s, "g") for s in ["str", "raise", "ok"]))
        stop.set()
        await asyncio.gather(*tasks)
        counts, first = other.run.reward_failure_details()
        assert counts == {"exception": 3, "timeout": 0, "non_finite": 1, "not_a_number": 1}
        assert other.run.reward_failures() == counts == other.stats()["reward_failures"]
        # the first failure of each kind in the run, once (HSETNX): with the worker's name and traceback
        assert set(first) == {"exception", "non_finite", "not_a_number"}
        assert first["exception"].startswith("[rollout") and "RuntimeError: reward exploded on raise" in first["exception"]
        assert f"{p}:compute_score" in first["exception"] and "Traceback" in first["exception"]
        assert "[rollout1]" in first["not_a_number"] and "'good'" in first["not_a_number"]
        # nothing more to flush: a second flush adds nothing
        await reporters[0].flush()
        assert other.run.reward_failures() == counts
    finally:
        for fn in fns:
            await fn.close()
        await buf.aclose()
        other.close()


def test_always_raising_reward_stops_the_run(tmp_path, run_launcher):
    """reward.max_failure_fraction: a function that always raises stops a real run — non-zero exit, the
    message names path:name, the first traceback is on the console, summary.json counts them."""
    reward = tmp_path / "broken_reward.py"
    reward.write_text(textwrap.dedent("""
        def parse_answer(text):
            return int(text.split("=")[1])

        def my_score(data_source, solution_str, ground_truth, extra_info):
            return float(parse_answer(solution_str) == int(ground_truth))
    """))
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, f"custom_reward_function.path={reward}", "custom_reward_function.name=my_score",
                           "reward.failure_window=32", "train.total_steps=200", "train.test_freq=0",
                           "data.val_files=[]", timeout=240)
    assert rc != 0, out[-3000:]
    # the worker's message, shown by the launcher (log tail of the role that stopped the run)
    assert f"{reward}:my_score" in out and "reward.max_failure_fraction=0.5" in out, out[-4000:]
    # the first failure of its kind, with the user's traceback, on the console
    assert "first reward failure of kind exception" in out and "in parse_answer" in out, out[-4000:]
    assert "IndexError: list index out of range" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_failures"]["exception"] > 16, summary  # > 0.5 × 32 of the window
    assert summary["reward_failures"]["timeout"] == 0
    assert summary["exit_reason"] != "completed"
    assert "rollout0" in summary["exit_reason"]
