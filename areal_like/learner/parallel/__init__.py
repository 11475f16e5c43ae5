"""The learner pool's parallelism: DP × PP × TP SPMD ranks over a plain HF causal LM.

    layout.py       `LayoutSpec` (sizes) and `ParallelLayout` — the one owner of ranks, groups, mesh
    parallelize.py  one function per strategy: pipeline split, tensor parallel, data parallel
    broadcast.py    rank 0's groups to every rank (msgpack bytes)
    spawn.py        per-rank entry (`init_pool_from_env`) and a fixed-batch runner for tests/benchmarks

The trainer itself (`areal_like.learner.trainer.Trainer`) applies these to its models; its loop is
`areal_like.learner.main`.
"""

from areal_like.learner.parallel.broadcast import broadcast_groups
from areal_like.learner.parallel.layout import LayoutSpec, ParallelLayout

__all__ = ["LayoutSpec", "ParallelLayout", "broadcast_groups"]
