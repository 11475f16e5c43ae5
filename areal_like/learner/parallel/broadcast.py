"""Rank 0 reads the buffer; every rank trains: the step's groups sent to the whole pool. And the two
byte moves a critic pool needs (`broadcast_bytes`, `gather_bytes`): rank 0 alone talks to the other pool."""

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


def broadcast_bytes(payload: bytes | None, layout: ParallelLayout) -> bytes:
    """Rank 0's `payload` on every rank of the pool (the host world group, under its timeout); the
    others pass None. No `leader_ready` here: every rank is already in step (inside `train_step`, or
    the critic pool's loop after its own `leader_ready`)."""
    if not layout.distributed or layout.world_size == 1:
        assert payload is not None
        return payload
    n = torch.tensor([len(payload) if layout.rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(n, src=0, group=layout.host_world_group)
    buf = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if layout.rank == 0 and len(payload)
           else torch.empty(int(n.item()), dtype=torch.uint8))
    if int(n.item()):
        dist.broadcast(buf, src=0, group=layout.host_world_group)
    return payload if layout.rank == 0 else buf.numpy().tobytes()


def gather_bytes(payload: bytes, layout: ParallelLayout) -> list[bytes]:
    """Every rank's `payload`, in rank order, on rank 0 ([] on the others): sizes first, then one
    all-gather of the padded buffers (gloo has no variable-size gather)."""
    if not layout.distributed or layout.world_size == 1:
        return [payload]
    g = layout.host_world_group
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(layout.world_size)]
    dist.all_gather(sizes, torch.tensor([len(payload)], dtype=torch.int64), group=g)
    n = [int(s.item()) for s in sizes]
    top = max(max(n), 1)
    mine = torch.zeros(top, dtype=torch.uint8)
    if payload:
        mine[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    bufs = [torch.empty(top, dtype=torch.uint8) for _ in range(layout.world_size)]
    dist.all_gather(bufs, mine, group=g)
    return [b[:k].numpy().tobytes() for b, k in zip(bufs, n)] if layout.rank == 0 else []
