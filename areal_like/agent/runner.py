"""Run a user's agent (`async def run(self, data, **kwargs)`) for one group and turn its proxy
sessions into trajectories.

```
 run_agent_group(ctx, agent, proxy)
   for i in range(ctx.n), concurrently:
     session = proxy.open_session(group_id, i)
     reward  = await agent.run(row, base_url, api_key=session.api_key, model, tools, max_turns, score)
     trajs  += session_trajectories(session, reward)        # concat or individual
     finally: proxy.close_session(session)
```
An agent that raises fails the whole group: the other samples are cancelled, every session is closed,
then the exception propagates (the rollout worker counts the group as failed and retries the prompt).
This module does not start the proxy, pick the agent or commit the group — the rollout worker does.
"""

from __future__ import annotations

import asyncio
from typing import Any

from areal_like.agent.proxy import AgentProxy, session_trajectories
from areal_like.api.trajectory import Trajectory
from areal_like.api.workflow import WorkflowResultError

AGENT_MODEL = "areal_like"
"""The `model` name agents are given (the proxy serves any name; this one is listed by /v1/models)."""


async def run_agent_group(ctx, agent, proxy: AgentProxy, *, export_style: str = "concat",
                          turn_discount: float = 1.0) -> list[Trajectory] | None:
    """The group's trajectories (ctx.n agent runs), or None when no run made a completion.

    `ctx` is an `EpisodeContext` (api/workflow.py). Each run gets `dict(ctx.row.row)` as `data` (with
    `prompt` filled from the record when the row has none) and the keyword arguments `base_url`,
    `api_key`, `model`, `tools` (ctx.tools: a ToolSet or None), `max_turns`
    (rollout.multi_turn.max_assistant_turns) and `score` (`async (text) -> float`, the row's reward).
    Its return value is the reward: a float, {completion id: float}, or None (set via /rl/set_reward)."""
    row = ctx.row

    async def score(text: str) -> float:
        return await ctx.score(row, text)

    async def one(i: int) -> list[Trajectory]:
        session = proxy.open_session(ctx.group_id, i)
        try:
            data: dict[str, Any] = dict(row.row)
            if "prompt" not in data and row.raw_prompt is not None:
                data["prompt"] = row.raw_prompt
            reward = await agent.run(data, base_url=proxy.base_url, api_key=session.api_key, model=AGENT_MODEL,
                                     tools=ctx.tools, max_turns=ctx.multi_turn.max_assistant_turns, score=score)
            try:
                trajs = session_trajectories(session, group_id=ctx.group_id, prompt_id=row.prompt_id,
                                             data_source=row.data_source, index=i, reward=reward,
                                             export_style=export_style, turn_discount=turn_discount)
            except (TypeError, ValueError) as e:  # e.g. a reward "1.0": the rollout worker counts `bad_result`
                raise WorkflowResultError(f"agent {type(agent).__name__} returned {reward!r} for sample {i}: {e}") from None
            info = ctx.info
            info["agent_completions"] = info.get("agent_completions", 0) + len(session.completions)
            if session.refused:  # past rollout.multi_turn.max_completions_per_episode (proxy module doc)
                info["agent_completions_refused"] = info.get("agent_completions_refused", 0) + session.refused
            return trajs
        finally:
            proxy.close_session(session)

    tasks = [asyncio.ensure_future(one(i)) for i in range(ctx.n)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # a failed sample, or this coroutine cancelled: stop the others and let them close their sessions
        for t in tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:  # the first failure in sample order (not a cancellation we caused)
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()
    out = [traj for t in tasks for traj in t.result()]
    return out or None
