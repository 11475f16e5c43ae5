"""Co-located (共卡) vs disaggregated vs the minimal single-process loop on the 2-core machine (issue 27 item 5).

Three ways to run the same training on the same 2 CPU cores, measured side by side in one run:

- **disaggregated**: `embedded.d1p1t1+d1p1t1`, pinned as benchmarks/e2e_vs_minimal_loop.py pins it — the
  server (with the rollout worker and Redis) on CPU 0, the learner on CPU 1, one torch thread each: each
  side owns one core and they work at the same time.
- **co-located**: `embedded:d1|fsdp:d1` on both cores (`launcher.cpu_affinity.server=0-1`, which pins the
  learner there too; the rollout worker and Redis as well), the server and the learner with two torch
  threads each (`server.torch_threads=2`, `train.torch_threads=2`): they take turns, each phase with both
  cores — generate → release → train → shared-memory handoff → resume.
  Also run once with `colocate.release_memory=false` (servers only pause), for the memory figure.
- **minimal loop**: e2e_vs_minimal_loop.py's synchronous GRPO loop (one process, HF generate in a static
  batch, 1 or 2 torch threads, whichever a probe finds faster).

Per configuration: steady-state trained samples/s (after the first step, from metrics.jsonl times, as
`launcher tune`), the per-step breakdown, and the **peak memory of all the run's processes together**:
the sum of every process's PSS (/proc/<pid>/smaps_rollup; proportional, so the shared-memory segments and
shared libraries are not counted twice), sampled every 0.2 s over each role's process group.

Workloads: *long-tail* (the headline) = e2e_vs_minimal_loop's (`longtail_workflow.py:longtail`, 4 groups ×
8 samples, lognormal lengths, median 64, σ 1, in [1, 448], random Qwen2 hidden 128 / 2 layers) at each η of
`--etas`; *demo* = configs/demo.yaml (8 × 16 samples of 1 token).

**Memory** (where release shows): the demo task on a larger random Qwen2 (`--memory-hidden` 2048, 4 layers,
≈ 0.2 B parameters: 0.8 GB of fp32 weights per copy), `--memory-steps` steps, co-located with and without
`colocate.release_memory`, and disaggregated; the peak of Σ PSS as above. (The workloads above use models of
a few MB: there every configuration's peak is the processes' own baseline.)

**Handoff vs broadcast** for the same bytes: one embedded server holding a random Qwen2 (`--handoff-hidden`,
default 1024 / intermediate 2816 / 2 layers ≈ 97 MB fp32); alternating rounds of
`SharedMemoryWeightPusher.update` (the co-located handoff) and `WeightPusher.update` (gloo broadcast,
overlapped loads, as disaggregated runs push to embedded servers), both end to end (pause → … → continue),
64 MiB buckets; medians.

Usage: python benchmarks/colocated.py [--steps 30] [--etas 1,4] [--demo-steps 60] [--keep DIR]
The last line is `colocated_vs_disaggregated: <ratio>x` — long-tail samples/s, best co-located η over the
best disaggregated η.
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
import threading
import time

from _common import ROOT, build_model, start_server, stop_server  # first: puts the repository root on sys.path

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from e2e_vs_minimal_loop import (add_longtail_args, best_minimal, fmt_br, longtail_overrides,  # noqa: E402
                                 minimal_loop)

DISAGGREGATED = ("embedded.d1p1t1+d1p1t1", {"server": "0", "learner": "1", "rollout": "0", "redis": "0"}, [])
COLOCATED = ("embedded:d1|fsdp:d1", {"server": "0-1", "rollout": "0-1", "redis": "0-1"},
             ["server.torch_threads=2", "train.torch_threads=2"])


# ------------------------------------------------------------------------------------------- memory
def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


class PeakMemory(threading.Thread):
    """Samples Σ PSS over the process groups of every role in `<run_dir>/pids.json` (each role leads its own
    group: its helpers count with it) until stopped; `.peak` in bytes."""

    def __init__(self, run_dir: str, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.run_dir, self.every_s = run_dir, every_s
        self.peak = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.every_s):
            try:
                with open(os.path.join(self.run_dir, "pids.json")) as f:
                    roles = set(json.load(f)["roles"].values())
            except (OSError, ValueError, KeyError):
                continue
            total = 0
            for d in os.listdir("/proc"):
                if not d.isdigit():
                    continue
                try:
                    pgid = os.getpgid(int(d))
                except ProcessLookupError:
                    continue
                if pgid in roles or int(d) in roles:
                    total += _pss_kib(int(d))
            self.peak = max(self.peak, total * 1024)

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak


# ------------------------------------------------------------------------------------------- system
def system_run(mode: tuple, overrides: list[str], run_dir: str) -> dict:
    allocation, pin, extra = mode
    argv = [sys.executable, "-m", "launcher", "run", "--config", os.path.join(ROOT, "configs", "demo.yaml"),
            "--allocation", allocation, "--run-dir", run_dir, "train.test_freq=0", "data.val_files=[]",
            *[f"launcher.cpu_affinity.{k}={v}" for k, v in pin.items()], *extra, *overrides]
    shutil.rmtree(run_dir, ignore_errors=True)  # a run dir left by an earlier --keep would resume, not rerun
    os.makedirs(run_dir)
    mem = PeakMemory(run_dir)
    mem.start()
    t = time.monotonic()
    with open(os.path.join(run_dir, "launcher.log"), "w") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    wall = time.monotonic() - t
    peak = mem.stop()
    if rc != 0:
        tail = open(os.path.join(run_dir, "launcher.log"), errors="replace").read().splitlines()[-15:]
        raise SystemExit(f"launcher run {allocation} {overrides} exited with {rc}:\n  " + "\n  ".join(tail))
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])
    steady = rows[1:]
    k = len(steady)
    t0, t1 = rows[0]["time"], rows[-1]["time"]

    def mean(key):
        vals = [r.get(key) for r in steady if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else 0.0

    per_step = (t1 - t0) / k
    br = {"fetch": mean("fetch_s"), "train": mean("step_s"), "push": mean("push_s")}
    br["other"] = per_step - sum(br.values())
    return {"sps": sum(r["samples"] for r in steady) / (t1 - t0), "per_step": per_step, "br": br, "wall": wall,
            "peak_gib": peak / 2**30, "reward_last": sum(r["reward_mean"] for r in rows[-5:]) / len(rows[-5:])}


def show(workload: str, name: str, r: dict) -> None:
    print(f"[{workload}] {name}: {r['sps']:.1f} samples/s, {r['per_step']:.3f} s/step = {fmt_br(r['br'])}; "
          f"peak memory of all processes {r['peak_gib']:.2f} GiB; wall {r['wall']:.0f} s "
          f"(reward last 5 steps {r['reward_last']:.2f})", flush=True)


# ------------------------------------------------------------------------------------------- handoff
async def handoff_rounds(url: str, weights, rounds: int, bucket: int) -> dict[str, list[float]]:
    from areal_like.api.net import free_port
    from areal_like.weights import SharedMemoryWeightPusher, WeightPusher

    shm = SharedMemoryWeightPusher([url], owner=f"bench{os.getpid()}", bucket_bytes=bucket, timeout_s=300)
    bcast = WeightPusher([url], master_port=free_port(), backend="gloo", bucket_bytes=bucket, timeout_s=300,
                         overlap_loads=True)
    out: dict[str, list[float]] = {"shm": [], "broadcast": []}
    await shm.init()
    await bcast.init()
    try:
        v = 1
        for _ in range(rounds):
            for name, p in (("shm", shm), ("broadcast", bcast)):
                res = await p.update(weights, v)
                out[name].append(res.push_s)
                v += 1
    finally:
        await shm.close()
        await bcast.close()
    return out


def handoff(base: str, args) -> tuple[float, float, float]:
    import torch
    import uvloop
    from safetensors.torch import load_file

    from areal_like.data.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    model_dir = build_tiny_model(os.path.join(base, "handoff_model"), hidden_size=args.handoff_hidden,
                                 intermediate_size=args.handoff_intermediate, num_layers=2, num_heads=8, num_kv_heads=2)
    weights = sorted(load_file(os.path.join(model_dir, "model.safetensors")).items())
    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    proc, url = start_server(model_dir, os.path.join(base, "handoff_server.log"), "--max-context-len", "64",
                             threads=1, max_batch=4)
    try:
        res = uvloop.run(handoff_rounds(url, weights, args.handoff_rounds, 64 << 20))
    finally:
        stop_server(proc)
    shm, bc = statistics.median(res["shm"]), statistics.median(res["broadcast"])
    return nbytes / 1e6, shm, bc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_longtail_args(ap)
    ap.add_argument("--etas", default="1,4", help="η values of both modes on the long-tail workload")
    ap.add_argument("--demo-steps", type=int, default=60, help="demo workload steps (0 = skip)")
    ap.add_argument("--demo-eta", type=int, default=1)
    ap.add_argument("--threads", default="2,1", help="minimal loop torch threads to compare (the faster is used)")
    ap.add_argument("--memory-hidden", type=int, default=2048)
    ap.add_argument("--memory-steps", type=int, default=6, help="memory workload steps (0 = skip)")
    ap.add_argument("--handoff-hidden", type=int, default=1024)
    ap.add_argument("--handoff-intermediate", type=int, default=2816)
    ap.add_argument("--handoff-rounds", type=int, default=7)
    ap.add_argument("--keep", default=None, help="keep run directories here (default: a temp dir, removed)")
    args = ap.parse_args()
    os.environ.update(LONGTAIL_MEDIAN=str(args.median), LONGTAIL_SIGMA=str(args.sigma))
    from longtail_workflow import output_length

    from areal_like.data.demo_task import resolve_demo_name

    etas = [int(e) for e in args.etas.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.abspath(args.keep) if args.keep else tmp
        # ---- long tail
        model_dir = build_model(os.path.join(base, "model"), args.hidden, args.layers)
        lt = longtail_overrides(args, model_dir)
        runs: dict[tuple[str, int], dict] = {}
        for eta in etas:
            for name, mode in (("disaggregated", DISAGGREGATED), ("co-located", COLOCATED)):
                runs[name, eta] = system_run(mode, [*lt, f"rollout.max_staleness={eta}"],
                                             os.path.join(base, f"longtail_{name}_eta{eta}"))
                show("longtail", f"{name} η = {eta}", runs[name, eta])
        keep_eta = max(etas, key=lambda e: runs["co-located", e]["sps"])
        kept = system_run(COLOCATED, [*lt, f"rollout.max_staleness={keep_eta}", "colocate.release_memory=false"],
                          os.path.join(base, "longtail_colocated_norelease"))
        show("longtail", f"co-located η = {keep_eta}, colocate.release_memory=false", kept)
        mini = best_minimal(args, lambda th, steps: minimal_loop(
            model_dir, steps, args.batch, args.n, args.lr,
            lambda s: [output_length(1, f"min-{s}-{g}", i, args.max_new) for g in range(args.batch)
                       for i in range(args.n)], th), args.steps, "longtail")
        print(f"[longtail] minimal loop ({mini['threads']} thread(s)): {mini['sps']:.1f} samples/s, "
              f"{mini['per_step']:.3f} s/step = {fmt_br(mini['br'])} (reward last 5 steps {mini['reward_last']:.2f})",
              flush=True)
        # ---- demo
        demo = {}
        if args.demo_steps > 0:
            d = [f"train.total_steps={args.demo_steps}", f"rollout.max_staleness={args.demo_eta}"]
            for name, mode in (("disaggregated", DISAGGREGATED), ("co-located", COLOCATED)):
                demo[name] = system_run(mode, d, os.path.join(base, f"demo_{name}"))
                show("demo", f"{name} η = {args.demo_eta}", demo[name])
            demo_model = resolve_demo_name("demo:tiny-qwen2", "model.path")
            dm = best_minimal(args, lambda th, steps: minimal_loop(demo_model, steps, 8, 16, 1e-3,
                                                                   lambda s: [1] * (8 * 16), th),
                              args.demo_steps, "demo")
            demo["minimal"] = dm
            print(f"[demo] minimal loop ({dm['threads']} thread(s)): {dm['sps']:.1f} samples/s, "
                  f"{dm['per_step']:.3f} s/step = {fmt_br(dm['br'])}", flush=True)
        # ---- memory at a size where the weights dominate
        mem = {}
        if args.memory_steps > 0:
            big = build_model(os.path.join(base, "memory_model"), args.memory_hidden, 4)
            m = [f"model.path={big}", f"train.total_steps={args.memory_steps}", "rollout.max_staleness=1",
                 "train.batch_size=2", "generation.n=8", "rollout.max_concurrent_groups=2"]
            for name, mode, extra in (("co-located", COLOCATED, []),
                                      ("co-located, colocate.release_memory=false", COLOCATED,
                                       ["colocate.release_memory=false"]),
                                      ("disaggregated", DISAGGREGATED, [])):
                mem[name] = system_run(mode, [*m, *extra], os.path.join(base, f"memory_{len(mem)}"))
                show("memory", name, mem[name])
        # ---- handoff vs broadcast
        mb, shm_s, bc_s = handoff(base, args)
    best = {name: max((runs[name, e] for e in etas), key=lambda r: r["sps"]) for name in ("disaggregated", "co-located")}
    best_eta = {name: max(etas, key=lambda e: runs[name, e]["sps"]) for name in ("disaggregated", "co-located")}
    print("summary (long tail, best η of each):")
    print(f"  samples/s: co-located {best['co-located']['sps']:.1f} (η {best_eta['co-located']}), disaggregated "
          f"{best['disaggregated']['sps']:.1f} (η {best_eta['disaggregated']}), minimal loop {mini['sps']:.1f}")
    print(f"  peak memory, all processes: co-located {best['co-located']['peak_gib']:.2f} GiB with release, "
          f"{kept['peak_gib']:.2f} GiB without (η {keep_eta}); disaggregated {best['disaggregated']['peak_gib']:.2f} GiB")
    if mem:
        print(f"  peak memory at hidden {args.memory_hidden}: " + ", ".join(f"{k} {v['peak_gib']:.2f} GiB"
                                                                           for k, v in mem.items()))
    if demo:
        print(f"  demo samples/s: co-located {demo['co-located']['sps']:.1f}, disaggregated "
              f"{demo['disaggregated']['sps']:.1f}, minimal loop {demo['minimal']['sps']:.1f} "
              f"(co-located/disaggregated {demo['co-located']['sps'] / demo['disaggregated']['sps']:.2f}x)")
    print(f"  handoff of {mb:.0f} MB to one server: shared memory {shm_s:.3f} s ({mb / shm_s:.0f} MB/s), gloo broadcast "
          f"{bc_s:.3f} s ({mb / bc_s:.0f} MB/s): {bc_s / shm_s:.2f}x faster")
    print(f"colocated_vs_disaggregated: {best['co-located']['sps'] / best['disaggregated']['sps']:.2f}x")


if __name__ == "__main__":
    main()
