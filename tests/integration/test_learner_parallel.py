"""Numerical equivalence of the learner pool on CPU (gloo): for a tiny Qwen2 and a fixed batch of
TrajectoryGroups, the loss, the full gradients (after dp reduction and clipping) and the weights
after one optimizer step under d2, p2 (1F1B and GPipe), t2, d2p2, d2t2 and p2t2 equal the
single-process `Learner`'s (fp32, 1e-5).

Two spawns in all (2 ranks, then 4): each rank builds every layout of its world size in turn on
the same process group, so the test pays the interpreter start-up twice, not once per layout."""

from __future__ import annotations

import datetime
import json
import os

import msgspec
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from areal_like.api.config import TrainConfig
from areal_like.data.tiny_model import build_tiny_model
from areal_like.learner.parallel.spawn import synthetic_groups
from areal_like.learner.trainer import Learner

pytestmark = pytest.mark.integration

TEMP = 0.9
# grad_clip small enough that clipping is active: the clipped gradient checks the global norm too.
# adam_eps=1e-6: Adam's first step is ≈ lr·g/(|g|+eps), which turns float noise of 1e-9 in a gradient
# element of size ~eps into a weight difference of ~lr/4·1e-9/eps — at the default eps=1e-8 that alone
# exceeds 1e-5 for lr=1e-2, whatever the layout (even between thread counts of one process).
CFG = dict(lr=1e-2, grad_clip=0.2, micro_batch_tokens=40, seed=3, behav_imp_weight_cap=2.0, warmup_steps=0,
           adam_eps=1e-6)
LAYOUTS = {2: ["d2", "p2", "p2-gpipe", "t2"], 4: ["d2p2", "d2t2", "p2t2"]}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist

    from areal_like.learner.parallel import ParallelLearner

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        groups = synthetic_groups(7)
        for name in LAYOUTS[world]:
            layout, _, sched = name.partition("-")
            cfg = TrainConfig(**CFG, pp_schedule=sched or "1f1b", collective_timeout_s=120)
            ln = ParallelLearner(model_dir, cfg, layout, temperature=TEMP)
            st = ln.train_step(groups, version=0)
            grads = ln.named_full_grads()
            weights = ln.named_tensors_for_push()
            if rank == 0:
                save_file({n: t.contiguous() for n, t in grads}, os.path.join(out_dir, f"{name}.grads.safetensors"))
                save_file({n: t.contiguous() for n, t in weights}, os.path.join(out_dir, f"{name}.weights.safetensors"))
                with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
                    json.dump({k: st[k] for k in ("loss", "grad_norm", "loss_tokens", "skipped", "clipfrac",
                                                  "entropy", "behav_w_max")}, f)
            del ln
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    # untied embeddings (pipeline split), 4 layers so p2 has 2 per stage, GQA 4 heads / 2 kv heads
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), hidden_size=32, intermediate_size=64,
                            num_layers=4, num_heads=4, num_kv_heads=2, seed=0)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Single-process run: loss, clipped full gradients, weights after the step."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks; restored below (process-global)
    ln = Learner(model_dir, TrainConfig(**CFG), temperature=TEMP)
    grads: dict[str, torch.Tensor] = {}
    orig = ln.optimizer.step

    def step(*a, **k):
        grads.update({n: p.grad.detach().clone() for n, p in ln.model.named_parameters() if p.grad is not None})
        return orig(*a, **k)

    ln.optimizer.step = step  # snapshot the clipped gradient right before it is applied
    try:
        st = ln.train_step(synthetic_groups(7), version=0)
    finally:
        torch.set_num_threads(threads)
    assert not st["skipped"] and st["grad_norm"] > CFG["grad_clip"]  # clipping is active
    return st, grads, dict(ln.named_tensors_for_push())


@pytest.fixture(scope="module")
def parallel_runs(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("par"))
    for world in (2, 4):
        mp.start_processes(_rank_main, args=(world, _free_port(), model_dir, out), nprocs=world, join=True,
                           start_method="spawn")
    return out


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
