"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`, so this directory is
on sys.path and `from _common import …` works): the repository root on sys.path, a free loopback
port, a `launcher run` to its end and its steady samples/s, an embedded server subprocess started healthy and
stopped again, and the long-tailed workload
and model of engine_vs_hf / interrupt_cost.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

HEALTH_TIMEOUT_S = 120


def launcher_run(run_dir: str, *args: str, what: str) -> tuple[list[dict], float]:
    """`launcher run --run-dir run_dir <args…>` from the repository root, to its end: (its metrics.jsonl rows,
    wall seconds). A failed run ends the benchmark, naming `what`, with the run's last output."""
    import json

    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", "--run-dir", run_dir, *args], cwd=ROOT,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{what} run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], wall


def alternate(kinds, run, *, steps: int, repeats: int, keep: str | None, prefix: str, digits: int = 4
              ) -> dict[str, list[dict]]:
    """`run(kind, steps, run_dir)` for every kind, `repeats` times, alternating (kinds side by side in one
    sitting), each result printed as a JSON line (floats to `digits`); run directories under `keep`, else in a
    temporary directory removed at the end. → {kind: [results]}."""
    import json
    import shutil
    import tempfile

    base = keep or tempfile.mkdtemp(prefix=prefix)
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    try:
        for i in range(repeats):
            for kind in kinds:
                r = run(kind, steps, os.path.join(base, f"{kind}{i}"))
                results[kind].append(r)
                print(json.dumps({k: (round(v, digits) if isinstance(v, float) else v) for k, v in r.items()}),
                      flush=True)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
    return results


def samples_per_s(rows: list[dict]) -> float:
    """Steady-state trained samples/s of a run: the rows after the first, by their times (as `launcher tune`)."""
    return sum(r["samples"] for r in rows[1:]) / (rows[-1]["time"] - rows[0]["time"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(threads: int = 1, **extra: str) -> dict[str, str]:
    """This process's environment for a child pinned to `threads` OpenMP threads (plus `extra`)."""
    return dict(os.environ, OMP_NUM_THREADS=str(threads), **extra)


def start_server(model_dir: str, log_path: str, *extra_args: str, threads: int = 1,
                 max_batch: int | None = None, cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    """An embedded server subprocess (`--torch-threads threads`, seed 0, log level WARNING, its output in
    `log_path`) on a free loopback port, healthy; returns (process, base URL). Stop it with `stop_server`.
    `max_batch` sets `--max-batch-size`; `extra_args` are further server flags; `cpus` pins it (as
    `launcher.cpu_affinity.server` does)."""
    port = free_port()
    env = child_env(threads, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "areal_like.engine.server", "--model-path", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--torch-threads", str(threads), "--random-seed", "0", "--log-level", "WARNING"]
    if max_batch is not None:
        cmd += ["--max-batch-size", str(max_batch)]
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        argv = [*cmd, *extra_args]
        if cpus:
            from launcher.procs import pinned_argv

            argv = pinned_argv(argv, cpus)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log {log_path}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"server not healthy after {HEALTH_TIMEOUT_S}s; log {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # our own child, by its Popen handle
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


# ---------------------------------------------------------------- engine_vs_hf / interrupt_cost workload
def build_model(out_dir: str, hidden: int, layers: int) -> str:
    """Random Qwen2 (GQA 4/2 heads, intermediate 3 × hidden, 1024 positions, char tokenizer) in `out_dir`."""
    from areal_like.data.tiny_model import build_tiny_model

    return build_tiny_model(out_dir, hidden_size=hidden, intermediate_size=3 * hidden, num_layers=layers,
                            num_heads=4, num_kv_heads=2, max_position_embeddings=1024)


def workload(n: int, seed: int, alpha: float, min_len: int, max_len: int, vocab: int):
    """n prompts of 16–48 random tokens and Pareto(alpha) output lengths in [min_len, max_len]; one is max_len."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(16, 48))] for _ in range(n)]
    lengths = [min(max_len, int(min_len * rng.paretovariate(alpha))) for _ in range(n)]
    lengths[rng.randrange(n)] = max_len  # the long tail is always there
    return prompts, lengths


def add_long_tail_args(ap, *, requests: int, seed: int, length_shape: bool = True) -> None:
    """The workload/model/server options of `long_tail_setup` (with `length_shape`: --alpha and --min-len
    too; without, they are fixed at 1.2 and 16)."""
    ap.add_argument("--requests", type=int, default=requests)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    if length_shape:
        ap.add_argument("--alpha", type=float, default=1.2, help="Pareto shape of the output lengths")
        ap.add_argument("--min-len", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=384)
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--model", default=None,
                    help="model dir or demo: name (e.g. demo:qwen3-0.6b-shape) instead of the random Qwen2 "
                         "of --hidden/--layers")
    ap.add_argument("--device", default="cpu", help="the server's (and HF's) device: cpu, cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def long_tail_setup(tmp: str, args):
    """The model (in `tmp`/model), the long-tailed workload and one server able to batch all of it, from
    the options of `add_long_tail_args`.

    Returns (model_dir, prompts, lengths, server process, server URL); stop the server with `stop_server`."""
    if args.model:
        from areal_like.data.demo_task import resolve_demo_name

        model_dir = resolve_demo_name(args.model, "--model") if args.model.startswith("demo:") else args.model
    else:
        model_dir = build_model(os.path.join(tmp, "model"), args.hidden, args.layers)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    prompts, lengths = workload(args.requests, args.seed, getattr(args, "alpha", 1.2), getattr(args, "min_len", 16),
                                args.max_len, vocab)
    ctx = max(len(p) for p in prompts) + max(lengths) + 8
    proc, url = start_server(model_dir, os.path.join(tmp, "server.log"), "--max-context-len", str(ctx),
                             "--device", args.device, "--dtype", args.dtype,
                             threads=args.threads, max_batch=args.requests)
    return model_dir, prompts, lengths, proc, url
