"""Every algorithm a user selects from the config, through a short real `launcher run` (real
redis-server, embedded server, learner and rollout processes): each advantage estimator, the PPO
update structure, π_prox modes, the reference model and its KL, the critic's checkpoint, DAPO's
dynamic sampling. Learning to the demo's bar is measured on full demo runs (README), not here."""

from __future__ import annotations

import json
import math
import os

import pytest

pytestmark = pytest.mark.integration

SHORT = ("train.total_steps=8", "train.batch_size=4", "generation.n=8", "train.test_freq=0")

RUNS = {
    # GRPO with AReaL's minibatches (the clip must bind) and DAPO's dynamic sampling
    "grpo": ("train.ppo_minibatches=4", "train.lr=2e-2", "generation.n=16", "algorithm.filter_groups=true",
             "algorithm.filter_groups_max_extra=64"),
    # RLOO with standard PPO's π_prox = π_behav at η = 2
    "rloo": ("train.proximal=behaviour", "rollout.max_staleness=2"),
    # REINFORCE++ with the reference model reporting KL, sequence-level loss aggregation
    "reinforce_plus_plus": ("algorithm.use_kl_loss=true", "train.loss_agg_mode=seq-mean-token-mean",
                            "train.proximal=loglinear"),
    # GAE with its critic, checkpointed and resumed by the launcher's checkpoint policy
    "gae": ("algorithm.lam=0.95", "critic.lr=1e-2", "train.save_freq=4"),
}


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("estimator", list(RUNS))
def test_estimator_runs_under_launcher(tmp_path, run_launcher, estimator):
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, *SHORT, f"algorithm.adv_estimator={estimator}", *RUNS[estimator])
    assert rc == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["exit_reason"] == "completed"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algorithm"]["adv_estimator"] == estimator
    rows = _rows(run_dir)
    assert [r["version"] for r in rows] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows if not r["skipped"])
    assert f"algorithm {estimator}" in (run_dir / "logs" / "learner.log").read_text()

    if estimator == "grpo":
        assert all(r["optimizer_steps"] == 4 for r in rows if not r["skipped"])
        trained = [r for r in rows if not r["skipped"]]
        assert sum(r["clipfrac"] > 0 for r in trained) > len(trained) / 2, [r["clipfrac"] for r in rows]
        # from a random init many groups score all 0: they are dropped and replaced
        assert sum(r["filtered"] for r in rows) > 0
        # Every trained group carries signal while the filter finds such groups within its budget; past
        # algorithm.filter_groups_max_extra (64) dropped in a step the batch trains as it is (verl's
        # max_num_gen_batches) — at lr 2e-2 a late step can find every group solved (seen in CI).
        within = [r for r in trained if r["filtered"] < 64]
        assert within and all(r["adv_abs_mean"] > 0 for r in within), [(r["filtered"], r["adv_abs_mean"]) for r in rows]
    if estimator == "rloo":
        assert max(r["staleness_max"] for r in rows) <= 2
        assert all(r["behav_w_min"] == 1.0 and r["behav_w_max"] == 1.0 for r in rows if not r["skipped"])
    if estimator == "reinforce_plus_plus":
        kls = [r["kl_ref"] for r in rows]
        assert all(k is not None and k >= 0 for k in kls)
        assert kls[0] == pytest.approx(0.0, abs=1e-6)  # step 1 trains the reference's own weights
    if estimator == "gae":
        assert all(r["value_loss"] is not None and math.isfinite(r["value_loss"]) for r in rows)
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert latest == "step_00000008"
        assert os.path.exists(run_dir / "checkpoints" / latest / "critic.safetensors")


def test_kl_loss_keeps_the_policy_closer_to_the_reference(tmp_path, run_launcher):
    """The same run with and without the KL loss: with it, KL(π ‖ π_ref) stays small.

    At the demo's LR a short run moves the policy too little for the KL term to show above Adam's
    step noise, so this run uses a large LR (2e-2) under which the policy without the KL loss drifts
    far from the reference (k2 estimate ≈ 6–10 over the last 20 of 40 steps, two seeds measured)
    while β = 1 holds it near 0.2. β = 0.1 on the full demo is in README's table."""
    kl = {}
    for coef in (0.0, 1.0):
        run_dir = tmp_path / f"kl{coef}"
        rc, out = run_launcher(run_dir, "train.total_steps=40", "train.batch_size=4", "generation.n=8",
                               "train.test_freq=0", "train.lr=2e-2", "algorithm.use_kl_loss=true",
                               f"algorithm.kl_loss_coef={coef}", "algorithm.kl_estimator=k2")
        assert rc == 0, out[-4000:]
        kl[coef] = [r["kl_ref"] for r in _rows(run_dir)]
    late0, late1 = sum(kl[0.0][20:]) / 20, sum(kl[1.0][20:]) / 20
    assert late1 < late0 / 2, kl
