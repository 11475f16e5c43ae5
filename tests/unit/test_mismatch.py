"""The training–inference mismatch (issue 26): measured every step, corrected when asked.

Pure logic: `rejection_sampling` (AReaL's settings: token/sequence, mask/clamp, ratio/KL metrics) and
the loss it feeds — a masked token contributes nothing, exactly as if its loss mask were 0 under the
same global normaliser. Through the `Trainer` on the tiny Qwen2: the step's mismatch statistics are
0 on-policy and equal to the perturbation put into the behaviour logprobs otherwise; IcePop masks
the tokens whose ratio leaves [0.5, 5] (counted), under the decoupled loss and under standard PPO
(with several minibatches, which then recompute the step-start logprobs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from areal_like.api.config import ConfigError, load_config
from areal_like.learner import algorithms as A
from areal_like.learner.trainer import Trainer

from test_trainer import DIGITS, TEMP, cfg, digit_reward, hf, model_dir, sample_groups, with_signal  # noqa: F401


def _lw(*vals):
    return torch.log(torch.tensor([vals], dtype=torch.float32))


def test_icepop_token_mask_keeps_the_ratio_inside_and_drops_the_rest():
    lw = _lw(0.4, 1.0, 4.9, 6.0, 2.0)
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])  # the last token is not a loss token: never acted on
    w, acted = A.rejection_sampling(lw, mask, **{**dict(level="token", action="mask", metric="ratio"),
                                                 "lower": 0.5, "upper": 5.0})
    assert acted.tolist() == [[True, False, False, True, False]]
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 4.9, 0.0, 0.0]]))


def test_sequence_level_geometric_mean_and_product():
    lw = torch.cat([_lw(2.0, 2.0, 2.0, 0.5), _lw(1.0, 1.0, 1.0, 1.0)])
    mask = torch.ones(2, 4)
    _, acted = A.rejection_sampling(lw, mask, level="sequence", action="mask", metric="ratio", agg="mean",
                                    lower=0.5, upper=1.3)  # geometric means 4^(1/4) = 1.414 and 1
    assert acted[0].all() and not acted[1].any()
    w, acted = A.rejection_sampling(lw, mask, level="sequence", action="clamp", metric="ratio", agg="sum",
                                    lower=None, upper=2.0)  # products 4 → 2, and 1
    torch.testing.assert_close(w, torch.tensor([[2.0] * 4, [1.0] * 4]))
    assert acted[0].all() and not acted[1].any()


def test_kl_metrics_and_token_tis():
    lw = _lw(1.0, math.e, 1 / math.e)
    mask = torch.ones(1, 3)
    _, acted = A.rejection_sampling(lw, mask, metric="kl_k3", upper=0.5)  # k3 = 0, e−2 = 0.718, 1/e = 0.368
    assert acted.tolist() == [[False, True, False]]
    _, acted = A.rejection_sampling(lw, mask, metric="kl_k2", upper=0.4)  # ½·log² = 0, 0.5, 0.5
    assert acted.tolist() == [[False, True, True]]
    w, acted = A.rejection_sampling(lw, mask, action="clamp", upper=2.0, lower=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.5]]))
    with pytest.raises(ValueError, match="metric=ratio"):
        A.rejection_sampling(lw, mask, action="clamp", metric="kl_k3", upper=1.0)


def test_masked_tokens_leave_the_loss():
    """The IcePop loss equals the plain (uncapped-w) loss with the masked tokens' loss mask set to 0,
    under the same global token count: their gradient is exactly 0."""
    torch.manual_seed(0)
    logp = (torch.randn(2, 5) - 2).requires_grad_()
    prox = logp.detach() + 0.05 * torch.randn(2, 5)
    behav = prox.clone()
    behav[0, 1] = prox[0, 1] - 2.0  # w = e² = 7.4 > 5
    behav[1, 3] = prox[1, 3] + 1.0  # w = e^-1 = 0.37 < 0.5
    adv = torch.randn(2, 5)
    mask = torch.ones(2, 5)
    kw = dict(eps_clip_low=0.2, eps_clip_high=0.28, loss_tokens_global=10)
    loss, st = A.decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=None,
                                    rejection=load_config(None, ["train.rejection_sampling=icepop"]).train.rejection_settings(),
                                    **kw)
    assert float(st["behav_frac_capped"]) * 10 == pytest.approx(2)
    (g,) = torch.autograd.grad(loss, logp)
    assert g[0, 1] == 0 and g[1, 3] == 0 and (g != 0).sum() == 8
    kept = mask.clone()
    kept[0, 1] = kept[1, 3] = 0
    ref, _ = A.decoupled_ppo_loss(logp, prox, behav, adv, kept, behav_imp_weight_cap=float("inf"), **kw)
    torch.testing.assert_close(loss, ref)
    with pytest.raises(ValueError, match="replaces behav_imp_weight_cap"):
        A.decoupled_ppo_loss(logp, prox, behav, adv, mask, behav_imp_weight_cap=5.0, rejection={"upper": 5.0}, **kw)


def test_config_presets_and_errors():
    rs = load_config(None, ["train.rejection_sampling=seq_tis"]).train.rejection_settings()
    assert rs == dict(level="sequence", action="clamp", metric="ratio", agg="sum", lower=None, upper=2.0)
    rs = load_config(None, ["train.rejection_sampling.metric=kl_k3", "train.rejection_sampling.upper=0.1"]
                     ).train.rejection_settings()
    assert rs["metric"] == "kl_k3" and rs["upper"] == 0.1 and rs["action"] == "mask"
    assert load_config(None, []).train.rejection_settings() is None
    for bad, word in ((["train.rejection_sampling=icepopp"], "use one of icepop"),
                      (["train.rejection_sampling=icepop", "train.behav_imp_weight_cap=2"], "replaces"),
                      (["train.rejection_sampling.lower=3", "train.rejection_sampling.upper=2"], "lower ≤ upper")):
        with pytest.raises(ConfigError, match=word):
            load_config(None, bad)


def _behav(tr) -> np.ndarray:
    """The output tokens' behaviour logprobs of a trajectory."""
    return np.frombuffer(tr.logprobs, dtype=np.float32)[tr.prompt_len:]


def _perturb(groups, deltas: dict[tuple[int, int, int], float]):
    """Shift chosen behaviour logprobs: (group, trajectory, output position) → Δ log π_behav."""
    for (g, t, i), d in deltas.items():
        tr = groups[g].trajectories[t]
        lp = np.frombuffer(tr.logprobs, dtype=np.float32).copy()
        lp[tr.prompt_len + i] += d
        tr.logprobs = lp.astype("<f4").tobytes()
    return groups


def test_trainer_measures_the_mismatch(model_dir):
    ln = Trainer(model_dir, cfg(micro_batch_tokens=40), temperature=TEMP)
    clean = with_signal(sample_groups(hf(ln), n_groups=2, n=3, gen_len=3, seed=2, reward_fn=digit_reward))
    st = ln.train_step(clean, version=0)
    assert st.mismatch_tokens == st.loss_tokens == 18
    assert st.mismatch_logp_abs_mean < 1e-5 and st.mismatch_logp_abs_max < 1e-5
    assert abs(st.mismatch_kl) < 1e-9 and st.mismatch_ratio_outside == 0.0

    ln = Trainer(model_dir, cfg(micro_batch_tokens=40), temperature=TEMP)
    noisy = with_signal(sample_groups(hf(ln), n_groups=2, n=3, gen_len=3, seed=2, reward_fn=digit_reward))
    rng = np.random.default_rng(0)
    shifts = {(g, t, i): float(rng.normal(0, 0.3)) for g in range(2) for t in range(3) for i in range(3)}
    shifts[(1, 2, 1)] = -2.0  # one ratio π_learner/π_behav = e² outside [0.5, 5]
    noisy = _perturb(noisy, shifts)
    d = np.array(list(shifts.values()))
    st = ln.train_step(noisy, version=0)
    assert st.mismatch_logp_abs_mean == pytest.approx(np.abs(d).mean(), abs=1e-5)
    assert st.mismatch_logp_abs_max == pytest.approx(np.abs(d).max(), abs=1e-5)
    assert st.mismatch_kl == pytest.approx(np.mean(np.expm1(-d) + d), abs=1e-5)  # r = π_learner/π_behav = e^−d
    assert st.mismatch_ratio_outside == pytest.approx(np.mean((-d < math.log(0.5)) | (-d > math.log(5))), abs=1e-6)


@pytest.mark.parametrize("proximal,minibatches", [("recompute", 2), ("behaviour", 1), ("behaviour", 3)])
def test_icepop_masks_and_counts_the_tokens_outside(model_dir, proximal, minibatches):
    ln = Trainer(model_dir, cfg(micro_batch_tokens=40, rejection_sampling="icepop", proximal=proximal,
                                ppo_minibatches=minibatches), temperature=TEMP)
    groups = with_signal(sample_groups(hf(ln), n_groups=3, n=2, gen_len=3, seed=5, reward_fn=digit_reward))
    # two tokens far outside [0.5, 5] (π_learner/π_behav = e^3 and e^−2), one just inside (e^1.5 = 4.5)
    groups = _perturb(groups, {(0, 0, 1): -3.0, (1, 1, 0): 2.0, (2, 0, 2): -1.5})
    st = ln.train_step(groups, version=0)
    assert st.behav_tokens_capped == 2
    assert st.mismatch_ratio_outside == pytest.approx(2 / st.loss_tokens)
    assert st.mismatch_tokens == st.loss_tokens
    if proximal == "behaviour":
        assert st.behav_w_min == 1.0 and st.behav_w_max == 1.0  # standard PPO: π_prox = π_behav


def test_fp32_lm_head_computes_the_logits_in_fp32(model_dir):
    """model.fp32_lm_head: a 16-bit head's logits come from fp32 input and weight (the stored weight
    unchanged); the Trainer applies it to the actor's head, the embedded engine to its model's."""
    from areal_like.engine.runner import ModelRunner
    from areal_like.learner.logprobs import fp32_lm_head

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    fp32_lm_head(head)
    y = head(x)
    assert y.dtype == torch.float32 and head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(y, x.float() @ head.weight.float().t())
    assert not torch.equal(y, (x @ head.weight.t()).float())  # the bf16 matmul rounds differently
    ln = Trainer(model_dir, cfg(), temperature=TEMP, dtype="bfloat16", fp32_lm_head=True)
    h = torch.randn(2, hf(ln).config.hidden_size, dtype=torch.bfloat16)
    assert ln.actor.head(h).dtype == torch.float32 and "LM head fp32" in ln.precision_policy
    runner = ModelRunner(model_dir, dtype="bfloat16", fp32_lm_head=True)
    with torch.no_grad():
        y1 = runner.model.lm_head(h)
        assert y1.dtype == torch.float32
        # the engine keeps the fp32 copy between decode steps; a weight update must replace it
        runner.load_weights({"lm_head.weight": runner.model.lm_head.weight.detach() * 2})
        torch.testing.assert_close(runner.model.lm_head(h), 2 * y1)
    with pytest.raises(TypeError, match="fp32_lm_head"):
        fp32_lm_head(torch.nn.Identity())
