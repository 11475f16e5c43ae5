"""The protocol the rollout worker drives, and the adapter that runs an episode workflow through it.

A workflow owns what happens inside a group (how many turns, which tools, how to score). It does
not know about the staleness gate, the buffer or policy versions beyond copying what the server
reports per token: the rollout worker admits the group, runs the workflow and commits the result.

User-facing shapes (episode workflows, agents) are in `areal_like/api/workflow.py`; `EpisodeWorkflow`
turns one episode function into the `run_group` the worker calls.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from typing import Any, Protocol, runtime_checkable

from areal_like.api.config import GenerationConfig, MultiTurnConfig
from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.api.workflow import EpisodeContext
from areal_like.api.workflow import PromptRecord

logger = logging.getLogger(__name__)


@runtime_checkable
class RolloutWorkflow(Protocol):
    async def run_group(self, record: PromptRecord, group_id: str) -> TrajectoryGroup | None:
        """Generate and score the group for `record`; None = nothing usable (the worker frees the slot)."""
        ...


class EpisodeWorkflow:
    """`run_group` for an episode function `async def f(ctx, row) -> list[Trajectory] | None`."""

    def __init__(self, episode, client, reward_fn, gen_cfg: GenerationConfig, tokenizer, *, producer: str,
                 seed: int | None = None, multi_turn: MultiTurnConfig | None = None, tools: Any = None,
                 max_context_len: int = 512, name: str = "", routing: bool = False):
        self.episode = episode
        self.client = client
        self.reward_fn = reward_fn
        self.gen_cfg = gen_cfg
        self.tokenizer = tokenizer
        self.producer = producer
        self.seed = seed
        self.multi_turn = multi_turn or MultiTurnConfig()
        self.tools = tools
        self.max_context_len = max_context_len
        self.routing = routing
        self.name = name or getattr(episode, "__name__", "episode")

    def context(self, record: PromptRecord, group_id: str) -> EpisodeContext:
        return EpisodeContext(client=self.client, tokenizer=self.tokenizer, reward=self.reward_fn, gen=self.gen_cfg,
                              multi_turn=self.multi_turn, row=record, group_id=group_id, tools=self.tools,
                              seed=self.seed, producer=self.producer, max_context_len=self.max_context_len,
                              routing=self.routing)

    async def run_group(self, record: PromptRecord, group_id: str) -> TrajectoryGroup | None:
        out = await self.episode(self.context(record, group_id), record)
        return make_group(out, record, group_id, self.producer, self.name)


def make_group(out: Any, record: PromptRecord, group_id: str, producer: str, name: str) -> TrajectoryGroup | None:
    """A workflow's return value → the group the buffer takes (None = skip the prompt)."""
    if out is None:
        return None
    if isinstance(out, TrajectoryGroup):
        trajs = list(out.trajectories)
    elif isinstance(out, (list, tuple)) and all(isinstance(t, Trajectory) for t in out):
        trajs = list(out)
    else:
        raise TypeError(f"workflow {name} returned {type(out).__name__}: return a list of Trajectory "
                        f"(TokenSequence.to_trajectory) or None to skip the prompt")
    if not trajs:
        return None
    for t in trajs:
        t.validate()
        r = t.reward
        if isinstance(r, bool) or not isinstance(r, numbers.Real) or not math.isfinite(r):
            raise ValueError(f"workflow {name}: trajectory {t.traj_id} has reward {r!r}: a reward must be a finite "
                             f"number (float)")
        if t.group_id != group_id:
            raise ValueError(f"workflow {name}: trajectory {t.traj_id} has group_id {t.group_id!r}, want {group_id!r} "
                             f"(build it with ctx.sequence(...).to_trajectory)")
    if len({t.traj_id for t in trajs}) != len(trajs):
        raise ValueError(f"workflow {name}: two trajectories of group {group_id} share a traj_id")
    if all(int(t.mask_np().sum()) == 0 for t in trajs):
        logger.warning("group %s (prompt %s): no sample produced a trained token; dropping it", group_id,
                       record.prompt_id)
        return None
    return TrajectoryGroup(group_id=group_id, prompt_id=record.prompt_id, trajectories=trajs,
                           created_at=time.time(), producer=producer)
