"""Issue 44 through `launcher run`: the MoE demo (configs/moe_demo.yaml — the demo's tiny model with Qwen3-MoE's
structure, bfloat16 servers, a float32 learner) learns the demo task with rollout routing replay
(`train.routing_replay=rollout`): the servers record each position's routed experts
(`--enable-return-routed-experts`), the trajectories carry them through Redis, and the learner's routers replay
them, and `train.routing_replay_measure` reports each step's mismatch with and without the replay. Measured side by side:
benchmarks/moe_routing_replay.py. The learner runs expert parallel (`megatron:d2e2`: each of its two ranks holds
4 of each layer's 8 experts, tokens dispatched to them by all-to-all over gloo)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration

THRESHOLD = 0.6  # held-out accuracy (val/all/mean@4, 32 prompts × 4) by the end; ~0.02 at the start


def test_the_moe_demo_learns_with_rollout_routing_replay(tmp_path, demo_assets):
    from conftest import launcher_cli

    _, data = demo_assets
    run_dir = tmp_path / "run"
    rc, out = launcher_cli("run", "--config", "configs/moe_demo.yaml", "--run-dir", str(run_dir),
                           "--allocation", "embedded.d1p1t1+megatron:d2e2",
                           f"data.train_files=[{data}]", "train.stop_reward=0.9", "train.test_freq=10",
                           "train.routing_replay_measure=true", timeout=600)
    assert rc == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "reward_reached", summary
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # every step replayed the servers' routes (a step without any would report NaN): the agreement of the
    # learner's router with them falls below 1 once the policy moves (stale samples, bfloat16 against float32)
    agree = [r["routing_agreement"] for r in rows]
    assert all(a is not None and 0.0 < a <= 1.0 for a in agree), agree
    assert min(agree) < 1.0
    # train.routing_replay_measure: each step's tokens measured with the servers' routes and with the learner's own
    measured = [(r["routing_dlogp_replayed"], r["routing_dlogp_own"]) for r in rows]
    assert all(a is not None and b is not None and a >= 0 and b >= 0 for a, b in measured), measured
    val = [r["val/all/mean@4"] for r in rows if "val/all/mean@4" in r]
    assert val[0] < 0.3 and max(val) >= THRESHOLD, val
    config = json.loads((run_dir / "config.json").read_text())
    assert config["train"]["routing_replay"] == "rollout" and config["server"]["dtype"] == "bfloat16"
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "layout d2p1t1e2" in log and "experts split over ep=2" in log and "4 of 8 per MoE layer" in log, log[-2000:]
