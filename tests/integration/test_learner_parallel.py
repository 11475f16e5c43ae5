"""Numerical equivalence of the learner pool on CPU (gloo): for a tiny Qwen2 and a fixed batch of
TrajectoryGroups, the loss, the full gradients (after dp reduction and clipping) and the weights
after one optimizer step under d2, p2 (1F1B and GPipe), t2, d2p2, d2t2 and p2t2 equal a plain
single-process oracle written here (one padded batch, the published loss; fp32, 1e-5) — the weights
read as a push reads them (bucket by bucket, gathered from the shards as it goes). Every
layout with d2 runs three ways: `train.dp_sharding=full` (FSDP2, ZeRO-3; 2-D with TP, each pipeline
stage sharded), `grad_op` (ZeRO-2) and `none` (replicated) — the dp gradient stays a SUM either way.

A second config per layout — GAE with its critic, a KL loss to the frozen reference and two PPO
minibatches (so π_prox is recomputed by a forward-only pass, on a pipeline too) — must give the
same losses, KL, value loss, actor and critic weights as the `Trainer` in one process. The layouts
run it with activation checkpointing (actor and critic) and logits in chunks of 5 tokens; the
one-process run with neither (`train.logits_chunk_tokens=0`): both memory knobs change no number.

Two spawns in all (2 ranks, then 4): each rank builds every layout of its world size in turn on
the same process group, so the test pays the interpreter start-up twice, not once per layout."""

from __future__ import annotations

import contextlib
import datetime
import json
import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from areal_like.api.config import TrainConfig
from areal_like.api.net import free_port
from areal_like.data.tiny_model import build_tiny_model
from areal_like.learner.parallel.spawn import leave_pool, synthetic_groups
from areal_like.api.config import AlgorithmConfig, CriticConfig, RefConfig
from areal_like.learner.lora import LoraSettings
from areal_like.learner.trainer import Trainer
from areal_like.weights.source import gather_in, plan_buckets
from conftest import RANK_START

pytestmark = pytest.mark.integration

TEMP = 0.9
# grad_clip small enough that clipping is active: the clipped gradient checks the global norm too.
# adam_eps=1e-6: Adam's first step is ≈ lr·g/(|g|+eps), which turns float noise of 1e-9 in a gradient
# element of size ~eps into a weight difference of ~lr/4·1e-9/eps — at the default eps=1e-8 that alone
# exceeds 1e-5 for lr=1e-2, whatever the layout (even between thread counts of one process).
CFG = dict(lr=1e-2, grad_clip=0.2, micro_batch_tokens=40, seed=3, behav_imp_weight_cap=2.0, warmup_steps=0,
           adam_eps=1e-6)
# "-full"/"-grad_op": train.dp_sharding (FSDP2 ZeRO-3 / ZeRO-2); "-none": replicated dp; "-offload":
# full with every offload key on (on CPU the host is the device: the wiring runs, no number changes).
LAYOUTS = {2: ["d2-none", "d2-full", "d2-grad_op", "d2-offload", "p2", "p2-gpipe", "t2"],
           4: ["d2p2-none", "d2p2-full", "d2p2-grad_op", "d2t2-none", "d2t2-full", "d2t2-grad_op", "p2t2"]}
EXT_CFG = dict(CFG, ppo_minibatches=2)
EXT_ALG = AlgorithmConfig(adv_estimator="gae", use_kl_loss=True, kl_loss_coef=0.1, lam=0.95)
EXT_KEYS = ("loss", "grad_norm", "kl_ref", "value_loss", "clipfrac", "optimizer_steps", "adv_abs_mean")
# LoRA (model.lora_rank): peft's adapters put in before the parallel strategies; a KL loss to the base
# (the adapter disabled: no reference model) and two minibatches, so the second one runs with B ≠ 0
LORA_LAYOUTS = ["d2-none", "d2-full", "p2", "t2", "d2p2-full", "d2t2-full", "p2t2"]
LORA = LoraSettings(4, 8.0, "all-linear")
LORA_ALG = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1)
LORA_KEYS = ("loss", "grad_norm", "kl_ref", "clipfrac", "optimizer_steps")
def _read_as_a_push_does(ln: Trainer, wire_dtype: torch.dtype | None = None) -> list:
    """The actor's full weights as rank 0's pusher reads them: small buckets, each gathered from
    the shards as it goes while the other ranks serve the gathers from their `leader_ready` wait.
    `wire_dtype`: as a push to servers of that dtype reads them (the shards cast before the gathers)."""
    src = gather_in(ln.weight_source(), wire_dtype)
    out = []
    if ln.layout.rank == 0:
        for idx in plan_buckets(src.meta, 2048):
            out += [(n, t.clone()) for n, t in src.open(idx)]
    ln.layout.leader_ready("finish reading the weights")
    return out


def _save(out_dir: str, name: str, stats: dict, json_suffix: str = "", **files) -> None:
    """Rank 0's results of one run: each of `files` ((name, tensor) lists) as `<name>.<key>.safetensors`, `stats`
    as `<name><json_suffix>.json` (what the tests below read back)."""
    for key, named in files.items():
        save_file({n: t.contiguous() for n, t in named}, os.path.join(out_dir, f"{name}.{key}.safetensors"))
    with open(os.path.join(out_dir, f"{name}{json_suffix}.json"), "w") as f:
        json.dump(stats, f)


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int):
    """This spawned process as rank `rank` of a gloo pool on loopback, one thread; it leaves the pool at the end
    (`leave_pool`: not a plain return, a rank may abort in the interpreter's finalization)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        yield
        leave_pool()
    finally:  # on a failure (leave_pool does not return)
        dist.destroy_process_group()


def _rank_main(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    with gloo_rank(rank, world, port):
        groups = synthetic_groups(7)
        for name in LAYOUTS[world]:
            layout, _, variant = name.partition("-")
            sched = variant if variant == "gpipe" else "1f1b"
            sharding = variant if variant in ("full", "grad_op", "none") else "full"
            off = dict(param_offload=True, optimizer_offload=True) if variant == "offload" else {}
            cfg = TrainConfig(**CFG, pp_schedule=sched, collective_timeout_s=120, dp_sharding=sharding, **off)
            ln = Trainer(model_dir, cfg, layout, temperature=TEMP)
            if variant in ("full", "grad_op") and ln.layout.is_last_stage:  # FSDP: vocabulary rows split over dp
                assert getattr(ln.actor.head, "vocab_parallel", False), name
            st = ln.train_step(groups, version=0)
            grads = ln.named_full_grads()
            weights = _read_as_a_push_does(ln)
            bf16 = _read_as_a_push_does(ln, torch.bfloat16)
            if rank == 0:
                _save(out_dir, name, {k: getattr(st, k) for k in ("loss", "grad_norm", "loss_tokens", "skipped",
                                                                  "clipfrac", "entropy", "behav_w_max")},
                      bf16=bf16, grads=grads, weights=weights)
            del ln
            ext = Trainer(model_dir, TrainConfig(**EXT_CFG, pp_schedule=sched, collective_timeout_s=120,
                                                 logits_chunk_tokens=5, dp_sharding=sharding, **off),
                          layout, temperature=TEMP, algorithm=EXT_ALG, gradient_checkpointing=True,
                          critic=CriticConfig(**off), ref=RefConfig(param_offload=bool(off)))
            st = ext.train_step(groups, version=0)
            weights = ext.full_state()
            critic = ext.critic.gather_full(dict(ext.critic.local))
            if rank == 0:
                _save(out_dir, name, {k: getattr(st, k) for k in EXT_KEYS}, ".ext", ext=weights, critic=critic)
            del ext
            if name not in LORA_LAYOUTS:
                continue
            lo = Trainer(model_dir, TrainConfig(**EXT_CFG, pp_schedule=sched, collective_timeout_s=120,
                                                logits_chunk_tokens=5, dp_sharding=sharding), layout,
                         temperature=TEMP, algorithm=LORA_ALG, gradient_checkpointing=True, lora=LORA)
            assert lo.ref is None and lo.ref_is_base  # no reference model built
            st = lo.train_step(groups, version=0)
            adapter = _read_as_a_push_does(lo)
            base = [(n, t) for n, t in lo.full_state() if "lora_" not in n]
            if rank == 0:
                _save(out_dir, name, {k: getattr(st, k) for k in LORA_KEYS}, ".lora", lora=adapter, lora_base=base)
            del lo


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # untied embeddings (pipeline split), 4 layers so p2 has 2 per stage, GQA 4 heads / 2 kv heads
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), hidden_size=32, intermediate_size=64,
                            num_layers=4, num_heads=4, num_kv_heads=2, seed=0)


def oracle_step(model_dir: str, cfg: TrainConfig, groups):
    """One decoupled-PPO step the plainest way: one padded batch, GRPO advantages, the loss of
    DESIGN invariant 5 over all loss tokens, clip, AdamW. Returns (stats, clipped grads, weights)."""
    from transformers import AutoModelForCausalLM

    from areal_like.learner.algorithms import decoupled_ppo_loss, entropy_from_logits, grpo_advantages
    from areal_like.learner.logprobs import token_logprobs_from_logits

    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples = [t for g in groups for t in g.trajectories]
    gidx = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([len(g.trajectories) for g in groups]))
    adv_N = grpo_advantages(torch.tensor([t.reward for t in samples], dtype=torch.float64), gidx)
    T = max(t.num_tokens for t in samples)
    ids = torch.zeros(len(samples), T, dtype=torch.long)
    mask, behav = torch.zeros(len(samples), T), torch.zeros(len(samples), T)
    for b, t in enumerate(samples):
        n = t.num_tokens
        ids[b, :n] = torch.from_numpy(t.ids_np().astype("int64"))
        mask[b, :n] = torch.from_numpy(t.mask_np().astype("float32"))
        behav[b, :n] = torch.from_numpy(t.logprobs_np().copy())
    m = mask[:, 1:]
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    logp = token_logprobs_from_logits(logits, ids[:, 1:], TEMP)
    loss, st = decoupled_ppo_loss(logp, logp.detach(), behav[:, 1:], adv_N.float()[:, None] * m, m,
                                  eps_clip_low=cfg.eps_clip_low, eps_clip_high=cfg.eps_clip_high,
                                  behav_imp_weight_cap=cfg.behav_imp_weight_cap)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay)
    opt.step()
    ent = (entropy_from_logits(logits.detach(), TEMP) * m).sum() / m.sum()
    stats = {"loss": float(loss.detach()), "grad_norm": float(norm), "loss_tokens": int(m.sum()), "clipfrac": float(st["clipfrac"]),
             "entropy": float(ent), "behav_w_max": float(st["behav_w_max"])}
    persistent = set(model.state_dict())
    weights = {n: p.detach() for n, p in model.named_parameters()}
    weights.update({n: b for n, b in model.named_buffers() if n in persistent})
    return stats, grads, weights


@pytest.fixture(scope="module")
def reference(model_dir):
    """Single-process oracle: loss, clipped full gradients, weights after the step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks; restored below (process-global)
    try:
        st, grads, weights = oracle_step(model_dir, TrainConfig(**CFG), synthetic_groups(7))
    finally:
        torch.set_num_threads(threads)
    assert st["grad_norm"] > CFG["grad_clip"]  # clipping is active
    return st, grads, weights


def one_process_step(model_dir, **kw) -> tuple[Trainer, dict]:
    """One step of the extended config by the Trainer in this process, on one thread as the ranks run
    (restored after: process-global)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ln = Trainer(model_dir, TrainConfig(**EXT_CFG, logits_chunk_tokens=0), None, temperature=TEMP, **kw)
        return ln, ln.train_step(synthetic_groups(7), version=0)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ext_reference(model_dir):
    """The extended config (critic, reference, minibatches) by the Trainer in one process."""
    ln, st = one_process_step(model_dir, algorithm=EXT_ALG)
    return st, dict(ln.full_state()), dict(ln.critic.gather_full(dict(ln.critic.local)))


def spawn_pools(rank_main, model, out: str) -> str:
    """`rank_main(rank, world, port, model, out)` on a pool of 2 ranks, then on one of 4; returns `out`."""
    for world in (2, 4):
        mp.start_processes(rank_main, args=(world, free_port(), model, out), nprocs=world, join=True,
                           start_method=RANK_START)
    return out


@pytest.fixture(scope="module")
def parallel_runs(model_dir, tmp_path_factory):
    return spawn_pools(_rank_main, model_dir, str(tmp_path_factory.mktemp("par")))


@pytest.mark.parametrize("layout", LAYOUTS[2] + LAYOUTS[4])
def test_one_step_matches_single_process(layout, reference, parallel_runs):
    ref_st, ref_grads, ref_weights = reference
    with open(os.path.join(parallel_runs, f"{layout}.json")) as f:
        st = json.load(f)
    assert not st["skipped"]
    assert st["loss_tokens"] == ref_st["loss_tokens"]
    for k in ("loss", "grad_norm", "clipfrac", "entropy", "behav_w_max"):
        assert st[k] == pytest.approx(ref_st[k], abs=1e-5, rel=1e-5), k
    grads = load_file(os.path.join(parallel_runs, f"{layout}.grads.safetensors"))
    weights = load_file(os.path.join(parallel_runs, f"{layout}.weights.safetensors"))
    assert set(grads) == set(ref_grads)
    assert list(weights) and set(weights) == set(ref_weights)
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"grad {n}: {m}")
    for n in ref_weights:
        torch.testing.assert_close(weights[n], ref_weights[n], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, n=n: f"weight {n}: {m}")
    # a push to bf16 servers gathers the shards cast to bf16 (issue 40 item 7): the same values as the fp32
    # read cast afterwards, bit for bit, in half the bytes
    bf16 = load_file(os.path.join(parallel_runs, f"{layout}.bf16.safetensors"))
    assert set(bf16) == set(weights)
    for n, t in weights.items():
        assert bf16[n].dtype == (torch.bfloat16 if t.is_floating_point() else t.dtype), n
        assert torch.equal(bf16[n], t.to(bf16[n].dtype)), n


@pytest.mark.parametrize("layout", LAYOUTS[2] + LAYOUTS[4])
def test_critic_reference_and_minibatches_match_single_process(layout, ext_reference, parallel_runs):
    assert_ext_matches(parallel_runs, layout, *ext_reference)


def assert_ext_matches(parallel_runs: str, name: str, ref_st, ref_weights: dict, ref_critic: dict) -> None:
    """The extended config's stats, actor and critic of run `name` are the one-process Trainer's."""
    assert ref_st.optimizer_steps == 2 and ref_st.kl_ref > 0 and ref_st.value_loss > 0
    with open(os.path.join(parallel_runs, f"{name}.ext.json")) as f:
        st = json.load(f)
    for k in EXT_KEYS:
        assert st[k] == pytest.approx(getattr(ref_st, k), abs=1e-5, rel=1e-5), k
    for fname, ref in (("ext", ref_weights), ("critic", ref_critic)):
        assert_tensors_match(os.path.join(parallel_runs, f"{name}.{fname}.safetensors"), ref, fname)


def assert_tensors_match(path: str, ref: dict, what: str) -> None:
    """The tensors a rank saved at `path` are `ref`'s, by name, to 1e-5."""
    got = load_file(path)
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"{what} {n}: {m}")


@pytest.fixture(scope="module")
def lora_reference(model_dir):
    """The LoRA config by the Trainer in one process: stats and the adapter after the step."""
    ln, st = one_process_step(model_dir, algorithm=LORA_ALG, lora=LORA)
    return st, dict(ln.full_state())


@pytest.mark.parametrize("layout", LORA_LAYOUTS)
def test_lora_matches_single_process(layout, lora_reference, parallel_runs, model_dir):
    """The adapter a push reads (its tensors alone), the loss, the KL to the base and the gradient
    norm equal the one-process LoRA learner's; the base weights stay the checkpoint's."""
    ref_st, ref_state = lora_reference
    assert ref_st.optimizer_steps == 2 and ref_st.kl_ref > 0
    with open(os.path.join(parallel_runs, f"{layout}.lora.json")) as f:
        st = json.load(f)
    for k in LORA_KEYS:
        assert st[k] == pytest.approx(getattr(ref_st, k), abs=1e-5, rel=1e-5), k
    adapter = load_file(os.path.join(parallel_runs, f"{layout}.lora.safetensors"))
    ref_adapter = {n: t for n, t in ref_state.items() if "lora_" in n}
    assert set(adapter) == set(ref_adapter) and len(adapter) == 4 * 7 * 2  # 4 layers × 7 linears × (A, B)
    for n, t in ref_adapter.items():
        torch.testing.assert_close(adapter[n], t, atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"adapter {n}: {m}")
    assert any(t.abs().max() > 0 for n, t in adapter.items() if ".lora_B." in n)  # trained away from B = 0
    base = load_file(os.path.join(parallel_runs, f"{layout}.lora_base.safetensors"))
    original = load_file(os.path.join(model_dir, "model.safetensors"))
    assert set(base) == set(original)
    for n, t in original.items():
        assert torch.equal(base[n], t), f"base weight {n} changed"
