"""The workflow protocol: one prompt in, one group of n scored trajectories out.

A workflow owns what happens inside a group (how many turns, which tools, how to score). It does
not know about the staleness gate, the buffer or policy versions beyond copying what the server
reports per token: the rollout worker admits the group, runs the workflow and commits the result.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from areal_like.api.trajectory import TrajectoryGroup
from areal_like.data.dataset import PromptRecord


@runtime_checkable
class RolloutWorkflow(Protocol):
    async def run_group(self, record: PromptRecord, group_id: str) -> TrajectoryGroup | None:
        """Generate and score the group for `record`; None = nothing usable (the worker frees the slot)."""
        ...
