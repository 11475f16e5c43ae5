"""Rollout workflows: the protocol, single-turn RLVR, and the registry `rollout.workflow` selects from."""

from areal_like.workflow.base import RolloutWorkflow
from areal_like.workflow.rlvr import RLVRWorkflow, sample_seed

# `rollout.workflow` name → class, constructed as cls(client, reward_fn, gen_cfg, tokenizer, producer=, seed=).
# Keep the names equal to `areal_like.api.config.WORKFLOW_NAMES` (config load checks them there).
WORKFLOWS: dict[str, type] = {"rlvr": RLVRWorkflow}


def get_workflow_class(name: str) -> type:
    """The workflow class registered under `name`; a KeyError naming the known names otherwise."""
    try:
        return WORKFLOWS[name]
    except KeyError:
        raise KeyError(f"rollout.workflow={name!r} is not a known workflow: use one of {', '.join(WORKFLOWS)}") from None


__all__ = ["RLVRWorkflow", "RolloutWorkflow", "WORKFLOWS", "get_workflow_class", "sample_seed"]
