"""The Trainer (layout d1p1t1) on the tiny Qwen2: a step runs and learns, on-policy sanity, exact gradient
accumulation, the PPO update structure (minibatches, π_prox modes), every advantage estimator, the critic,
the reference model and KL, bit-exact checkpoint resume (critic included), weight export names.
Everything CPU, a few seconds in all."""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
import torch
from safetensors import safe_open

from areal_like.api.config import TrainConfig
from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.data.tiny_model import build_tiny_model, char_vocab
from areal_like.learner.logprobs import token_logprobs_from_logits
from areal_like.api.config import AlgorithmConfig, CriticConfig
from areal_like.learner.checkpoint import export_hf, load_checkpoint, save_checkpoint
from areal_like.learner.trainer import Trainer

TEMP = 0.9
VOCAB = char_vocab()
DIGITS = [VOCAB[c] for c in "0123456789"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), seed=0)


def cfg(**kw) -> TrainConfig:
    base = dict(lr=1e-2, grad_clip=1.0, micro_batch_tokens=4096, seed=3, behav_imp_weight_cap=5.0)
    base.update(kw)
    return TrainConfig(**base)


@torch.no_grad()
def sample_groups(
    model, *, n_groups: int, n: int, gen_len: int, seed: int, reward_fn, behav_noise: float = 0.0, version: int = 0
) -> list[TrajectoryGroup]:
    """On-policy rollouts from `model` with torch: π_behav = the model's own logprob at TEMP."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        prompt = [VOCAB["<bos>"]] + torch.randint(4, len(VOCAB), (3 + gi % 3,), generator=gen).tolist()
        trajs = []
        for k in range(n):
            ids = list(prompt)
            lps = []
            for _ in range(gen_len):
                logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
                tok = int(torch.multinomial(torch.softmax(logits / TEMP, -1), 1, generator=gen))
                lps.append(float(token_logprobs_from_logits(logits[None], torch.tensor([tok]), TEMP)[0]))
                ids.append(tok)
            out = ids[len(prompt):]
            lp = np.asarray(lps, np.float32)
            if behav_noise:
                lp = lp + behav_noise * torch.randn(len(lp), generator=gen).numpy().astype(np.float32)
            trajs.append(
                Trajectory.build(
                    traj_id=f"g{gi}-{k}", group_id=f"g{gi}", prompt_id=f"p{gi}", prompt_ids=prompt, output_ids=out,
                    output_logprobs=lp, output_versions=[version] * gen_len, reward=reward_fn(out),
                    finish_reason="length",
                )
            )
        groups.append(TrajectoryGroup(group_id=f"g{gi}", prompt_id=f"p{gi}", trajectories=trajs, created_at=0.0))
    return groups


def digit_reward(out: list[int]) -> float:
    return 1.0 if out[0] in DIGITS else 0.0


def hf(learner: Trainer):
    """The plain HF model inside a single-process trainer (its one pipeline stage is the whole model)."""
    return learner.actor.stage_module.hf


def params(learner: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in hf(learner).named_parameters()}


def grads(learner: Trainer) -> dict[str, torch.Tensor]:
    return dict(learner.named_full_grads())


def with_signal(groups):
    groups[0].trajectories[0].reward = 1.0 - groups[0].trajectories[1].reward  # at least one group has signal
    return groups


def test_train_step_runs_and_changes_weights(model_dir):
    ln = Trainer(model_dir, cfg(), temperature=TEMP)
    groups = with_signal(sample_groups(hf(ln), n_groups=3, n=4, gen_len=3, seed=1, reward_fn=digit_reward,
                                       behav_noise=0.3))
    before = params(ln)
    st = ln.train_step(groups, version=0)
    assert not st.skipped, st.skip_reason
    for k, v in msgspec.structs.asdict(st).items():  # every statistic the step measured is a finite number
        if isinstance(v, float):
            assert np.isfinite(v), k
    assert st.num_groups == 3 and st.num_samples == 12 and st.loss_tokens == 12 * 3
    assert st.num_tokens == sum(t.num_tokens for g in groups for t in g.trajectories)
    assert st.behav_w_max > 1.0 > st.behav_w_min  # behaviour logprobs were perturbed
    assert st.kl_ref is None and st.value_loss is None  # no reference, no critic by default
    changed = [n for n, p in hf(ln).named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) > 0
    assert ln.step == 1 and ln.optimizer_steps == 1 and st.optimizer_steps == 1


def test_on_policy_weights_and_ratio_are_one(model_dir):
    ln = Trainer(model_dir, cfg(micro_batch_tokens=40), temperature=TEMP)
    groups = with_signal(sample_groups(hf(ln), n_groups=2, n=3, gen_len=3, seed=2, reward_fn=digit_reward))
    st = ln.train_step(groups, version=0)
    # π_behav was computed by the same definition on the same weights (unpadded, one at a time)
    assert st.behav_w_min == pytest.approx(1.0, abs=1e-5) and st.behav_w_max == pytest.approx(1.0, abs=1e-5)
    assert st.behav_tokens_capped == 0
    # one optimizer step: π_prox = the weights being differentiated, ratio exactly 1, nothing clipped
    assert st.ratio_mean == pytest.approx(1.0, abs=1e-6) and st.ratio_max == pytest.approx(1.0, abs=1e-6)
    assert st.clipfrac == 0.0 and st.approx_kl == pytest.approx(0.0, abs=1e-9)


def _p_digit(model, prompts) -> float:
    with torch.no_grad():
        ps = []
        for p in prompts:
            logits = model(input_ids=torch.tensor([p]), use_cache=False).logits[0, -1].float()
            ps.append(torch.softmax(logits / TEMP, -1)[DIGITS].sum().item())
    return float(np.mean(ps))


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
                                       "reinforce_plus_plus_baseline", "gae"])
def test_every_estimator_learns_the_bandit(model_dir, estimator):
    """Reward 1 iff the first generated token is a digit: training raises P(first token ∈ digits)."""
    torch.manual_seed(0)
    ln = Trainer(model_dir, cfg(lr=5e-3), temperature=TEMP, algorithm=AlgorithmConfig(adv_estimator=estimator),
                 critic=CriticConfig(lr=5e-2))
    probe = sample_groups(hf(ln), n_groups=6, n=1, gen_len=1, seed=100, reward_fn=digit_reward)
    prompts = [list(g.trajectories[0].ids_np()[: g.trajectories[0].prompt_len]) for g in probe]
    p0 = _p_digit(hf(ln), prompts)
    rewards = []
    for step in range(4):
        groups = sample_groups(hf(ln), n_groups=6, n=8, gen_len=1, seed=step, reward_fn=digit_reward, version=step)
        st = ln.train_step(groups, version=step)
        assert not st.skipped
        assert (st.value_loss is not None) == (estimator == "gae")
        rewards.append(st.reward_mean)
    p1 = _p_digit(hf(ln), prompts)
    assert p1 > p0 * 1.5, (p0, p1, rewards)


def test_uniform_rewards_give_zero_advantage_for_every_estimator(model_dir):
    for estimator in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        ln = Trainer(model_dir, cfg(), temperature=TEMP, algorithm=AlgorithmConfig(adv_estimator=estimator))
        groups = sample_groups(hf(ln), n_groups=2, n=4, gen_len=2, seed=3, reward_fn=lambda o: 0.7)
        before = params(ln)
        st = ln.train_step(groups, version=0)
        assert st.adv_abs_mean == 0.0, estimator
        assert st.loss == 0.0 and st.grad_norm == 0.0, estimator
        assert all(torch.equal(p, before[n]) for n, p in hf(ln).named_parameters()), estimator


def test_two_micro_batches_give_the_same_gradient(model_dir):
    one = Trainer(model_dir, cfg(micro_batch_tokens=100_000), temperature=TEMP)
    two = Trainer(model_dir, cfg(micro_batch_tokens=30), temperature=TEMP)
    groups = with_signal(sample_groups(hf(one), n_groups=2, n=3, gen_len=3, seed=5, reward_fn=digit_reward,
                                       behav_noise=0.2))
    s1, s2 = one.train_step(groups, 0), two.train_step(groups, 0)
    assert s1.loss == pytest.approx(s2.loss, abs=1e-6)
    g1, g2 = grads(one), grads(two)
    n_nonzero = 0
    for n, g in g2.items():
        torch.testing.assert_close(g, g1[n], atol=1e-6, rtol=0, msg=n)
        n_nonzero += int(g1[n].abs().sum() > 0)
    assert n_nonzero > 0


def test_minibatches_take_several_optimizer_steps_and_the_clip_binds(model_dir):
    ln = Trainer(model_dir, cfg(lr=3e-2, ppo_minibatches=4, ppo_epochs=2), temperature=TEMP)
    groups = with_signal(sample_groups(hf(ln), n_groups=4, n=4, gen_len=3, seed=8, reward_fn=digit_reward))
    st = ln.train_step(groups, version=0)
    assert st.optimizer_steps == 8 and ln.optimizer_steps == 8 and st.num_minibatches == 4
    assert st.ratio_max > 1.0 and st.approx_kl > 0.0  # π_θ moved away from π_prox within the step
    assert st.clipfrac > 0.0


def test_recompute_uses_the_steps_starting_weights(model_dir):
    """On-policy data: π_behav = the step's starting policy, so recomputing π_prox with the starting
    weights gives the same update as π_prox = π_behav — in every minibatch, not only the first."""
    runs = {}
    for mode in ("recompute", "behaviour", "loglinear"):
        ln = Trainer(model_dir, cfg(ppo_minibatches=3), temperature=TEMP)
        groups = with_signal(sample_groups(hf(ln), n_groups=3, n=4, gen_len=2, seed=9, reward_fn=digit_reward))
        st = ln.train_step(groups, version=0)
        assert st.optimizer_steps == 3
        runs[mode] = (st, params(ln))
    for mode in ("behaviour", "loglinear"):
        assert runs[mode][0].loss == pytest.approx(runs["recompute"][0].loss, abs=1e-5)
        for n, p in runs[mode][1].items():
            torch.testing.assert_close(p, runs["recompute"][1][n], atol=1e-5, rtol=0, msg=f"{mode} {n}")


def test_behaviour_proximal_makes_the_behaviour_weight_one(model_dir):
    ln = Trainer(model_dir, cfg(proximal="behaviour"), temperature=TEMP)
    groups = with_signal(sample_groups(hf(ln), n_groups=2, n=4, gen_len=3, seed=4, reward_fn=digit_reward,
                                       behav_noise=0.5, version=0))
    st = ln.train_step(groups, version=3)  # stale data (η ≥ 2): still w ≡ 1 by construction
    assert st.behav_w_min == 1.0 and st.behav_w_max == 1.0 and st.behav_tokens_capped == 0


def test_reference_kl_starts_at_zero_and_the_kl_loss_keeps_it_smaller(model_dir):
    kls = {}
    for coef in (0.0, 0.1):
        ln = Trainer(model_dir, cfg(lr=2e-2), temperature=TEMP,
                     algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=coef, kl_estimator="k2"))
        assert ln.ref is not None
        seq = []
        for step in range(4):
            groups = with_signal(sample_groups(hf(ln), n_groups=3, n=4, gen_len=2, seed=20 + step,
                                               reward_fn=digit_reward, version=step))
            seq.append(ln.train_step(groups, version=step).kl_ref)
        kls[coef] = seq
    assert kls[0.0][0] == pytest.approx(0.0, abs=1e-7)  # the reference is the initial policy
    assert kls[0.0][-1] > 0 and kls[0.1][-1] < kls[0.0][-1], kls


def test_kl_in_reward_changes_the_advantages(model_dir):
    ln = Trainer(model_dir, cfg(), temperature=TEMP, algorithm=AlgorithmConfig(kl_reward_coef=0.5))
    groups = sample_groups(hf(ln), n_groups=2, n=4, gen_len=2, seed=3, reward_fn=lambda o: 1.0)
    # uniform rewards, but the KL to the reference (here: behav logprobs vs ref, perturbed) differs per sample
    for g in groups:
        for k, t in enumerate(g.trajectories):
            t.logprobs = (t.logprobs_np() + np.float32(0.1 * k) * t.mask_np()).astype(np.float32).tobytes()
    st = ln.train_step(groups, version=0)
    assert st.adv_abs_mean > 0.0 and st.kl_ref is not None


def test_overlong_penalty_shapes_the_reward(model_dir):
    from areal_like.api.config import RewardShapingConfig

    ln = Trainer(model_dir, cfg(), temperature=TEMP, reward=RewardShapingConfig(overlong_buffer_len=2),
                 max_new_tokens=4)
    groups = sample_groups(hf(ln), n_groups=1, n=4, gen_len=3, seed=3, reward_fn=lambda o: 1.0)
    st = ln.train_step(groups, version=0)
    assert st.reward_mean == 1.0 and st.score_mean == pytest.approx(0.5)  # 3 of 4 tokens: half-way down the 2-token ramp


def test_non_finite_gradient_skips_the_step(model_dir, caplog):
    ln = Trainer(model_dir, cfg(), temperature=TEMP)
    groups = sample_groups(hf(ln), n_groups=1, n=2, gen_len=2, seed=7, reward_fn=lambda o: float(o[0] % 2))
    groups[0].trajectories[0].reward, groups[0].trajectories[1].reward = 1.0, 0.0
    t = groups[0].trajectories[0]
    lp = t.logprobs_np().copy()
    lp[-1] = np.nan  # a corrupt behaviour logprob poisons the gradient
    t.logprobs = lp.tobytes()
    before = params(ln)
    st = ln.train_step(groups, version=0)
    assert st.skipped and "non-finite" in st.skip_reason
    assert "skipped" in caplog.text
    assert all(torch.equal(p, before[n]) for n, p in hf(ln).named_parameters())
    assert ln.step == 1 and ln.optimizer_steps == 0 and ln.skipped_steps == 1


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_checkpoint_round_trip_matches_uninterrupted_run(model_dir, tmp_path, estimator, monkeypatch):
    if estimator == "gae":  # weights in several safetensors shards + index, as a real model's are
        import areal_like.learner.checkpoint as C

        monkeypatch.setattr(C, "HF_SHARD_BYTES", 40_000)
    c = cfg(lr=3e-3, ppo_minibatches=2)
    alg = AlgorithmConfig(adv_estimator=estimator)
    make = lambda: Trainer(model_dir, c, temperature=TEMP, algorithm=alg)  # noqa: E731
    ref = make()
    batches = [with_signal(sample_groups(hf(ref), n_groups=2, n=3, gen_len=2, seed=10 + i, reward_fn=digit_reward,
                                         behav_noise=0.1)) for i in range(3)]
    ref_stats = [ref.train_step(b, version=i) for i, b in enumerate(batches)]

    first = make()
    for i, b in enumerate(batches[:2]):
        first.train_step(b, version=i)
    ck = save_checkpoint(first, str(tmp_path / "ckpt"), extra={"buffer_offset": "12-0", "version": 2})
    save_checkpoint(first, ck, extra={"buffer_offset": "12-0", "version": 2})  # overwrite in place works
    del first
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no tmp/old dirs left behind
    if estimator == "gae":
        files = os.listdir(ck)
        assert "model.safetensors.index.json" in files and "critic.safetensors.index.json" in files, files
        assert len([f for f in files if f.startswith("model-0")]) > 1, files

    resumed = make()
    extra = load_checkpoint(resumed, ck)
    assert extra == {"buffer_offset": "12-0", "version": 2}
    assert resumed.step == 2 and resumed.optimizer_steps == 4
    st = resumed.train_step(batches[2], version=2)
    assert st.loss == ref_stats[2].loss
    assert st.grad_norm == ref_stats[2].grad_norm
    assert st.value_loss == ref_stats[2].value_loss
    for (n, p), (_, q) in zip(hf(resumed).named_parameters(), hf(ref).named_parameters()):
        assert torch.equal(p, q), n  # optimizer moments restored bit-exactly
    if estimator == "gae":
        for (n, p), (_, q) in zip(resumed.critic.stage_module.named_parameters(),
                                  ref.critic.stage_module.named_parameters()):
            assert torch.equal(p, q), f"critic {n}"
        # a run without the critic refuses this checkpoint, naming the fix
        with pytest.raises(ValueError, match="adv_estimator"):
            load_checkpoint(Trainer(model_dir, c, temperature=TEMP), ck)

    # only tensors and plain values: loads with weights_only=True
    torch.load(os.path.join(ck, "rank00000.pt"), weights_only=True)
    with pytest.raises((TypeError, msgspec.EncodeError)):
        save_checkpoint(resumed, str(tmp_path / "bad"), extra={"obj": object()})


def test_push_names_match_hf_files_and_save_hf_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM

    tied = build_tiny_model(str(tmp_path / "tied"), tie_word_embeddings=True, num_layers=1)
    ln = Trainer(tied, cfg(), temperature=TEMP)
    pushed = ln.full_state()
    with safe_open(os.path.join(tied, "model.safetensors"), "pt") as f:
        file_keys = set(f.keys())
    assert {n for n, _ in pushed} == file_keys  # tied lm_head not repeated
    assert all(t.is_contiguous() and not t.requires_grad and t.dtype == torch.float32 for _, t in pushed)

    out = export_hf(ln, str(tmp_path / "export"))
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    sd = reloaded.state_dict()
    for n, t in pushed:
        assert torch.equal(sd[n], t), n


def test_colocated_sleep_frees_gradients_and_the_next_step_is_unchanged(model_dir):
    """Co-located mode's sleep/wake between training phases: on CPU the state is host memory already, so
    sleep frees the gradients only; two steps with a sleep/wake in between train exactly as two without."""
    groups = with_signal(sample_groups(hf(Trainer(model_dir, cfg(), temperature=TEMP)), n_groups=2, n=3, gen_len=3,
                                       seed=5, reward_fn=digit_reward, behav_noise=0.2))
    plain, slept = Trainer(model_dir, cfg(), temperature=TEMP), Trainer(model_dir, cfg(), temperature=TEMP)
    for ln in (plain, slept):
        ln.train_step(groups, version=0)
    assert any(p.grad is not None for p in hf(slept).parameters())
    slept.sleep(keep_params=True)
    assert all(p.grad is None for p in hf(slept).parameters())
    slept.sleep()
    assert slept.wake() >= 0.0 and not slept.actor.asleep  # nothing moved on CPU
    a, b = plain.train_step(groups, version=1), slept.train_step(groups, version=1)
    assert a.loss == b.loss and a.grad_norm == b.grad_norm
    assert all(torch.equal(p, q) for p, q in zip(hf(plain).parameters(), hf(slept).parameters()))
