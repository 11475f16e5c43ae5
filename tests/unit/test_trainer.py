"""Learner on the tiny Qwen2: a step runs and learns, on-policy sanity, exact gradient accumulation,
bit-exact checkpoint resume, weight export names. Everything CPU, a few seconds in all."""

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
from areal_like.learner.trainer import Learner

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


def params(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


EXPECTED_KEYS = {"loss", "reward_mean", "reward_std", "grad_norm", "clipfrac", "approx_kl", "behav_w_mean",
                 "behav_w_max", "num_tokens", "loss_tokens", "num_groups", "num_samples", "skipped", "step_s"}


def test_train_step_runs_and_changes_weights(model_dir):
    ln = Learner(model_dir, cfg(), temperature=TEMP)
    groups = sample_groups(ln.model, n_groups=3, n=4, gen_len=3, seed=1, reward_fn=digit_reward, behav_noise=0.3)
    groups[0].trajectories[0].reward = 1.0  # make sure at least one group has signal
    before = params(ln)
    st = ln.train_step(groups, version=0)
    assert EXPECTED_KEYS <= set(st)
    assert not st["skipped"], st["skip_reason"]
    for k, v in st.items():
        if isinstance(v, float):
            assert np.isfinite(v), k
    assert st["num_groups"] == 3 and st["num_samples"] == 12 and st["loss_tokens"] == 12 * 3
    assert st["num_tokens"] == sum(t.num_tokens for g in groups for t in g.trajectories)
    assert st["behav_w_max"] > 1.0  # behaviour logprobs were perturbed
    changed = [n for n, p in ln.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) > 0
    assert ln.step == 1 and ln.optimizer_steps == 1


def test_on_policy_weights_and_ratio_are_one(model_dir):
    ln = Learner(model_dir, cfg(micro_batch_tokens=40), temperature=TEMP)
    groups = sample_groups(ln.model, n_groups=2, n=3, gen_len=3, seed=2, reward_fn=digit_reward)
    batch = ln.prepare_batch(groups, version=0)
    assert len(batch.micro_batches) > 1
    st = {k: v.item() for k, v in ln.forward_backward(batch).items()}
    # π_behav was computed by the same definition on the same weights (unpadded, one at a time)
    assert st["behav_w_mean"] == pytest.approx(1.0, abs=1e-5)
    assert st["behav_w_max"] == pytest.approx(1.0, abs=1e-5)
    assert st["behav_frac_capped"] == 0.0
    # π_prox recomputed with the same weights and shapes: ratio exactly 1, nothing clipped
    assert st["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert st["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert st["clipfrac"] == 0.0 and st["approx_kl"] == pytest.approx(0.0, abs=1e-9)


def _p_digit(model, prompts) -> float:
    with torch.no_grad():
        ps = []
        for p in prompts:
            logits = model(input_ids=torch.tensor([p]), use_cache=False).logits[0, -1].float()
            ps.append(torch.softmax(logits / TEMP, -1)[DIGITS].sum().item())
    return float(np.mean(ps))


def test_bandit_learning_signal_increases_target_probability(model_dir):
    """Reward 1 iff the first generated token is a digit: training raises P(first token ∈ digits)."""
    torch.manual_seed(0)
    ln = Learner(model_dir, cfg(lr=5e-3), temperature=TEMP)
    probe = sample_groups(ln.model, n_groups=6, n=1, gen_len=1, seed=100, reward_fn=digit_reward)
    prompts = [list(g.trajectories[0].ids_np()[: g.trajectories[0].prompt_len]) for g in probe]
    p0 = _p_digit(ln.model, prompts)
    rewards = []
    for step in range(4):
        groups = sample_groups(ln.model, n_groups=6, n=8, gen_len=1, seed=step, reward_fn=digit_reward, version=step)
        st = ln.train_step(groups, version=step)
        assert not st["skipped"]
        rewards.append(st["reward_mean"])
    p1 = _p_digit(ln.model, prompts)
    assert p1 > p0 * 1.5, (p0, p1, rewards)


def test_two_micro_batches_give_the_same_gradient(model_dir):
    one = Learner(model_dir, cfg(micro_batch_tokens=100_000), temperature=TEMP)
    two = Learner(model_dir, cfg(micro_batch_tokens=30), temperature=TEMP)
    groups = sample_groups(one.model, n_groups=2, n=3, gen_len=3, seed=5, reward_fn=digit_reward, behav_noise=0.2)
    groups[1].trajectories[0].reward = 1.0
    b1, b2 = one.prepare_batch(groups, 0), two.prepare_batch(groups, 0)
    assert len(b1.micro_batches) == 1 and len(b2.micro_batches) >= 2
    s1, s2 = one.forward_backward(b1), two.forward_backward(b2)
    torch.testing.assert_close(s1["loss"], s2["loss"], atol=1e-6, rtol=0)
    g1 = {n: p.grad for n, p in one.model.named_parameters()}
    n_nonzero = 0
    for n, p in two.model.named_parameters():
        torch.testing.assert_close(p.grad, g1[n], atol=1e-6, rtol=0, msg=n)
        n_nonzero += int(g1[n].abs().sum() > 0)
    assert n_nonzero > 0


def test_detach_proximal_equals_recompute(model_dir):
    a = Learner(model_dir, cfg(), temperature=TEMP, proximal="recompute")
    b = Learner(model_dir, cfg(), temperature=TEMP, proximal="detach")
    groups = sample_groups(a.model, n_groups=2, n=3, gen_len=2, seed=6, reward_fn=digit_reward, behav_noise=0.2)
    groups[0].trajectories[0].reward = 1.0
    sa, sb = a.train_step(groups, 0), b.train_step(groups, 0)
    assert sa["loss"] == pytest.approx(sb["loss"], abs=1e-7)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-7, rtol=0, msg=n)


def test_non_finite_gradient_skips_the_step(model_dir, caplog):
    ln = Learner(model_dir, cfg(), temperature=TEMP)
    groups = sample_groups(ln.model, n_groups=1, n=2, gen_len=2, seed=7, reward_fn=lambda o: float(o[0] % 2))
    groups[0].trajectories[0].reward, groups[0].trajectories[1].reward = 1.0, 0.0
    t = groups[0].trajectories[0]
    lp = t.logprobs_np().copy()
    lp[-1] = np.nan  # a corrupt behaviour logprob poisons the gradient
    t.logprobs = lp.tobytes()
    before = params(ln)
    st = ln.train_step(groups, version=0)
    assert st["skipped"] and "non-finite" in st["skip_reason"]
    assert "skipped" in caplog.text
    assert all(torch.equal(p, before[n]) for n, p in ln.model.named_parameters())
    assert ln.step == 1 and ln.optimizer_steps == 0 and ln.skipped_steps == 1


def test_checkpoint_round_trip_matches_uninterrupted_run(model_dir, tmp_path):
    c = cfg(lr=3e-3)
    ref = Learner(model_dir, c, temperature=TEMP)
    batches = [
        sample_groups(ref.model, n_groups=2, n=3, gen_len=2, seed=10 + i, reward_fn=digit_reward, behav_noise=0.1)
        for i in range(3)
    ]
    for b in batches:
        b[0].trajectories[0].reward = 1.0
    ref_stats = [ref.train_step(b, version=i) for i, b in enumerate(batches)]

    first = Learner(model_dir, c, temperature=TEMP)
    for i, b in enumerate(batches[:2]):
        first.train_step(b, version=i)
    ck = first.save_checkpoint(str(tmp_path / "ckpt"), extra={"buffer_offset": "12-0", "version": 2})
    first.save_checkpoint(ck, extra={"buffer_offset": "12-0", "version": 2})  # overwrite in place works
    del first
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no tmp/old dirs left behind

    resumed = Learner(model_dir, c, temperature=TEMP)
    extra = resumed.load_checkpoint(ck)
    assert extra == {"buffer_offset": "12-0", "version": 2}
    assert resumed.step == 2 and resumed.optimizer_steps == 2
    st = resumed.train_step(batches[2], version=2)
    assert st["loss"] == ref_stats[2]["loss"]
    assert st["grad_norm"] == ref_stats[2]["grad_norm"]
    for (n, p), (_, q) in zip(resumed.model.named_parameters(), ref.model.named_parameters()):
        assert torch.equal(p, q), n  # optimizer moments restored bit-exactly

    # only tensors and plain values: loads with weights_only=True
    torch.load(os.path.join(ck, "trainer_state.pt"), weights_only=True)
    with pytest.raises((TypeError, msgspec.EncodeError)):
        resumed.save_checkpoint(str(tmp_path / "bad"), extra={"obj": object()})


def test_push_names_match_hf_files_and_save_hf_round_trips(tmp_path):
    from transformers import AutoModelForCausalLM

    tied = build_tiny_model(str(tmp_path / "tied"), tie_word_embeddings=True, num_layers=1)
    ln = Learner(tied, cfg(), temperature=TEMP)
    pushed = ln.named_tensors_for_push()
    with safe_open(os.path.join(tied, "model.safetensors"), "pt") as f:
        file_keys = set(f.keys())
    assert {n for n, _ in pushed} == file_keys  # tied lm_head not repeated
    assert all(t.is_contiguous() and not t.requires_grad and t.dtype == torch.float32 for _, t in pushed)

    out = ln.save_hf(str(tmp_path / "export"))
    assert os.path.exists(os.path.join(out, "tokenizer.json"))
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    sd = reloaded.state_dict()
    for n, t in pushed:
        assert torch.equal(sd[n], t), n
