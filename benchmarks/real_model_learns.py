"""A real pretrained model learns, mode by mode (issue 39 item 4), measured side by side in one run.

Each mode is `launcher run --config configs/real_model.yaml` (SmolLM2-135M-Instruct, one-digit addition in
English, held-out mean@4 on 64 prompts every 10 steps and at version 0) plus its overrides, one after the
other on the same machine, `--steps` steps each:

    async       the config as it is (η = 1, full fine-tuning, disaggregated, fp32 everywhere)
    sync        rollout.max_staleness=0 (η = 0: synchronous RL through the same code path)
    lora        model.lora_rank=16 model.lora_alpha=32 train.lr=1e-4 (adapters only, adapter-only pushes)
    colocated   --allocation "embedded:d1|fsdp:d1" (generation and training take turns on the same cores)
    bf16        server.dtype=bfloat16 train.rejection_sampling=icepop (bf16 servers, fp32 learner: a real
                training–inference mismatch, IcePop masking the tokens whose ratio leaves [0.5, 5])

For each: held-out mean@4 against wall clock (from the launcher's start, model loading included), the
wall clock at which it first reached `--target` (0.8), trained samples/s, the mismatch between the
servers' and the learner's log-probabilities of the sampled tokens (mean |Δ log p|, KL) and the share of
loss tokens the correction masked or capped. One plot per comparison (async vs sync, full vs LoRA,
disaggregated vs co-located, fp32 vs bf16 servers) in `--plots` (default docs/images/).

    .venv/bin/python benchmarks/real_model_learns.py                 # all modes, ~45–60 min on 2 cores
    .venv/bin/python benchmarks/real_model_learns.py --modes async,sync --steps 30

The last line is `real_model_learns: time to held-out mean@4 ≥ 0.8, sync/async: <ratio>` (> 1: async
gets there sooner); "never" where a mode did not reach the target within its steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _common import ROOT

MODES: dict[str, tuple[list[str], str | None]] = {
    "async": ([], None),
    "sync": (["rollout.max_staleness=0"], None),
    "lora": (["model.lora_rank=16", "model.lora_alpha=32", "train.lr=1e-4"], None),
    "colocated": ([], "embedded:d1|fsdp:d1"),
    "bf16": (["server.dtype=bfloat16", "train.rejection_sampling=icepop"], None),
}
COMPARISONS = (("async", "sync", "η = 1 vs η = 0"), ("async", "lora", "full fine-tuning vs LoRA r16"),
               ("async", "colocated", "disaggregated vs co-located"), ("async", "bf16", "fp32 vs bf16 servers"))
VAL_KEY = "val/all/mean@4"


def run_mode(name: str, steps: int, out_dir: str, cache: str | None) -> dict:
    overrides, allocation = MODES[name]
    run_dir = os.path.join(out_dir, name)
    cmd = [sys.executable, "-m", "launcher", "run", "--config", "configs/real_model.yaml", "--run-dir", run_dir,
           f"train.total_steps={steps}", *overrides]
    if allocation:
        cmd += ["--allocation", allocation]
    env = dict(os.environ)
    if cache:
        env["AREAL_LIKE_CACHE"] = cache
    t0 = time.time()
    with open(os.path.join(out_dir, f"{name}.log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.time() - t0
    if rc != 0:
        raise SystemExit(f"mode {name}: launcher run exited {rc}; see {out_dir}/{name}.log")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    val = [(r["val/version"], r["time"] - t0, r[VAL_KEY]) for r in rows if VAL_KEY in r]
    tokens = sum(r["loss_tokens"] for r in rows)
    masked = sum(r.get("behav_tokens_capped") or 0 for r in rows)
    n = len(rows)
    return {
        "mode": name, "wall_s": wall, "val": val, "samples_per_s": summary["samples_per_s"],
        "val0": val[0][2] if val else float("nan"), "val_end": val[-1][2] if val else float("nan"),
        "mismatch_logp": sum(r["mismatch_logp_abs_mean"] for r in rows) / n,
        "mismatch_kl": sum(r["mismatch_kl"] for r in rows) / n,
        "masked_share": masked / tokens if tokens else 0.0,
        "mean_step_s": sum(r["step_s"] for r in rows) / n,
        "mean_push_s": sum(r["push_s"] for r in rows) / n,
        "max_staleness": summary.get("max_staleness_observed"),
    }


def first_reach(res: dict, target: float) -> float | None:
    return next((t for _, t, v in res["val"] if v >= target), None)


def plot(results: dict[str, dict], plots: str, target: float) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(plots, exist_ok=True)
    paths = []
    for a, b, title in COMPARISONS:
        if a not in results or b not in results:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for m in (a, b):
            ax.plot([t / 60 for _, t, _ in results[m]["val"]], [v for _, _, v in results[m]["val"]], marker="o", label=m)
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("wall clock (min, from launch)")
        ax.set_ylabel("held-out mean@4")
        ax.set_ylim(0, 1)
        ax.set_title(f"SmolLM2-135M-Instruct, one-digit addition: {title}", fontsize=9)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(plots, f"real_model_{a}_vs_{b}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {', '.join(MODES)}")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "real_model_learns"))
    ap.add_argument("--plots", default=os.path.join(ROOT, "docs", "images"))
    ap.add_argument("--cache", default=None, help="AREAL_LIKE_CACHE for the runs (default: the usual cache)")
    a = ap.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; the modes are {', '.join(MODES)}")
    os.makedirs(a.out, exist_ok=True)
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[:3]}; {a.steps} steps per mode; runs in {a.out}", flush=True)
    results: dict[str, dict] = {}
    for m in modes:
        results[m] = res = run_mode(m, a.steps, a.out, a.cache)
        curve = ", ".join(f"v{v}: {s:.2f} @ {t / 60:.1f} min" for v, t, s in res["val"])
        print(f"{m}: {curve}", flush=True)
    print()
    print(f"| mode | held-out mean@4 v0 → end | first ≥ {a.target} (min) | wall (min) | samples/s | step s | push s "
          "| mismatch mean abs Δlogp | mismatch KL | masked/capped share | max staleness |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m, r in results.items():
        reach = first_reach(r, a.target)
        print(f"| {m} | {r['val0']:.3f} → {r['val_end']:.3f} | {'never' if reach is None else f'{reach / 60:.1f}'} "
              f"| {r['wall_s'] / 60:.1f} | {r['samples_per_s']:.2f} | {r['mean_step_s']:.1f} | {r['mean_push_s']:.2f} "
              f"| {r['mismatch_logp']:.4f} | {r['mismatch_kl']:.2e} | {r['masked_share']:.4f} | {r['max_staleness']} |")
    for p in plot(results, a.plots, a.target):
        print(f"plot: {os.path.relpath(p, ROOT)}")
    if "async" in results and "sync" in results:
        ra, rs = first_reach(results["async"], a.target), first_reach(results["sync"], a.target)
        ratio = "n/a (async never reached it)" if ra is None else "never (sync)" if rs is None else f"{rs / ra:.2f}"
        print(f"real_model_learns: time to held-out mean@4 ≥ {a.target}, sync/async: {ratio}")


if __name__ == "__main__":
    main()
