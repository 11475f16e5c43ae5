"""A real architecture through `launcher run` on CPU: Qwen3-0.6B's shape, Qwen3's tokenizer, bf16 servers.

configs/real_shape.yaml: `demo:qwen3-0.6b-shape` (Qwen3-0.6B's published config at random init, 596 M
parameters, with Qwen3's real tokenizer and chat template), `demo:gsm8k-style` chat prompts scored by the
built-in gsm8k scorer, an fp32-master learner, one embedded server; every step pushes the whole model.
Two runs side by side, the same seed:

    bf16     server.dtype=bfloat16 with train.rejection_sampling=icepop — the training–inference mismatch
             of bf16 generation against the fp32 learner, and how many tokens IcePop masks
    fp32     server.dtype=float32 — the same run with fp32 servers (their logprobs are the learner's
             definition on the same fp32 weights: the mismatch left is numerical noise)

Printed per run, from metrics.jsonl (steps after the first): the bytes each push moved (the servers'
dtype), the push seconds and GB/s, the learner's step seconds and loss tokens/s, generation seconds
(the fetch wait: η = 0, so the learner waits for every batch), and the mismatch metrics of every step.
The last line is the ratio of the mean |Δ log p| of the bf16 run to the fp32 run's.

    .venv/bin/python benchmarks/real_shape_run.py [--steps 3] [--keep DIR]

~20 GB of RAM at its peak and ~10 minutes on 2 cores (the first run also builds the 2.4 GB model into
the demo cache).
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


def run(run_dir: str, steps: int, overrides: list[str], env: dict | None = None) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "launcher", "run", "--config", "configs/real_shape.yaml", "--run-dir", run_dir,
           f"train.total_steps={steps}", *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-6000:])
        raise SystemExit(f"launcher run failed ({proc.returncode}): {' '.join(overrides)}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return rows, wall


def push_bytes(run_dir: str, dtype_bytes: int) -> int:
    """The model's bytes in the servers' dtype (what every push moves): parameters of config.json's model."""
    from allocation.memory import ModelShape

    cfg = json.load(open(os.path.join(run_dir, "config.json")))
    shape = ModelShape.load(cfg["model"]["path"])
    return shape.count_params() * dtype_bytes


def summary(name: str, rows: list[dict], nbytes: int, wall: float) -> dict:
    later = rows[1:] or rows
    push = statistics.median(r["push_s"] for r in later)
    step = statistics.median(r["step_s"] for r in later)
    out = {"run": name, "steps": len(rows), "wall_s": round(wall, 1), "push_GB": round(nbytes / 1e9, 3),
           "push_s_median": round(push, 2), "push_GB_per_s": round(nbytes / 1e9 / push, 3),
           "learner_step_s_median": round(step, 1),
           "learner_loss_tokens_per_s": round(statistics.median(r["loss_tokens"] / r["step_s"] for r in later), 1),
           "fetch_s_median": round(statistics.median(r["fetch_s"] for r in later), 1),
           "mismatch_logp_abs_mean": [float(f"{r['mismatch_logp_abs_mean']:.3g}") for r in rows],
           "mismatch_logp_abs_max": [float(f"{r['mismatch_logp_abs_max']:.3g}") for r in rows],
           "mismatch_kl": [float(f"{r['mismatch_kl']:.3g}") for r in rows],
           "mismatch_ratio_outside": [round(r["mismatch_ratio_outside"], 4) for r in rows],
           "tokens_masked_or_capped": [r["behav_tokens_capped"] for r in rows],
           "loss_tokens": [r["loss_tokens"] for r in rows],
           "learner_device_mem_peak_gib": [r.get("device_mem_peak_gib") for r in rows]}
    print(json.dumps(out), flush=True)
    out["abs_mean_raw"] = statistics.mean(r["mismatch_logp_abs_mean"] for r in rows)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--keep", default=None, help="keep the run dirs under this directory")
    ap.add_argument("--device", default="cpu",
                    help="server.device: cpu, or cuda (the learner then trains on CUDA too; with one visible GPU "
                         "the server and the learner share it)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="more config overrides for both runs (e.g. train.batch_size=8 generation.max_new_tokens=256)")
    a = ap.parse_args()
    base = a.keep or tempfile.mkdtemp(prefix="real_shape.")
    env = None
    extra = [*a.overrides]
    if a.device.startswith("cuda"):
        extra.append(f"server.device={a.device}")
        import torch

        if torch.cuda.device_count() == 1:
            # embedded.d1p1t1+d1p1t1 places the server on plan device 0 and the learner on plan device 1;
            # plan device i is the i-th entry of the launcher's CUDA_VISIBLE_DEVICES: both map to the one GPU
            # (the weights travel over gloo on the host, so no NCCL pair shares the device).
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="0,0")
    print(f"Qwen3-0.6B shape (random init, Qwen3 tokenizer), fp32-master learner, 1 embedded server, "
          f"{a.steps} steps (configs/real_shape.yaml{' + ' + ' '.join(extra) if extra else ''}), "
          f"gsm8k-style chat prompts; {a.device}", flush=True)
    res = {}
    for name, ov, dtype_bytes in (("bf16 servers + icepop", ["server.dtype=bfloat16", "train.rejection_sampling=icepop"], 2),
                                  ("fp32 servers", ["server.dtype=float32"], 4)):
        d = os.path.join(base, name.split()[0])
        rows, wall = run(d, a.steps, [*extra, *ov], env)
        res[name] = summary(name, rows, push_bytes(d, dtype_bytes), wall)
    b = res["bf16 servers + icepop"]["abs_mean_raw"]
    f = res["fp32 servers"]["abs_mean_raw"]
    print(f"mismatch mean |dlogp|: bf16 servers {b:.3g}, fp32 servers {f:.3g}; "
          f"bf16/fp32 = {b / f if f else float('inf'):.3g}")


if __name__ == "__main__":
    main()
