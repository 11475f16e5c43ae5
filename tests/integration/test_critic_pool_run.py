"""Issue 43 item 2 through `launcher run`: a critic on a pool of its own learns the demo with GAE. The allocation
names it as AReaL does (`fsdp[critic]:d2`, its own devices; `fsdp[actor]:d1|fsdp[critic]:d1`, co-located with
the actor); the launcher starts its ranks (`critic`, `critic1`: learner/critic_pool.py), the actor's step asks
them for V_old and they train on its returns. One of its ranks is killed mid-run: the learner pool and the
critic pool restart together from the latest checkpoint (one budget, launcher.max_restarts.learner), and the
run still learns (train.stop_reward 0.9, held-out ≥ THRESHOLD).

The numbers (the same value losses as the critic inside the actor's process) and the checkpoint's two parts are
checked in tests/integration/test_critic_pool.py."""

from __future__ import annotations

import json
import os

import pytest
from conftest import launcher_run_killing

pytestmark = pytest.mark.integration

THRESHOLD = 0.6  # held-out accuracy (val/all/mean@4 on the 32 held-out prompts); from a random init ~0.02
GAE = ("algorithm.adv_estimator=gae", "critic.lr=1e-2", "train.lr=2e-3")


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_critic_on_its_own_pool_learns_the_demo_with_gae_and_restarts_with_the_learner(tmp_path, demo_assets):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    # a follower of the critic pool killed between checkpoints: both pools restart from step 10
    rc, out = launcher_run_killing("critic1", 12, run_dir, "--config", "configs/demo.yaml",
                                   "--allocation", "embedded[rollout]:d1+fsdp[actor]:d1+fsdp[critic]:d2",
                                   f"model.path={model}", f"data.train_files=[{data}]", *GAE, "train.total_steps=300",
                                   "train.test_freq=10", "train.stop_reward=0.9", "train.save_freq=5",
                                   "launcher.max_restarts.learner=1")
    assert rc == 0, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "reward_reached", summary
    # the critic rank's death restarted both pools, on the learner's budget (its rank 0 may be seen first: the
    # pool's collective with the dead rank fails at once)
    assert summary["restart_counts"]["learner"] == 1, summary["restarts"]
    assert [r["role"] for r in summary["restarts"]] in (["critic1"], ["critic"]), summary["restarts"]
    rows = _rows(run_dir)
    assert [r["incarnation"] for r in rows][:10] == [0] * 10 and rows[-1]["incarnation"] == 1
    # every step trained the critic on its pool: value losses and critic stats in every row
    assert all(r["value_loss"] is not None and r["critic_grad_norm"] is not None and r["critic_lr"] == 1e-2
               for r in rows)
    val = [(r["step"], r["val/all/mean@4"]) for r in rows if "val/all/mean@4" in r]
    assert val[0][1] < 0.3, val
    assert max(v for _, v in val) >= THRESHOLD, val
    # the restarted pools resumed from the same checkpoint: the actor's log says where the critic pool was
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert "critic pool at " in learner_log and ": at step 0 (fresh)" in learner_log
    resumed = [ln for ln in learner_log.splitlines() if "critic pool at" in ln and "checkpoint" in ln]
    assert resumed and resumed[-1].split("at step ")[1].split(" ")[0] in ("5", "10"), resumed
    critic_log = (run_dir / "logs" / "critic.log").read_text()
    assert "critic pool fsdp[critic]: layout d2p1t1" in critic_log and "resumed from" in critic_log
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert os.path.isfile(run_dir / "checkpoints" / latest / "critic_pool" / "critic.safetensors")
    # the critic pool's ranks are roles of the run, placed by the plan
    pids = json.loads((run_dir / "pids.json").read_text())["roles"]
    assert {"critic", "critic1", "learner"} <= set(pids)


def test_a_critic_co_located_with_the_actor(tmp_path, run_launcher):
    """`fsdp[actor]:d1|fsdp[critic]:d1`: the critic pool on the actor's devices (a process of its own)."""
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, *GAE, "train.total_steps=4", "train.test_freq=0", "train.save_freq=4",
                           allocation="embedded[rollout]:d1+fsdp[actor]:d1|fsdp[critic]:d1")
    assert rc == 0, out[-3000:]
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["value_loss"] is not None for r in rows)
    assert os.path.isfile(run_dir / "checkpoints" / "step_00000004" / "critic_pool" / "critic.safetensors")
    assert "[critic] critic pool fsdp[critic]" in (run_dir / "logs" / "critic.log").read_text()
