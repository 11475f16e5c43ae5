"""The whole system (`launcher run`) vs a minimal single-process synchronous GRPO loop, same tiny model,
task, batch and lengths: trained samples/s (issue 14, part 3).

Minimal loop (written here, one process, not pinned: it may use both cores; `torch.set_num_threads`
2 or 1, whichever a 4-step probe finds faster — on a loaded machine 2 OpenMP threads can be many
times slower than 1): per step B prompts × n samples in ONE static batch, HF `model.generate(do_sample=True,
temperature=1.0, top_k=0, top_p=1.0, use_cache=True)` with KV cache; with per-sample output lengths a
static batch must generate to its longest sample (min_new_tokens = max_new_tokens = that length), then
each row is cut to its own length for reward and loss — that padding is the honest cost of a minimal
loop. Then the demo reward, GRPO advantages (r − mean) / (std + 1e-6) per group, and one AdamW step
(weight decay 0, betas 0.9/0.999, `train.lr`, grad clip 1.0) on the token-level policy-gradient loss
−Σ A·log π / (loss tokens in the batch): the system's default `train.*` (token-mean loss; its decoupled
PPO loss reduces to this when the samples are fresh).

The system: one real `launcher run` subprocess per η in `--etas` (the best is the headline), pinned as
benchmarks/async_vs_sync.py pins it (`launcher.cpu_affinity`: server on CPU 0, learner on CPU 1,
rollout worker and Redis on CPU 0) — the same 2 cores the minimal loop gets.

samples/s, both sides alike: steady state, samples trained after the first step / time from the end of
the first step to the end of the last (the system: between its first and last metrics.jsonl rows, as
`launcher tune` computes it).

Workloads:
- longtail (the headline): benchmarks/longtail_workflow.py:longtail as async_vs_sync runs it — per-sample
  output lengths lognormal (median `--median`, σ `--sigma`) clipped to [1, `--max-new`], ignore_eos;
  `--batch` groups × `--n` samples; random Qwen2 (`--hidden`, `--layers`, char tokenizer), demo task.
  Both sides draw the lengths from the same distribution with the same seed, keyed by their own group
  ids (the system's `w0-<k>`, the loop's `min-<step>-<g>`), so the draws differ but not their law.
  `--etas` defaults to 4, async_vs_sync's best η.
- demo (reported, not the headline; `--demo-steps 0` skips it): configs/demo.yaml as is (demo model,
  8 groups × 16 samples, 1 token each): fixed per-step costs dominate.

Per step breakdown printed for each: the minimal loop's generate / reward / train seconds, the system's
metrics.jsonl `fetch_s`, `step_s` (learner train_step), `push_s` (of which `pause_window_s`), and the
rest of the wall time per step (broadcast, gather, report, commit, …).

Usage: python benchmarks/e2e_vs_minimal_loop.py [--steps 30] [--etas 4] [--demo-steps 60] [--demo-etas 1,4]
       [--threads 2,1] [--keep DIR]
The last line printed is `e2e_vs_minimal_loop: <ratio>x (demo <ratio>x)` — the long-tail ratio of
trained samples/s, system / minimal loop.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import ROOT, build_model  # first: puts the repository root on sys.path

WORKFLOW = os.path.join(ROOT, "benchmarks", "longtail_workflow.py")
PIN = {"server": "0", "learner": "1", "rollout": "0", "redis": "0"}


# ---------------------------------------------------------------------------------------------- system
def system_run(overrides: list[str], run_dir: str, env: dict) -> dict:
    argv = [sys.executable, "-m", "launcher", "run", "--config", os.path.join(ROOT, "configs", "demo.yaml"),
            "--run-dir", run_dir, "train.test_freq=0", "data.val_files=[]",
            *[f"launcher.cpu_affinity.{k}={v}" for k, v in PIN.items()], *overrides]
    os.makedirs(run_dir, exist_ok=True)
    t = time.monotonic()
    with open(os.path.join(run_dir, "launcher.log"), "w") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    wall = time.monotonic() - t
    if rc != 0:
        tail = open(os.path.join(run_dir, "launcher.log"), errors="replace").read().splitlines()[-15:]
        raise SystemExit(f"launcher run {overrides} exited with {rc}:\n  " + "\n  ".join(tail))
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])
    t0, t1 = rows[0]["time"], rows[-1]["time"]
    steady = rows[1:]
    k = len(steady)

    def mean(key):
        vals = [r.get(key) for r in steady if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else 0.0

    trained = sum(r["samples"] for r in steady)
    per_step = (t1 - t0) / k
    br = {"fetch": mean("fetch_s"), "train": mean("step_s"), "push": mean("push_s"), "pause": mean("pause_window_s")}
    br["other"] = per_step - br["fetch"] - br["train"] - br["push"]
    return {"sps": trained / (t1 - t0), "per_step": per_step, "wall": wall, "br": br, "samples": trained / k,
            "reward_last": sum(r["reward_mean"] for r in rows[-5:]) / len(rows[-5:])}


# ------------------------------------------------------------------------------------------ minimal loop
def minimal_loop(model_dir: str, steps: int, groups: int, n: int, lr: float, lengths_fn, threads: int,
                 seed: int = 1) -> dict:
    """The synchronous GRPO loop; `lengths_fn(step)` → the B·n output lengths of that step."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_like.data.demo_task import demo_compute_score, resolve_demo_name

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    table = pq.read_table(resolve_demo_name("demo:next-digit", "data.train_files")).to_pylist()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()  # no dropout, as the learner
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    pad = tok.pad_token_id
    times, gen_s, rew_s, train_s, rewards_hist = [], [], [], [], []
    cursor = 0
    for step in range(steps):
        t0 = time.perf_counter()
        rows = [table[(cursor + g) % len(table)] for g in range(groups)]
        cursor += groups
        enc = tok([r["prompt"] for r in rows for _ in range(n)], return_tensors="pt", padding=True)
        lens = lengths_fn(step)
        L = max(lens)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, use_cache=True,
                                 max_new_tokens=L, min_new_tokens=L, pad_token_id=pad)
        t1 = time.perf_counter()
        P = enc["input_ids"].shape[1]
        comp = out[:, P:P + L]
        keep = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]  # each row cut to its own length
        texts = [tok.decode(c[k].tolist(), skip_special_tokens=True) for c, k in zip(comp, keep)]
        gts = [r["reward_model"]["ground_truth"] for r in rows for _ in range(n)]
        rew = torch.tensor([demo_compute_score(t, g) for t, g in zip(texts, gts)], dtype=torch.float32)
        r_GN = rew.view(groups, n)
        std = r_GN.std(1, keepdim=True)
        adv = torch.where(std > 0, (r_GN - r_GN.mean(1, keepdim=True)) / (std + 1e-6), torch.zeros_like(r_GN)).reshape(-1)
        t2 = time.perf_counter()
        ids = out[:, :P + L]
        attn = torch.cat([enc["attention_mask"], keep.long()], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits[:, P - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, comp[..., None]).squeeze(-1)
        mask = keep.float()
        loss = -(adv[:, None] * logp * mask).sum() / mask.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
        t3 = time.perf_counter()
        times.append(t3 - t0)
        gen_s.append(t1 - t0)
        rew_s.append(t2 - t1)
        train_s.append(t3 - t2)
        rewards_hist.append(float(rew.mean()))
    k = steps - 1
    total = sum(times[1:])
    return {"sps": k * groups * n / total, "per_step": total / k,
            "br": {"generate": sum(gen_s[1:]) / k, "reward": sum(rew_s[1:]) / k, "train": sum(train_s[1:]) / k},
            "reward_last": sum(rewards_hist[-5:]) / len(rewards_hist[-5:]),
            "gen_tokens": sum(len(lengths_fn(s)) * max(lengths_fn(s)) for s in range(1, steps)) / k,
            "used_tokens": sum(sum(lengths_fn(s)) for s in range(1, steps)) / k}


def best_minimal(args, loop, steps: int, name: str) -> dict:
    """The minimal loop with the faster thread count of `--threads` (what a user would pick): a 4-step
    probe of each (the same first steps), then the full loop of `steps` steps with the faster."""
    threads = [int(t) for t in str(args.threads).split(",")]
    best = threads[0]
    if len(threads) > 1:
        probe = {}
        for th in threads:
            probe[th] = loop(th, 4)["per_step"]
        best = min(threads, key=lambda th: probe[th])
        print(f"[{name}] minimal loop probe, s/step by torch threads: "
              + ", ".join(f"{th}: {v:.3f}" for th, v in probe.items()), flush=True)
    r = loop(best, steps)
    r["threads"] = best
    return r


def fmt_br(br: dict) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in br.items())


def report(name: str, mini: dict, sys_runs: dict[int, dict]) -> float:
    print(f"[{name}] minimal loop ({mini['threads']} thread(s)): {mini['sps']:.1f} samples/s, {mini['per_step']:.3f} s/step = {fmt_br(mini['br'])}"
          f"  (reward last 5 steps {mini['reward_last']:.2f})")
    if mini.get("gen_tokens"):
        print(f"[{name}]   static batch generates {mini['gen_tokens']:.0f} tokens/step to use {mini['used_tokens']:.0f} "
              f"({mini['used_tokens'] / mini['gen_tokens']:.0%})")
    for eta, r in sys_runs.items():
        b = r["br"]
        print(f"[{name}] system η = {eta}: {r['sps']:.1f} samples/s ({r['sps'] / mini['sps']:.2f}x), {r['per_step']:.3f} s/step"
              f" = fetch {b['fetch']:.3f} + train {b['train']:.3f} + push {b['push']:.3f} (pause window {b['pause']:.3f})"
              f" + other {b['other']:.3f}; wall {r['wall']:.0f} s (reward last 5 steps {r['reward_last']:.2f})")
    best = max(sys_runs.values(), key=lambda r: r["sps"])
    return best["sps"] / mini["sps"]


def add_longtail_args(ap: argparse.ArgumentParser) -> None:
    """The long-tail workload's options (shared with benchmarks/colocated.py)."""
    ap.add_argument("--steps", type=int, default=30, help="long-tail steps (each side)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=448)
    ap.add_argument("--median", type=float, default=64.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3, help="train.lr of configs/demo.yaml")


def longtail_overrides(args, model_dir: str) -> list[str]:
    """`launcher run` overrides of the long-tail workload (any η: add rollout.max_staleness)."""
    return [f"model.path={model_dir}", f"rollout.workflow={WORKFLOW}:longtail", f"generation.n={args.n}",
            f"generation.max_new_tokens={args.max_new}", f"train.batch_size={args.batch}",
            f"rollout.max_concurrent_groups={args.batch}", f"train.total_steps={args.steps}", f"train.lr={args.lr}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_longtail_args(ap)
    ap.add_argument("--etas", default="4", help="long-tail η values of the system (best is the headline)")
    ap.add_argument("--demo-steps", type=int, default=60, help="demo workload steps (0 = skip)")
    ap.add_argument("--demo-etas", default="1,4", help="demo workload η values of the system")
    ap.add_argument("--threads", default="2,1",
                    help="torch threads of the minimal loop; several = one loop each, the fastest is compared")
    ap.add_argument("--only", choices=["longtail", "demo"], default=None)
    ap.add_argument("--keep", default=None, help="keep run directories here (default: a temp dir, removed)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    os.environ.update(LONGTAIL_MEDIAN=str(args.median), LONGTAIL_SIGMA=str(args.sigma))
    from longtail_workflow import output_length

    from areal_like.data.demo_task import resolve_demo_name

    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.abspath(args.keep) if args.keep else tmp
        env = dict(os.environ)
        if args.only != "demo":
            model_dir = build_model(os.path.join(base, "model"), args.hidden, args.layers)
            runs = {}
            for eta in [int(e) for e in args.etas.split(",")]:
                runs[eta] = system_run([*longtail_overrides(args, model_dir), f"rollout.max_staleness={eta}"],
                                       os.path.join(base, f"longtail_eta{eta}"), env)
                print(f"[longtail] system η = {eta}: {runs[eta]['sps']:.1f} samples/s", flush=True)
            mini = best_minimal(args, lambda th, steps: minimal_loop(
                model_dir, steps, args.batch, args.n, args.lr,
                lambda s: [output_length(1, f"min-{s}-{g}", i, args.max_new) for g in range(args.batch)
                           for i in range(args.n)], th), args.steps, "longtail")
            ratios["longtail"] = report("longtail", mini, runs)
        if args.only != "longtail" and args.demo_steps > 0:
            runs = {}
            for eta in [int(e) for e in args.demo_etas.split(",")]:
                runs[eta] = system_run([f"train.total_steps={args.demo_steps}", f"rollout.max_staleness={eta}"],
                                       os.path.join(base, f"demo_eta{eta}"), env)
                print(f"[demo] system η = {eta}: {runs[eta]['sps']:.1f} samples/s", flush=True)
            demo_model = resolve_demo_name("demo:tiny-qwen2", "model.path")
            mini = best_minimal(args, lambda th, steps: minimal_loop(demo_model, steps, 8, 16, 1e-3,
                                                                     lambda s: [1] * (8 * 16), th),
                                args.demo_steps, "demo")
            ratios["demo"] = report("demo", mini, runs)
    print(f"workloads: longtail = {args.batch} groups × {args.n} samples, lognormal lengths (median {args.median:g}, "
          f"σ {args.sigma:g}) in [1, {args.max_new}], random Qwen2 hidden {args.hidden}, {args.layers} layers, "
          f"{args.steps} steps; demo = configs/demo.yaml (8 × 16, 1 token), {args.demo_steps} steps")
    print(f"pinning: system server/rollout/redis on CPU 0, learner on CPU 1; minimal loop one process, not pinned "
          f"(both CPUs), torch threads {args.threads} (the faster compared)")
    head = ratios.get("longtail")
    demo = f" (demo {ratios['demo']:.2f}x)" if "demo" in ratios else ""
    print(f"e2e_vs_minimal_loop: {head:.2f}x{demo}" if head is not None else f"e2e_vs_minimal_loop: demo {ratios['demo']:.2f}x")


if __name__ == "__main__":
    main()
