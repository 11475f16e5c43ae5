"""The learner pool's parallelism: DP × PP × TP SPMD ranks over a plain HF causal LM.

    layout.py       `LayoutSpec` (sizes) and `ParallelLayout` — the one owner of ranks, groups, mesh
    parallelize.py  one function per strategy: pipeline split, tensor parallel, activation
                    checkpointing, data parallel (FSDP2 `fully_shard`, or the replicated reducer)
    sharded_model.py `ShardedModel`: one model on this rank — optimizer, gradient reduction and
                    clipping, full state dicts gathered from the shards (pushes, checkpoints)
    broadcast.py    rank 0's groups to every rank (msgpack bytes)
    spawn.py        per-rank entry (`init_pool_from_env`) and a fixed-batch runner for tests/benchmarks

`areal_like.learner.model.build_model` applies these to each model (load → convert → parallelize);
the trainer (`areal_like.learner.trainer.Trainer`) keeps the RL step; its loop is `areal_like.learner.main`.
"""

from areal_like.learner.parallel.broadcast import broadcast_groups
from areal_like.learner.parallel.layout import LayoutSpec, ParallelLayout

__all__ = ["LayoutSpec", "ParallelLayout", "broadcast_groups"]
