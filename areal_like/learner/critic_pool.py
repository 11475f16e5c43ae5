"""A critic on a pool of its own (issue 43 item 2): the process of each rank of the allocation's critic
component (`fsdp[critic]:d2`, separate with `+` or co-located with the actor by `|`), as AReaL places one.

The pool is SPMD like the actor's (its own torch.distributed world, its own DP×PP×TP layout, FSDP2 over
its dp ranks) and trains the value model alone. It has no loop of its own: the actor's step drives it
through rank 0's `CriticLink` (learner/critic_link.py), and every rank here answers in the same order:

    start     load the critic's part of the checkpoint the actor resumed from (`critic_pool/` inside it),
              or keep the fresh value model
    values    the step's groups → V_old of every sample (this pool's dp shares, gathered on rank 0)
    train     that step's returns (GAE, computed by the actor from those values) → ppo_epochs ×
              ppo_minibatches optimizer steps of the critic in the actor's minibatch order, while the
              actor trains its own; the stats go back for the step's metrics row
    save      the critic's checkpoint into the actor's checkpoint being written (the actor publishes both
              at once: one checkpoint, one `latest`, exactly-once commits unchanged)
    stop      leave the pool

GAE itself is unchanged: the actor computes advantages and returns from these values exactly as it does
with the critic inside its own ranks. A dead rank of either pool restarts both (launcher/run.py): the
actor resumes from its checkpoint and sends `start` with it, so the two are always at the same step.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import msgspec

from areal_like.api.config import decode_config

_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(dict[str, Any])
OPS = ("start", "values", "train", "save", "stop")


def log(msg: str) -> None:
    print(f"[critic] {msg}", flush=True)


def critic_component(allocation: str):
    """The allocation's critic component, or None."""
    from allocation import parse_allocation

    return next((c for c in parse_allocation(allocation).training_components if c.role == "critic"), None)


def run(run_dir: str, incarnation: int, link_port: int, device: str) -> int:
    import torch

    from areal_like.api.trajectory import TrajectoryGroup
    from areal_like.learner.checkpoint import CRITIC_POOL_DIR, load_checkpoint, save_checkpoint, verify_checkpoint
    from areal_like.learner.critic_link import CriticLink, bytes_to_arrays, gather_samples
    from areal_like.learner.parallel import LayoutSpec
    from areal_like.learner.parallel.broadcast import broadcast_bytes
    from areal_like.learner.parallel.spawn import init_pool_from_env
    from areal_like.learner.trainer import Trainer

    with open(os.path.join(run_dir, "config.json"), "rb") as f:
        cfg = decode_config(f.read())
    torch.set_num_threads(cfg.train.torch_threads)
    rank = init_pool_from_env(cfg.train.collective_timeout_s, device)
    comp = critic_component(cfg.allocation)
    if comp is None:
        log(f"allocation {cfg.allocation!r} has no critic component: nothing for a critic pool to do")
        return 2
    trainer = Trainer.from_config(cfg, LayoutSpec.from_component(comp), device=device, role="critic")
    L = trainer.layout
    link = None
    if rank == 0:
        link = CriticLink.host(os.environ["MASTER_ADDR"], link_port, timeout_s=cfg.critic.timeout_s)
        log(f"critic pool {comp.backend}[{comp.name}]: layout {L.spec}, {trainer.sharding_policy}; "
            f"incarnation {incarnation}, waiting for the actor at {link.address}")
    groups: list | None = None
    values: dict = {}
    group_dec = msgspec.msgpack.Decoder(list[TrajectoryGroup])
    while True:
        raw = None
        if rank == 0:
            msg = link.recv(OPS, timeout_s=None, what="send its next request")
            raw = _ENC.encode(msg)
        # the followers wait for rank 0's next request outside any collective (the actor may wait long for data)
        L.leader_ready("receive the actor's next request")
        msg = _DEC.decode(broadcast_bytes(raw, L))
        op = msg["op"]
        try:
            if op == "start":
                path = msg.get("checkpoint")
                if path:
                    part = os.path.join(path, CRITIC_POOL_DIR)
                    err = verify_checkpoint(part, L.rank, L.world_size)
                    if err is not None:
                        raise RuntimeError(f"the critic's part of checkpoint {path} is unusable: {err}")
                    load_checkpoint(trainer, part)
                reply: dict[str, Any] = {"step": trainer.step}
                if rank == 0:
                    log(f"critic pool: {'resumed from ' + path if path else 'fresh'} at step {trainer.step}")
            elif op == "values":
                groups = group_dec.decode(msg["groups"])
                values = trainer.critic_values(groups)
                blobs = gather_samples(values, sum(len(g.trajectories) for g in groups), L, "values")
                reply = {"values": blobs} if rank == 0 else {}
            elif op == "train":
                if groups is None:
                    raise RuntimeError(f"asked to train step {msg.get('step')} before any values were asked for")
                returns = bytes_to_arrays(msg["returns"])
                losses, norms, lr = trainer.critic_train(groups, values, returns)
                trainer.version = int(msg.get("version", trainer.version))
                reply = {"value_losses": losses, "grad_norms": norms, "lr": lr}
                groups, values = None, {}
            elif op == "save":
                save_checkpoint(trainer, msg["path"])
                reply = {}
            else:  # stop
                reply = {}
        except Exception as e:
            if rank == 0:
                link.send("error", message=f"{op}: {type(e).__name__}: {e}")
            raise
        if op == "stop":  # no answer: the actor does not wait for one (this rank's store ends with it)
            break
        if rank == 0:
            link.send({"start": "started", "values": "values", "train": "trained", "save": "saved"}[op], **reply)
    trainer.barrier()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_like.learner.critic_pool")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--incarnation", type=int, default=0, help="how many times the launcher restarted the pools")
    p.add_argument("--link-port", type=int, required=True, help="rank 0's port for the actor's requests")
    p.add_argument("--device", required=True, help="torch device of this rank")
    a = p.parse_args(argv)
    from areal_like.api.net import apply_gloo_interface

    apply_gloo_interface()
    code = run(a.run_dir, a.incarnation, a.link_port, a.device)
    import torch.distributed as dist

    if dist.is_initialized():
        from areal_like.learner.parallel.spawn import exit_rank

        exit_rank(code)
    return code


if __name__ == "__main__":
    from areal_like.api.process import exit_now

    exit_now(main())
