"""The judge pool's share of a step (issue 43 item 6c), on the 2-core machine.

Side by side in one run, `--repeats` times each, alternating: the demo task (configs/demo.yaml's model,
data and settings, `algorithm.adv_estimator=dr_grpo` as the judge demo uses) rewarded

- **rule**: by the task's rule (`embedded.d1p1t1+d1p1t1`), and
- **judge**: by the demo judge alone (configs/judge_demo.yaml: `+embedded[judge]:d1`, judge.rule_weight=0),

each for `--steps` steps (no early stop). Per run: steady-state trained samples/s (after the first step,
from metrics.jsonl times, as `launcher tune`), the step at which the 5-step mean reward first reaches 0.8,
and for the judge runs the gradings' mean latency and the mean number of gradings in flight (Σ grading time
over the run's wall time, Little's law), from the rollout worker's
Prometheus series `areal_like_judge_latency_seconds`, scraped every second while the run lasts.

Usage: python benchmarks/judge_share.py [--steps 150] [--repeats 2] [--keep DIR]
The last line is `judge_vs_rule_samples_per_s: <ratio>` (median judge run over median rule run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from _common import ROOT  # first: puts the repository root on sys.path


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("areal_like_judge_latency_seconds_sum") or line.startswith(
                "areal_like_judge_latency_seconds_count"):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = float(value)
    return out


def run(kind: str, steps: int, run_dir: str) -> dict:
    config = "configs/judge_demo.yaml" if kind == "judge" else "configs/demo.yaml"
    argv = [sys.executable, "-m", "launcher", "run", "--config", config, "--run-dir", run_dir,
            f"train.total_steps={steps}", "train.test_freq=0", "data.val_files=[]",
            "algorithm.adv_estimator=dr_grpo"]
    last: dict[str, float] = {}
    stop = threading.Event()

    def watch() -> None:  # the rollout worker's judge series, until the run ends
        while not stop.is_set():
            try:
                ports = json.load(open(os.path.join(run_dir, "endpoints.json")))["metrics_ports"]
                last.update(_scrape(ports["rollout0"]))
            except Exception:  # noqa: BLE001 — not started yet, or already gone
                pass
            stop.wait(1.0)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    t0 = time.monotonic()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    stop.set()
    t.join()
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    sps = sum(r["samples"] for r in rows[1:]) / (rows[-1]["time"] - rows[0]["time"])
    rewards = [r["reward_mean"] for r in rows]
    reached = next((i + 1 for i in range(4, len(rewards)) if statistics.mean(rewards[i - 4:i + 1]) >= 0.8), None)
    out = {"kind": kind, "samples_per_s": sps, "reach_0.8_at_step": reached, "reward_last5": statistics.mean(rewards[-5:]),
           "wall_s": wall}
    if kind == "judge":
        count = last.get("areal_like_judge_latency_seconds_count", 0.0)
        total = last.get("areal_like_judge_latency_seconds_sum", 0.0)
        out |= {"gradings": count, "grading_latency_ms": 1000 * total / count if count else None,
                "gradings_in_flight_mean": total / wall}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", help="keep the run directories here")
    args = ap.parse_args()
    base = args.keep or tempfile.mkdtemp(prefix="judge_share-")
    results: dict[str, list[dict]] = {"rule": [], "judge": []}
    try:
        for i in range(args.repeats):
            for kind in ("rule", "judge"):
                r = run(kind, args.steps, os.path.join(base, f"{kind}{i}"))
                results[kind].append(r)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in results.items()}
    print(f"samples/s median: rule {med['rule']:.1f}, judge {med['judge']:.1f}")
    print(f"judge_vs_rule_samples_per_s: {med['judge'] / med['rule']:.3f}")


if __name__ == "__main__":
    main()
