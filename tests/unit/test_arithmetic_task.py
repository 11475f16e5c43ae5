"""The arithmetic task (data/arithmetic.py): verl parquet built in code, difficulty from the demo name, a
held-out split that shares no problem with training, and its reward (verl's gsm8k scorer, flexible)."""

from __future__ import annotations

import re

import pyarrow.parquet as pq
import pytest

from areal_like.data.arithmetic import ARITHMETIC_DATA_SOURCE, ArithmeticSpec, held_out, parse_arithmetic_name
from areal_like.data.demo_task import resolve_demo_name
from areal_like.reward.builtin import default_compute_score
from areal_like.reward.fn import RewardFn

_EXPR = re.compile(r"(\d+) (\+|-|\*|plus|minus|times) (\d+)")
_SYM = {"plus": "+", "minus": "-", "times": "*"}


def _problem(question: str) -> tuple[int, str, int]:
    m = _EXPR.search(question)
    assert m, question
    return int(m.group(1)), _SYM.get(m.group(2), m.group(2)), int(m.group(3))


def test_demo_name_builds_verl_parquet_with_a_disjoint_held_out_split(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path))
    train = pq.read_table(resolve_demo_name("demo:arithmetic-1d-add", "data.train_files")).to_pylist()
    val = pq.read_table(resolve_demo_name("demo:arithmetic-1d-add-val", "data.val_files")).to_pylist()
    assert len(train) == 2048 and len(val) == 64
    assert len({r["prompt"][0]["content"] for r in val}) == 64  # distinct held-out questions
    for split, rows in (("train", train), ("val", val)):
        for r in rows:
            assert r["data_source"] == ARITHMETIC_DATA_SOURCE and r["extra_info"]["split"] == split
            (msg,) = r["prompt"]
            assert msg["role"] == "user"
            a, op, b = _problem(msg["content"])
            assert op == "+" and 0 <= a <= 9 and 0 <= b <= 9
            assert r["reward_model"]["ground_truth"] == str(a + b)
            assert held_out(a, op, b) == (split == "val")
    train_problems = {_problem(r["prompt"][0]["content"]) for r in train}
    val_problems = {_problem(r["prompt"][0]["content"]) for r in val}
    assert not train_problems & val_problems  # no held-out sum is trained on, in any phrasing
    assert len(train_problems) + len(val_problems) == 100  # every one-digit sum is in one split or the other
    # rebuilt from the same seed: the same file (a cached copy and a fresh one never differ)
    again = tmp_path / "again"
    monkeypatch.setenv("AREAL_LIKE_CACHE", str(again))
    assert pq.read_table(resolve_demo_name("demo:arithmetic-1d-add-val", "k")).to_pylist() == val


def test_difficulty_is_spelled_by_the_name(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path))
    rows = pq.read_table(resolve_demo_name("demo:arithmetic-2d-submul-words", "k")).to_pylist()
    ops = set()
    for r in rows[:300]:
        q, gt = r["prompt"][0]["content"], int(r["reward_model"]["ground_truth"])
        nums = [int(x) for x in re.findall(r"\d+", q)]
        assert len(nums) == 2 and all(10 <= n <= 99 for n in nums), q
        if "gives away" in q:
            ops.add("-")
            assert gt == nums[0] - nums[1] >= 0
        else:
            assert "bags" in q and gt == nums[0] * nums[1], q
            ops.add("*")
    assert ops == {"-", "*"}
    assert parse_arithmetic_name("demo:arithmetic-3d-addsubmul-val") == (ArithmeticSpec(3, ("+", "-", "*")), True)
    assert parse_arithmetic_name("demo:next-digit") is None
    with pytest.raises(ValueError, match=r"data.train_files=demo:arithmetic-2x-add: .*demo:arithmetic-<digits>d-<ops>"):
        resolve_demo_name("demo:arithmetic-2x-add", "data.train_files")
    with pytest.raises(ValueError, match="digits=9"):
        ArithmeticSpec(9)


def test_reward_is_the_last_number_of_the_reply():
    score = lambda s, gt: default_compute_score(ARITHMETIC_DATA_SOURCE, s, gt)  # noqa: E731
    assert score("4 + 5 = 9", "9") == 1.0
    assert score("The sum of 4 and 5 is 9.", "9") == 1.0
    assert score("4 + 5 = 9. So 4 plus 5 equals 10", "9") == 0.0  # the LAST number counts
    assert score("Adding 4 and 5 gives 1,000", "1000") == 1.0
    assert score("I can't compute that.", "9") == 0.0
    assert default_compute_score(ARITHMETIC_DATA_SOURCE, "it is 8", "9", format_score=0.1) == 0.1


async def test_the_arithmetic_reward_runs_in_the_event_loop():
    """A regex over the reply's end cannot hang: no reward worker process is started for it."""
    fn = RewardFn()
    try:
        assert fn.runs_inline(ARITHMETIC_DATA_SOURCE)
        assert await fn.score(ARITHMETIC_DATA_SOURCE, "so the answer is 12", "12") == 1.0
        assert fn.worker_pids() == []
    finally:
        await fn.close()
