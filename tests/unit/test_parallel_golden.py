"""Golden per-step losses of the learner on a fixed tiny config (torchtitan's habit): a refactor of
the train step must reproduce tests/golden/learner_tiny_losses.json under the same seeds.

Regenerate (only for an intended change of the numbers, and say why in the commit):
    python tests/unit/test_parallel_golden.py --regenerate
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import pytest

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "learner_tiny_losses.json")
MODEL = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=0)
TRAIN = dict(lr=3e-3, grad_clip=1.0, micro_batch_tokens=48, seed=11, warmup_steps=2, lr_schedule="cosine",
             total_steps=6, behav_imp_weight_cap=5.0)
STEPS = 6
# Not bit-exact across machines: BLAS kernels differ by CPU ISA in the last bits; 1e-6 is far
# tighter than any change a refactor of the step could make without noticing.
TOL = 1e-6


def run_steps(model_dir: str) -> list[dict[str, float]]:
    import torch

    from areal_like.api.config import TrainConfig
    from areal_like.learner.trainer import Trainer
    from areal_like.learner.parallel.spawn import synthetic_groups

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # process-global: restored below
    try:
        ln = Trainer(model_dir, TrainConfig(**TRAIN), None, temperature=0.9)
        rows = []
        for step in range(1, STEPS + 1):
            st = ln.train_step(synthetic_groups(100 + step, version=step - 1), version=step - 1)
            rows.append({"step": step, "loss": st["loss"], "grad_norm": st["grad_norm"], "lr": st["lr"]})
    finally:
        torch.set_num_threads(threads)
    return rows


def _model(tmp: str) -> str:
    from areal_like.data.tiny_model import build_tiny_model

    return build_tiny_model(os.path.join(tmp, "m"), **MODEL)


def test_golden_losses(tmp_path):
    with open(GOLDEN) as f:
        golden = json.load(f)
    assert golden["model"] == MODEL and golden["train"] == TRAIN  # the file matches this config
    rows = run_steps(_model(str(tmp_path)))
    for got, want in zip(rows, golden["steps"], strict=True):
        for k in ("loss", "grad_norm", "lr"):
            assert got[k] == pytest.approx(want[k], abs=TOL, rel=TOL), (got["step"], k, got[k], want[k])


if __name__ == "__main__" and "--regenerate" in sys.argv:
    with tempfile.TemporaryDirectory() as tmp:
        out = {"model": MODEL, "train": TRAIN, "steps": run_steps(_model(tmp))}
    with open(GOLDEN, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {GOLDEN}")
