"""The learner pool: DP × PP × TP SPMD ranks over a plain HF causal LM.

    layout.py       `LayoutSpec` (sizes) and `ParallelLayout` — the one owner of ranks, groups, mesh
    parallelize.py  one function per strategy: pipeline split, tensor parallel, data parallel
    learner.py      `ParallelLearner` — the train step, full-tensor gather, checkpoints
    spawn.py        per-rank entry (`init_pool_from_env`) and a fixed-batch runner for tests/benchmarks

How a learner loop drives the pool (every rank runs the same loop; rank 0 alone talks to Redis and
the servers):

    init_pool_from_env(cfg.train.collective_timeout_s)          # RANK, WORLD_SIZE, MASTER_* env
    learner = ParallelLearner(model_path, cfg.train, LayoutSpec.from_allocation(cfg.allocation),
                              temperature=cfg.generation.temperature, dtype=cfg.model.dtype)
    ckpt = CheckpointManager.from_config(cfg.train, run_dir=run_dir)
    extra = ckpt.resume(learner)                                  # every rank; None = fresh start
    for step in ...:
        groups = buffer.read(...) if learner.is_rank0 else None   # rank 0 reads and filters
        groups, version = broadcast_groups(groups, version, learner.layout)   # msgpack bytes
        stats = learner.train_step(groups, version)               # every rank, same stats
        tensors = learner.named_tensors_for_push()                # every rank; full tensors on rank 0
        if learner.is_rank0: push(tensors), bump version, ack
        ckpt.maybe_save(learner, step, extra={...})               # every rank
"""

from areal_like.learner.parallel.layout import LayoutSpec, ParallelLayout
from areal_like.learner.parallel.learner import ParallelLearner, broadcast_groups, dp_share

__all__ = ["LayoutSpec", "ParallelLayout", "ParallelLearner", "broadcast_groups", "dp_share"]
