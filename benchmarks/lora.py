"""LoRA vs full fine-tuning (issue 28 item 5), measured side by side in one run on the 2-core machine.

**Learner** — Qwen2.5-0.5B's published shape (hidden 896, 24 layers, 14/2 heads, intermediate 4864,
vocab 151,936, tied; 494 M parameters) at random initialisation, fp32, one process with 2 threads (the
real `Trainer`, d1): full fine-tuning, then LoRA rank 8 and rank 32 (`model.lora_rank`, all-linear), each
in a fresh process for `--steps` steps on the same synthetic groups (`--samples` samples of ~`--tokens`
tokens). Per case: the process's peak RSS above its RSS after imports (VmHWM; glibc's mmap threshold
pinned low so freed buffers leave), the planner's prediction (`allocation/memory.py::learner_parts`,
no CUDA runtime on CPU) and learner tokens/s (median step after the first).

**Push** — one embedded server holding the same model (`--enable-lora`, rank 32, all-linear), one
learner process holding the LoRA r8 trainer and pushing to it as a run does: the full weights (the
base's names, what a full fine-tuning run pushes) and the adapter (`Trainer.weight_source()`), over the
gloo broadcast (`WeightPusher`, 64 MiB buckets) and through disk (`DiskWeightPusher`, the adapter as a
peft dir + /load_lora_adapter); `--pushes` alternating rounds, end to end (pause → … → continue),
medians of the rounds after the first two (steady state: a server injects peft's layers for its first
two adapters, 0.1–0.3 s on this model; from then on the slot the previous adapter freed takes the new
one's tensors, as every step of a run does); bytes as sent.

**End to end** — `launcher run` of configs/demo.yaml (the tiny demo model), `--run-steps` steps, full
fine-tuning vs LoRA r8 (its adapter on lm_head too, as tests/integration/test_lora_run.py, LR 2e-3):
trained samples/s after the first step from metrics.jsonl.

    .venv/bin/python benchmarks/lora.py            # ~12 min on 2 cores, ~14 GB RAM at its peak

The last line is `full/adapter push bytes: <ratio>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _common import ROOT, start_server, stop_server

QWEN25_05B = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896, intermediate_size=4864,
                  num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                  tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  torch_dtype="float32")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(key))


def _groups(step: int, samples: int, tokens: int):
    from areal_like.learner.parallel.spawn import synthetic_groups

    return synthetic_groups(100 + step, vocab=QWEN25_05B["vocab_size"], n_groups=2, n=samples // 2,
                            min_len=tokens - 8, max_len=tokens + 8)


def _trainer(model_dir: str, rank: int):
    from areal_like.api.config import TrainConfig
    from areal_like.learner.lora import LoraSettings
    from areal_like.learner.trainer import Trainer

    cfg = TrainConfig(lr=1e-5, micro_batch_tokens=1024, logits_chunk_tokens=256, seed=0, warmup_steps=0)
    return Trainer(model_dir, cfg, None, temperature=1.0,
                   lora=LoraSettings(rank, 2.0 * rank, "all-linear") if rank else None)


def learner_main(model_dir: str, rank: int, steps: int, samples: int, tokens: int, out: str) -> None:
    import torch

    torch.set_num_threads(2)
    base = _status("VmRSS")
    t = _trainer(model_dir, rank)
    times, n_tok = [], 0
    for step in range(steps):
        t0 = time.perf_counter()
        st = t.train_step(_groups(step, samples, tokens), version=step)
        times.append(time.perf_counter() - t0)
        n_tok = st.num_tokens
    trainable = sum(p.numel() for p in t.actor.opt_params)
    with open(out, "w") as f:
        json.dump({"peak": _status("VmHWM") - base, "times": times, "tokens": n_tok, "trainable": trainable}, f)


def predicted(rank: int, seq_len: int) -> int:
    from allocation.memory import ModelShape, TrainSettings, learner_parts

    parts = learner_parts(ModelShape.from_config(QWEN25_05B),
                          TrainSettings(dtype="float32", master_dtype="float32", micro_batch_tokens=1024,
                                        seq_len=seq_len, logits_chunk_tokens=256, math_attention=True,
                                        lora_rank=rank, lora_targets=LINEARS), pp=1, tp=1, stage=0)
    parts.pop("runtime_bytes")
    return sum(parts.values())


async def _push_rounds(model_dir: str, url: str, tmp: str, rounds: int) -> dict:
    from areal_like.api.net import free_port
    from areal_like.weights import DiskWeightPusher, WeightPusher

    t = _trainer(model_dir, 8)
    adapter = t.weight_source()
    # what a full fine-tuning run pushes: every base tensor by its HF name (the servers' own names)
    full = [(n, x) for n, x in t.full_state() if ".lora_" not in n]
    out: dict[str, list] = {}
    for name, pusher in (("broadcast", WeightPusher([url], master_port=free_port(), backend="gloo", timeout_s=600,
                                                    bucket_bytes=64 << 20, overlap_loads=True)),
                         ("disk", DiskWeightPusher([url], out_dir=os.path.join(tmp, "push"), model_path=model_dir,
                                                   timeout_s=600))):
        await pusher.init()
        try:
            v = 0
            for _ in range(rounds):
                for kind, weights in (("full", full), ("adapter", adapter)):
                    v += 1
                    res = await pusher.update(weights, v)
                    out.setdefault(f"{name} {kind}", []).append((res.push_s, res.bytes))
        finally:
            await pusher.close()
    return out


def push_main(model_dir: str, url: str, tmp: str, rounds: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    res = asyncio.run(_push_rounds(model_dir, url, tmp, rounds))
    with open(out, "w") as f:
        json.dump(res, f)


def _run(tmp: str, name: str, steps: int, extra: list[str]) -> float:
    run_dir = os.path.join(tmp, name)
    cmd = [sys.executable, "-m", "launcher.cli", "run", "--config", "configs/demo.yaml", "--run-dir", run_dir,
           f"train.total_steps={steps}", "train.test_freq=0", "train.save_freq=0", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"launcher run ({name}) exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    rows = [json.loads(x) for x in open(os.path.join(run_dir, "metrics.jsonl")) if x.strip()]
    span = rows[-1]["time"] - rows[0]["time"]
    return sum(r["samples"] for r in rows[1:]) / span


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "learner":
        _, _, model_dir, rank, steps, samples, tokens, out = sys.argv
        learner_main(model_dir, int(rank), int(steps), int(samples), int(tokens), out)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "push":
        _, _, model_dir, url, tmp, rounds, out = sys.argv
        push_main(model_dir, url, tmp, int(rounds), out)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--pushes", type=int, default=5)
    ap.add_argument("--run-steps", type=int, default=60)
    ap.add_argument("--keep", default=None, help="keep the work files in this directory")
    args = ap.parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tmp = args.keep or tempfile.mkdtemp(prefix="lora-bench-")
    os.makedirs(tmp, exist_ok=True)
    model_dir = os.path.join(tmp, "qwen2.5-0.5b-shape")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN25_05B), dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir)
    del model
    from areal_like.data.tiny_model import build_char_tokenizer

    build_char_tokenizer(model_dir)  # the server needs a tokenizer file; the ids are synthetic anyway
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    seq_len = args.tokens + 8
    print(f"Qwen2.5-0.5B shape, random init: {n_params / 1e6:.0f} M parameters, fp32, 1 process × 2 threads; "
          f"{args.steps} steps of {args.samples} samples of ~{args.tokens} tokens", flush=True)
    print(f"{'learner':<10} {'trainable':>11} {'peak GiB':>9} {'planner GiB':>12} {'tokens/s':>9}", flush=True)
    learner: dict[int, dict] = {}
    for rank in (0, 8, 32):
        out = os.path.join(tmp, f"learner-{rank}.json")
        subprocess.run([sys.executable, __file__, "learner", model_dir, str(rank), str(args.steps), str(args.samples),
                        str(args.tokens), out], env=env, check=True, cwd=ROOT)
        with open(out) as f:
            r = json.load(f)
        r["tps"] = r["tokens"] / statistics.median(r["times"][1:] or r["times"])
        learner[rank] = r
        name = "full" if rank == 0 else f"LoRA r{rank}"
        print(f"{name:<10} {r['trainable'] / 1e6:>10.1f}M {r['peak'] / 2**30:>9.2f} "
              f"{predicted(rank, seq_len) / 2**30:>12.2f} {r['tps']:>9.1f}", flush=True)

    proc, url = start_server(model_dir, os.path.join(tmp, "server.log"), "--enable-lora", "--max-lora-rank", "32",
                             "--lora-target-modules", "all-linear", "--max-loaded-loras", "2",
                             "--max-loras-per-batch", "2", "--max-context-len", "256", threads=1)
    try:
        out = os.path.join(tmp, "push.json")
        subprocess.run([sys.executable, __file__, "push", model_dir, url, tmp, str(args.pushes), out], env=env,
                       check=True, cwd=ROOT)
    finally:
        stop_server(proc)
    with open(out) as f:
        pushes = json.load(f)
    print(f"{'push':<18} {'MB':>9} {'s (median)':>11}", flush=True)
    med = {}
    for k, v in pushes.items():  # steady state: the rounds after the first two (see the module docstring)
        med[k] = (statistics.median(s for s, _ in v[2:] or v), v[0][1])
        print(f"{k:<18} {v[0][1] / 1e6:>9.2f} {med[k][0]:>11.3f}", flush=True)

    full_sps = _run(tmp, "run-full", args.run_steps, [])
    lora_sps = _run(tmp, "run-lora", args.run_steps, [
        "model.lora_rank=8", f"model.target_modules=[{','.join((*LINEARS, 'lm_head'))}]", "train.lr=2e-3"])
    print(f"end to end (demo, {args.run_steps} steps): full {full_sps:.0f} samples/s, LoRA r8 {lora_sps:.0f} "
          f"samples/s ({lora_sps / full_sps:.2f}x)", flush=True)
    print(f"learner peak memory LoRA r8/full: {learner[8]['peak'] / learner[0]['peak']:.3f}, r32/full: "
          f"{learner[32]['peak'] / learner[0]['peak']:.3f}; tokens/s r8/full: "
          f"{learner[8]['tps'] / learner[0]['tps']:.2f}x")
    for t in ("broadcast", "disk"):
        print(f"{t} push seconds full/adapter: {med[f'{t} full'][0] / med[f'{t} adapter'][0]:.1f}x")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"full/adapter push bytes: {med['broadcast full'][1] / med['broadcast adapter'][1]:.1f}")


if __name__ == "__main__":
    main()
