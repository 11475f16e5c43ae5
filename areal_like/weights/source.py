"""What a weight push (or an HF export) reads: a `WeightSource`, opened one bucket at a time.

A source knows every tensor's name, shape and dtype up front (`meta`, the whole model's, in the
order `save_pretrained` writes) without holding the tensors; `open(indices)` yields those tensors
one at a time. The pushers plan their buckets from `meta` alone and copy each yielded tensor into
the bucket (cast to the servers' dtype) before asking for the next, so a push holds at most one
bucket plus the tensor in hand — whether the tensors are already in memory (`LocalWeights`, a
one-process learner) or gathered from a sharded learner pool tensor by tensor
(`learner.parallel.sharded_model.GatheredWeights`, `gathers=True`: its `open` runs collectives, so
the pusher opens one bucket at a time and never overlaps two).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

TensorMeta = tuple[str, tuple[int, ...], torch.dtype]  # (HF name, shape, dtype as the source yields it)


class WeightSource(Protocol):
    meta: Sequence[TensorMeta]
    device: torch.device  # where `open` yields the tensors (a push's bucket buffer lives there)
    # True: `open` runs collectives (all-gathers over the learner's shards); one bucket open at a time.
    gathers: bool

    def open(self, indices: Sequence[int]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors `meta[i]` for i in `indices`, in that order, one at a time: the caller drops
        each before asking for the next."""
        ...


class LocalWeights:
    """A source over tensors in memory (a list of (name, tensor)); `open` yields them as they are."""

    gathers = False

    def __init__(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        self._tensors = list(named_tensors)
        self.meta = [(n, tuple(t.shape), t.dtype) for n, t in self._tensors]
        self.device = self._tensors[0][1].device if self._tensors else torch.device("cpu")

    def open(self, indices: Sequence[int]) -> Iterator[tuple[str, torch.Tensor]]:
        for i in indices:
            yield self._tensors[i]


def gather_in(src: WeightSource, dtype: torch.dtype | None) -> WeightSource:
    """Ask a gathering source (a sharded learner's) to gather its floating-point tensors in `dtype`, the
    servers' (issue 40 item 7: the shards are cast before the all-gather and the stage transfer, so an
    fp32 master crosses the pool as bf16 for bf16 servers); a source without the knob is left as it is."""
    if dtype is not None and hasattr(src, "wire_dtype"):
        src.wire_dtype = dtype  # type: ignore[attr-defined]
    return src


def as_source(weights: WeightSource | Sequence[tuple[str, torch.Tensor]]) -> WeightSource:
    """A `WeightSource` as it is; a list of (name, tensor) wrapped in `LocalWeights`."""
    return weights if hasattr(weights, "open") and hasattr(weights, "meta") else LocalWeights(weights)  # type: ignore[arg-type]


def wire_dtype_of(dtype: torch.dtype, to: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor of `dtype` travels in: `to` (the servers' dtype) for floating point, None =
    as it is; integer and bool buffers are never cast."""
    return to if to is not None and dtype.is_floating_point else dtype


def meta_nbytes(m: TensorMeta, to: torch.dtype | None) -> int:
    n = 1
    for s in m[1]:
        n *= s
    return n * wire_dtype_of(m[2], to).itemsize


def plan_buckets(meta: Sequence[TensorMeta], bucket_bytes: int, to: torch.dtype | None = None, *,
                 aligned: bool = True) -> list[list[int]]:
    """Indices of `meta` cut, in order, into buckets of at most `bucket_bytes` as sent (cast to `to`;
    a bigger tensor goes alone). `aligned`: each bucket ordered by element size as sent, largest
    first (stable within one size) — a flattened bucket carries no padding, and the receiver (SGLang's
    `FlattenedTensorBucket`, and ours) refuses an offset that is not a multiple of its dtype's size;
    element sizes are powers of two, so in this order every offset is aligned."""
    buckets: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, m in enumerate(meta):
        n = meta_nbytes(m, to)
        if cur and size + n > bucket_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        buckets.append(cur)
    if aligned:
        buckets = [sorted(b, key=lambda i: -wire_dtype_of(meta[i][2], to).itemsize) for b in buckets]
    return buckets


def fill_bucket(tensors: Iterator[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta], out: torch.Tensor,
                to: torch.dtype | None = None) -> torch.Tensor:
    """Copy the tensors, as they come, into the uint8 buffer `out` back to back (floating-point ones
    cast to `to` on the way: `copy_` converts, so no cast copy is ever held); returns the filled
    prefix. `metas` are the tensors' metadata, in the same order. Each tensor is dropped before the
    next is asked for (a gathered one is freed at once)."""
    off = 0
    it = iter(tensors)
    for m in metas:
        name, t = next(it)
        if name != m[0]:
            raise RuntimeError(f"weight source yielded {name!r} where {m[0]!r} was planned")
        wd, size = wire_dtype_of(t.dtype, to), meta_nbytes(m, to)
        dst = out[off:off + size]
        src = t.detach().reshape(-1)
        if wd == t.dtype:
            dst.copy_(src.contiguous().view(torch.uint8))
        elif off % wd.itemsize == 0:
            dst.view(wd).copy_(src)  # the cast lands in the bucket
        else:  # an offset not aligned to the dtype (unaligned order): one tensor's cast copy
            dst.copy_(src.to(wd).view(torch.uint8))
        del t, src, name
        off += size
    return out[:off]
