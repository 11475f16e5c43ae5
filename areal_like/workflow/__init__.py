"""Rollout workflows: the built-in episode workflows and the names `rollout.workflow` selects from (the
runner the rollout worker drives, which also reaches the agents, is `areal_like.rollout.workflows`).

    rollout.workflow / a row's agent_name
        ├─ rlvr, multi_turn, tool_agent  → built-in episode workflows (this package)
        ├─ openai_agent                   → built-in agent (areal_like/agent/builtin.py) via the proxy
        └─ path/to/file.py:Name           → a user's episode workflow or agent (areal_like/api/workflow.py)

`areal_like.rollout.workflows.WorkflowRunner` runs them: it sits above both this package and the agents.
"""

from __future__ import annotations

from areal_like.workflow.base import EpisodeWorkflow, RolloutWorkflow
from areal_like.workflow.multi_turn import multi_turn
from areal_like.workflow.rlvr import RLVRWorkflow, rlvr, sample_seed
from areal_like.workflow.tool_agent import tool_agent

EPISODES = {"rlvr": rlvr, "multi_turn": multi_turn, "tool_agent": tool_agent}
AGENTS = ("openai_agent",)
# Keep equal to `areal_like.api.config.WORKFLOW_NAMES` (config load checks names there, without torch).
WORKFLOWS: tuple[str, ...] = tuple(EPISODES) + AGENTS
VERL_ALIASES = {"single_turn_agent": "rlvr"}
"""verl's agent-loop names, accepted in a row's `agent_name`."""


def get_workflow_class(name: str) -> type:
    """The class behind a built-in single-turn name (kept for callers that build `RLVRWorkflow` directly)."""
    if name == "rlvr":
        return RLVRWorkflow
    raise KeyError(f"rollout.workflow={name!r}: only rlvr has a class; use "
                   "areal_like.rollout.workflows.WorkflowRunner for the others")


__all__ = ["EpisodeWorkflow", "RLVRWorkflow", "RolloutWorkflow", "WORKFLOWS", "VERL_ALIASES", "get_workflow_class",
           "sample_seed", "EPISODES", "AGENTS", "multi_turn", "rlvr", "tool_agent"]
