"""On-policy distillation from a trained teacher against GRPO from the reward alone, on the demo task.

Side by side, the same seeds, `--repeats` times each, alternating, through `launcher run`:

    distill  configs/distill_demo.yaml: a fresh demo model learns next-digit from the demo teacher's
             logprobs of its own samples (teacher.reward_weight=0: no reward in training; a teacher pool
             embedded[teacher]:d1 beside the rollout server)
    grpo     configs/demo.yaml: the same fresh model, GRPO on the task's rule reward (its tuned lr, 1e-3;
             also at the distillation's lr 4e-3 with --grpo-lr)

Each for `--steps` steps with a validation every 5 (32 held-out prompts × 4 samples, `val/all/mean@4`).
Printed per run: held-out accuracy at steps 25/50/…, the first step (and wall-clock seconds since the
run's first step) at which it reached 0.9, and samples/s. The last line is
`distill_vs_grpo_steps_to_0.9: <ratio>` (median distillation run over median GRPO run; a run that never
reached 0.9 counts as `--steps`).

    .venv/bin/python benchmarks/distill_vs_grpo.py [--steps 200] [--repeats 2] [--grpo-lr 1e-3]

~2 minutes per run on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 0.9


def run(kind: str, seed: int, steps: int, grpo_lr: float, run_dir: str) -> dict:
    config = "configs/distill_demo.yaml" if kind == "distill" else "configs/demo.yaml"
    extra = [] if kind == "distill" else [f"train.lr={grpo_lr}"]
    cmd = [sys.executable, "-m", "launcher", "run", "--config", config, "--run-dir", run_dir, f"seed={seed}",
           f"train.total_steps={steps}", "train.test_freq=5", "metrics.report=false", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:])
        raise SystemExit(f"launcher run failed ({proc.returncode}): {kind} seed {seed}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    t0 = rows[0]["time"]
    val = [(r["step"], r["val/all/mean@4"], r["time"] - t0) for r in rows if "val/all/mean@4" in r]
    hit = next(((s, round(t, 1)) for s, v, t in val if v >= TARGET), (None, None))
    out = {"kind": kind, "seed": seed, "lr": None if kind == "distill" else grpo_lr,
           "val_at": {s: round(v, 3) for s, v, _ in val if s % 25 == 0},
           f"step_to_{TARGET}": hit[0], f"seconds_to_{TARGET}": hit[1],
           "samples_per_s": round(sum(r["samples"] for r in rows[1:]) / (rows[-1]["time"] - t0), 1),
           "teacher_kl_last": rows[-1].get("teacher_kl")}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--grpo-lr", type=float, default=1e-3)
    ap.add_argument("--keep", default=None)
    a = ap.parse_args()
    base = a.keep or tempfile.mkdtemp(prefix="distill_vs_grpo.")
    print(f"demo task (next digit), fresh tiny model, {a.steps} steps, validation every 5 on 32 held-out prompts "
          f"× 4; distill: configs/distill_demo.yaml; grpo: configs/demo.yaml at lr {a.grpo_lr:g}", flush=True)
    res: dict[str, list[dict]] = {"distill": [], "grpo": []}
    for k in range(a.repeats):
        for kind in ("distill", "grpo"):
            res[kind].append(run(kind, 1 + k, a.steps, a.grpo_lr, os.path.join(base, f"{kind}{k}")))
    med = {kind: statistics.median(r[f"step_to_{TARGET}"] or a.steps for r in v) for kind, v in res.items()}
    print(f"steps to held-out {TARGET} (median): distill {med['distill']:g}, grpo {med['grpo']:g}")
    print(f"distill_vs_grpo_steps_to_{TARGET}: {med['distill'] / med['grpo']:.3f}")


if __name__ == "__main__":
    main()
