"""The shared vocabulary: the one record type, typed configs. Imports nothing else of ours."""

from areal_like.api.trajectory import (
    SCHEMA_VERSION,
    Trajectory,
    TrajectoryGroup,
    decode_group,
    encode_group,
)

__all__ = ["SCHEMA_VERSION", "Trajectory", "TrajectoryGroup", "decode_group", "encode_group"]
