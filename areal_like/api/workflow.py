"""The rollout workflow API: what a user's rollout script is given and what it returns.

`rollout.workflow=path/to/file.py:Name` selects a user's object; built-ins go by short name (`rlvr`,
`multi_turn`, `tool_agent`, `openai_agent`). A row's `agent_name` column picks one per row (verl).
Two shapes are accepted (`load_workflow` tells them apart):

**Episode workflow** — a coroutine function `async def name(ctx: EpisodeContext, row: PromptRecord)`,
or a class (constructed with no arguments) with `async def run_episode(self, ctx, row)`. It talks to
the generation servers token-in/token-out through `ctx` and returns the trajectories of one group —
a list of `Trajectory` (build them with `ctx.sequence(...)` / `TokenSequence.to_trajectory`) — or
None to skip the prompt (counted as `skipped`). Typically n samples:

    async def my_workflow(ctx, row):
        trajs = []
        for i in range(ctx.n):
            seq = ctx.sequence(row.input_ids, index=i)
            res = await seq.generate()                 # ids, behaviour logprobs, per-token versions
            text = ctx.tokenizer.decode(res.output_ids, skip_special_tokens=True)
            seq.append_observation(ctx.tokenizer.encode("\\nchecked.", add_special_tokens=False))  # loss mask 0
            trajs.append(seq.to_trajectory(reward=await ctx.score(row, text), finish_reason=res.finish_reason))
        return trajs

Interruptions by weight updates are handled underneath (`GenerationClient.generate` resubmits and
keeps each token's version); a workflow never invents a version or a logprob.

**Agent** — any object with `async def run(self, data: dict, **kwargs)` (a class constructed with no
arguments, or an instance). It is run once per sample with the row as `data` and `base_url`, `api_key`
and `model` for the `openai` SDK, pointed at the rollout worker's OpenAI-compatible proxy
(areal_like/agent/), which records every completion's tokens, logprobs and versions. It returns a
reward (float), per-completion rewards ({completion id: float}), or None when it set rewards
through `/rl/set_reward`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from areal_like.api.config import GenerationConfig, MultiTurnConfig
from areal_like.api.trajectory import Trajectory


@dataclass(frozen=True, slots=True)
class PromptRecord:
    prompt_id: str
    """Stable across runs: `extra_info.index` when present (prefixed by the file stem), else `stem:row`."""
    input_ids: list[int]
    ground_truth: str
    data_source: str
    extra_info: dict[str, Any] = field(default_factory=dict)
    raw_prompt: Any = None
    """The `prompt` cell as read: a str or a list of {"role", "content"} dicts."""
    row: dict[str, Any] = field(default_factory=dict)
    """The whole parquet row, every column as read (what a workflow is given, verl-style)."""

    @property
    def question(self) -> str:
        """The prompt as text, what a judge's `{question}` stands for: a string prompt as is, a chat
        prompt's last user message."""
        raw = self.raw_prompt
        if isinstance(raw, str):
            return raw
        if isinstance(raw, (list, tuple)):
            users = [m.get("content", "") for m in raw if isinstance(m, dict) and m.get("role") == "user"]
            if users:
                return str(users[-1])
        return "" if raw is None else str(raw)

    @property
    def agent_name(self) -> str | None:
        """verl's per-row workflow choice: the `agent_name` column (or `extra_info.agent_name`); None = the config's."""
        name = self.row.get("agent_name") or self.extra_info.get("agent_name")
        return str(name) if name else None

    @property
    def tools_kwargs(self) -> dict[str, Any]:
        """verl's per-row tool arguments, `{tool: {"create_kwargs": {…}, "execute_kwargs": {…}}}` (extra_info)."""
        kw = self.extra_info.get("tools_kwargs", self.row.get("tools_kwargs"))
        return dict(kw) if isinstance(kw, dict) else {}

    @property
    def interaction_kwargs(self) -> dict[str, Any]:
        kw = self.extra_info.get("interaction_kwargs", self.row.get("interaction_kwargs"))
        return dict(kw) if isinstance(kw, dict) else {}


class WorkflowLoadError(ValueError):
    """`rollout.workflow` (or a row's `agent_name`) names something that cannot be used; says how to fix it."""


class WorkflowResultError(ValueError):
    """A workflow (or agent) returned something that is not a group: not a list of Trajectory, a reward
    that is not a finite number (e.g. the string "1.0"), a foreign group id. The rollout worker counts it
    as a workflow failure of kind `bad_result` (`rollout.max_failure_fraction`)."""


def sample_seed(base_seed: int, group_id: str, index: int) -> int:
    """Per-sample sampling seed, stable across processes (Python's hash() is salted per process).

    Each sample of a group needs its own seed: with one seed per request, deterministic servers
    return n identical samples and GRPO's advantages are all zero.
    """
    h = hashlib.blake2b(f"{base_seed}:{group_id}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


# ---- token sequences: prompt, then generated turns (trained) and observations (not trained) --------
class TokenSequence:
    """One sample being built turn by turn: the prompt, then generated tokens (loss mask 1, the
    server's logprobs and versions) and observation tokens — tool results, user turns, template
    glue — (loss mask 0, logprob 0, version −1), in order. `to_trajectory` gives the one token
    sequence the learner trains on; its loss ignores the masked tokens (Search-R1 state masking)."""

    def __init__(self, ctx: "EpisodeContext", prompt_ids: list[int], index: int):
        if not prompt_ids:
            raise ValueError("TokenSequence needs a non-empty prompt")
        self.ctx = ctx
        self.index = index
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.mask: list[int] = []
        self.turns = 0
        self.finish_reason = ""
        # MoE rollout routing replay (ctx.routing): the experts each position was routed to, from position 0
        self.routes: list[np.ndarray] = []
        self.routes_n = 0
        self.routes_ok = bool(ctx.routing)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.ids

    @property
    def room(self) -> int:
        """Tokens left before the episode's context limit (rollout.multi_turn.max_total_tokens)."""
        return self.ctx.max_total_tokens - len(self)

    def has_room(self) -> bool:
        """Can another turn be generated? If not, the episode ends: finish reason `context_limit`."""
        if self.room > 0:
            return True
        self.finish_reason = "context_limit"
        return False

    def observe(self, ids) -> bool:
        """Append observation tokens if they leave room for a generated token after them; else append
        nothing, set finish reason `context_limit` and return False (end the episode cleanly)."""
        ids = list(ids)
        if len(ids) >= self.room:
            self.finish_reason = "context_limit"
            return False
        self.append_observation(ids)
        return True

    async def generate(self, *, max_new_tokens: int | None = None, stop_token_ids: list[int] | None = None):
        """Generate one assistant turn after everything so far and append it (trained). The turn's
        budget is the smaller of `max_new_tokens` (default: the per-turn limit) and the room left."""
        limit = max_new_tokens if max_new_tokens is not None else self.ctx.max_tokens_per_turn
        limit = min(limit, self.room)
        if limit <= 0:
            raise ValueError(f"no room left to generate ({len(self)} tokens of {self.ctx.max_total_tokens}): "
                             f"check `seq.room` first")
        res = await self.ctx.generate(self.all_ids, index=self.index, turn=self.turns, max_new_tokens=limit,
                                      stop_token_ids=stop_token_ids,
                                      routed_experts_start_len=self.routes_n if self.routes_ok else None)
        if self.routes_ok:  # this turn's positions (observations before it included: the server ran them)
            r = res.extra.get("routed_experts")
            if r is None:
                self.routes_ok = False
            else:
                self.routes.append(r)
                self.routes_n += len(r)
        self.append_generated(res.output_ids, res.output_logprobs, res.output_versions)
        self.turns += 1
        self.finish_reason = res.finish_reason
        return res

    def append_generated(self, ids, logprobs, versions) -> None:
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"generated ids ({len(ids)}), logprobs ({len(logprobs)}) and versions ({len(versions)}) "
                             f"must have the same length")
        self.ids += [int(t) for t in ids]
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(v) for v in versions]
        self.mask += [1] * len(ids)

    def append_observation(self, ids) -> None:
        """Tokens the policy did not generate (tool output, a user turn): in the context, not trained."""
        ids = [int(t) for t in ids]
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.mask += [0] * len(ids)

    def to_trajectory(self, *, reward: float, finish_reason: str | None = None) -> Trajectory:
        ctx = self.ctx
        # the positions the servers ran, [0, routes_n), when each turn returned its routes (a trailing observation
        # no server ran is routed by the learner itself)
        routes = (np.concatenate(self.routes) if self.routes_ok and self.routes and self.routes_n <= len(self) - 1
                  else None)
        return Trajectory.build(
            traj_id=f"{ctx.group_id}-{self.index}", group_id=ctx.group_id, prompt_id=ctx.row.prompt_id,
            prompt_ids=self.prompt_ids, output_ids=np.asarray(self.ids, dtype=np.int64),
            output_logprobs=self.logprobs, output_versions=self.versions, output_loss_mask=self.mask,
            reward=reward, finish_reason=finish_reason or self.finish_reason or "stop",
            data_source=ctx.row.data_source).with_routes(routes)


# ---- what a workflow is given -------------------------------------------------------------------
@dataclass
class EpisodeContext:
    """Everything one group's workflow may use. One context per group (`group_id`, `row`)."""

    client: Any
    """`GenerationClient` (engine/client.py): token-in/token-out over every generation server."""
    tokenizer: Any
    reward: Any
    """`RewardFn` (reward/fn.py): `await reward.score(data_source, text, ground_truth, extra_info)`; never
    raises, failures score 0 and are counted."""
    gen: GenerationConfig
    multi_turn: MultiTurnConfig
    row: PromptRecord
    group_id: str
    tools: Any = None
    """`ToolSet` (areal_like/tools) from `rollout.tools_config`, or None."""
    seed: int | None = None
    producer: str = ""
    max_context_len: int = 512
    info: dict[str, Any] = field(default_factory=dict)
    """Per-group counters a workflow may add to (e.g. tool calls); logged with the dump."""
    routing: bool = False
    """MoE rollout routing replay (train.routing_replay=rollout): `TokenSequence.generate` asks the servers for
    each position's routed experts and the trajectory carries them."""

    @property
    def n(self) -> int:
        return self.gen.n

    @property
    def max_tokens_per_turn(self) -> int:
        return self.multi_turn.max_tokens_per_turn or self.gen.max_new_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.multi_turn.max_total_tokens or self.max_context_len

    @property
    def stop_token_ids(self) -> list[int]:
        stop = list(self.gen.stop_token_ids)
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos not in stop:
            stop.append(int(eos))
        return stop

    def sampling_seed(self, index: int, turn: int = 0) -> int | None:
        """A stable seed per (group, sample, turn): deterministic servers still give n different samples."""
        if self.seed is None:
            return None
        return sample_seed(self.seed, self.group_id if turn == 0 else f"{self.group_id}/t{turn}", index)

    async def generate(self, input_ids: list[int], *, index: int, turn: int = 0, max_new_tokens: int | None = None,
                       stop_token_ids: list[int] | None = None, routed_experts_start_len: int | None = None):
        """One generation at the run's sampling settings (generation.temperature/top_p/top_k);
        `routed_experts_start_len`: also each position's routed experts from there (`GenerationClient.generate`)."""
        g = self.gen
        return await self.client.generate(
            list(input_ids), max_new_tokens=max_new_tokens or g.max_new_tokens, temperature=g.temperature,
            top_p=g.top_p, top_k=g.top_k,
            stop_token_ids=self.stop_token_ids if stop_token_ids is None else stop_token_ids,
            sampling_seed=self.sampling_seed(index, turn),
            rid=f"{self.group_id}-{index}" if turn == 0 else f"{self.group_id}-{index}.t{turn}",
            key=self.group_id,  # a group's samples go to one server: the prompt's prefix is cached once
            **({} if routed_experts_start_len is None else {"routed_experts_start_len": routed_experts_start_len}))

    async def score(self, row: PromptRecord, text: str) -> float:
        """The row's reward of `text`: verifiable (built-in by data_source, or custom_reward_function)
        and, in a run with a judge, the judge's grade of it for the row's prompt (judge.*)."""
        return await self.reward.score(row.data_source, text, row.ground_truth, row.extra_info,
                                       question=row.question, key=self.group_id)

    def sequence(self, prompt_ids: list[int] | None = None, *, index: int) -> TokenSequence:
        return TokenSequence(self, list(self.row.input_ids if prompt_ids is None else prompt_ids), index)


# ---- loading a user's workflow --------------------------------------------------------------------
@dataclass
class LoadedWorkflow:
    kind: str
    """"episode" or "agent"."""
    obj: Any
    """The coroutine function (episode), or the object with run_episode / run (instance)."""
    name: str


def _load_module(path: str, spec_text: str):
    if not os.path.isfile(path):
        raise WorkflowLoadError(f"{spec_text}: {path} does not exist (use path/to/file.py:Name)")
    mod_name = "areal_like_user_workflow_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise WorkflowLoadError(f"{spec_text}: cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # the script may import its neighbours
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise WorkflowLoadError(f"{spec_text}: importing {path} failed: {type(e).__name__}: {e}") from e
    return mod


def classify(obj: Any, spec_text: str) -> LoadedWorkflow:
    """Tell an episode workflow from an agent (see the module doc); WorkflowLoadError otherwise."""
    if inspect.isclass(obj):
        try:
            inst = obj()
        except TypeError as e:
            raise WorkflowLoadError(f"{spec_text}: {obj.__name__}() must be constructible without arguments "
                                    f"({e})") from e
        return classify(inst, spec_text)
    if inspect.iscoroutinefunction(obj):
        return LoadedWorkflow("episode", obj, getattr(obj, "__name__", spec_text))
    run_episode = getattr(obj, "run_episode", None)
    if run_episode is not None and inspect.iscoroutinefunction(run_episode):
        return LoadedWorkflow("episode", run_episode, type(obj).__name__)
    run = getattr(obj, "run", None)
    if run is not None and inspect.iscoroutinefunction(run):
        return LoadedWorkflow("agent", obj, type(obj).__name__)
    raise WorkflowLoadError(
        f"{spec_text}: {obj!r} is neither an episode workflow (async def f(ctx, row), or a class with "
        f"async def run_episode(self, ctx, row)) nor an agent (a class with async def run(self, data, **kwargs))")


def load_user_workflow(spec_text: str) -> LoadedWorkflow:
    """`path/to/file.py:Name` → the loaded workflow."""
    if ":" not in spec_text:
        raise WorkflowLoadError(f"rollout.workflow={spec_text!r}: want a built-in name or path/to/file.py:Name")
    path, name = spec_text.rsplit(":", 1)
    mod = _load_module(path, f"rollout.workflow={spec_text}")
    if not hasattr(mod, name):
        public = [k for k in vars(mod) if not k.startswith("_")]
        raise WorkflowLoadError(f"rollout.workflow={spec_text}: {path} defines no {name!r} (it defines: "
                                f"{', '.join(public[:20])})")
    return classify(getattr(mod, name), f"rollout.workflow={spec_text}")
