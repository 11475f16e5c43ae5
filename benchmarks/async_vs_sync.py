"""Asynchronous (η ≥ 1) vs synchronous (η = 0) RL on a long-tail workload: trained samples/s, the
generation busy fraction, and the overlap bound (issue 14).

Workload: `benchmarks/longtail_workflow.py:longtail` — every sample's output length drawn from a
lognormal (median `--median`, shape `--sigma`) clipped to [1, `--max-new`], generated with
`ignore_eos`; `--n` samples per prompt, `--batch` groups per step; a random Qwen2 (`--hidden`,
`--layers`, char tokenizer, as engine_vs_hf builds) on the demo task (prompts and reward).
Generation and learner are pinned to disjoint cores (`launcher.cpu_affinity.server` / `.learner`,
standing in for separate GPUs); the rollout worker and Redis go with generation (`--rollout-cpus`,
default the server's core: in a GPU deployment they run on the generation nodes' host CPUs, not on the
trainer's device — left on the learner's core they slow its step by ~30%).

For η = 0 and each η in `--etas`: one real `launcher run` (a subprocess, its own run dir) of `--steps`
steps, the same settings except `rollout.max_staleness`. Per run:
- samples/s: steady state as `launcher tune` computes it — samples trained after the first step /
  (time of the last metrics row − time of the first), so the start-up every run pays alike is out;
- gen busy: Δ`areal_like_server_busy_seconds` / Δwall over that same window, scraped from the server's
  /metrics while the run goes (summary.json's `generation.busy_fraction`, start-up included, is
  printed beside it).

Alone, in the same invocation:
- T_gen: `--steps × --batch` groups of the same workload (same length distribution, same group size,
  `rollout.max_concurrent_groups` groups in flight, refilled as each ends) on one embedded server
  pinned to the server's core, driven from `--rollout-cpus`, no learner, no weight pushes — per
  step: T_gen / steps. Its busy fraction is the ceiling of gen busy (the metric counts the engine's
  compute only, not the scheduler's and HTTP's own time around it);
- T_train: the η = 0 run's learner step + weight push per step (mean `step_s + push_s` over steps
  2…N of metrics.jsonl): at η = 0 nothing is generated while the learner steps.

    bound = (T_gen + T_train) / max(T_gen, T_train)     (per step; perfect overlap reaches it)
    ratio(η) = samples/s(η) / samples/s(η = 0)

Usage: python benchmarks/async_vs_sync.py [--steps 30] [--etas 1,2,4] [--batch 4] [--n 8] [--max-new 448]
       [--median 64] [--sigma 1.0] [--hidden 128] [--layers 2] [--concurrency B] [--server-cpus 0]
       [--learner-cpus 1] [--rollout-cpus 0] [--keep DIR]
The last line printed is `async_vs_sync: <best ratio>x (bound <b>)`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from _common import ROOT, build_model, start_server, stop_server  # first: puts the repository root on sys.path

WORKFLOW = os.path.join(ROOT, "benchmarks", "longtail_workflow.py")
BUSY = "areal_like_server_busy_seconds_total"


def scrape_busy(url: str) -> float | None:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2.0) as r:
            text = r.read().decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 — not up yet / already gone
        return None
    vals = [float(line.split()[-1]) for line in text.splitlines()
            if line.startswith(BUSY) and line[len(BUSY):len(BUSY) + 1] in (" ", "{")]
    return sum(vals) if vals else None


class BusyPoller(threading.Thread):
    """Samples (unix time, busy seconds) of the run's server every 0.25 s until stopped."""

    def __init__(self, run_dir: str):
        super().__init__(daemon=True)
        self.run_dir, self.samples, self.done = run_dir, [], threading.Event()

    def run(self) -> None:
        url = None
        while not self.done.is_set():
            if url is None:
                try:
                    with open(os.path.join(self.run_dir, "endpoints.json")) as f:
                        url = json.load(f)["servers"][0]
                except (OSError, ValueError, KeyError, IndexError):
                    pass
            if url is not None:
                b = scrape_busy(url)
                if b is not None:
                    self.samples.append((time.time(), b))
            self.done.wait(0.25)

    def fraction(self, t0: float, t1: float) -> float | None:
        """Busy seconds / wall seconds between the first sample at or after t0 and the last at or before t1."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def launcher_run(eta: int, args, run_dir: str) -> dict:
    argv = [sys.executable, "-m", "launcher", "run", "--config", os.path.join(ROOT, "configs", "demo.yaml"),
            "--run-dir", run_dir, f"model.path={args.model_dir}",
            f"rollout.workflow={WORKFLOW}:longtail", f"generation.n={args.n}",
            f"generation.max_new_tokens={args.max_new}", f"train.batch_size={args.batch}",
            f"rollout.max_concurrent_groups={args.concurrency}", f"train.total_steps={args.steps}",
            "train.test_freq=0", "data.val_files=[]", f"rollout.max_staleness={eta}",
            f"launcher.cpu_affinity.server={args.server_cpus}", f"launcher.cpu_affinity.learner={args.learner_cpus}"]
    if args.rollout_cpus:
        argv += [f"launcher.cpu_affinity.rollout={args.rollout_cpus}", f"launcher.cpu_affinity.redis={args.rollout_cpus}"]
    env = dict(os.environ, LONGTAIL_MEDIAN=str(args.median), LONGTAIL_SIGMA=str(args.sigma))
    os.makedirs(run_dir, exist_ok=True)
    poller = BusyPoller(run_dir)
    poller.start()
    t = time.monotonic()
    with open(os.path.join(run_dir, "launcher.log"), "w") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    wall = time.monotonic() - t
    poller.done.set()
    poller.join()
    if rc != 0:
        tail = open(os.path.join(run_dir, "launcher.log"), errors="replace").read().splitlines()[-15:]
        raise SystemExit(f"η = {eta}: launcher run exited with {rc}:\n  " + "\n  ".join(tail))
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    rows = sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    t0, t1 = rows[0]["time"], rows[-1]["time"]
    trained = sum(r["samples"] for r in rows[1:])
    return {"eta": eta, "rows": rows, "wall": wall, "sps": trained / (t1 - t0), "trained": trained,
            "busy": poller.fraction(t0, t1), "busy_run": (summary.get("generation") or {}).get("busy_fraction"),
            "staleness": summary.get("max_staleness_observed"),
            "dropped": sum(((summary.get("buffer") or {}).get("dropped") or {}).values()),
            "step_s": sum(r["step_s"] for r in rows[1:]) / (len(rows) - 1),
            "push_s": sum(r["push_s"] for r in rows[1:]) / (len(rows) - 1)}


async def drive_alone(url: str, prompts: list[list[int]], groups: int, args) -> tuple[float, float]:
    """`groups` groups of the long-tail workload, `args.concurrency` groups in flight; (wall seconds,
    the server's busy fraction over them)."""
    import aiohttp

    from longtail_workflow import output_length

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def sample(p, n):
            body = {"input_ids": p, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True}}
            async with s.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=600)) as r:
                reply = await r.json()
                assert r.status == 200, reply
                assert len(reply["output_ids"]) == n

        async def group(k):
            p = prompts[k % len(prompts)]
            await asyncio.gather(*(sample(p, output_length(1, f"alone-{k}", i, args.max_new))
                                   for i in range(args.n)))

        sem = asyncio.Semaphore(args.concurrency)

        async def limited(k):
            async with sem:
                await group(k)

        await group(10**6)  # warm-up
        b0 = await asyncio.to_thread(scrape_busy, url)
        t0 = time.perf_counter()
        await asyncio.gather(*(limited(k) for k in range(groups)))
        wall = time.perf_counter() - t0
        b1 = await asyncio.to_thread(scrape_busy, url)
        return wall, (b1 - b0) / wall


def gen_alone(args, tmp: str) -> tuple[float, float]:
    from transformers import AutoTokenizer

    from areal_like.api.config import parse_cpu_list
    from areal_like.data.demo_task import resolve_demo_name
    import pyarrow.parquet as pq

    model = args.model_dir
    tok = AutoTokenizer.from_pretrained(model)
    texts = pq.read_table(resolve_demo_name("demo:next-digit", "data.train_files")).column("prompt").to_pylist()
    prompts = [tok(t)["input_ids"] for t in texts[:512]]
    proc, url = start_server(model, os.path.join(tmp, "alone_server.log"), "--max-context-len", "512",
                             max_batch=64, cpus=parse_cpu_list(args.server_cpus))
    os.environ.update(LONGTAIL_MEDIAN=str(args.median), LONGTAIL_SIGMA=str(args.sigma))
    mine = os.sched_getaffinity(0)
    if args.rollout_cpus:  # the driver stands in for the rollout worker: on its CPUs
        os.sched_setaffinity(0, parse_cpu_list(args.rollout_cpus))
    try:
        import uvloop

        return uvloop.run(drive_alone(url, prompts, args.steps * args.batch, args))
    finally:
        os.sched_setaffinity(0, mine)
        stop_server(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--etas", default="1,2,4")
    ap.add_argument("--batch", type=int, default=4, help="groups per step")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="rollout.max_concurrent_groups, also the groups in flight of T_gen (default: --batch)")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--max-new", type=int, default=448)
    ap.add_argument("--median", type=float, default=64.0, help="median output length (tokens)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal shape of the output lengths")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size of the random Qwen2 (intermediate 3×)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--server-cpus", default="0")
    ap.add_argument("--learner-cpus", default="1")
    ap.add_argument("--rollout-cpus", default="0",
                    help="launcher.cpu_affinity.rollout and .redis, and the T_gen driver's CPUs ('' = not pinned)")
    ap.add_argument("--keep", default=None, help="keep the run directories here (default: a temp dir, removed)")
    args = ap.parse_args()
    args.concurrency = args.concurrency or args.batch
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    os.environ.update(LONGTAIL_MEDIAN=str(args.median), LONGTAIL_SIGMA=str(args.sigma))
    etas = [0] + [int(e) for e in args.etas.split(",") if int(e) != 0]

    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.abspath(args.keep) if args.keep else tmp
        args.model_dir = build_model(os.path.join(base, "model"), args.hidden, args.layers)
        runs = []
        for eta in etas:
            r = launcher_run(eta, args, os.path.join(base, f"eta{eta}"))
            print(f"[async_vs_sync] η = {eta}: {r['sps']:.1f} samples/s, busy {r['busy']}, wall {r['wall']:.0f}s",
                  flush=True)
            runs.append(r)
        t_gen_total, busy_alone = gen_alone(args, tmp)

    from longtail_workflow import output_length

    lens = sorted(output_length(1, f"alone-{k}", i, args.max_new) for k in range(args.steps * args.batch)
                  for i in range(args.n))
    sync = runs[0]
    t_gen = t_gen_total / args.steps
    t_train = sync["step_s"] + sync["push_s"]
    bound = (t_gen + t_train) / max(t_gen, t_train)
    print(f"workload: {args.steps} steps × {args.batch} groups × {args.n} samples, output lengths lognormal "
          f"(median {args.median:g}, σ {args.sigma:g}) clipped to [1, {args.max_new}], ignore_eos: "
          f"min {lens[0]} median {lens[len(lens) // 2]} p90 {lens[int(0.9 * len(lens))]} max {lens[-1]}")
    print(f"pinning: server on CPU {args.server_cpus}, learner on CPU {args.learner_cpus}, rollout worker and redis "
          f"on {'CPU ' + args.rollout_cpus if args.rollout_cpus else 'any CPU'}; model: random Qwen2 hidden {args.hidden}, "
          f"{args.layers} layers (GQA 4/2 heads, char tokenizer), fp32; task demo:next-digit")
    print(f"alone, per step: T_gen {t_gen:.3f} s ({args.steps * args.batch} groups in {t_gen_total:.2f} s, "
          f"no learner; gen busy {busy_alone:.2f}), T_train {t_train:.3f} s (η = 0 learner step {sync['step_s']:.3f} + push "
          f"{sync['push_s']:.3f}); bound (T_gen + T_train) / max = {bound:.2f}")
    print(f"{'η':>3} {'samples/s':>10} {'ratio':>6} {'gen busy':>9} {'busy (run)':>11} {'step s':>7} "
          f"{'push s':>7} {'max stale':>10} {'dropped':>8} {'wall s':>7}")
    for r in runs:
        busy = f"{r['busy']:.2f}" if r["busy"] is not None else "–"
        busy_run = f"{r['busy_run']:.2f}" if r["busy_run"] is not None else "–"
        print(f"{r['eta']:>3} {r['sps']:>10.1f} {r['sps'] / sync['sps']:>6.2f} {busy:>9} {busy_run:>11} "
              f"{r['step_s']:>7.3f} {r['push_s']:>7.3f} {r['staleness']!s:>10} {r['dropped']:>8} {r['wall']:>7.0f}")
    best = max(runs[1:], key=lambda r: r["sps"]) if len(runs) > 1 else sync
    ratio = best["sps"] / sync["sps"]
    print(f"best η = {best['eta']}: ratio {ratio:.2f} (goal ≥ 1.5), {ratio / bound:.2f} of the bound (goal ≥ 0.9), "
          f"gen busy {best['busy'] if best['busy'] is None else round(best['busy'], 2)} (goal ≥ 0.9)")
    print(f"async_vs_sync: {ratio:.2f}x (bound {bound:.2f})")


if __name__ == "__main__":
    main()
