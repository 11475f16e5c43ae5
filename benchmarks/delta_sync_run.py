"""`weights.sync=delta` against `full` in a whole run: trained samples/s where the push is a share of the step.

configs/real_shape.yaml (Qwen3-0.6B's published shape at random init, 596 M parameters, Qwen3's tokenizer,
bf16 embedded server, fp32-master learner at lr 1e-6) through `launcher run`, shrunk so that the push is a
visible share of a step on this CPU machine: one group of 2 samples × 8 new tokens per step, an entropy
bonus (random weights earn no reward, so it is what moves them), η = 1 (the
server generates the next batch while the learner trains, so a push's pause window is what generation
waits for). Two runs side by side, the same seed, `--steps` steps each, alternating `--repeats` times:

    full     weights.sync=full   every push: the whole model, 1.19 GB in bf16
    delta    weights.sync=delta  after the first push: the changed elements (weights/delta.py)

Per run, from metrics.jsonl: steady-state trained samples/s (rows after the first, by their times, as
`launcher tune` reads them), and the medians of the push's seconds, its pause window (generation stopped),
its bytes and the learner's step seconds. The last line is `delta_vs_full_samples_per_s: <ratio>` (the
median delta run over the median full run).

    .venv/bin/python benchmarks/delta_sync_run.py [--steps 6] [--repeats 1] [--keep DIR]

~20 GB of RAM at its peak, ~4 minutes per run on 2 cores (the first run also builds the model into the
demo cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHRINK = ["train.batch_size=1", "generation.n=2", "generation.max_new_tokens=8", "rollout.max_staleness=1",
          "train.test_freq=0",
          # random-init weights earn no reward: every advantage is 0 and, without this, no weight would ever
          # change (the first try measured deltas of 0 bytes); the entropy bonus gives each step a gradient,
          # and AdamW moves the weights by ~lr as an RL step does
          "algorithm.entropy_coef=0.01"]


def run(run_dir: str, steps: int, sync: str) -> dict:
    cmd = [sys.executable, "-m", "launcher", "run", "--config", "configs/real_shape.yaml", "--run-dir", run_dir,
           f"train.total_steps={steps}", *SHRINK, f"weights.sync={sync}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-6000:])
        raise SystemExit(f"launcher run failed ({proc.returncode}): weights.sync={sync}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    later = rows[1:]
    if not later:
        raise SystemExit("need at least 2 steps (--steps)")
    med = lambda key: statistics.median(r[key] for r in later)  # noqa: E731
    out = {"sync": sync, "steps": len(rows), "wall_s": round(wall, 1),
           "samples_per_s": round(sum(r["samples"] for r in later) / (later[-1]["time"] - rows[0]["time"]), 4),
           "push_s_median": round(med("push_s"), 3), "pause_window_s_median": round(med("pause_window_s"), 3),
           "push_MB_median": round(med("push_bytes") / 1e6, 3), "learner_step_s_median": round(med("step_s"), 2),
           "push_delta": [bool(r.get("push_delta")) for r in rows],
           "push_changed": [None if r.get("push_changed") is None else round(r["push_changed"], 4) for r in rows]}
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--keep", default=None, help="keep the run dirs under this directory")
    a = ap.parse_args()
    base = a.keep or tempfile.mkdtemp(prefix="delta_sync_run.")
    print(f"Qwen3-0.6B shape (random init), bf16 embedded server, fp32-master learner at lr 1e-6, "
          f"{a.steps} steps of {' '.join(SHRINK)}; CPU, {os.cpu_count()} cores", flush=True)
    res: dict[str, list[dict]] = {"full": [], "delta": []}
    for k in range(a.repeats):
        for sync in ("full", "delta"):
            res[sync].append(run(os.path.join(base, f"{sync}{k}"), a.steps, sync))
    sps = {s: statistics.median(r["samples_per_s"] for r in v) for s, v in res.items()}
    pause = {s: statistics.median(r["pause_window_s_median"] for r in v) for s, v in res.items()}
    print(f"samples/s median: full {sps['full']:.4f}, delta {sps['delta']:.4f}; pause window median: "
          f"full {pause['full']:.3f} s, delta {pause['delta']:.3f} s")
    print(f"delta_vs_full_samples_per_s: {sps['delta'] / sps['full']:.3f}")


if __name__ == "__main__":
    main()
