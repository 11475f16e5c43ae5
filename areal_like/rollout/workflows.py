"""The runner the rollout worker drives per group, and the loader of `rollout.workflow` names: the
built-in episode workflows (areal_like/workflow), the built-in agent (areal_like/agent/builtin.py, run
through the worker's OpenAI-compatible proxy) and users' `path/to/file.py:Name`.

`WorkflowRunner.run_group(record, group_id)` picks the row's workflow (verl: the `agent_name` column,
else the config's), gives an episode workflow its `EpisodeContext`, runs an agent once per sample
against the worker's proxy (started on first use), and turns the result into the group the buffer takes.
It lives here, above both the workflows and the agents it drives.
"""

from __future__ import annotations

import asyncio
from typing import Any

from areal_like.api.workflow import (LoadedWorkflow, WorkflowLoadError, WorkflowResultError, classify,
                                     load_user_workflow)
from areal_like.workflow import EPISODES, VERL_ALIASES, WORKFLOWS, tool_agent
from areal_like.workflow.base import EpisodeWorkflow, make_group


def load_workflow(name: str) -> LoadedWorkflow:
    """A built-in by name (or a verl alias), or `path/to/file.py:Name`; WorkflowLoadError naming the fix."""
    name = VERL_ALIASES.get(name, name)
    if name in EPISODES:
        return LoadedWorkflow("episode", EPISODES[name], name)
    if name == "openai_agent":
        from areal_like.agent.builtin import OpenAIToolAgent

        return classify(OpenAIToolAgent, name)
    if ":" in name:
        return load_user_workflow(name)
    raise WorkflowLoadError(f"workflow {name!r} is not known: use one of {', '.join(WORKFLOWS)} "
                            f"(or {', '.join(VERL_ALIASES)}), or path/to/file.py:Name for your own")


class WorkflowRunner:
    """What the rollout worker calls per group. See the module doc."""

    def __init__(self, cfg, client, reward_fn, tokenizer, *, producer: str, tools: Any = None):
        self.cfg = cfg
        self.client = client
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.producer = producer
        self.tools = tools
        self.default = cfg.rollout.workflow
        self._loaded: dict[str, LoadedWorkflow] = {}
        self._proxy = None
        self._proxy_lock = asyncio.Lock()
        self.episode_info: dict[str, dict] = {}
        """group id → the episode's counters (ctx.info, e.g. tool calls) for the dump; the worker pops them."""
        self.resolve(self.default)  # a bad file fails at start, naming rollout.workflow

    def resolve(self, name: str, where: str = "rollout.workflow") -> LoadedWorkflow:
        wf = self._loaded.get(name)
        if wf is None:
            try:
                wf = load_workflow(name)
            except WorkflowLoadError as e:
                raise WorkflowLoadError(f"{where}={name!r}: {e}") from None
            if wf.obj is tool_agent and self.tools is None:
                raise WorkflowLoadError(f"{where}={name!r} needs tools: set rollout.tools_config=path/to/tools.yaml")
            self._loaded[name] = wf
        return wf

    def check_rows(self, records) -> list[str]:
        """Resolve every `agent_name` the rows use, at start: a typo fails now, naming the row."""
        names = []
        for r in records:
            n = r.agent_name
            if n and n not in self._loaded:
                self.resolve(n, where=f"row {r.prompt_id} agent_name")
                names.append(n)
        return names

    def episode_workflow(self, episode, name: str) -> EpisodeWorkflow:
        c = self.cfg
        return EpisodeWorkflow(episode, self.client, self.reward_fn, c.generation, self.tokenizer,
                               producer=self.producer, seed=c.seed, multi_turn=c.rollout.multi_turn, tools=self.tools,
                               max_context_len=c.resolved_max_context_len(), name=name,
                               # train.routing_replay=rollout: every generation records its routed experts
                               routing=c.train.routing_replay == "rollout")

    async def proxy(self):
        """The worker's one agent proxy, started by the first agent group (concurrent first groups wait
        for it rather than each starting a server)."""
        async with self._proxy_lock:
            if self._proxy is None:
                from areal_like.agent.proxy import AgentProxy

                c = self.cfg
                proxy = AgentProxy(self.client, self.tokenizer, c.generation, c.rollout.multi_turn, seed=c.seed,
                                   max_context_len=c.resolved_max_context_len())
                await proxy.start()
                self._proxy = proxy
        return self._proxy

    def workflow_name(self, record) -> str:
        """The workflow that runs `record`: its `agent_name`, else rollout.workflow (verl aliases resolved)."""
        name = record.agent_name or self.default
        return VERL_ALIASES.get(name, name)

    async def run_group(self, record, group_id: str, *, gen=None, keep_info: bool = True):
        """The group for `record` (None = skipped). `gen` replaces the run's generation settings (the
        evaluator passes eval.n / eval.temperature / eval.top_p); `keep_info`: leave the episode's
        counters in `episode_info` for the dump (the worker pops them)."""
        name = record.agent_name or self.default
        wf = self.resolve(name)
        ew = self.episode_workflow(wf.obj if wf.kind == "episode" else None, wf.name)
        if gen is not None:
            ew.gen_cfg = gen
        ctx = ew.context(record, group_id)
        if wf.kind == "episode":
            out = await wf.obj(ctx, record)
        else:
            from areal_like.agent.runner import run_agent_group

            mt = self.cfg.rollout.multi_turn
            out = await run_agent_group(ctx, wf.obj, await self.proxy(), export_style=mt.export_style,
                                        turn_discount=mt.turn_discount)
        try:
            group = make_group(out, record, group_id, self.producer, wf.name)
        except (TypeError, ValueError) as e:  # not a group: counted as `bad_result` by the rollout worker
            raise WorkflowResultError(f"workflow {wf.name} (prompt {record.prompt_id}): {e}") from None
        if group is not None and ctx.info and keep_info:
            self.episode_info[group_id] = ctx.info
        return group

    async def close(self) -> None:
        if self._proxy is not None:
            await self._proxy.close()
            self._proxy = None
        if self.tools is not None:
            await self.tools.close()
