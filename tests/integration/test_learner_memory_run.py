"""The learner's memory knobs through a real `launcher run` (redis, embedded server, learner, rollout):
activation checkpointing by verl's key (`actor_rollout_ref.model.enable_gradient_checkpointing`) on
actor and critic, log-probabilities in small token chunks (`train.logits_chunk_tokens`) and the
entropy statistic switched off (`train.compute_entropy`). The
numbers themselves are proven equal to the plain path in tests/unit/test_learner_memory.py and
tests/integration/test_learner_parallel.py; here the keys reach the learner and a run trains."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.integration


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_gradient_checkpointing_and_logits_chunks_under_launcher(tmp_path, run_launcher):
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, "train.total_steps=8", "train.batch_size=4", "generation.n=8",
                           "train.test_freq=0", "algorithm.adv_estimator=gae", "critic.lr=1e-2",
                           "actor_rollout_ref.model.enable_gradient_checkpointing=true",
                           "train.logits_chunk_tokens=2", "train.compute_entropy=false")
    assert rc == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["exit_reason"] == "completed"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model"]["enable_gradient_checkpointing"] is True
    assert config["train"]["logits_chunk_tokens"] == 2 and config["train"]["compute_entropy"] is False
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "gradient checkpointing on (actor, critic); logits in chunks of 2 tokens" in log
    rows = _rows(run_dir)
    trained = [r for r in rows if not r["skipped"]]
    assert trained and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
                           and math.isfinite(r["value_loss"]) for r in trained)
    # the entropy statistic was switched off: not measured (NaN, written as null), never a made-up 0
    assert all(r.get("entropy") is None or math.isnan(r["entropy"]) for r in rows)


def test_demo_learns_sharded_with_gradient_checkpointing(tmp_path, run_launcher):
    """The demo (0.8 is usually passed by step ~120–140, configs/demo.yaml) on a 2-rank FSDP learner
    (`fsdp:d2`: parameters, gradients and AdamW state in halves) with every decoder layer recomputed
    in backward and logits in chunks: the learning is the same learning."""
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, "train.total_steps=300", "train.stop_reward=0.8", "train.test_freq=0",
                           "model.enable_gradient_checkpointing=true", "train.logits_chunk_tokens=16",
                           allocation="embedded:d1+fsdp:d2", timeout=600)
    assert rc == 0, out[-4000:]
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "gradient checkpointing on (actor)" in log
    assert "FSDP2 over dp=2 (train.dp_sharding=full" in log
    rewards = [r["reward_mean"] for r in _rows(run_dir)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "reward_reached" and summary["steps"] == len(rewards) < 300, summary
    assert sum(rewards[-5:]) / 5 >= 0.8 and sum(rewards[-6:-1]) / 5 < 0.8, rewards[::10]  # stopped at the step


def test_sharded_pool_pushes_through_disk_and_exports_in_shards_under_launcher(tmp_path, run_launcher):
    """`weights.mode=disk` and `train.export_hf` from a 2-rank FSDP learner through `launcher run`: rank 0
    writes each safetensors file from the shards as it goes (the other rank joins the gathers), files
    of at most `weights.bucket_mb`; the server loads them every step and the export is an HF dir that
    transformers loads."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal_like.weights.disk import SafetensorsDir

    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, "train.total_steps=3", "train.test_freq=0", "weights.mode=disk",
                           "weights.bucket_mb=0.05", "train.save_freq=3", "train.export_hf=true",
                           allocation="embedded:d1+fsdp:d2")
    assert rc == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["final_version"] == 3
    latest = sorted((run_dir / "weights_disk").iterdir())[-1]  # the version dir the server loaded last
    files = {p.name for p in latest.iterdir()}
    assert "model.safetensors.index.json" in files, files
    assert len([f for f in files if f.startswith("model-")]) > 1, files
    assert all((latest / f).stat().st_size <= 0.05 * 2**20 + 65536 for f in files if f.startswith("model-"))
    ckpt = run_dir / "checkpoints" / "step_00000003"
    model = AutoModelForCausalLM.from_pretrained(str(ckpt / "hf"))  # the exported HF dir, fp32 like model.dtype
    saved = SafetensorsDir(str(ckpt))  # the checkpoint's own copy of the trained weights
    for name, t in model.state_dict().items():
        if name in saved:
            assert torch.equal(t, saved[name]), name
