"""Delta weight sync (`weights.sync=delta`) vs full pushes, side by side, on the Qwen3-0.6B shape.

Learner: Qwen3-0.6B's published config at random init (596 M parameters, tied embeddings; stored in bf16),
fp32 master weights, AdamW (β = 0.9/0.999, weight decay 0.01) at each `--lrs` rate; every step a real forward and
backward on a batch of `--batch`×`--seq` random tokens (next-token loss: the update's size is AdamW's
normalized step, ≈ lr per element, whatever the loss). Two embedded servers hold the model in bf16 on
loopback gloo groups (`--torch-threads 1` each): after every step the same weights go to server A as a
full push (`WeightPusher`, sync=full) and to server B as a delta (sync=delta), one after the other, so
both figures come from the same step on the same machine. Per step and pusher: the fraction of elements
sent (delta), bytes, the pause window (generation stopped: pause → continue) and the whole push's
seconds (the delta's diff runs before its pause). After the last step each server's per-tensor checksums
(/weights_checker) are compared with a full push of the final version: equal, or the script fails.

Transports: the bucketed broadcast (`weights.mode=distributed`) at every `--lrs`, and the file system
(`weights.mode=disk`: a checkpoint dir per full push, a delta dir per delta push, in the run's tmp dir)
at `--disk-lrs`. SGLang's route is not measured here (delta reaches embedded servers only, so far).

Last line: delta pause window / full pause window (medians over steps 2…, the broadcast at the first of
`--lrs`).

`--model smollm2`: the real pretrained SmolLM2-135M-Instruct instead (its master is the GGUF's dequantised
fp32, not on bf16's grid), e.g. at the real-model config's training lr: `--model smollm2 --lrs 1e-5`.

Usage: python benchmarks/delta_sync.py [--steps 20] [--lrs 1e-6,1e-5] [--disk-lrs 1e-6] [--batch 1 --seq 64]
       [--model qwen3-shape|smollm2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import ROOT, free_port, start_server, stop_server  # noqa: F401 (ROOT: the repo on sys.path)


BUILD = """
import sys, torch
from transformers import AutoModelForCausalLM
from areal_like.data.real_shape import build_real_shape_model
d = build_real_shape_model(sys.argv[1])
AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(torch.bfloat16).save_pretrained(d)
"""


def median(xs):
    return statistics.median(xs) if xs else float("nan")


async def run_lr(lr: float, model_dir: str, servers: list[str], steps: int, batch: int, seq: int, bucket_mb: int,
                 transport: str = "distributed", disk_dir: str = ""):
    import torch
    from transformers import AutoModelForCausalLM

    from areal_like.weights import DiskWeightPusher, WeightPusher, delta_sync

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.01, foreach=False)
    if transport == "disk":  # weights.mode=disk: a checkpoint dir (full) or a delta dir per push, under disk_dir
        kw = dict(model_path=model_dir, timeout_s=600, dtype="bfloat16", shard_bytes=bucket_mb << 20)
        full = DiskWeightPusher([servers[0]], out_dir=os.path.join(disk_dir, "full"), **kw)
        delta = DiskWeightPusher([servers[1]], out_dir=os.path.join(disk_dir, "delta"), sync="delta", **kw)
    else:
        kw = dict(backend="gloo", bucket_bytes=bucket_mb << 20, timeout_s=600, dtype="bfloat16", overlap_loads=True)
        full = WeightPusher([servers[0]], master_port=free_port(), group_name="full", **kw)
        delta = WeightPusher([servers[1]], master_port=free_port(), group_name="delta", sync="delta", **kw)
    await full.init()
    await delta.init()
    rows = []
    g = torch.Generator().manual_seed(1)
    try:
        # the parameters once each (the tied LM head is the embedding: the learner pushes it once too)
        named = lambda: list(dict(model.named_parameters()).items())  # noqa: E731
        await full.update(named(), version=0)
        await delta.update(named(), version=0)  # both servers start from the same full push
        for step in range(1, steps + 1):
            ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
            t0 = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            train_s = time.perf_counter() - t0
            f = await full.update(named(), version=step)
            d = await delta.update(named(), version=step)
            assert d.delta and not f.delta, (d, f)
            rows.append(dict(step=step, train_s=train_s, changed=d.changed, full_bytes=f.bytes, delta_bytes=d.bytes,
                             full_pause=f.pause_window_s, delta_pause=d.pause_window_s, full_push=f.push_s,
                             delta_push=d.push_s))
            print(f"  {transport} lr {lr:g} step {step:2d}: changed {100 * d.changed:6.3f} %  bytes {d.bytes / 2**20:8.1f} / "
                  f"{f.bytes / 2**20:7.1f} MiB  pause {d.pause_window_s:6.3f} / {f.pause_window_s:6.3f} s  "
                  f"push {d.push_s:6.3f} / {f.push_s:6.3f} s  (delta / full; train {train_s:.1f} s)", flush=True)
        # both servers hold what a full push of the last version sends, checksum for checksum
        checked = [await delta_sync.check_servers(p, named(), torch.bfloat16, bucket_mb << 20, steps)
                   for p in (full, delta)]
        print(f"  {transport} lr {lr:g}: after step {steps}, {checked[1]} tensors on the delta server and {checked[0]} on the "
              f"full server equal a full push of version {steps} (checksums)", flush=True)
    finally:
        await full.close()
        await delta.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lrs", default="1e-6,1e-5")
    ap.add_argument("--disk-lrs", default="1e-6", help="the lrs also measured over weights.mode=disk ('' for none)")
    ap.add_argument("--model", choices=("qwen3-shape", "smollm2"), default="qwen3-shape",
                    help="qwen3-shape: Qwen3-0.6B's config at random init, stored in bf16; smollm2: the real "
                         "SmolLM2-135M-Instruct (configs/real_model.yaml's model; its training lr there: 1e-5)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bucket-mb", type=int, default=256, help="weights.bucket_mb (512 by default; 256 keeps the two pushers, two servers and the learner within 24 GiB)")
    a = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tmp = tempfile.mkdtemp(prefix="delta_sync.")
    if a.model == "smollm2":  # the real pretrained model (fp32, dequantised from its GGUF; the demo cache)
        from areal_like.data.demo_task import resolve_demo_name

        model_dir = resolve_demo_name("demo:smollm2-135m-instruct", "--model")
    else:
        model_dir = os.path.join(tmp, "qwen3-0.6b-shape")
        # built in a child (its fp32 copy is not kept here) and stored in bf16: the servers load 1.2 GB, not 2.4
        subprocess.run([sys.executable, "-c", BUILD, model_dir], check=True, cwd=ROOT)
    procs, urls = [], []
    try:
        for name in ("full", "delta"):
            p, u = start_server(model_dir, os.path.join(tmp, f"server_{name}.log"), "--dtype", "bfloat16")
            procs.append(p)
            urls.append(u)
        what = ("SmolLM2-135M-Instruct (pretrained, fp32 from its GGUF)" if a.model == "smollm2"
                else "Qwen3-0.6B shape (596 M params, random init)")
        print(f"{what}, fp32 master + AdamW, bf16 embedded servers over gloo "
              f"(loopback), {a.steps} steps per lr, bucket {a.bucket_mb} MiB; each step pushed full to one server and "
              f"as a delta to the other", flush=True)
        results = {}
        for lr in [float(x) for x in a.lrs.split(",")]:
            results[("distributed", lr)] = asyncio.run(run_lr(lr, model_dir, urls, a.steps, a.batch, a.seq,
                                                              a.bucket_mb))
        for lr in [float(x) for x in a.disk_lrs.split(",") if x]:
            results[("disk", lr)] = asyncio.run(run_lr(lr, model_dir, urls, a.steps, a.batch, a.seq, a.bucket_mb,
                                                       "disk", os.path.join(tmp, "weights_disk")))
    finally:
        for p in procs:
            stop_server(p)
        shutil.rmtree(tmp, ignore_errors=True)
    print()
    print("| transport | lr | changed / step (min–max) | delta bytes | full bytes | bytes ratio | pause delta | "
          "pause full | pause ratio | push delta | push full |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (transport, lr), rows in results.items():
        rest = rows[1:] or rows
        ch = [r["changed"] for r in rows]
        db, fb = median([r["delta_bytes"] for r in rest]), median([r["full_bytes"] for r in rest])
        dp, fp = median([r["delta_pause"] for r in rest]), median([r["full_pause"] for r in rest])
        dpu, fpu = median([r["delta_push"] for r in rest]), median([r["full_push"] for r in rest])
        print(f"| {transport} | {lr:g} | {100 * median(ch):.3f} % ({100 * min(ch):.3f}–{100 * max(ch):.3f}) | {db / 2**20:.1f} MiB | "
              f"{fb / 2**20:.1f} MiB | {db / fb:.4f} | {dp:.3f} s | {fp:.3f} s | {dp / fp:.3f} | {dpu:.3f} s | "
              f"{fpu:.3f} s |")
    key = next(iter(results))
    first = results[key][1:]
    ratio = median([r["delta_pause"] for r in first]) / median([r["full_pause"] for r in first])
    print(f"delta_pause_window / full_pause_window at lr {key[1]:g} = {ratio:.3f}")


if __name__ == "__main__":
    main()
