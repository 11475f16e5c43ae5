"""algorithms.py against the published reference implementations, on fixed small tensors.

The oracles below are written here, in plain loops, from the formulas of
  verl   — verl/trainer/ppo/core_algos.py (+ masked_mean/masked_var/masked_whiten of
           verl/utils/torch_functional.py, apply_kl_penalty of verl/trainer/ppo/ray_trainer.py),
  AReaL  — areal/utils/functional.py (`ppo_actor_loss_fn`),
each citing the function it follows. They compute in float32 tensors like the originals, so that
rounding behaviour (zero-variance cases) is reproduced too. Where our convention differs on purpose,
a test named `test_deliberate_*` asserts the difference and says why.

Fixture: 6 sequences × 7 tokens, loss tokens a prefix of each row (verl's response_mask), row 4
fully masked, groups {0,1,2} and {3,4,5}.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

from areal_like.learner.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    aggregate_loss,
    decoupled_ppo_loss,
    gae_advantages,
    grpo_advantages,
    kl_estimate,
    kl_loss,
    kl_penalized_rewards,
    masked_moments,
    masked_whiten,
    ppo_value_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_token_advantages,
    reinforce_pp_token_advantages,
    rloo_advantages,
)

T = torch.tensor
ATOL = 1e-6
B, L = 6, 7
LENGTHS = [7, 5, 3, 6, 0, 4]  # row 4: no loss token at all
GROUPS = T([0, 0, 0, 1, 1, 1])
SCORES = T([1.0, 0.0, 0.5, 0.2, 0.9, 0.0])  # no uniform group
SCORES_UNIFORM_G1 = T([1.0, 0.0, 0.5, 1.0, 1.0, 1.0])  # group 1 all equal


def _mask(lengths=LENGTHS) -> torch.Tensor:
    m = torch.zeros(len(lengths), L)
    for i, n in enumerate(lengths):
        m[i, :n] = 1.0
    return m


MASK = _mask()


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's outcome layout: the sequence score on the last response token (column 0 for an empty row)."""
    r = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        r[i, max(n - 1, 0)] = scores[i]
    return r


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


# ==== oracles (verl) =============================================================================
def verl_masked_mean(x, m):
    """verl torch_functional.masked_mean: Σ x·m / (Σ m + 1e-8)."""
    return (x * m).sum() / (m.sum() + 1e-8)


def verl_masked_whiten(x, m, shift_mean=True):
    """verl torch_functional.masked_whiten: unbiased masked var (raises for Σm ≤ 1), rsqrt(var + 1e-8).
    Values at masked-out positions are whitened too (verl's callers multiply by the mask)."""
    mean = verl_masked_mean(x, m)
    var = verl_masked_mean((x - mean) ** 2, m)
    n = m.sum()
    if n <= 1:
        raise ValueError("verl needs at least two masked values")
    var = var * n / (n - 1)
    out = (x - mean) * torch.rsqrt(var + 1e-8)
    return out + mean if not shift_mean else out


def verl_gae(rewards, values, mask, gamma, lam):
    """verl compute_gae_advantage_return: backwards over columns; masked (observation) columns carry
    nextvalue and lastgaelam through unchanged; returns = adv + values; then whiten the advantages."""
    Bn, Tn = rewards.shape
    adv = torch.zeros_like(rewards)
    for i in range(Bn):
        nextvalue, lastgaelam = 0.0, 0.0
        for t in reversed(range(Tn)):
            delta = rewards[i, t] + gamma * nextvalue - values[i, t]
            candidate = delta + gamma * lam * lastgaelam
            if mask[i, t] > 0:
                nextvalue, lastgaelam = values[i, t], candidate
            adv[i, t] = lastgaelam
    returns = adv + values
    return verl_masked_whiten(adv, mask), returns, adv


def verl_reinforce_pp(token_rewards, mask, gamma):
    """verl compute_reinforce_plus_plus_outcome_advantage: running return r_t + γ·G, stored at every
    column, then *reset to 0 after a masked column*; whiten the returns, times mask."""
    Bn, Tn = token_rewards.shape
    returns = torch.zeros_like(token_rewards)
    for i in range(Bn):
        running = torch.tensor(0.0)
        for t in reversed(range(Tn)):
            running = token_rewards[i, t] + gamma * running
            returns[i, t] = running
            running = running * mask[i, t]
    return verl_masked_whiten(returns, mask) * mask, returns


def _groups(scores, index):
    by_group = defaultdict(list)
    for i in range(len(scores)):
        by_group[int(index[i])].append(scores[i])
    return by_group


def verl_grpo(token_rewards, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """verl compute_grpo_outcome_advantage: score = Σ_t rewards; group of one → mean 0, std 1; else
    torch.mean / torch.std (unbiased); (s − mean)/(std + eps) or, Dr.GRPO, s − mean; times mask."""
    scores = token_rewards.sum(-1)
    by_group = _groups(scores, index)
    out = torch.zeros_like(scores)
    for i in range(len(scores)):
        g = torch.stack(by_group[int(index[i])])
        mean, std = (torch.tensor(0.0), torch.tensor(1.0)) if len(g) == 1 else (g.mean(), g.std())
        out[i] = (scores[i] - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else scores[i] - mean
    return out[:, None] * mask


def verl_rloo(token_rewards, mask, index):
    """verl compute_rloo_outcome_advantage (the loop version): n/(n−1)·s − n/(n−1)·mean for groups of
    n > 1; a group of one keeps its raw score. Times mask."""
    scores = token_rewards.sum(-1)
    by_group = _groups(scores, index)
    out = scores.clone()
    for i in range(len(scores)):
        g = torch.stack(by_group[int(index[i])])
        n = len(g)
        if n > 1:
            out[i] = scores[i] * n / (n - 1) - g.mean() * n / (n - 1)
    return out[:, None] * mask


def verl_rloo_vectorized(token_rewards, mask, index):
    """verl compute_rloo_vectorized_outcome_advantage: (c·s − Σ_group s)/max(c−1, 1)·[c > 1]."""
    scores = token_rewards.sum(-1)
    by_group = _groups(scores, index)
    out = torch.zeros_like(scores)
    for i in range(len(scores)):
        g = torch.stack(by_group[int(index[i])])
        c = len(g)
        out[i] = (c * scores[i] - g.sum()) / max(c - 1, 1) * (1.0 if c > 1 else 0.0)
    return out[:, None] * mask


def verl_reinforce_pp_baseline(token_rewards, mask, index):
    """verl compute_reinforce_plus_plus_baseline_outcome_advantage: s − group mean (group of one: mean
    0), tiled over the columns, times mask, whitened over the batch, times mask."""
    scores = token_rewards.sum(-1)
    by_group = _groups(scores, index)
    centered = torch.zeros_like(scores)
    for i in range(len(scores)):
        g = torch.stack(by_group[int(index[i])])
        centered[i] = scores[i] - (torch.tensor(0.0) if len(g) == 1 else g.mean())
    x = centered[:, None].expand_as(mask) * mask
    return verl_masked_whiten(x, mask) * mask


def verl_kl_penalty(logprob, ref_logprob, name):
    """verl kl_penalty / kl_penalty_forward. A trailing '+' (not for k2/mse): value of the estimator,
    gradient of ½(logprob − ref)² (straight-through)."""
    if name.endswith("+") and name not in ("mse", "k2"):
        forward = verl_kl_penalty(logprob, ref_logprob, name[:-1])
        backward = 0.5 * (logprob - ref_logprob).square()
        return backward - backward.detach() + forward.detach()
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if name in ("low_var_kl", "k3"):  # verl's "k3" is the clamped one
        kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    raise NotImplementedError(name)


def verl_agg_loss(loss_mat, mask, mode, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    """verl agg_loss with dp_size = 1 (current version: fully masked rows excluded from the default
    sequence count; +1e-8 in the per-sequence token mean)."""
    if mode == "token-mean":
        n = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (loss_mat * mask).sum() / n
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        total, seqs = torch.tensor(0.0), 0
        for i in range(loss_mat.shape[0]):
            n_i = mask[i].sum()
            s_i = (loss_mat[i] * mask[i]).sum()
            if mode == "seq-mean-token-mean":
                s_i = s_i / (n_i + 1e-8)
            if n_i > 0:
                total, seqs = total + s_i, seqs + 1
        return total / (seqs if global_batch_size is None else global_batch_size)
    if mode == "seq-mean-token-sum-norm":
        horizon = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
        return (loss_mat * mask).sum() / horizon
    raise ValueError(mode)


def verl_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, clip_low, clip_high, clip_ratio_c, mode,
                             **agg_kw):
    """verl compute_policy_loss_vanilla: log r clamped to [−20, 20]; PPO clip; dual clip (c) where A < 0.
    Returns (loss, pg_clipfrac, pg_clipfrac_lower)."""
    log_r = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    r = torch.exp(log_r)
    l1 = -advantages * r
    l2 = -advantages * torch.clamp(r, 1 - clip_low, 1 + clip_high)
    clip1 = torch.maximum(l1, l2)
    l3 = -advantages * clip_ratio_c
    clip2 = torch.minimum(l3, clip1)
    losses = torch.where(advantages < 0, clip2, clip1)
    clipfrac = verl_masked_mean((l2 > l1).float(), mask)
    clipfrac_lower = verl_masked_mean(((clip1 > l3) & (advantages < 0)).float(), mask)
    return verl_agg_loss(losses, mask, mode, **agg_kw), clipfrac, clipfrac_lower


def verl_value_loss(vpreds, returns, values, mask, cliprange_value, mode):
    """verl compute_value_loss: clip vpreds into values ± c, ½·agg(max of the two squared errors)."""
    clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    losses = torch.maximum((vpreds - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * verl_agg_loss(losses, mask, mode)


# ==== oracle (AReaL) =============================================================================
def areal_ppo_actor_loss(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask,
                         eps_clip_higher=None, c_clip=None, behav_imp_weight_cap=None):
    """AReaL ppo_actor_loss_fn: r = π_θ/π_prox (0 off-mask), PPO clip (eps_clip, eps_clip_higher);
    dual clip min(loss, c·|A|); w = π_prox/π_behav, tokens with w > cap get weight 0 (cap None: w
    uncapped); Σ over loss tokens / their count (or 1). Returns (loss, clipfrac, dual_clipfrac)."""
    lm = loss_mask.bool()
    count = int(lm.sum()) or 1
    ratio = torch.where(lm, torch.exp(logprobs - proximal_logprobs), torch.zeros_like(logprobs))
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + high)
    clip_mask = l1 < l2
    loss = torch.maximum(l1, l2)
    dual_mask = torch.zeros_like(clip_mask)
    if c_clip is not None:
        l3 = torch.sign(advantages) * c_clip * advantages
        dual_mask = l3 < loss
        loss = torch.minimum(loss, l3)
    w = torch.exp(proximal_logprobs - old_logprobs)
    keep = lm if behav_imp_weight_cap is None else (w <= behav_imp_weight_cap) & lm
    loss = loss * torch.where(keep, w, torch.zeros_like(w))
    total = torch.where(lm, loss, torch.zeros_like(loss)).sum() / count
    return total, (clip_mask & lm).float().sum() / count, (dual_mask & lm).float().sum() / count


# ==== advantages ================================================================================
@pytest.mark.parametrize("norm_std", [True, False])  # False = Dr.GRPO (norm_adv_by_std_in_grpo=False)
@pytest.mark.parametrize("scores", [SCORES, SCORES_UNIFORM_G1])
def test_grpo_matches_verl(norm_std, scores):
    ours = grpo_advantages(scores, GROUPS, norm_std=norm_std)[:, None] * MASK
    ref = verl_grpo(_token_rewards(scores, MASK), MASK, GROUPS, norm_adv_by_std_in_grpo=norm_std)
    _close(ours, ref)
    assert torch.isfinite(ours).all()


@pytest.mark.parametrize("scores", [SCORES, SCORES_UNIFORM_G1])
def test_rloo_matches_verl(scores):
    ours = rloo_advantages(scores, GROUPS)[:, None] * MASK
    _close(ours, verl_rloo(_token_rewards(scores, MASK), MASK, GROUPS))
    _close(ours, verl_rloo_vectorized(_token_rewards(scores, MASK), MASK, GROUPS))


def test_deliberate_single_sample_group_gets_zero():
    """A group of one sample has no baseline, hence no group-relative signal: we give it A = 0. verl's
    GRPO uses mean 0 / std 1 there (A = score/(1+ε)), its loop RLOO and RF++-baseline keep the raw
    score — while verl's own vectorised RLOO gives 0, as we do."""
    scores, groups = T([1.0, 0.0, 0.7]), T([0, 0, 1])
    mask = _mask([3, 2, 4])
    tr = _token_rewards(scores, mask)
    assert grpo_advantages(scores, groups)[2] == 0.0
    assert verl_grpo(tr, mask, groups)[2, 0].item() == pytest.approx(0.7 / (1 + 1e-6))
    assert rloo_advantages(scores, groups)[2] == 0.0
    assert verl_rloo(tr, mask, groups)[2, 0].item() == pytest.approx(0.7)
    assert verl_rloo_vectorized(tr, mask, groups)[2, 0].item() == 0.0
    ours = reinforce_pp_baseline_token_advantages(scores, groups, mask)
    assert (ours[2] == 0).all()
    assert verl_reinforce_pp_baseline(tr, mask, groups)[2, 0].item() > 0.5
    # the other group is unaffected in GRPO/RLOO and only shares whitening statistics in RF++-baseline
    _close(grpo_advantages(scores, groups)[:2], verl_grpo(tr, mask, groups)[:2, 0])


def test_deliberate_uniform_group_rounding_is_exactly_zero():
    """verl: (s − mean)/(std + 1e-6) turns the float rounding of a uniform group's mean into an
    advantage (0.9 × 3 gives +0.0555 on every sample). We give exactly 0: all-equal rewards carry no
    signal."""
    scores, groups = T([0.9, 0.9, 0.9, 1.0, 0.0]), T([0, 0, 0, 1, 1])
    mask = torch.ones(5, 3)
    ref = verl_grpo(_token_rewards(scores, mask), mask, groups)
    assert ref[:3].abs().max() > 0.05  # rounding noise / 1e-6
    ours = grpo_advantages(scores, groups)
    assert ours[:3].tolist() == [0.0, 0.0, 0.0]
    _close(ours[3:], ref[3:, 0])


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_token_matches_verl(gamma):
    tr = torch.rand(B, L, generator=_gen(1)) * MASK  # dense per-token rewards, not only outcomes
    adv, ret = reinforce_pp_token_advantages(tr, MASK, gamma=gamma)
    ref_adv, ref_ret = verl_reinforce_pp(tr, MASK, gamma)
    _close(adv, ref_adv)
    _close(ret, ref_ret * MASK)  # verl leaves returns at masked positions; ours are 0 there
    assert (adv[MASK == 0] == 0).all() and (ret[MASK == 0] == 0).all()


def test_reinforce_pp_token_outcome_rewards_match_verl():
    tr = _token_rewards(SCORES, MASK)
    adv, _ = reinforce_pp_token_advantages(tr, MASK, gamma=0.95)
    _close(adv, verl_reinforce_pp(tr, MASK, 0.95)[0])


def test_deliberate_reinforce_pp_steps_over_holes():
    """Row with a hole (tool output inside a multi-turn row). verl resets the running return after every
    masked column ("reset after EOS"), so the final reward never reaches the first turn. We step over
    masked columns (as verl's own GAE and our gae_advantages do): a multi-turn row is one episode. On
    rows whose loss tokens are contiguous (everything above) the two agree."""
    mask = T([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    tr = torch.zeros(2, L)
    tr[0, 5], tr[1, 3] = 1.0, 0.5
    tr[0, 2] = 7.0  # a reward on a masked position is ignored by both
    _, ret = reinforce_pp_token_advantages(tr, mask, gamma=0.9)
    _, ref_ret = verl_reinforce_pp(tr, mask, 0.9)
    _close(ret[0, [4, 5]], ref_ret[0, [4, 5]])  # last turn: same
    _close(ret[0, [0, 1]], T([0.9**3, 0.9**2]))  # first turn sees the final reward, discounted per loss token
    _close(ref_ret[0, [0, 1]], T([0.0, 0.0]))  # verl: cut off by the hole
    _close(ret[1], ref_ret[1] * mask[1])  # no hole: identical


def test_reinforce_pp_baseline_token_matches_verl():
    adv = reinforce_pp_baseline_token_advantages(SCORES, GROUPS, MASK)
    _close(adv, verl_reinforce_pp_baseline(_token_rewards(SCORES, MASK), MASK, GROUPS))


def test_deliberate_reinforce_pp_baseline_uniform_group_is_zero():
    """Uniform group in a non-uniform batch: verl whitens the group-centred scores over all tokens, and
    the token-weighted batch mean is ≠ 0 when lengths differ, so the uniform group gets −mean/std.
    We give it exactly 0 (no signal) and keep verl's whitening statistics, so other rows match."""
    adv = reinforce_pp_baseline_token_advantages(SCORES_UNIFORM_G1, GROUPS, MASK)
    ref = verl_reinforce_pp_baseline(_token_rewards(SCORES_UNIFORM_G1, MASK), MASK, GROUPS)
    assert (adv[3:] == 0).all()
    assert ref[3:].abs().max() > 0.1
    _close(adv[:3], ref[:3])


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5)])
def test_gae_matches_verl_then_whiten(gamma, lam):
    g = _gen(2)
    rewards = torch.rand(B, L, generator=g) * MASK
    values = torch.randn(B, L, generator=g)
    adv, ret = gae_advantages(rewards, values, MASK, gamma=gamma, lam=lam)
    ref_white, ref_ret, ref_raw = verl_gae(rewards, values, MASK, gamma, lam)
    _close(adv, ref_raw * MASK)
    _close(ret, ref_ret * MASK)
    _close(masked_whiten(adv, MASK), ref_white * MASK)  # verl's whitened GAE = ours + masked_whiten


def test_deliberate_gae_zero_at_masked_positions_with_holes():
    """With holes both recursions step over masked columns, so every loss token agrees with verl. verl
    leaves the carried advantage (and adv + value) at masked columns and whitens those too; ours are 0
    there (they are never trained on, and 0 keeps them out of any later sum)."""
    mask = T([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]])
    g = _gen(3)
    rewards, values = torch.rand(2, L, generator=g), torch.randn(2, L, generator=g)
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    ref_white, ref_ret, ref_raw = verl_gae(rewards, values, mask, 0.9, 0.8)
    on = mask > 0
    _close(adv[on], ref_raw[on])
    _close(ret[on], ref_ret[on])
    _close(masked_whiten(adv, mask)[on], ref_white[on])
    assert (adv[~on] == 0).all() and (ref_raw[~on] != 0).any()


# ==== whitening =================================================================================
@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_verl_and_shards_with_moments(shift_mean):
    x = torch.randn(B, L, generator=_gen(4)) * 3 + 1
    x[MASK == 0] = float("nan")  # garbage off the mask must not leak
    ours = masked_whiten(x, MASK, shift_mean=shift_mean)
    ref = verl_masked_whiten(torch.nan_to_num(x), MASK, shift_mean=shift_mean)
    _close(ours, ref * MASK)
    assert torch.isfinite(ours).all()
    # data-parallel: each shard whitened with the summed moments == the whole batch in one process
    shards = (slice(0, 2), slice(2, 6))
    parts = [masked_moments(x[s], MASK[s]) for s in shards]
    total = tuple(sum(p[k] for p in parts) for k in range(3))
    whole = torch.cat([masked_whiten(x[s], MASK[s], shift_mean=shift_mean, moments=total) for s in shards])
    _close(whole, ours)
    # moments passed in float32 (e.g. all-reduced in float32) give the same result at this tolerance
    total32 = tuple(t.float() for t in total)
    _close(torch.cat([masked_whiten(x[s], MASK[s], shift_mean=shift_mean, moments=total32) for s in shards]),
           ours, atol=1e-5)


def test_deliberate_masked_whiten_degenerate_inputs():
    """verl raises for ≤ 1 masked value and amplifies rounding noise by rsqrt(1e-8) = 10⁴ when all
    values are equal. We return exactly 0 (the mean with shift_mean=False): no NaN, no noise."""
    x = torch.full((B, L), 0.7)
    ref = verl_masked_whiten(x, MASK)
    assert ref[MASK > 0].abs().max() > 1e-4  # float32 rounding of the mean (~6e-8) × 10⁴
    assert (masked_whiten(x, MASK) == 0).all()
    _close(masked_whiten(x, MASK, shift_mean=False), 0.7 * MASK)
    assert (masked_whiten(x, torch.zeros(B, L)) == 0).all()  # empty mask
    one = torch.zeros(B, L)
    one[0, 0] = 1.0
    with pytest.raises(ValueError):
        verl_masked_whiten(x, one)
    assert (masked_whiten(torch.randn(B, L, generator=_gen(5)), one) == 0).all()
    # uniform values split over shards, moments summed (in float64 or float32): still exactly 0
    parts = [masked_moments(x[s], MASK[s]) for s in (slice(0, 3), slice(3, 6))]
    for cast in (torch.float64, torch.float32):
        total = tuple((parts[0][k] + parts[1][k]).to(cast) for k in range(3))
        assert (masked_whiten(x[:3], MASK[:3], moments=total) == 0).all()


# ==== exactly zero for uniform groups / batches, for every estimator ===========================
@pytest.mark.parametrize("value", [0.0, 1.0, 0.7, 0.9, 2.2, -3.3])
def test_uniform_rewards_give_exactly_zero_everywhere(value):
    scores = torch.full((B,), value)
    tr = _token_rewards(scores, MASK)
    outs = {
        "grpo": grpo_advantages(scores, GROUPS),
        "dr_grpo": grpo_advantages(scores, GROUPS, norm_std=False),
        "rloo": rloo_advantages(scores, GROUPS),
        "rf++ seq": reinforce_pp_advantages(scores),
        "rf++ seq baseline": reinforce_pp_advantages(scores, GROUPS),
        "rf++ token": reinforce_pp_token_advantages(tr, MASK, gamma=1.0)[0],
        "rf++ baseline token": reinforce_pp_baseline_token_advantages(scores, GROUPS, MASK),
        "rf++ token dense": reinforce_pp_token_advantages(torch.full((B, L), value) * MASK, MASK, gamma=0.0)[0],
    }
    for name, a in outs.items():
        assert torch.isfinite(a).all(), name
        assert (a == 0).all(), f"{name}: {a}"


def test_reinforce_pp_seq_uniform_batch_regression():
    """The bug of issue 10: (R − mean)/(std + 1e-6) on 24 rewards of 2.2 gave advantages of ±0.19."""
    r = torch.full((24,), 2.2)
    assert ((r - r.mean()) / (r.std() + 1e-6)).abs().max() > 0.1  # the old formula
    assert (reinforce_pp_advantages(r) == 0).all()
    # and the seq-level variants still normalise a real batch exactly as before
    x = T([1.0, 2.0, 4.0, 4.0])
    _close(reinforce_pp_advantages(x), (x - x.mean()) / (x.std() + 1e-6))


def test_uniform_group_zero_in_mixed_batch_for_group_estimators():
    for a in (grpo_advantages(SCORES_UNIFORM_G1, GROUPS), rloo_advantages(SCORES_UNIFORM_G1, GROUPS),
              reinforce_pp_advantages(SCORES_UNIFORM_G1, GROUPS),
              reinforce_pp_baseline_token_advantages(SCORES_UNIFORM_G1, GROUPS, MASK)):
        assert (a[3:] == 0).all() and torch.isfinite(a).all() and (a[:3] != 0).any()


# ==== KL ========================================================================================
def _logps():
    g = _gen(6)
    logp = (-torch.rand(B, L, generator=g) * 3).requires_grad_()
    ref = -torch.rand(B, L, generator=g) * 3
    return logp, ref


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "kl+", "k1+", "abs+", "low_var_kl+"])
def test_kl_estimate_matches_verl(name):
    assert name in KL_ESTIMATORS
    logp, ref = _logps()
    ours = kl_estimate(logp, ref, name)
    logp2 = logp.detach().clone().requires_grad_()
    theirs = verl_kl_penalty(logp2, ref, name)
    _close(ours, theirs.detach())
    (ours * MASK).sum().backward()
    (theirs * MASK).sum().backward()
    _close(logp.grad, logp2.grad)


def test_kl_k3_equals_verl_in_range_and_k3_plus_is_straight_through():
    logp, ref = _logps()
    _close(kl_estimate(logp, ref, "k3"), verl_kl_penalty(logp, ref, "low_var_kl").detach())
    v = kl_estimate(logp, ref, "k3+")
    _close(v, kl_estimate(logp, ref, "k3").detach())
    v.sum().backward()
    _close(logp.grad, (logp - ref).detach())  # gradient of k2


def test_deliberate_k3_is_unclamped_low_var_kl_is_verls():
    """verl's "k3" and "low_var_kl" are the same clamped estimator (log-ratio to [−20, 20], value to
    [−10, 10]). Our "low_var_kl" is exactly that; our plain "k3" is the unclamped (unbiased) estimator,
    computed with expm1 — it only differs where verl's clamps bite."""
    logp, ref = T([-1.0, -30.0, -1.0]), T([-1.0, -1.0, -30.0])  # log-ratio 0, −29, +29
    ours_k3 = kl_estimate(logp, ref, "k3")
    verl_k3 = verl_kl_penalty(logp, ref, "k3")
    _close(kl_estimate(logp, ref, "low_var_kl"), verl_k3)
    assert verl_k3.tolist()[1:] == [10.0, 10.0]
    assert ours_k3[1].item() == pytest.approx(math.exp(29) - 1 - 29, rel=1e-5)
    assert ours_k3[2].item() == pytest.approx(math.expm1(-29) + 29, rel=1e-6)
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k2+")  # verl has no straight-through k2 either


@pytest.mark.parametrize("name", ["kl", "low_var_kl", "k2"])
def test_kl_penalized_rewards_matches_verl_apply_kl_penalty(name):
    """verl ray_trainer.apply_kl_penalty: scores − β·kl_penalty(old, ref)·response_mask."""
    logp, ref = _logps()
    scores = _token_rewards(SCORES, MASK)
    ours = kl_penalized_rewards(scores, logp, ref, MASK, beta=0.05, kind=name)
    _close(ours, scores - 0.05 * verl_kl_penalty(logp, ref, name).detach() * MASK)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_kl_loss_aggregates_like_verl(mode):
    logp, ref = _logps()
    ours = kl_loss(logp, ref, MASK, kind="low_var_kl", agg=mode)
    _close(ours, verl_agg_loss(verl_kl_penalty(logp, ref, "low_var_kl"), MASK, mode).detach())


# ==== loss aggregation ==========================================================================
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregate_loss_matches_verl_and_splits_over_micro_batches(mode):
    loss_mat = torch.randn(B, L, generator=_gen(7))
    loss_mat[MASK == 0] = float("inf")  # garbage off the mask
    ref = verl_agg_loss(torch.where(MASK > 0, loss_mat, 0.0), MASK, mode)
    _close(aggregate_loss(loss_mat, MASK, mode), ref)
    # micro-batches (or ranks) with the global counts sum to the full-batch loss
    n_tok, n_seq = MASK.sum(), int((MASK.sum(-1) > 0).sum())  # verl: fully masked rows don't count
    parts = sum(aggregate_loss(loss_mat[s], MASK[s], mode, loss_tokens_global=n_tok, num_seqs_global=n_seq,
                               loss_norm_const=L) for s in (slice(0, 1), slice(1, 4), slice(4, 6)))
    _close(parts, ref)
    ref_global = verl_agg_loss(torch.where(MASK > 0, loss_mat, 0.0), MASK, mode, batch_num_tokens=40,
                               global_batch_size=12, loss_scale_factor=100.0)
    _close(aggregate_loss(loss_mat, MASK, mode, loss_tokens_global=40, num_seqs_global=12, loss_norm_const=100.0),
           ref_global)


def test_aggregate_loss_empty_and_bad_mode():
    z = torch.zeros(2, 3)
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(torch.ones(2, 3), z, mode).item() == 0.0
    with pytest.raises(ValueError, match="token-mean"):
        aggregate_loss(z, z, "seq-sum")


# ==== policy and value losses ===================================================================
def _ppo_inputs(seed=8, spread=0.3):
    g = _gen(seed)
    behav = -torch.rand(B, L, generator=g) * 3
    prox = behav + torch.randn(B, L, generator=g) * 0.4
    logp = (prox + torch.randn(B, L, generator=g) * spread).requires_grad_()
    A = grpo_advantages(SCORES, GROUPS)[:, None].expand(B, L) + 0.3 * torch.randn(B, L, generator=g)
    return logp, prox, behav, A


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("spread", [0.3, 30.0])  # 30: log-ratios far beyond verl's ±20 clamp
def test_decoupled_ppo_equals_verl_vanilla_when_prox_is_behav(mode, spread):
    """π_prox = π_behav (w ≡ 1) and dual_clip_c = 3 (verl's default clip_ratio_c). verl clamps log r to
    [−20, 20] and we do not; with the PPO clip and the dual clip active, that changes nothing."""
    logp, prox, _, A = _ppo_inputs(spread=spread)
    ours, st = decoupled_ppo_loss(logp, prox, prox, A, MASK, eps_clip_low=0.2, eps_clip_high=0.28,
                                  behav_imp_weight_cap=5.0, dual_clip_c=3.0, agg=mode)
    logp2 = logp.detach().clone().requires_grad_()
    ref, clipfrac, clipfrac_lower = verl_policy_loss_vanilla(prox, logp2, A, MASK, 0.2, 0.28, 3.0, mode)
    _close(ours, ref)
    _close(st["clipfrac"], clipfrac)
    _close(st["dual_clipfrac"], clipfrac_lower)
    ours.backward()
    ref.backward()
    _close(logp.grad, logp2.grad)


@pytest.mark.parametrize("cap,c_clip", [(1.3, None), (1.3, 3.0), (1.1, 3.0)])
def test_decoupled_ppo_mask_mode_equals_areal(cap, c_clip):
    logp, prox, behav, A = _ppo_inputs(seed=9)
    ours, st = decoupled_ppo_loss(logp, prox, behav, A, MASK, eps_clip_low=0.2, eps_clip_high=0.28,
                                  behav_imp_weight_cap=cap, behav_mode="mask", dual_clip_c=c_clip)
    logp2 = logp.detach().clone().requires_grad_()
    ref, clipfrac, dual = areal_ppo_actor_loss(logp2, prox, behav, A, 0.2, MASK, eps_clip_higher=0.28,
                                               c_clip=c_clip, behav_imp_weight_cap=cap)
    _close(ours, ref)
    _close(st["clipfrac"], clipfrac)
    _close(st["dual_clipfrac"], dual)
    assert 0 < st["behav_frac_capped"] < 1  # the cap is active on this data
    ours.backward()
    ref.backward()
    _close(logp.grad, logp2.grad)


def test_deliberate_behav_cap_none_means_no_correction():
    """AReaL's behav_imp_weight_cap=None keeps the *uncapped* weight π_prox/π_behav; ours means no
    behaviour correction (w ≡ 1, as TrainConfig documents). AReaL's None is our float('inf')."""
    logp, prox, behav, A = _ppo_inputs(seed=10)
    kw = dict(eps_clip_low=0.2, eps_clip_high=0.2)
    ref, _, _ = areal_ppo_actor_loss(logp, prox, behav, A, 0.2, MASK, behav_imp_weight_cap=None)
    inf, _ = decoupled_ppo_loss(logp, prox, behav, A, MASK, behav_imp_weight_cap=float("inf"), **kw)
    _close(inf, ref)
    none, _ = decoupled_ppo_loss(logp, prox, behav, A, MASK, behav_imp_weight_cap=None, **kw)
    same_as_w1, _, _ = areal_ppo_actor_loss(logp, prox, prox, A, 0.2, MASK)
    _close(none, same_as_w1)
    assert abs(none.item() - ref.item()) > 1e-3


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("clip", [0.2, 0.05])
def test_value_loss_matches_verl(mode, clip):
    g = _gen(11)
    old_values = torch.randn(B, L, generator=g)
    values = (old_values + 0.3 * torch.randn(B, L, generator=g)).requires_grad_()
    returns = torch.randn(B, L, generator=g)
    ours = ppo_value_loss(values, old_values, returns, MASK, value_clip=clip, agg=mode)
    v2 = values.detach().clone().requires_grad_()
    ref = verl_value_loss(v2, returns, old_values, MASK, clip, mode)
    _close(ours, ref)
    ours.backward()
    ref.backward()
    _close(values.grad, v2.grad)


def test_token_estimators_with_moments_fn_equal_the_whole_batch():
    """A data-parallel caller passes moments_fn = all-reduce; here the 'all-reduce' adds the moments of
    both shards (each shard holds whole groups)."""
    tr = torch.rand(B, L, generator=_gen(12)) * MASK
    shards = (slice(0, 3), slice(3, 6))

    def fake_all_reduce(parts):
        total = tuple(sum(p[k] for p in parts) for k in range(3))
        return lambda _local: total

    full, _ = reinforce_pp_token_advantages(tr, MASK, gamma=0.9)
    local_returns = [reinforce_pp_token_advantages(tr[s], MASK[s], gamma=0.9)[1] for s in shards]
    fn = fake_all_reduce([masked_moments(r, MASK[s]) for r, s in zip(local_returns, shards)])
    _close(torch.cat([reinforce_pp_token_advantages(tr[s], MASK[s], gamma=0.9, moments_fn=fn)[0] for s in shards]),
           full)

    full_b = reinforce_pp_baseline_token_advantages(SCORES, GROUPS, MASK)
    local_groups = T([0, 0, 0])
    x_parts = []
    for s in shards:
        sc = SCORES[s]
        x_parts.append(masked_moments((sc - sc.mean())[:, None] * MASK[s], MASK[s]))
    fn = fake_all_reduce(x_parts)
    _close(torch.cat([reinforce_pp_baseline_token_advantages(SCORES[s], local_groups, MASK[s], moments_fn=fn)
                      for s in shards]), full_b)


def test_reinforce_pp_baseline_rows_selects_this_ranks_samples():
    """rows_B: a rank holds rows {4, 0, 2} of the batch but group means use every sample's score."""
    full = reinforce_pp_baseline_token_advantages(SCORES_UNIFORM_G1, GROUPS, MASK)
    rows = T([4, 0, 2])
    centred = SCORES_UNIFORM_G1 - T([0.5, 0.5, 0.5, 1.0, 1.0, 1.0])
    centred[3:] = 0.0
    total = masked_moments(centred[:, None] * MASK, MASK)  # the dp-global moments
    mine = reinforce_pp_baseline_token_advantages(SCORES_UNIFORM_G1, GROUPS, MASK[rows], rows_B=rows,
                                                  moments_fn=lambda _local: total)
    _close(mine, full[rows])
