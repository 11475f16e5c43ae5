"""Server side of weight sync: join the weight group, receive bucketed tensors, hand them back.

Receiving is blocking torch.distributed work: callers run it on a thread (never on the event loop).
This module does not load tensors into a model — the engine does, all or nothing, after the whole
bucket arrived (so a failed receive leaves the served weights untouched).
"""

from __future__ import annotations

import torch

from areal_like.weights.group import WeightGroup, init_weight_group

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "uint8": torch.uint8, "int8": torch.int8, "bool": torch.bool,
}


def parse_dtype(name: str) -> torch.dtype:
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}: use one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unflatten_bucket(buf_u8: torch.Tensor, names: list[str], dtypes: list[torch.dtype],
                     shapes: list[list[int]]) -> dict[str, torch.Tensor]:
    """Split one uint8 buffer (tensors' bytes concatenated in `names` order) into named tensors."""
    out: dict[str, torch.Tensor] = {}
    off = 0
    for name, dt, shape in zip(names, dtypes, shapes):
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dt).element_size()
        chunk = buf_u8[off:off + nbytes]
        if off % torch.empty((), dtype=dt).element_size():
            # SGLang's rule (FlattenedTensorBucket.empty): a bucket carries no padding, so the sender
            # orders tensors to keep every offset aligned (`push.align_bucket`); refuse what it would.
            raise ValueError(f"Unaligned received tensor {name}: byte offset {off}, dtype {dt}")
        out[name] = chunk.view(dt).view(*shape) if nbytes else torch.empty(shape, dtype=dt, device=buf_u8.device)
        off += nbytes
    if off != buf_u8.numel():
        raise ValueError(f"bucket holds {buf_u8.numel()} bytes but the metadata describes {off}")
    return out


def bucket_nbytes(dtypes: list[torch.dtype], shapes: list[list[int]]) -> int:
    total = 0
    for dt, shape in zip(dtypes, shapes):
        numel = 1
        for d in shape:
            numel *= int(d)
        total += numel * torch.empty((), dtype=dt).element_size()
    return total


class WeightReceiver:
    """The weight groups this server has joined, by name."""

    def __init__(self, device: str | torch.device = "cpu", num_devices: int = 1):
        self.device = torch.device(device)
        self.num_devices = num_devices  # this server's ranks in the group (1: no tensor parallel here)
        self.groups: dict[str, WeightGroup] = {}
        # Grow-only receive buffers per (group, slot): fresh multi-MiB buffers per bucket cost page
        # faults and zeroing while the trainer waits. The caller picks the slot and reuses one only
        # after the engine copied the tensors of its last bucket out (the server: bucket k+1 is
        # received into the other slot while bucket k loads).
        self._bufs: dict[tuple[str, int], torch.Tensor] = {}

    def init_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str, timeout_s: float) -> WeightGroup:
        """Blocks until every rank joined (run on a thread)."""
        if group_name in self.groups:
            raise ValueError(f"weight group {group_name!r} already exists: destroy it first")
        group = init_weight_group(master_address=master_address, master_port=master_port, world_size=world_size,
                                  rank=rank_offset, group_name=group_name, backend=backend, timeout_s=timeout_s)
        self.groups[group_name] = group
        return group

    def receive(self, *, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load_format: str | None, slot: int = 0) -> dict[str, torch.Tensor]:
        """Receive one update's tensors (blocking). Per name, or one flattened uint8 bucket (into the
        group's buffer `slot`: the returned tensors are views of it until that slot is received into again)."""
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight group {group_name!r}: call /init_weights_update_group first")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise ValueError(f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}")
        dts = [parse_dtype(d) for d in dtypes]
        # gloo moves host memory; the engine's load copies to the model's device afterwards.
        device = torch.device("cpu") if group.backend == "gloo" else self.device
        if load_format == "flattened_bucket":
            nbytes = bucket_nbytes(dts, shapes)
            buf = self.receive_bytes(group_name=group_name, nbytes=nbytes, slot=slot,
                                     what=f"a flattened bucket of {len(names)} tensors ({nbytes} bytes)")
            return unflatten_bucket(buf, names, dts, shapes)
        if load_format not in (None, "", "direct"):
            raise ValueError(f"unknown load_format {load_format!r}: use null or 'flattened_bucket'")
        out = {}
        for name, dt, shape in zip(names, dts, shapes):
            t = torch.empty(shape, dtype=dt, device=device)
            group.broadcast(t, 0, what=f"tensor {name!r}")
            out[name] = t
        return out

    def receive_bytes(self, *, group_name: str, nbytes: int, slot: int = 0, what: str = "") -> torch.Tensor:
        """Receive one flat uint8 bucket of `nbytes` (a delta update's: weights/delta.py decodes it) into the
        group's buffer `slot`; the returned tensor is a view of it until that slot is received into again."""
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"no weight group {group_name!r}: call /init_weights_update_group first")
        device = torch.device("cpu") if group.backend == "gloo" else self.device
        big = self._bufs.get((group_name, slot))
        if big is None or big.numel() < nbytes or big.device != device:
            big = self._bufs[(group_name, slot)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        buf = big[:nbytes]
        group.broadcast(buf, 0, what=what or f"a bucket of {nbytes} bytes")
        return buf

    def destroy(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        for key in [k for k in self._bufs if k[0] == group_name]:
            del self._bufs[key]
        if group is None:
            raise ValueError(f"no weight group {group_name!r}")
        group.destroy()

    def close(self) -> None:
        for name in list(self.groups):
            self.destroy(name)
