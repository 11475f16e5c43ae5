"""The learner's step on a MoE model with expert parallel against without (issue 44 item 4).

One pool of 2 ranks (gloo on loopback, one thread each), one MoE model at random init — Qwen3-MoE's structure
scaled down (`--experts` experts of `--moe-intermediate`, top-2, every layer sparse) — and the same batch of
synthetic trajectories each step (`--groups` groups × 8 samples of 96–160 tokens). The pool builds two learners
in turn, `--repeats` times, each timing `--steps` steps after one warm-up step:

    fsdp  megatron:d2    FSDP2 (train.dp_sharding=full): every layer's experts gathered whole on both ranks
                         for its forward and again for its backward, their gradients reduce-scattered
    ep    megatron:d2e2  expert parallel: each rank keeps its half of the experts; each token's top-k
                         assignments travel to the rank holding the expert and back (all-to-all), the
                         rest of the model FSDP-sharded as before
    tp    megatron:t2    tensor parallel: attention split over the two ranks, every expert on both, each
                         computing every token's experts (the same work twice)
    tp_ep megatron:t2e2  the same with expert parallel over the two t ranks: each keeps half the experts
                         and dispatches half the tokens (Megatron's token split for expert TP 1)

Per layout: the median step seconds, and the routed experts' parameter bytes each rank holds between steps
(its shard under FSDP; its own experts under EP) and at the peak of a layer's compute (FSDP: the gathered
layer). Then `t2e2_vs_t2_step_time: <ratio>`, and the last line `ep_vs_fsdp_step_time: <ratio>` (EP's median
step over FSDP's; < 1: EP is faster).

    .venv/bin/python benchmarks/moe_expert_parallel.py [--steps 5] [--repeats 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import tempfile
import time

from _common import free_port  # first: puts the repository root on sys.path

LAYOUTS = {"fsdp": "d2", "ep": "d2e2", "tp": "t2", "tp_ep": "t2e2"}


def _rank(rank: int, args, model_dir: str, port: int, q) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    from areal_like.api.config import TrainConfig
    from areal_like.learner.moe import expert_modules
    from areal_like.learner.parallel.parallelize import local_tensor
    from areal_like.learner.parallel.spawn import synthetic_groups
    from areal_like.learner.trainer import Trainer

    groups = synthetic_groups(1, n_groups=args.groups, n=8, vocab=64, min_len=96, max_len=160)
    for _ in range(args.repeats):
        for kind, layout in LAYOUTS.items():
            ln = Trainer(model_dir, TrainConfig(lr=1e-4, micro_batch_tokens=4096, collective_timeout_s=600,
                                                dp_sharding="full"), layout, temperature=1.0)
            held = sum(local_tensor(getattr(m, w)).numel() * local_tensor(getattr(m, w)).element_size()
                       for _, m in expert_modules(ln.actor.stage_module) for w in ("gate_up_proj", "down_proj"))
            ln.train_step(groups, version=0)  # warm-up
            times = []
            for step in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                ln.train_step(groups, version=step + 1)
                times.append(time.perf_counter() - t0)
            if rank == 0:
                q.put((kind, times, held))
            del ln
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    args = ap.parse_args()

    import torch.multiprocessing as mp

    from areal_like.data.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(os.path.join(tmp, "moe"), arch="qwen3_moe", hidden_size=args.hidden,
                                 num_layers=args.layers, num_heads=4, num_kv_heads=2,
                                 moe=dict(num_experts=args.experts, moe_intermediate_size=args.moe_intermediate))
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        mp.start_processes(_rank, args=(args, model, free_port(), q), nprocs=2, join=True, start_method="spawn")
        results: dict[str, list[float]] = {k: [] for k in LAYOUTS}
        held: dict[str, int] = {}
        while not q.empty():
            kind, times, h = q.get()
            results[kind] += times
            held[kind] = h
    expert_bytes = args.layers * args.experts * 3 * args.hidden * args.moe_intermediate * 4  # fp32
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.experts} experts × moe_intermediate "
          f"{args.moe_intermediate} (top-2), routed experts {expert_bytes / 2**20:.1f} MiB fp32; "
          f"{args.groups} groups × 8 samples per step; 2 ranks, one thread each")
    med = {}
    for kind, layout in LAYOUTS.items():
        med[kind] = statistics.median(results[kind])
        gathered = expert_bytes // args.layers if kind == "fsdp" else 0  # (t2: every expert held whole)
        print(f"{kind:5s} megatron:{layout:5s} step median {med[kind]:.3f} s over {len(results[kind])} steps "
              f"(min {min(results[kind]):.3f}, max {max(results[kind]):.3f}); routed experts held per rank "
              f"{held[kind] / 2**20:.2f} MiB between steps, + {gathered / 2**20:.2f} MiB gathered per layer in compute")
    print(f"t2e2_vs_t2_step_time: {med['tp_ep'] / med['tp']:.3f}")
    print(f"ep_vs_fsdp_step_time: {med['ep'] / med['fsdp']:.3f}")


if __name__ == "__main__":
    main()
