"""Per-rank entry of the learner pool, and a fixed-batch runner (tests, golden file, benchmark).

    init_pool_from_env()   torch.distributed from the usual env (RANK, WORLD_SIZE, MASTER_ADDR,
                           MASTER_PORT; the CUDA device is the one passed) — gloo on CPU,
                           "cpu:gloo,cuda:nccl" on CUDA (layout.pool_backend)
    synthetic_groups()     deterministic TrajectoryGroups (random tokens and behaviour logprobs)

`python -m areal_like.learner.parallel.spawn --model M --layout d2 --steps N ...` runs N train
steps of one rank on synthetic groups (start WORLD_SIZE of them with the env above); with
`--die-after k` the process SIGKILLs itself right after step k's checkpoint, which is how the resume
test kills a learner.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist

from areal_like.api.trajectory import Trajectory, TrajectoryGroup


def init_pool_from_env(timeout_s: float = 300.0, device: str = "cpu") -> int:
    """`init_process_group` from the env (no-op without WORLD_SIZE>1); returns this rank. Rank 0's
    store binds MASTER_ADDR only (the launcher uses 127.0.0.1).

    On CPU set GLOO_SOCKET_IFNAME=lo (or the node's interface) in the environment beforehand.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        return dist.get_rank() if dist.is_initialized() else 0
    from areal_like.learner.parallel.layout import pool_backend

    device_type = torch.device(device).type
    backend = pool_backend(device_type)  # gloo for CPU tensors beside NCCL for CUDA ones
    if device_type == "cuda":
        # The device the launcher gives this rank (its CUDA_VISIBLE_DEVICES holds the plan's device for
        # it alone, so this is cuda:0) — never LOCAL_RANK, which would land every rank of a node on the
        # first devices of that node, the generation servers' ones.
        torch.cuda.set_device(torch.device(device))
    from areal_like.weights.group import bound_listen_fd

    rank, timeout = int(os.environ["RANK"]), datetime.timedelta(seconds=timeout_s)
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # Rank 0's TCPStore listens on MASTER_ADDR alone (env:// would bind every interface).
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False,
                          master_listen_fd=bound_listen_fd(addr, port) if rank == 0 else None, use_libuv=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.get_rank()


def synthetic_groups(seed: int, *, n_groups: int = 4, n: int = 4, vocab: int = 64, version: int = 0,
                     min_len: int = 2, max_len: int = 7) -> list[TrajectoryGroup]:
    """Deterministic groups: random prompt/output ids in [4, vocab), behaviour logprobs in [−4, −0.1],
    0/1 rewards (every group has both, so GRPO advantages are nonzero)."""
    rng = np.random.default_rng(seed)
    groups = []
    for gi in range(n_groups):
        prompt = [1] + rng.integers(4, vocab, size=int(rng.integers(2, 5))).tolist()
        trajs = []
        for k in range(n):
            L = int(rng.integers(min_len, max_len + 1))
            trajs.append(Trajectory.build(
                traj_id=f"s{seed}-g{gi}-{k}", group_id=f"s{seed}-g{gi}", prompt_id=f"p{gi}", prompt_ids=prompt,
                output_ids=rng.integers(4, vocab, size=L).tolist(),
                output_logprobs=(-rng.uniform(0.1, 4.0, size=L)).astype(np.float32),
                output_versions=[version] * L, reward=float(k % 2 if gi % 2 == 0 else (k + 1) % 2),
                finish_reason="length"))
        groups.append(TrajectoryGroup(group_id=f"s{seed}-g{gi}", prompt_id=f"p{gi}", trajectories=trajs,
                                      created_at=0.0))
    return groups


def main(argv: list[str] | None = None) -> int:
    from areal_like.api.config import TrainConfig
    from areal_like.learner.checkpoint import CheckpointManager
    from areal_like.learner.parallel.broadcast import broadcast_groups
    from areal_like.learner.trainer import Trainer

    ap = argparse.ArgumentParser(prog="python -m areal_like.learner.parallel.spawn")
    ap.add_argument("--model", required=True)
    ap.add_argument("--layout", default="d1")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--train-cfg", default="{}", help="TrainConfig fields as JSON")
    ap.add_argument("--out", required=True, help="JSON lines of per-step stats (rank 0)")
    ap.add_argument("--die-after", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.9)
    a = ap.parse_args(argv)
    import msgspec

    cfg = msgspec.convert(json.loads(a.train_cfg), TrainConfig)
    rank = init_pool_from_env(cfg.collective_timeout_s)
    torch.set_num_threads(cfg.torch_threads)
    learner = Trainer(a.model, cfg, a.layout, temperature=a.temperature)
    ckpt = CheckpointManager.from_config(cfg, run_dir=os.path.dirname(os.path.abspath(a.out)))
    extra = ckpt.resume(learner)  # None on a fresh start
    start = learner.step
    for step in range(start + 1, a.steps + 1):
        groups = synthetic_groups(1000 + step, version=step - 1) if rank == 0 else None
        groups, version = broadcast_groups(groups, step - 1, learner.layout)
        st = learner.train_step(groups, version)
        ckpt.maybe_save(learner, step, extra={"dataloader_cursor": step, "resumed_from": (extra or {}).get(
            "dataloader_cursor")})
        if rank == 0:
            with open(a.out, "a") as f:
                f.write(json.dumps({"step": step, "loss": st["loss"], "grad_norm": st["grad_norm"]}) + "\n")
        if a.die_after and step == a.die_after:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash right after step k's checkpoint
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
