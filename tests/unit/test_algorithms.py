"""algorithms.py against small hand-computed cases (numbers worked out in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from areal_like.learner.algorithms import (
    decoupled_ppo_loss,
    dynamic_sampling_mask,
    entropy_from_logits,
    gae_advantages,
    group_index_from_sizes,
    grpo_advantages,
    kl_estimate,
    loglinear_alpha,
    loglinear_proximal,
    overlong_penalty,
    reinforce_pp_advantages,
    reward_transform,
    rloo_advantages,
)

T = torch.tensor
ln = math.log


# ---- advantages ---------------------------------------------------------------------------------
def test_grpo_hand_case_and_all_equal_group_is_zero():
    r = T([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0])
    g = group_index_from_sizes([4, 3])
    assert g.tolist() == [0, 0, 0, 0, 1, 1, 1]
    # group 0: mean 0.5, unbiased std = sqrt(4·0.25/3) = 0.57735 → ±0.5/0.57735 = ±0.866025
    a = grpo_advantages(r, g, eps=0.0)
    torch.testing.assert_close(a[:4], T([1.0, -1.0, 1.0, -1.0]) * 0.5 / math.sqrt(1 / 3))
    assert a[4:].tolist() == [0.0, 0.0, 0.0]  # all-equal group: exactly zero, no NaN
    # Dr.GRPO: no std division
    torch.testing.assert_close(grpo_advantages(r, g, norm_std=False), T([0.5, -0.5, 0.5, -0.5, 0, 0, 0]))


def test_grpo_single_sample_group_and_interleaved_ids():
    a = grpo_advantages(T([3.0, 2.0, 0.0]), T([1, 0, 1]))
    # group 1 = {3, 0}: mean 1.5, std = sqrt(2·2.25/1) = 2.1213 → ±0.7071; group 0 = {2}: 0
    torch.testing.assert_close(a, T([1.5 / math.sqrt(4.5) , 0.0, -1.5 / math.sqrt(4.5)]), atol=1e-5, rtol=0)


def test_rloo_leave_one_out():
    a = rloo_advantages(T([1.0, 0.0, 0.0, 5.0]), T([0, 0, 0, 1]))
    # A_0 = 1 − mean(0, 0) = 1; A_1 = 0 − mean(1, 0) = −0.5; single-sample group → 0
    torch.testing.assert_close(a, T([1.0, -0.5, -0.5, 0.0]))


def test_reinforce_pp_batch_normalised():
    a = reinforce_pp_advantages(T([1.0, 2.0, 3.0]), eps=0.0)
    torch.testing.assert_close(a, T([-1.0, 0.0, 1.0]))  # mean 2, unbiased std 1
    # baseline variant: group means removed first → [−0.5, 0.5, 0, 0], then batch-normalised
    b = reinforce_pp_advantages(T([1.0, 2.0, 7.0, 7.0]), T([0, 0, 1, 1]), eps=0.0)
    x = T([-0.5, 0.5, 0.0, 0.0])
    torch.testing.assert_close(b, (x - x.mean()) / x.std())


def test_gae_matches_hand_recursion_and_skips_masked_positions():
    r = T([[0.0, 0.0, 1.0]])
    v = T([[0.5, 0.5, 0.5]])
    m = T([[1.0, 1.0, 1.0]])
    adv, ret = gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, T([[0.5, 0.5, 0.5]]))  # Monte-Carlo return 1 − V
    torch.testing.assert_close(ret, T([[1.0, 1.0, 1.0]]))
    g, l = 0.9, 0.5
    # δ2 = 1 − .5 = .5; δ1 = 0 + .9·.5 − .5 = −.05; δ0 = −.05
    # A2 = .5; A1 = −.05 + .45·.5 = .175; A0 = −.05 + .45·.175 = .02875
    adv, _ = gae_advantages(r, v, m, gamma=g, lam=l)
    torch.testing.assert_close(adv, T([[0.02875, 0.175, 0.5]]))
    # A masked (tool) token in the middle is stepped over: same as the 2-token episode.
    r2, v2, m2 = T([[0.0, 9.0, 1.0]]), T([[0.5, 7.0, 0.5]]), T([[1.0, 0.0, 1.0]])
    adv2, _ = gae_advantages(r2, v2, m2, gamma=g, lam=l)
    ref, _ = gae_advantages(T([[0.0, 1.0]]), T([[0.5, 0.5]]), T([[1.0, 1.0]]), gamma=g, lam=l)
    torch.testing.assert_close(adv2[:, [0, 2]], ref)
    assert adv2[0, 1] == 0.0


# ---- KL -----------------------------------------------------------------------------------------
def test_kl_estimators():
    lp, lq = T([ln(0.5)]), T([ln(0.25)])  # log ratio = ln 2
    assert kl_estimate(lp, lq, "k1").item() == pytest.approx(ln(2))
    assert kl_estimate(lp, lq, "k2").item() == pytest.approx(0.5 * ln(2) ** 2)
    assert kl_estimate(lp, lq, "k3").item() == pytest.approx(0.5 - 1 + ln(2))  # q/p − 1 − ln(q/p)
    assert kl_estimate(lq, lq, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(lp, lq, "k4")  # type: ignore[arg-type]


# ---- decoupled PPO ------------------------------------------------------------------------------
def _case():
    """Five tokens; the last is masked out and holds garbage that must not leak (no NaN/inf)."""
    lp_prox = T([ln(0.4), ln(0.4), ln(0.4), ln(0.1), -1.0])
    logp = T([ln(0.6), ln(0.2), ln(0.2), ln(0.1), 500.0], requires_grad=True)  # r = 1.5, .5, .5, 1, —
    lp_behav = T([ln(0.4), ln(0.4), ln(0.4), ln(0.01), -900.0])  # w = 1, 1, 1, 10, —
    A = T([1.0, 1.0, -1.0, 2.0, 3.0])
    mask = T([1.0, 1.0, 1.0, 1.0, 0.0])
    return logp, lp_prox, lp_behav, A, mask


def test_decoupled_ppo_hand_case_cap():
    logp, lp_prox, lp_behav, A, mask = _case()
    loss, st = decoupled_ppo_loss(
        logp, lp_prox, lp_behav, A, mask, eps_clip_low=0.2, eps_clip_high=0.28,
        behav_imp_weight_cap=5.0, behav_mode="cap", loss_tokens_global=8,
    )
    # token a: r=1.5, A=+1 → min(1.5, 1.28) = 1.28 → pg −1.28 (clipped)
    # token b: r=0.5, A=+1 → min(0.5, 0.8) = 0.5 → pg −0.5
    # token c: r=0.5, A=−1 → min(−0.5, −0.8) = −0.8 → pg +0.8 (clipped)
    # token d: r=1, w=10 capped to 5, A=2 → pg −10
    # loss = (−1.28 − 0.5 + 0.8 − 10) / 8 (global loss tokens, not the 4 here)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8 - 10.0) / 8, abs=1e-6)
    assert st["clipfrac"].item() == pytest.approx(0.5)
    assert st["behav_frac_capped"].item() == pytest.approx(0.25)
    assert st["behav_w_max"].item() == pytest.approx(10.0, rel=1e-5)
    assert st["behav_w_mean"].item() == pytest.approx(13.0 / 4, rel=1e-5)
    assert st["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 0.5 + 1) / 4, rel=1e-5)
    assert st["ratio_max"].item() == pytest.approx(1.5, rel=1e-5)
    assert st["loss_tokens"].item() == 4
    # approx_kl = mean of (r − 1) − ln r
    kl = [(r - 1) - ln(r) for r in (1.5, 0.5, 0.5, 1.0)]
    assert st["approx_kl"].item() == pytest.approx(sum(kl) / 4, rel=1e-5)
    loss.backward()
    g = logp.grad
    # d pg/d logp = −w·A·r where unclipped, 0 where clipped: b → −0.5/8, d → −5·2·1/8
    torch.testing.assert_close(g, T([0.0, -0.5 / 8, 0.0, -10.0 / 8, 0.0]))
    assert torch.isfinite(g).all()


def test_decoupled_ppo_mask_mode_drops_over_cap_tokens():
    logp, lp_prox, lp_behav, A, mask = _case()
    loss, st = decoupled_ppo_loss(
        logp, lp_prox, lp_behav, A, mask, eps_clip_low=0.2, eps_clip_high=0.28,
        behav_imp_weight_cap=5.0, behav_mode="mask",
    )
    # token d (w=10 > 5) gets weight 0; default denominator = local loss tokens (4)
    assert loss.item() == pytest.approx((-1.28 - 0.5 + 0.8) / 4, abs=1e-6)
    assert st["behav_frac_capped"].item() == pytest.approx(0.25)
    # cap None = no behaviour correction: w ≡ 1 → token d gives −2
    loss_none, _ = decoupled_ppo_loss(
        logp, lp_prox, lp_behav, A, mask, eps_clip_low=0.2, eps_clip_high=0.28, behav_imp_weight_cap=None,
    )
    assert loss_none.item() == pytest.approx((-1.28 - 0.5 + 0.8 - 2.0) / 4, abs=1e-6)


def test_clip_boundaries_exact():
    # r exactly on 1+ε_high and 1−ε_low: min(rA, clip(r)A) equal, so not counted as clipped
    lp_prox = T([0.0, 0.0, 0.0])
    logp = torch.log(T([1.28, 0.8, 1.3]))
    A = T([1.0, -1.0, -1.0])
    loss, st = decoupled_ppo_loss(
        logp, lp_prox, lp_prox, A, torch.ones(3), eps_clip_low=0.2, eps_clip_high=0.28, behav_imp_weight_cap=5.0,
    )
    # token 3: A<0, r=1.3 > 1.28: rA = −1.3 < clip·A = −1.28 → unclipped, pg = 1.3
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 1.3) / 3, abs=1e-6)
    assert st["clipfrac"].item() == 0.0


def test_dual_clip_bounds_negative_advantage():
    logp = torch.log(T([5.0, 5.0]))
    z = torch.zeros(2)
    A = T([-1.0, 1.0])
    loss, st = decoupled_ppo_loss(
        logp, z, z, A, torch.ones(2), eps_clip_low=0.2, eps_clip_high=0.28, behav_imp_weight_cap=5.0,
        dual_clip_c=3.0,
    )
    # A=−1, r=5: pg = max(5, 1.28) = 5 → dual clip min(5, 3) = 3; A=+1: min(5, 1.28) → −1.28
    assert loss.item() == pytest.approx((3.0 - 1.28) / 2, abs=1e-6)
    assert st["dual_clipfrac"].item() == pytest.approx(0.5)


def test_token_count_normalisation_sums_over_micro_batches():
    torch.manual_seed(0)
    logp = torch.randn(4, 6) * 0.1 - 2.0
    prox = logp + torch.randn(4, 6) * 0.05
    behav = prox + torch.randn(4, 6) * 0.05
    A = torch.randn(4, 1).expand(4, 6).contiguous()
    mask = (torch.rand(4, 6) > 0.3).float()
    kw = dict(eps_clip_low=0.2, eps_clip_high=0.28, behav_imp_weight_cap=2.0)
    n_global = int(mask.sum().item())
    full, _ = decoupled_ppo_loss(logp, prox, behav, A, mask, **kw)
    parts = sum(
        decoupled_ppo_loss(logp[s], prox[s], behav[s], A[s], mask[s], loss_tokens_global=n_global, **kw)[0]
        for s in (slice(0, 1), slice(1, 4))
    )
    torch.testing.assert_close(parts, full)
    # seq-mean aggregations split over rows the same way with num_seqs_global
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        full, _ = decoupled_ppo_loss(logp, prox, behav, A, mask, agg=agg, **kw)
        parts = sum(
            decoupled_ppo_loss(logp[s], prox[s], behav[s], A[s], mask[s], agg=agg, num_seqs_global=4, **kw)[0]
            for s in (slice(0, 3), slice(3, 4))
        )
        torch.testing.assert_close(parts, full)


def test_empty_mask_is_zero_not_nan():
    z = torch.zeros(3, requires_grad=True)
    loss, st = decoupled_ppo_loss(z, z, z, torch.ones(3), torch.zeros(3), eps_clip_low=0.2, eps_clip_high=0.2,
                                  behav_imp_weight_cap=5.0)
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in st.values())


# ---- proximal approximation, filtering, shaping -------------------------------------------------
def test_loglinear_proximal():
    alpha = loglinear_alpha(T([3, 4, 5]), v_prox=5, v_theta=6)
    torch.testing.assert_close(alpha, T([2 / 3, 0.5, 0.0]))
    lp = loglinear_proximal(T([-2.0, -2.0, -2.0]), T([-1.0, -1.0, -1.0]), alpha)
    torch.testing.assert_close(lp, T([-2.0 + 2 / 3, -1.5, -2.0]))
    assert loglinear_alpha(T([5]), v_prox=5, v_theta=5).item() == 0.0  # no division by zero


def test_dynamic_sampling_mask():
    keep = dynamic_sampling_mask(T([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5]), T([0, 0, 1, 1, 2, 2, 3]))
    assert keep.tolist() == [False, True, False, False]


def test_overlong_penalty_and_reward_transform():
    p = overlong_penalty(T([10, 12, 14, 16, 20]), max_len=16, buffer_len=4, penalty_factor=1.0)
    torch.testing.assert_close(p, T([0.0, 0.0, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(reward_transform(T([0.0, 1.0, 10.0]), scale=2.0, bias=-0.5, clip=5.0), T([-1.0, 1.0, 5.0]))


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(1, 4)).item() == pytest.approx(ln(4))
    # temperature scales logits first: T→large makes it uniform
    assert entropy_from_logits(T([[0.0, 100.0]]), temperature=1e6).item() == pytest.approx(ln(2), rel=1e-4)
    assert entropy_from_logits(T([[0.0, 100.0]])).item() == pytest.approx(0.0, abs=1e-6)
