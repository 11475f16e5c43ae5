"""Hand-computed cases for the item-3 functions added with the learner pool: KL as a loss and in
the reward, the PPO critic (clipped value) loss, the entropy bonus."""

from __future__ import annotations

import math

import pytest
import torch

from areal_like.learner.algorithms import entropy_bonus_loss, kl_loss, kl_penalized_rewards, ppo_value_loss


def test_kl_loss_k1_k2_k3_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0, 9.0]])  # third token masked out (any value, no NaN)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # log_ratio = [0.5, 0]
    assert kl_loss(logp, ref, mask, kind="k1").item() == pytest.approx(0.25)
    assert kl_loss(logp, ref, mask, kind="k2").item() == pytest.approx(0.5 * 0.25 / 2)
    k3 = math.exp(-0.5) - 1 + 0.5
    assert kl_loss(logp, ref, mask, kind="k3").item() == pytest.approx(k3 / 2)
    assert kl_loss(logp, ref, mask, kind="k3", loss_tokens_global=4).item() == pytest.approx(k3 / 4)
    kl_loss(logp, ref, mask, kind="k1").backward()
    assert logp.grad.tolist() == [[0.5, 0.5, 0.0]]


def test_kl_in_reward_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.0, -2.0, -1.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    out = kl_penalized_rewards(r, logp, ref, mask, beta=0.1, kind="k1")
    torch.testing.assert_close(out, torch.tensor([[0.0, -0.1, 1.0 - 0.05]]))


def test_value_loss_clipped_and_unclipped():
    v = torch.tensor([1.0, 0.0], requires_grad=True)
    v_old = torch.tensor([0.5, 0.0])
    R = torch.tensor([2.0, 1.0])
    m = torch.ones(2)
    # unclipped: ½·((1−2)² + (0−1)²)/2 = 0.5
    assert ppo_value_loss(v, v_old, R, m, value_clip=None).item() == pytest.approx(0.5)
    # clip 0.2: token 0 V_clip = 0.7 → (0.7−2)² = 1.69 > 1 → max = 1.69; token 1 unchanged 1
    assert ppo_value_loss(v, v_old, R, m, value_clip=0.2).item() == pytest.approx(0.5 * (1.69 + 1.0) / 2)
    ppo_value_loss(v, v_old, R, m, value_clip=0.2).backward()
    # token 0: the clipped branch is active and constant in V → zero gradient; token 1: (V−R)/2
    torch.testing.assert_close(v.grad, torch.tensor([0.0, -0.5]))


def test_entropy_bonus_sign_and_normalisation():
    H = torch.tensor([[1.0, 2.0, 3.0]])
    m = torch.tensor([[1.0, 1.0, 0.0]])
    assert entropy_bonus_loss(H, m, coef=0.01).item() == pytest.approx(-0.01 * 1.5)
    assert entropy_bonus_loss(H, m, coef=0.01, loss_tokens_global=6).item() == pytest.approx(-0.01 * 0.5)
