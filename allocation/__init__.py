"""Allocation strings → typed `Allocation` → `Placement` on nodes × devices.

Pure standard library: imports neither torch nor redis, so ``launcher plan`` answers instantly.
Parsing rules live in `allocation.parser`, the typed value in `allocation.spec`, device placement in
`allocation.placement`; every error is an `AllocationError`. Nothing here starts processes.
"""

from allocation.errors import AllocationError
from allocation.parser import parse_allocation
from allocation.placement import (
    DEFAULT_DEVICES_PER_NODE,
    ComponentPlacement,
    GenerationPlacement,
    Placement,
    RankPlacement,
    ServerPlacement,
    nodes_needed,
    place,
    rank_of,
    resolve_cluster,
)
from allocation.spec import (
    GENERATION_BACKENDS,
    ROLES,
    RUNNABLE_GENERATION_BACKENDS,
    RUNNABLE_TRAINING_BACKENDS,
    TRAINING_BACKENDS,
    Allocation,
    Component,
    GenerationSpec,
    Kind,
    ParallelDims,
    TrainingSpec,
)

__all__ = [
    "DEFAULT_DEVICES_PER_NODE",
    "GENERATION_BACKENDS",
    "ROLES",
    "RUNNABLE_GENERATION_BACKENDS",
    "RUNNABLE_TRAINING_BACKENDS",
    "TRAINING_BACKENDS",
    "Allocation",
    "AllocationError",
    "Component",
    "ComponentPlacement",
    "GenerationPlacement",
    "GenerationSpec",
    "Kind",
    "ParallelDims",
    "Placement",
    "RankPlacement",
    "ServerPlacement",
    "TrainingSpec",
    "nodes_needed",
    "parse_allocation",
    "place",
    "rank_of",
    "resolve_cluster",
]
