"""The mission's allocation at toy scale: `embedded.d16p1m1+d8p2m1` under `launcher run --backend ray`
on a simulated 4-node × 8-device Ray cluster (four raylets on this machine, loopback, devices as a
logical GPU resource; the tiny demo model on CPU) — 16 generation servers and a 16-rank dp8 × pp2
learner — against the single-machine default `embedded.d1p1t1+d1p1t1` (local backend), same config
and steps, in the same run.

    python benchmarks/mission_toy_ray.py [--steps 4]

Prints wall time, peak memory in use on the machine (MemTotal − MemAvailable, sampled), the mean
learner step time and the time to the first step for both, then
`mission_toy_ray: <wall ratio> (ray 32 devices / local 2)`.
Too heavy for CI on 2 cores (~35 processes with torch): not run by the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from _common import ROOT

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def mem_used_gib() -> float:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0])
    return (info["MemTotal"] - info["MemAvailable"]) / 2**20


class PeakMem:
    def __init__(self):
        self.base = mem_used_gib()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, mem_used_gib())

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return self.peak - self.base


def run(label: str, argv: list[str], run_dir: str, timeout: float) -> dict:
    mem = PeakMem()
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", *argv, "--run-dir", run_dir], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - t0
    peak = mem.stop()
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        raise SystemExit(f"{label}: launcher run exited with {proc.returncode}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    step_s = sum(r["step_s"] for r in rows) / len(rows)
    first = next((line for line in proc.stdout.splitlines() if "generation server(s) healthy" in line), "")
    out = {"label": label, "wall_s": wall, "peak_mem_gib": peak, "steps": summary["steps"], "step_s": step_s,
           "push_s": sum(r["push_s"] for r in rows) / len(rows), "samples_per_s": summary["samples_per_s"]}
    print(f"{label:36s} wall {wall:6.1f}s  peak mem +{peak:5.2f} GiB  steps {summary['steps']}  "
          f"learner step {step_s:.3f}s  push {out['push_s']:.3f}s  samples/s {summary['samples_per_s']:.1f}  {first[:60]}",
          flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--devices-per-node", type=int, default=8)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    common = ["--config", "configs/demo.yaml", f"train.total_steps={args.steps}", "train.test_freq=0",
              "rollout.workers=2", "metrics.prometheus=false", "server.health_timeout_s=600",
              "train.collective_timeout_s=600", "weights.timeout_s=600", "launcher.ray.placement_timeout_s=300",
              "launcher.ray.call_timeout_s=300"]
    with tempfile.TemporaryDirectory(prefix="mission_toy_") as tmp:
        local = run("local embedded.d1p1t1+d1p1t1", [*common, "--allocation", "embedded.d1p1t1+d1p1t1"],
                    os.path.join(tmp, "local"), 900)
        t0 = time.monotonic()
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            node_ip_address="127.0.0.1", num_cpus=24, num_gpus=args.devices_per_node, include_dashboard=False))
        try:
            for _ in range(args.nodes - 1):
                cluster.add_node(node_ip_address="127.0.0.1", num_cpus=24, num_gpus=args.devices_per_node)
            cluster.wait_for_nodes()
            print(f"Ray cluster of {args.nodes} node(s) × {args.devices_per_node} up in {time.monotonic() - t0:.1f}s",
                  flush=True)
            mission = run(f"ray embedded.d16p1m1+d8p2m1 ({args.nodes}×{args.devices_per_node})",
                          [*common, "--backend", "ray", "--ray-address", cluster.address,
                           "--allocation", "embedded.d16p1m1+d8p2m1"], os.path.join(tmp, "ray"), 1800)
        finally:
            if ray.is_initialized():
                ray.shutdown()
            cluster.shutdown()
    print(f"mission_toy_ray: {mission['wall_s'] / local['wall_s']:.2f} (wall, ray 32 devices / local 2; "
          f"learner step {mission['step_s'] / local['step_s']:.2f}x, peak mem {mission['peak_mem_gib']:.1f} GiB "
          f"vs {local['peak_mem_gib']:.1f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
