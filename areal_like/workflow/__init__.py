"""Rollout workflows: the protocol and single-turn RLVR."""

from areal_like.workflow.base import RolloutWorkflow
from areal_like.workflow.rlvr import RLVRWorkflow, sample_seed

__all__ = ["RLVRWorkflow", "RolloutWorkflow", "sample_seed"]
