"""The agentic demo's task (areal_like/data/agent_task.py): the questions need the calculator, the
warm-start episodes have exactly the token layout the `tool_agent` workflow builds, and the demo names
resolve to verl-format parquet the built-in exact reward scores."""

from __future__ import annotations

import asyncio
import random

import pytest

from areal_like.data import agent_task as A


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from areal_like.data.tiny_model import build_char_tokenizer

    return build_char_tokenizer(str(tmp_path_factory.mktemp("tok")), agent=True)


def test_questions_have_four_digit_products():
    rng = random.Random(0)
    for _ in range(500):
        expr, value = A.make_question(rng)
        a, b = (int(x) for x in expr.split("*"))
        assert A.LO <= a <= A.HI and A.LO <= b <= A.HI and value == str(a * b) and len(value) == 4


def test_tool_episode_is_what_tool_agent_builds_and_the_calculator_answers(tok):
    from areal_like.reward.builtin import default_compute_score
    from areal_like.tools import ToolSet
    from areal_like.workflow import chat
    from areal_like.workflow.tool_parser import parse_tool_calls

    schemas = A._tool_schemas()
    assert schemas == ToolSet.from_config("configs/tools/calculator.yaml").schemas()  # what the demo's run renders
    ids, mask = A.sft_example(tok, schemas, random.Random(3), p_tool=1.0, p_train_call=1.0)
    expr, value = A.make_question(random.Random(3))
    prompt = chat.prompt_ids(tok, [A.user_message(expr)], schemas)
    assert ids[:len(prompt)] == prompt and not any(mask[:len(prompt)])
    eos = tok.eos_token_id
    # trained runs: the call turn and the answer turn, each ending with <eos>; between them the observation
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    assert len(runs) == 2
    (c0, c1), (a0, a1) = runs
    call = tok.decode(ids[c0:c1 - 1], skip_special_tokens=True)
    assert ids[c1 - 1] == eos and ids[a1 - 1] == eos
    content, calls = parse_tool_calls(call)
    assert content == "" and len(calls) == 1 and calls[0].error is None
    assert calls[0].name == "calculator" and calls[0].arguments == {"expression": expr}
    result = asyncio.run(ToolSet.from_config("configs/tools/calculator.yaml").call(calls[0].name, calls[0].arguments, {}))
    assert result.error is None and result.text == value
    obs = chat.observation_ids(tok, [{"role": "tool", "content": result.text, "name": "calculator"}], ended_with_eos=True)
    assert ids[c1:a0] == obs and "<tool_response>" + value in tok.decode(obs)
    answer = tok.decode(ids[a0:a1], skip_special_tokens=True)
    assert default_compute_score(A.CALC_DATA_SOURCE, answer, value) == 1.0


def test_direct_episode_is_a_wrong_estimate_and_the_call_prior_is_small(tok):
    rng = random.Random(0)
    schemas = A._tool_schemas()
    starts = []
    for _ in range(400):
        ids, mask = A.sft_example(tok, schemas, rng, p_tool=0.8, p_train_call=0.02)
        first = mask.index(1)
        starts.append(ids[first])
    call_id = tok.convert_tokens_to_ids("<tool_call>")
    # trained first tokens that are <tool_call>: ≈ 0.8·0.02 / (0.2 + 0.8·0.02) ≈ 7%
    assert 0 < starts.count(call_id) / len(starts) < 0.2
    wrong = sum(A.estimate(e) != v for e, v in (A.make_question(rng) for _ in range(1000)))
    assert wrong > 950  # a rounded estimate is almost never the exact product


def test_demo_names_resolve_to_verl_parquet(tmp_path, monkeypatch):
    from areal_like.data.dataset import check_verl_parquet, read_verl_parquet
    from areal_like.data.demo_task import DEMO_NAMES, resolve_demo_name

    monkeypatch.setenv("AREAL_LIKE_CACHE", str(tmp_path))
    assert {"demo:calc-agent", "demo:calc-train", "demo:calc-val"} <= set(DEMO_NAMES)
    train, val = resolve_demo_name("demo:calc-train", "k"), resolve_demo_name("demo:calc-val", "k")
    assert check_verl_parquet(train) == 2048 and check_verl_parquet(val) == 32
    rows = read_verl_parquet(val)
    r = rows[0]
    assert r["data_source"] == "exact" and r["prompt"][0]["role"] == "user" and r["extra_info"]["split"] == "val"
    expr = r["prompt"][0]["content"].removesuffix("=?")
    a, b = (int(x) for x in expr.split("*"))
    assert r["ground_truth"] == str(a * b)
    train_q = {row["prompt"][0]["content"] for row in read_verl_parquet(train)}
    assert not any(row["prompt"][0]["content"] in train_q for row in rows)  # held out
