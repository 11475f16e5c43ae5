"""Rank 0 reads the buffer; every rank trains: the step's groups sent to the whole pool."""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from areal_like.api.trajectory import TrajectoryGroup
from areal_like.learner.parallel.layout import ParallelLayout

_GROUPS_DECODER = msgspec.msgpack.Decoder(list[TrajectoryGroup])
_GROUPS_ENCODER = msgspec.msgpack.Encoder()


def broadcast_groups(groups: list[TrajectoryGroup] | None, version: int, layout: ParallelLayout
                     ) -> tuple[list[TrajectoryGroup], int]:
    """Rank 0's (groups, version) on every rank, as msgpack bytes (never pickle, DESIGN invariant 6).

    The other ranks first wait outside any collective until rank 0 has its groups in hand (however
    long it waits for data: `leader_ready`), then two broadcasts (size, then bytes) over the pool's
    host world group — gloo, since these are CPU tensors (NCCL would refuse them) — under its timeout.
    """
    if not layout.distributed or layout.world_size == 1:
        assert groups is not None
        return groups, version
    layout.leader_ready("send the next batch of groups (it waits for them in the buffer)")
    if layout.rank == 0:
        payload = _GROUPS_ENCODER.encode(groups)
        header = torch.tensor([len(payload), version], dtype=torch.int64)
    else:
        header = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(header, src=0, group=layout.host_world_group)
    n, version = (int(x) for x in header.tolist())  # host sync: the payload size is needed to allocate
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if layout.rank == 0
           else torch.empty(n, dtype=torch.uint8))
    dist.broadcast(buf, src=0, group=layout.host_world_group)
    return (groups if layout.rank == 0 else _GROUPS_DECODER.decode(buf.numpy().tobytes())), version
