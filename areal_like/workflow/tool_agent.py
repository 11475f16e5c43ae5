"""Multi-turn tool use (`tool_agent`): the model calls tools in the Hermes/Qwen format, tool results
come back as observation tokens (loss mask 0, version −1), until it answers without a call.

    prompt = chat template(row's messages, tools = rollout.tools_config's schemas)
    for each of n samples (concurrently), up to rollout.multi_turn.max_assistant_turns turns:
        generate a turn (≤ max_tokens_per_turn, ≤ the room left in max_total_tokens)
        no <tool_call> in it          → the answer: done (finish reason of the turn)
        else run every call (ToolSet.call never raises: an unknown tool, bad JSON, a crash or a
             timeout is an error observation, counted) → tool messages, each cut to
             max_tool_response_tokens → observation tokens; no room for them → `context_limit`
    reward = the row's reward of the last turn's text outside tool calls; the episode's counters
    (turns, tool calls, tool errors) go to the trajectory dump (rollout.dump_dir) via ctx.info.

Search-R1's state masking is this loss mask: the learner never trains on retrieved text.
"""

from __future__ import annotations

from areal_like.api.trajectory import Trajectory
from areal_like.api.workflow import EpisodeContext
from areal_like.api.workflow import PromptRecord
from areal_like.workflow import chat
from areal_like.workflow.rlvr import gather_samples
from areal_like.workflow.tool_parser import parse_tool_calls


async def tool_agent(ctx: EpisodeContext, row: PromptRecord) -> list[Trajectory]:
    if ctx.tools is None:
        raise ValueError("the tool_agent workflow needs tools: set rollout.tools_config=path/to/tools.yaml")
    schemas = ctx.tools.schemas()
    prompt = chat.prompt_ids(ctx.tokenizer, chat.chat_messages(row.raw_prompt), schemas)
    tools_kwargs = row.tools_kwargs
    eos = ctx.tokenizer.eos_token_id
    info = ctx.info.setdefault("samples", {})

    async def one(i: int) -> Trajectory:
        seq = ctx.sequence(prompt, index=i)
        stats = info[i] = {"turns": 0, "tool_calls": 0, "tool_errors": 0}
        answer = ""
        for turn in range(ctx.multi_turn.max_assistant_turns):
            if not seq.has_room():
                break
            res = await seq.generate()
            stats["turns"] += 1
            text = ctx.tokenizer.decode(res.output_ids, skip_special_tokens=True)
            answer, calls = parse_tool_calls(text, id_prefix=f"call_{turn}")
            if not calls:
                break
            if turn + 1 == ctx.multi_turn.max_assistant_turns:
                seq.finish_reason = "max_turns"  # it still wanted a tool: no turn left to read the result
                break
            messages = []
            for call in calls:
                stats["tool_calls"] += 1
                if call.error is not None:
                    out, err = f"Error: {call.error}", "bad_call"
                else:
                    result = await ctx.tools.call(call.name, call.arguments, tools_kwargs)
                    out, err = result.text, result.error
                if err is not None:
                    stats["tool_errors"] += 1
                content = chat.truncate_text(ctx.tokenizer, out, ctx.multi_turn.max_tool_response_tokens)
                messages.append({"role": "tool", "content": content, "tool_call_id": call.id,
                                 "name": call.name})
            obs = chat.observation_ids(ctx.tokenizer, messages,
                                       ended_with_eos=bool(res.output_ids) and res.output_ids[-1] == eos)
            if not seq.observe(obs):
                break
        stats["finish_reason"] = seq.finish_reason
        return seq.to_trajectory(reward=await ctx.score(row, answer))

    return await gather_samples(one(i) for i in range(ctx.n))

