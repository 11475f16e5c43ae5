"""Issue 40 item 1 on GPUs: a weight broadcast whose receiver dies does not take the learner with it.

Learner rank 0's side of the NCCL weight group (`areal_like.weights.group`, as `WeightPusher` forms it)
runs with the environment the launcher gives it (`WEIGHT_SENDER_ENV`: TORCH_NCCL_ASYNC_ERROR_HANDLING=2).
A receiver process on another GPU joins the group, takes one broadcast, then dies; the sender's next
broadcast must fail within the group's timeout (or at once, after `WeightGroup.abort`) with the process
alive, and a fresh receiver must then join a new group (`<name>_r1`, another port) and take a broadcast —
the learner's re-sync. Prints one line per phase and `survived: yes|no`.

NCCL puts one rank per GPU: this needs 2 GPUs (`cuda_figures.sh` skips the stage with 1).

    python benchmarks/nccl_push_failure.py [--mb 256] [--timeout 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def receiver(port: int, name: str, numel: int, die: bool, timeout_s: float) -> None:
    import torch

    from areal_like.weights.group import init_weight_group

    torch.cuda.set_device(1)
    g = init_weight_group(master_address="127.0.0.1", master_port=port, world_size=2, rank=1, group_name=name,
                          backend="nccl", timeout_s=timeout_s)
    buf = torch.empty(numel, dtype=torch.uint8, device="cuda:1")
    g.broadcast(buf, 0, what="bucket 0")
    torch.cuda.synchronize()
    if die:
        os._exit(1)  # a server that dies mid-push: never joins the next broadcast
    g.destroy()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=20.0)
    a = ap.parse_args()
    import torch

    from areal_like.api.net import free_port
    from areal_like.engine.sglang_args import WEIGHT_SENDER_ENV
    from areal_like.weights.group import init_weight_group

    if torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs (NCCL puts one rank per GPU); this machine has {torch.cuda.device_count()}")
        return 0
    os.environ.update(WEIGHT_SENDER_ENV)  # what the launcher gives learner rank 0 (read when a group is built)
    torch.cuda.set_device(0)
    numel = a.mb << 20
    buf = torch.ones(numel, dtype=torch.uint8, device="cuda:0")
    ctx = mp.get_context("spawn")

    port = free_port()
    p = ctx.Process(target=receiver, args=(port, "weight_update_group", numel, True, a.timeout))
    p.start()
    g = init_weight_group(master_address="127.0.0.1", master_port=port, world_size=2, rank=0,
                          group_name="weight_update_group", backend="nccl", timeout_s=a.timeout)
    t0 = time.perf_counter()
    g.broadcast(buf, 0, what="bucket 0")
    torch.cuda.synchronize()
    print(f"broadcast 1 ({a.mb} MiB) to a live receiver: {time.perf_counter() - t0:.3f} s")
    p.join(60)
    t0 = time.perf_counter()
    try:
        g.broadcast(buf, 0, what="bucket 1")
        torch.cuda.synchronize()
        print("broadcast 2 to a dead receiver: completed (unexpected)")
    except RuntimeError as e:
        print(f"broadcast 2 to a dead receiver failed after {time.perf_counter() - t0:.1f} s "
              f"(timeout {a.timeout:.0f} s): {str(e)[:160]}")
    print(f"abort issued: {g.abort()}")
    g.destroy()

    port = free_port()
    p = ctx.Process(target=receiver, args=(port, "weight_update_group_r1", numel, False, a.timeout))
    p.start()
    t0 = time.perf_counter()
    g = init_weight_group(master_address="127.0.0.1", master_port=port, world_size=2, rank=0,
                          group_name="weight_update_group_r1", backend="nccl", timeout_s=a.timeout)
    g.broadcast(buf, 0, what="bucket 0")
    torch.cuda.synchronize()
    p.join(60)
    print(f"re-formed group and broadcast to a fresh receiver: {time.perf_counter() - t0:.3f} s (receiver exit "
          f"{p.exitcode})")
    g.destroy()
    print("survived: yes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
