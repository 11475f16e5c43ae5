"""agent/reasoning.py: SGLang's one-shot reasoning parse (qwen3, deepseek-r1) on the texts a model writes."""

import pytest

from areal_like.agent.reasoning import split_reasoning


@pytest.mark.parametrize("text,want", [
    ("no thinking here", (None, "no thinking here")),
    ("<think>\nA\n</think>\n\nB", ("\nA\n", "B")),
    # a call written inside a closed think block is thinking
    ("<think>maybe <tool_call>{}</tool_call>?</think>ok", ("maybe <tool_call>{}</tool_call>?", "ok")),
    # a call opened before </think> closes the block; the call stays in the content
    ('<think>plan<tool_call>{"name": "f"}</tool_call>', ("plan", '<tool_call>{"name": "f"}</tool_call>')),
    ("<think>cut off mid-thou", ("cut off mid-thou", "")),  # max_tokens reached inside the block
    ("<think><think>x</think>y", ("x", "y")),  # repeated opening tags
    # an opening tag mid-text: as SGLang, everything before </think> is reasoning
    ("answer first <think>then</think>", ("answer first <think>then", "")),
])
def test_qwen3(text, want):
    assert split_reasoning(text, "qwen3") == want


def test_deepseek_r1_thinks_from_the_first_character():
    assert split_reasoning("reason</think>answer", "deepseek-r1") == ("reason", "answer")
    assert split_reasoning("<think>reason</think>answer", "deepseek-r1") == ("reason", "answer")
    assert split_reasoning("still thinking", "deepseek-r1") == ("still thinking", "")
    # no tool-call early close for R1: the call is reasoning until </think>
    assert split_reasoning("a<tool_call>{}</tool_call>", "deepseek-r1") == ("a<tool_call>{}</tool_call>", "")


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek-r1.*qwen3"):
        split_reasoning("x", "qwen-3")
