"""The workflow API (api/workflow.py) and the multi-turn built-ins against a scripted generation
client and a scripted tool set (pure logic: the real servers, tools and proxy are tested in
tests/integration/). What a user notices: which tokens are trained, what the model saw between its
turns, the finish reason, the reward, and clear errors for a bad `rollout.workflow`."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from areal_like.api.config import GenerationConfig, MultiTurnConfig, load_config
from areal_like.api.workflow import WorkflowLoadError, load_user_workflow
from areal_like.data.dataset import PromptRecord
from areal_like.data.tiny_model import build_char_tokenizer
from areal_like.reward import RewardFn
from areal_like.rollout.dump import group_record, record_group
from areal_like.rollout.workflows import WorkflowRunner
from areal_like.workflow import chat
from areal_like.workflow.tool_parser import parse_tool_calls


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_char_tokenizer(str(tmp_path_factory.mktemp("agent_tok")), agent=True)


@dataclass
class Result:
    output_ids: list
    output_logprobs: list
    output_versions: list
    finish_reason: str


class ScriptedClient:
    """Turn t of every sample answers script[t] (+ EOS), version 5 + t, logprob −0.25."""

    def __init__(self, tok, script):
        self.tok, self.script, self.prompts = tok, script, []

    async def generate(self, input_ids, *, max_new_tokens, temperature, top_p, top_k, stop_token_ids, sampling_seed,
                       rid, key):
        turn = int(rid.split(".t")[1]) if ".t" in rid else 0
        self.prompts.append((rid, list(input_ids)))
        ids = self.tok(self.script[turn], add_special_tokens=False)["input_ids"]
        if len(ids) >= max_new_tokens:
            ids, reason = ids[:max_new_tokens], "length"
        else:
            ids, reason = ids + [self.tok.eos_token_id], "stop"
        return Result(ids, [-0.25] * len(ids), [5 + turn] * len(ids), reason)


@dataclass
class ToolResult:
    text: str
    error: str | None = None


class Tools:
    names = ["lookup"]

    def __init__(self):
        self.calls = []

    def schemas(self):
        return [{"type": "function", "function": {"name": "lookup", "description": "look a key up",
                                                  "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                                 "required": ["key"]}}}]

    async def call(self, name, arguments, tools_kwargs=None):
        self.calls.append((name, arguments, tools_kwargs))
        if name != "lookup":
            return ToolResult(f"Error: unknown tool {name}", "unknown_tool")
        return ToolResult({"x": "42"}.get(arguments.get("key"), "none"))

    async def close(self):
        pass


def _cfg(workflow="tool_agent", **mt):
    cfg = load_config(None, [f"rollout.workflow={workflow}"] if workflow != "tool_agent" else [])
    cfg.rollout.workflow = workflow
    cfg.generation = GenerationConfig(n=2, max_new_tokens=64)
    cfg.rollout.multi_turn = MultiTurnConfig(**mt)
    cfg.server.max_context_len = 512
    return cfg


def _row(tok, **extra):
    msgs = [{"role": "user", "content": "what is x?"}]
    return PromptRecord(prompt_id="p:1", input_ids=chat.prompt_ids(tok, msgs), ground_truth="42", data_source="exact",
                        extra_info={"tools_kwargs": {"lookup": {"create_kwargs": {"k": 1}}}, **extra}, raw_prompt=msgs,
                        row={"prompt": msgs, **extra})


CALL = '<tool_call>{"name": "lookup", "arguments": {"key": "x"}}</tool_call>'


async def test_tool_agent_masks_tool_output_and_scores_the_answer(tok):
    client, tools = ScriptedClient(tok, [CALL, "42"]), Tools()
    runner = WorkflowRunner(_cfg(), client, RewardFn(), tok, producer="rollout0", tools=tools)
    g = await runner.run_group(_row(tok), "w0-1")
    assert [t.traj_id for t in g.trajectories] == ["w0-1-0", "w0-1-1"]
    t = g.trajectories[0]
    assert t.reward == 1.0 and t.finish_reason == "stop"
    ids, mask, vers = t.ids_np().tolist(), t.mask_np().tolist(), t.versions_np().tolist()
    rec = group_record(g, tok)["trajectories"][0]
    trained = [s["text"] for s in rec["segments"] if s["trained"]]
    untrained = [s["text"] for s in rec["segments"] if not s["trained"]]
    # two assistant turns trained (each ends on EOS), the tool's answer and the template glue not
    assert trained == [CALL + "<eos>", "42<eos>"]
    from areal_like.rollout.worker import assistant_turns  # the areal_like_rollout_assistant_turns histogram

    assert assistant_turns(t) == 2
    assert untrained == ["\n#T:<tool_response>42</tool_response>\n#A:"]
    assert set(v for v, m in zip(vers, mask) if m) == {5, 6} and all(v == -1 for v, m in zip(vers, mask) if not m)
    # the second turn was generated after exactly the tokens a re-rendered conversation has
    second_prompt = [p for rid, p in client.prompts if rid == "w0-1-0.t1"][0]
    assert second_prompt == ids[:len(second_prompt)]
    assert tok.decode(second_prompt, skip_special_tokens=False) == chat.render(
        tok, [{"role": "user", "content": "what is x?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "lookup", "arguments": {"key": "x"}}}]},
              {"role": "tool", "content": "42"}], tools=tools.schemas(), add_generation_prompt=True)
    assert tools.calls[0] == ("lookup", {"key": "x"}, {"lookup": {"create_kwargs": {"k": 1}}})
    # the dump line rebuilds the very same group
    back = record_group(json.loads(json.dumps(group_record(g, tok))))
    assert [x.input_ids for x in back.trajectories] == [x.input_ids for x in g.trajectories]
    assert [x.loss_mask for x in back.trajectories] == [x.loss_mask for x in g.trajectories]


async def test_tool_agent_limits_end_the_episode_cleanly(tok):
    # always calling a tool: out of turns
    g = await WorkflowRunner(_cfg(max_assistant_turns=3), ScriptedClient(tok, [CALL] * 3), RewardFn(), tok,
                             producer="r", tools=Tools()).run_group(_row(tok), "g")
    assert {t.finish_reason for t in g.trajectories} == {"max_turns"} and {t.reward for t in g.trajectories} == {0.0}
    # a context too small for the tool result: ends with context_limit, nothing over the limit
    cfg = _cfg(max_total_tokens=len(_row(tok).input_ids) + len(CALL) + 5)
    g = await WorkflowRunner(cfg, ScriptedClient(tok, [CALL, "42"]), RewardFn(), tok, producer="r",
                             tools=Tools()).run_group(_row(tok), "g")
    t = g.trajectories[0]
    assert t.finish_reason == "context_limit" and t.num_tokens <= cfg.rollout.multi_turn.max_total_tokens
    # a malformed call becomes an error observation, and the episode goes on
    tools = Tools()
    g = await WorkflowRunner(_cfg(), ScriptedClient(tok, ["<tool_call>{oops</tool_call>", "42"]), RewardFn(), tok,
                             producer="r", tools=tools).run_group(_row(tok), "g")
    rec = group_record(g, tok)["trajectories"][0]
    assert "Error: the tool call is not valid JSON" in [s for s in rec["segments"] if not s["trained"]][0]["text"]
    assert tools.calls == [] and g.trajectories[0].reward == 1.0


async def test_multi_turn_gives_feedback_until_correct(tok):
    client = ScriptedClient(tok, ["7", "42"])
    g = await WorkflowRunner(_cfg("multi_turn"), client, RewardFn(), tok, producer="r").run_group(
        _row(tok, interaction_kwargs={"feedback": "no"}), "g")
    rec = group_record(g, tok)["trajectories"][0]
    assert [s["text"] for s in rec["segments"]] == ["7<eos>", "\n#U:no\n#A:", "42<eos>"]
    assert g.trajectories[0].reward == 1.0


def test_tool_call_parser():
    content, calls = parse_tool_calls('hm <tool_call>{"name": "a", "arguments": "{\\"q\\": 1}"}</tool_call> ok')
    assert content == "hm  ok" and calls[0].name == "a" and calls[0].arguments == {"q": 1} and calls[0].error is None
    _, calls = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "b"')
    assert [c.error is not None for c in calls] == [True, True]


def test_user_workflow_files(tmp_path, tok):
    f = tmp_path / "wf.py"
    f.write_text("async def episode(ctx, row):\n    return None\n\n"
                 "class Agent:\n    async def run(self, data, **kw):\n        return 1.0\n\n"
                 "class Bad:\n    def run(self, data):\n        return 1.0\n")
    assert load_user_workflow(f"{f}:episode").kind == "episode"
    assert load_user_workflow(f"{f}:Agent").kind == "agent"
    with pytest.raises(WorkflowLoadError, match="neither an episode workflow"):
        load_user_workflow(f"{f}:Bad")
    with pytest.raises(WorkflowLoadError, match="defines no 'Nope'"):
        load_user_workflow(f"{f}:Nope")
    # at config load: a missing file names the key; tool_agent without tools names rollout.tools_config
    from areal_like.api.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.workflow"):
        load_config(None, [f"rollout.workflow={tmp_path}/missing.py:X"])
    with pytest.raises(ConfigError, match="rollout.tools_config"):
        load_config(None, ["rollout.workflow=tool_agent"])


async def test_row_agent_name_selects_the_workflow(tmp_path, tok):
    f = tmp_path / "mine.py"
    f.write_text("async def skip(ctx, row):\n    return None\n")
    runner = WorkflowRunner(_cfg("rlvr"), ScriptedClient(tok, ["42"]), RewardFn(), tok, producer="r")
    row = _row(tok, agent_name=f"{f}:skip")
    assert runner.check_rows([row]) == [f"{f}:skip"]
    assert await runner.run_group(row, "g") is None  # the row's own workflow skipped it
    bad = _row(tok, agent_name="no_such_agent")
    with pytest.raises(WorkflowLoadError, match="row p:1 agent_name"):
        runner.check_rows([bad])


async def test_the_readme_example_workflow_runs(tmp_path, tok):
    """The README's "write your own rollout" example, as printed, through the worker's runner."""
    import os
    import re

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    code = re.search(r"```python\n(# my_workflow\.py.*?)```", readme, re.DOTALL).group(1)
    f = tmp_path / "my_workflow.py"
    f.write_text(code)
    runner = WorkflowRunner(_cfg(f"{f}:two_tries"), ScriptedClient(tok, ["7", "42"]), RewardFn(), tok, producer="r")
    g = await runner.run_group(_row(tok), "g")
    rec = group_record(g, tok)["trajectories"][0]
    assert [(s["text"], s["trained"]) for s in rec["segments"]] == [
        ("7<eos>", True), ("\n#U:wrong, try again\n#A:", False), ("42<eos>", True)]
    assert g.trajectories[0].reward == 1.0


async def test_validation_runs_multi_turn_episodes_through_the_workflow(tok):
    """With a tool workflow, validation scores whole episodes (the tool's answer), not the first turn."""
    from areal_like.api.config import EvalConfig
    from areal_like.rollout.evaluator import Evaluator

    cfg = _cfg()
    runner = WorkflowRunner(cfg, ScriptedClient(tok, [CALL, "42"]), RewardFn(), tok, producer="r", tools=Tools())
    ev = Evaluator(runner.client, RewardFn(), tok, [_row(tok)], EvalConfig(n=3), cfg.generation, channel=None,
                   runner=runner)
    res = await ev.evaluate(version=5, step=10)
    assert res["val/exact/mean@3"] == 1.0 and res["val/samples"] == 3.0 and res["val/failed_samples"] == 0.0
    # 2 turns per sample, the second generated at version 6 (the scripted server's versions 5 + turn)
    assert res["val/version_mismatch_tokens"] == 3 * len(tok("42", add_special_tokens=False)["input_ids"]) + 3
    # the single-turn path would have scored the tool call itself
    single = await Evaluator(runner.client, RewardFn(), tok, [_row(tok)], EvalConfig(n=3), cfg.generation,
                             channel=None).evaluate(version=5, step=10)
    assert single["val/exact/mean@3"] == 0.0
