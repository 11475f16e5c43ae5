"""Per-rank entry of the learner pool, and a fixed-batch runner (tests, golden file, benchmark).

    init_pool_from_env()   torch.distributed from the usual env (RANK, WORLD_SIZE, MASTER_ADDR,
                           MASTER_PORT; the CUDA device is the one passed) — gloo on CPU,
                           "cpu:gloo,cuda:nccl" on CUDA (layout.pool_backend)
    exit_rank()            how a pool rank's process ends: flushed, then os._exit (why: its docstring)
    leave_pool()           a barrier over the pool, then exit_rank(0): a rank done with its work
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
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from areal_like.api.process import exit_now
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


def exit_rank(code: int = 0) -> NoReturn:
    """End this pool rank's process with `code`: stdio and logging flushed, then `os._exit` — the
    interpreter's finalization never runs. The rank's files and trackers are closed before this.

    Why not a plain exit: torch's functional collectives (what DTensor uses — FSDP2, tensor parallel,
    the vocab split, `full_tensor`) keep the gloo process group, and so its worker threads, alive past
    `destroy_process_group` (torch 2.13). A worker that drops the last reference to a finished
    collective's Python-held tensor needs the GIL; once the interpreter is finalizing, CPython ends
    such a thread inside a C++ destructor: "terminate called without an active exception", SIGABRT,
    after a rank that did all its work — at random, about 1 end in 20 of the vocab-parallel test, and
    the launcher would take such a learner rank for a crashed one and restart the pool. (The other
    roles end the same way, for speed alone: `areal_like.api.process`.)"""
    exit_now(code)


def leave_pool() -> NoReturn:
    """A rank that is done: a barrier over the pool, then `exit_rank(0)`. The barrier keeps every rank
    until all are through with their collectives and with the pool's store — rank 0 hosts it, and a
    rank 0 that left first would take it from a follower still reading its last `leader_ready`."""
    if dist.is_initialized():
        dist.all_reduce(torch.zeros(1))  # a CPU tensor: the gloo side of the pool's backend, its timeout
    exit_rank(0)


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
                f.write(json.dumps({"step": step, "loss": st.loss, "grad_norm": st.grad_norm}) + "\n")
        if a.die_after and step == a.die_after:
            os.kill(os.getpid(), signal.SIGKILL)  # a crash right after step k's checkpoint
    if dist.is_initialized():
        leave_pool()
    return 0


if __name__ == "__main__":
    sys.exit(main())
