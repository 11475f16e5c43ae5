"""Mixed precision of the learner (issue 25 item 3): `model.dtype` is the compute dtype; the master
weights, gradient reduction and AdamW state are `train.master_dtype` (float32 by default). On the
tiny Qwen2 in bf16, d1p1t1, CPU: tiny updates that a bf16 master rounds away accumulate in the fp32
master; the state's dtypes; pushes and checkpoints carry the fp32 master (resume is bit-exact); a
pure-bf16 checkpoint (what earlier builds wrote) still loads; bad combinations are refused."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from areal_like.api.config import ConfigError, TrainConfig, load_config
from areal_like.api.trajectory import Trajectory, TrajectoryGroup
from areal_like.data.tiny_model import build_tiny_model
from areal_like.learner.checkpoint import export_hf, load_checkpoint, save_checkpoint
from areal_like.learner.trainer import Trainer

TEMP = 0.9


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), seed=0)


def cfg(**kw) -> TrainConfig:
    base = dict(lr=3e-4, grad_clip=1.0, micro_batch_tokens=4096, seed=3, behav_imp_weight_cap=5.0)
    base.update(kw)
    return TrainConfig(**base)


def groups(seed: int = 1, n_groups: int = 3, n: int = 4, gen_len: int = 3) -> list[TrajectoryGroup]:
    """Fixed random rollouts with rewards 0/1 alternating inside each group (every group has signal)."""
    rng = np.random.default_rng(seed)
    out = []
    for gi in range(n_groups):
        prompt = [1] + rng.integers(4, 30, size=3).tolist()
        trajs = [Trajectory.build(traj_id=f"g{gi}-{k}", group_id=f"g{gi}", prompt_id=f"p{gi}", prompt_ids=prompt,
                                  output_ids=rng.integers(4, 30, size=gen_len).tolist(),
                                  output_logprobs=np.full(gen_len, -3.0, np.float32), output_versions=[0] * gen_len,
                                  reward=float(k % 2), finish_reason="length") for k in range(n)]
        out.append(TrajectoryGroup(group_id=f"g{gi}", prompt_id=f"p{gi}", trajectories=trajs, created_at=0.0))
    return out


def hf(ln: Trainer):
    return ln.actor.stage_module.hf


def norm_gains(ln: Trainer) -> torch.Tensor:
    """Every RMSNorm gain of the bf16 model (initialised to exactly 1.0)."""
    return torch.cat([p.detach().float().reshape(-1) for n, p in hf(ln).named_parameters() if "norm" in n])


def test_fp32_master_accumulates_updates_a_bf16_master_rounds_away(model_dir, caplog):
    """lr 3e-4: each AdamW update of a norm gain (1.0) is below half a bf16 ulp at 1.0 (2^-9 ≈ 2e-3).
    A bf16 master rounds every one of them away, so the gains never move; the default fp32 master
    accumulates them and the bf16 model the servers get moves. (Before the fix, model.dtype=bfloat16
    meant a bf16 master: seen failing at `moved >= 10` with 0 gains moved.)"""
    batch = groups()
    caplog.set_level(logging.INFO, logger="areal_like.learner.trainer")
    mixed = Trainer(model_dir, cfg(), temperature=TEMP, dtype="bfloat16")  # train.master_dtype default
    assert "learner precision: compute bfloat16, master float32, grad reduce float32, AdamW state float32" \
        in caplog.text
    assert "pure bfloat16 optimizer" not in caplog.text
    caplog.clear()
    pure = Trainer(model_dir, cfg(master_dtype="bfloat16"), temperature=TEMP, dtype="bfloat16")
    assert "train.master_dtype=bfloat16: pure bfloat16 optimizer" in caplog.text  # never silent
    assert torch.equal(norm_gains(mixed), torch.ones_like(norm_gains(mixed)))
    for step in range(12):
        assert not mixed.train_step(batch, version=step).skipped
        assert not pure.train_step(batch, version=step).skipped
    moved = (norm_gains(mixed) != 1.0).sum().item()
    assert moved >= 10, moved  # the fp32 master's updates reached the model (40 of 320 gains here)
    master_gains = torch.cat([m.detach().reshape(-1) for n, m in mixed.actor.master_by_name.items() if "norm" in n])
    assert (master_gains - 1.0).abs().max() > 2 ** -9  # past half a bf16 ulp: sums of updates each below it
    assert torch.equal(norm_gains(pure), torch.ones_like(norm_gains(pure)))  # rounded away, every step

    # the state: bf16 model, fp32 master and AdamW moments (and fp32 reduced grads), one per parameter
    assert all(p.dtype == torch.bfloat16 and p.grad is None for p in mixed.actor.params)
    opt = mixed.actor.optimizer
    assert [p for g in opt.param_groups for p in g["params"]] == mixed.actor.master
    assert len(mixed.actor.master) == len(mixed.actor.params)
    for m in mixed.actor.master:
        assert m.dtype == torch.float32 and m.grad is not None and m.grad.dtype == torch.float32
        assert opt.state[m]["exp_avg"].dtype == opt.state[m]["exp_avg_sq"].dtype == torch.float32
    # the model is the master rounded once to bf16
    for p, m in zip(mixed.actor.params, mixed.actor.master):
        assert torch.equal(p, m.detach().to(torch.bfloat16))
    # pure bf16 keeps today's state: no master copy, bf16 AdamW moments
    assert pure.actor.master == [] and pure.precision_policy.startswith("compute bfloat16, master bfloat16")
    p0 = pure.actor.params[0]
    assert pure.actor.optimizer.state[p0]["exp_avg"].dtype == torch.bfloat16


def test_fp32_model_has_no_extra_copy(model_dir):
    ln = Trainer(model_dir, cfg(), temperature=TEMP)
    assert ln.actor.master == [] and ln.actor.opt_params == ln.actor.params
    assert ln.precision_policy == "compute float32, master float32, grad reduce float32, AdamW state float32"


def test_push_and_export_read_the_fp32_master(model_dir, tmp_path):
    ln = Trainer(model_dir, cfg(lr=1e-3), temperature=TEMP, dtype="bfloat16")
    ln.train_step(groups(), version=0)
    pushed = dict(ln.full_state())
    master = {n: m.detach() for n, m in ln.actor.master_by_name.items()}
    assert set(master) <= set(pushed)
    for n, m in master.items():
        assert pushed[n].dtype == torch.float32 and torch.equal(pushed[n], m), n
    # the master is not the bf16 model: pushing the model would round once more before server.dtype
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in master.values())
    grads = dict(ln.named_full_grads())
    assert grads and all(g.dtype == torch.float32 for g in grads.values())
    from safetensors import safe_open

    out = export_hf(ln, str(tmp_path / "hf"))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:  # an HF model dir in model.dtype
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_checkpoint_keeps_the_fp32_master(model_dir, tmp_path, estimator):
    from areal_like.api.config import AlgorithmConfig

    alg = AlgorithmConfig(adv_estimator=estimator)
    make = lambda: Trainer(model_dir, cfg(lr=1e-3, ppo_minibatches=2), temperature=TEMP,  # noqa: E731
                           dtype="bfloat16", algorithm=alg)
    batches = [groups(seed=s) for s in (1, 2, 3)]
    ref = make()
    ref_stats = [ref.train_step(b, version=i) for i, b in enumerate(batches)]
    first = make()
    for i, b in enumerate(batches[:2]):
        first.train_step(b, version=i)
    ck = save_checkpoint(first, str(tmp_path / "ckpt"))
    meta = json.load(open(os.path.join(ck, "meta.json")))
    assert meta["master_dtype"] == "float32" and meta["model_dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(os.path.join(ck, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.float32  # the master, not the bf16 copy
    resumed = make()
    load_checkpoint(resumed, ck)
    shards = [(resumed.actor, first.actor)] + ([(resumed.critic, first.critic)] if estimator == "gae" else [])
    for got, want in shards:
        for a, b in zip(got.master, want.master):
            assert torch.equal(a, b)  # the fp32 master itself, not the bf16 model upcast
        for a, b in zip(got.params, want.params):
            assert torch.equal(a, b)
    st = resumed.train_step(batches[2], version=2)
    assert st.loss == ref_stats[2].loss and st.grad_norm == ref_stats[2].grad_norm
    assert st.value_loss == ref_stats[2].value_loss
    for a, b in zip(resumed.actor.master, ref.actor.master):
        assert torch.equal(a, b)  # AdamW moments restored in fp32, bit-exactly


def test_a_pure_bf16_checkpoint_of_earlier_builds_loads_into_an_fp32_master(model_dir, tmp_path, caplog):
    """Earlier builds with model.dtype=bfloat16 wrote bf16 weights and bf16 AdamW moments and no
    master_dtype in meta.json: such a checkpoint loads (upcast, lossless), with a warning."""
    old = Trainer(model_dir, cfg(lr=1e-3, master_dtype="bfloat16"), temperature=TEMP, dtype="bfloat16")
    old.train_step(groups(), version=0)
    ck = save_checkpoint(old, str(tmp_path / "old"))
    meta_path = os.path.join(ck, "meta.json")
    meta = json.load(open(meta_path))
    del meta["master_dtype"], meta["model_dtype"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    caplog.set_level(logging.WARNING, logger="areal_like.learner.checkpoint")
    new = Trainer(model_dir, cfg(lr=1e-3), temperature=TEMP, dtype="bfloat16")
    load_checkpoint(new, ck)
    assert "written before train.master_dtype" in caplog.text
    for p_old, m in zip(old.actor.params, new.actor.master):
        assert m.dtype == torch.float32 and torch.equal(m, p_old.float())
    for m in new.actor.master:
        assert new.actor.optimizer.state[m]["exp_avg"].dtype == torch.float32
    assert not new.train_step(groups(seed=2), version=1).skipped


def test_master_dtype_combinations(model_dir):
    assert load_config(None, ["model.dtype=bfloat16"]).train.master_dtype == "float32"  # the default
    load_config(None, ["model.dtype=bfloat16", "train.master_dtype=bfloat16"])  # pure bf16, asked for
    with pytest.raises(ConfigError, match="train.master_dtype"):
        load_config(None, ["model.dtype=bfloat16", "train.master_dtype=float16"])
    with pytest.raises(ConfigError, match="train.master_dtype"):
        load_config(None, ["train.master_dtype=bfloat16"])  # a bf16 master under fp32 compute
    with pytest.raises(ValueError, match="train.master_dtype"):
        Trainer(model_dir, cfg(master_dtype="float16"), temperature=TEMP, dtype="bfloat16")


def test_micro_batch_gradients_accumulate_in_fp32(model_dir, monkeypatch):
    """Many micro-batches: each one's bf16 gradient is added into the master's fp32 `.grad` as soon as
    backward makes it (the bf16 one freed), so the accumulated gradient is the exact fp32 sum — not
    a bf16 running sum rounded after every micro-batch."""
    from areal_like.learner.parallel.sharded_model import ShardedModel

    ln = Trainer(model_dir, cfg(micro_batch_tokens=24), temperature=TEMP, dtype="bfloat16")
    seen: dict[int, list[torch.Tensor]] = {}
    orig = ShardedModel._grad_to_master

    def record(p, m):
        if p.grad is not None:
            seen.setdefault(id(m), []).append(p.grad.detach().clone())
        orig(p, m)

    monkeypatch.setattr(ShardedModel, "_grad_to_master", staticmethod(record))
    at_reduce = {}

    def capture():
        assert all(p.grad is None for p in ln.actor.params)  # no bf16 gradient left on the model
        at_reduce.update({id(m): m.grad.detach().clone() for m in ln.actor.master})

    monkeypatch.setattr(ln.actor.reducer, "all_reduce_grads", capture)
    ln.train_step(groups(n_groups=4), version=0)
    n_micro = max(len(v) for v in seen.values())
    assert n_micro >= 3, n_micro
    rounded_differs = False
    for m in ln.actor.master:
        parts = seen[id(m)]
        fp32_sum, bf16_sum = parts[0].float(), parts[0]
        for g in parts[1:]:
            fp32_sum = fp32_sum + g.float()
            bf16_sum = bf16_sum + g
        assert at_reduce[id(m)].dtype == torch.float32 and torch.equal(at_reduce[id(m)], fp32_sum)
        rounded_differs |= not torch.equal(bf16_sum.float(), fp32_sum)
    assert rounded_differs  # a bf16 accumulation would have lost bits: the test can tell them apart
