"""Issue 43 item 2: a critic on a pool of its own (`fsdp[critic]:d2` in the allocation). The actor's `Trainer`
(one process here) asks a real two-rank critic pool (learner/critic_pool.py: its own gloo world, FSDP2 over
its dp=2 or a two-stage pipeline; the TCPStore line of learner/critic_link.py) for V_old and sends it the returns; the numbers must
be those of the critic trained inside the actor's process — GAE unchanged, the same value losses, the same
actor losses. The checkpoint holds both pools' parts (the critic's under `critic_pool/`), is verified as one,
and a fresh critic pool resumed from it continues exactly where the reference does.

Through `launcher run` (a critic pool learning the demo, killed and restarted with the learner pool):
tests/integration/test_critic_pool_run.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from areal_like.api.config import encode_config, load_config
from areal_like.api.net import free_port
from areal_like.learner.checkpoint import CRITIC_POOL_DIR, CheckpointManager, verify_checkpoint
from areal_like.learner.critic_link import CriticLink, CriticLinkError
from areal_like.learner.parallel.spawn import synthetic_groups
from areal_like.learner.trainer import Trainer
from conftest import RANK_START

pytestmark = pytest.mark.integration

OVERRIDES = ["algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.lr=1e-2", "train.lr=1e-2",
             "train.ppo_minibatches=2", "train.micro_batch_tokens=40", "train.seed=3", "train.warmup_steps=0",
             "train.adam_eps=1e-6", "train.grad_clip=0.2", "critic.timeout_s=120", "train.collective_timeout_s=120"]
STEPS = 4  # the reference's; the pool trains 3, checkpoints, and a fresh pool resumed from it trains the 4th
KEYS = ("loss", "grad_norm", "value_loss", "critic_grad_norm", "adv_abs_mean")


def _critic_rank(rank: int, world: int, master_port: int, link_port: int, run_dir: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(master_port), "GLOO_SOCKET_IFNAME": "lo"})
    torch.set_num_threads(1)
    from areal_like.learner.critic_pool import run
    from areal_like.learner.parallel.spawn import exit_rank

    exit_rank(run(run_dir, 0, link_port, "cpu"))


def _start_pool(run_dir: str, world: int = 2):
    master, link = free_port(), free_port()
    ctx = mp.start_processes(_critic_rank, args=(world, master, link, run_dir), nprocs=world, join=False,
                             start_method=RANK_START)
    return ctx, CriticLink.connect("127.0.0.1", link, timeout_s=120)


def _end_pool(ctx) -> None:
    """The pool's ranks end on `stop`; any still alive (a failed test) are killed."""
    ctx.join(timeout=60)
    for p in ctx.processes:
        if p.is_alive():
            p.kill()


def _stats(st) -> dict:
    return {k: getattr(st, k) for k in KEYS}


@pytest.mark.parametrize("critic", ["fsdp[critic]:d2", "megatron[critic]:p2"])
def test_a_critic_pool_trains_as_the_critic_inside_the_actor_and_resumes_from_the_checkpoint(tmp_path, tiny_model_dir,
                                                                                              critic):
    """`critic`: the critic pool (FSDP2 over dp=2; a two-stage pipeline), against the one-process critic."""
    torch.set_num_threads(1)
    cfg = load_config(None, [f"model.path={tiny_model_dir}", *OVERRIDES,
                             f"allocation=embedded[rollout]:d1+fsdp[actor]:d1+{critic}"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_bytes(encode_config(cfg))
    batches = [synthetic_groups(seed=s, n_groups=3, n=4) for s in range(STEPS)]

    ref_cfg = load_config(None, [f"model.path={tiny_model_dir}", *OVERRIDES])  # the critic inside the actor
    ref = Trainer.from_config(ref_cfg, None)
    assert ref.critic is not None and not ref.critic_pool
    expected = [_stats(ref.train_step(g, version=v)) for v, g in enumerate(batches)]

    actor = Trainer.from_config(cfg, None)
    assert actor.critic is None and actor.critic_pool
    ctx, actor.remote_critic = _start_pool(str(run_dir))
    ckpt = CheckpointManager(str(run_dir / "checkpoints"), save_freq=3)
    try:
        actor.remote_critic.send("start", checkpoint=None)
        assert actor.remote_critic.recv("started", timeout_s=120, what="start")["step"] == 0
        got = [_stats(actor.train_step(g, version=v)) for v, g in enumerate(batches[:3])]
        path = ckpt.save(actor, 3)
        actor.remote_critic.send("stop")
    finally:
        _end_pool(ctx)
    for step, (g, e) in enumerate(zip(got, expected), 1):
        for k in KEYS:  # two ranks against one process: sums in another order
            assert g[k] == pytest.approx(e[k], rel=1e-4, abs=1e-6), (step, k, g, e)
    assert all(e["value_loss"] > 0 for e in expected[1:])

    # one checkpoint, both pools' parts, verified together
    assert os.path.isfile(os.path.join(path, CRITIC_POOL_DIR, "critic.safetensors"))
    assert verify_checkpoint(path) is None
    victim = os.path.join(path, CRITIC_POOL_DIR, "critic.safetensors")
    data = bytearray(open(victim, "rb").read())
    data[-1] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    assert f"{CRITIC_POOL_DIR}/: critic.safetensors does not match its sha256" in verify_checkpoint(path)
    data[-1] ^= 0xFF
    open(victim, "wb").write(bytes(data))

    # both pools restarted: the actor resumes, the fresh critic pool loads its part, step 4 is the reference's
    actor2 = Trainer.from_config(cfg, None)
    ckpt.resume(actor2, log=lambda *_: None)
    assert ckpt.resumed_from == path and actor2.step == 3
    ctx, actor2.remote_critic = _start_pool(str(run_dir))
    try:
        actor2.remote_critic.send("start", checkpoint=ckpt.resumed_from)
        assert actor2.remote_critic.recv("started", timeout_s=120, what="start")["step"] == 3
        fourth = _stats(actor2.train_step(batches[3], version=3))
        actor2.remote_critic.send("stop")
    finally:
        _end_pool(ctx)
    for k in KEYS:
        assert fourth[k] == pytest.approx(expected[3][k], rel=1e-4, abs=1e-6), (k, fourth, expected[3])


def test_the_actor_names_a_critic_pool_that_does_not_answer(tmp_path):
    """No critic pool behind the port: the actor's wait ends at critic.timeout_s with the peer named."""
    port = free_port()
    with pytest.raises(CriticLinkError, match=r"cannot reach the critic pool's rank 0 .*\(critic.timeout_s\)"):
        CriticLink.connect("127.0.0.1", port, timeout_s=1)
    # a pool that is up but never answers a request
    host = CriticLink.host("127.0.0.1", port, timeout_s=5)
    actor = CriticLink.connect("127.0.0.1", port, timeout_s=5)
    actor.send("values", step=1, groups=b"")
    assert host.recv(("values",), timeout_s=5, what="send a request")["step"] == 1
    with pytest.raises(CriticLinkError, match=r"did not send step 1's values within 1 s \(critic.timeout_s"):
        actor.recv("values", timeout_s=1, what="send step 1's values")
