"""LoRA through `launcher run` (`model.lora_rank=8`): the demo learns with pushes of the adapter alone
(the broadcast transport; disk in a shorter run), the servers serve it under one name that every
request names, checkpoints hold the adapter, `train.export_hf` a peft adapter, `train.export_merged`
the merged model, and a resumed run continues from the adapter checkpoint."""

from __future__ import annotations

import json
import os

import pytest

from allocation.memory import LORA_LINEARS, ModelShape

pytestmark = pytest.mark.integration

# The demo model is a random tiny one: its frozen random LM head caps how confident an adapter on the
# decoder layers alone can make it (p ≤ ~0.04 per token), so the demo's adapter includes lm_head
# (README, "LoRA"); real checkpoints do not need it.
TARGETS = [*LORA_LINEARS, "lm_head"]
LORA = ["model.lora_rank=8", f"model.target_modules=[{','.join(TARGETS)}]", "train.lr=2e-3"]


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _adapter_bytes(model_dir: str) -> tuple[int, int]:
    """(adapter bytes, whole model bytes) in fp32 (server.dtype of the demo) of the demo model."""
    shape = ModelShape.load(model_dir)
    adapter = shape.layers * shape.lora_layer_params(8, tuple(LORA_LINEARS)) + 8 * (shape.hidden + shape.vocab)
    return 4 * adapter, 4 * shape.count_params()


def test_lora_demo_learns_with_adapter_only_pushes(tmp_path, run_launcher, demo_assets):
    run_dir = tmp_path / "run"
    # ends at its criterion (train.stop_reward: last 5 steps' mean reward ≥ 0.8), saved and exported there
    rc, out = run_launcher(run_dir, *LORA, "train.total_steps=300", "train.stop_reward=0.8", "train.save_freq=100",
                           "train.export_hf=true", "train.export_merged=true", "train.test_freq=100", timeout=600)
    assert rc == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["exit_reason"] == "reward_reached" and steps < 300 and summary["reward_last"] >= 0.8, summary
    assert f"train.stop_reward=0.8 reached at step {steps}" in (run_dir / "logs" / "learner.log").read_text()
    assert summary["buffer"]["workflow_failures"]["generation"] == 0, summary  # no request before the adapter
    adapter, whole = _adapter_bytes(demo_assets[0])
    rows = _rows(run_dir)
    assert len(rows) == steps and all(r["push_bytes"] == adapter for r in rows), rows[0]
    assert adapter < whole / 4
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "LoRA: rank 8" in learner_log
    server_log = (run_dir / "logs" / "server0.log").read_text()
    assert server_log.count("loaded LoRA adapter policy") == steps + 1  # version 0 at start, then each step
    ck = run_dir / "checkpoints" / f"step_{steps:08d}"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(ck))
    assert not (ck / "model.safetensors").exists()
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(demo_assets[0], dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(ck / "hf")).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(ck / "hf_merged"), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_lora_disk_sync_and_resume(tmp_path, run_launcher):
    """weights.mode=disk: the adapter dir of each version loaded with /load_lora_adapter; then the run
    resumes from its adapter checkpoint and continues."""
    run_dir = tmp_path / "run"
    common = [*LORA, "weights.mode=disk", "train.save_freq=3", "train.test_freq=0"]
    rc, out = run_launcher(run_dir, *common, "train.total_steps=3")
    assert rc == 0, out[-4000:]
    rc, out = run_launcher(run_dir, *common, "train.total_steps=5")
    assert rc == 0, out[-4000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert len({r["push_bytes"] for r in rows}) == 1
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "resumed from step 3" in learner_log
    server_log = (run_dir / "logs" / "server0.log").read_text()
    assert "loaded LoRA adapter policy from" in server_log and "/weights_disk/v00000005" in server_log


def test_lora_colocated_demo_learns_keeping_the_servers_base(tmp_path, run_launcher, demo_assets):
    """Co-located LoRA (`embedded:d1|fsdp:d1`, η = 1): for each training phase the server releases only its KV
    cache — a push carries the adapter alone, so it keeps its frozen base — the adapter is handed over as a
    peft dir (`/load_lora_adapter`) inside the phase, and the demo learns."""
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, *LORA, "train.total_steps=300", "train.stop_reward=0.8", "rollout.max_staleness=1",
                           "train.test_freq=0", allocation="embedded:d1|fsdp:d1", timeout=600)
    assert rc == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["exit_reason"] == "reward_reached" and steps < 300 and summary["reward_last"] >= 0.8, summary
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert learner_log.count("co-located step: release") == steps and "weights.mode=memory" in learner_log
    server_log = (run_dir / "logs" / "server0.log").read_text()
    assert server_log.count("released ['kv_cache']") == steps and "released ['kv_cache', 'weights']" not in server_log
    assert server_log.count("server: loaded LoRA adapter policy from") == steps + 1  # version 0, then each step
    adapter, _ = _adapter_bytes(demo_assets[0])
    assert all(r["push_bytes"] == adapter for r in _rows(run_dir))


def test_lora_path_starts_a_run_from_an_adapter_the_servers_then_serve(tmp_path, run_launcher):
    """`model.lora_path` through `launcher run`: a new run starts from another run's adapter checkpoint (a
    peft dir); its first push (version 0) hands the servers exactly that adapter."""
    from safetensors.torch import load_file

    first = tmp_path / "first"
    rc, out = run_launcher(first, *LORA, "train.total_steps=2", "train.save_freq=2", "train.test_freq=0")
    assert rc == 0, out[-4000:]
    ck = first / "checkpoints" / "step_00000002"
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, *LORA, f"model.lora_path={ck}", "weights.mode=disk", "train.total_steps=1",
                           "train.test_freq=0")
    assert rc == 0, out[-4000:]
    assert f"started from {ck}" in (run_dir / "logs" / "learner.log").read_text()
    pushed = load_file(str(run_dir / "weights_disk" / "v00000000" / "adapter_model.safetensors"))
    saved = load_file(str(ck / "adapter_model.safetensors"))
    assert pushed.keys() == saved.keys() and all(pushed[k].equal(saved[k]) for k in saved)
    assert any(t.abs().sum() > 0 for k, t in saved.items() if "lora_B" in k)  # trained, not a fresh B = 0
