"""The learner process (one per rank of the pool): the RL loop of a training run, on one screen.

    resume: checkpoint (if any; verified, falling back past unusable ones) → buffer.recover (finish a
            cut-off commit; pending entries to redo; rewind a buffer ahead of a deliberate rollback)
            → push the restored weights so every server serves the policy we resume from
    ┌─ fetch B groups to train (rank 0, feed.py; redo entries first; blocks until rollouts produced them)
    │    ├─ consume-time guard: drop groups older than the limit (counted; ~0 when the gate works)
    │    ├─ DAPO dynamic sampling: drop groups whose rewards are all equal
    │    └─ each drop credits the gate (same atomic ack) and is replaced by one more read
    ├─ broadcast the groups to every rank (msgpack bytes)
    ├─ train   (every rank: forward-only passes, advantages, ppo_epochs × ppo_minibatches updates; a critic
    │           on a pool of its own (`fsdp[critic]` in the allocation) is asked for V_old and trains beside
    │           the actor on the returns: learner/critic_pool.py)
    ├─ collect the validation of the served version, if one is running (servers must not change under
    │  it; evaluation.py); its results go into the metrics row of the step that produced that version
    ├─ push weights to every server (rank 0: pause → buckets → continue)  ← generation waits only here
    │    (weight_sync.py) each bucket gathered from the shards as it goes: the other ranks join its
    │    gathers from their wait for rank 0 (`leader_command`), so no rank ever holds the whole model
    ├─ bump the policy version v (only now: the new weights are on every server; ledger.py) → frees the gate
    ├─ request a validation of v every train.test_freq steps (rollout0 runs it while we train on)
    ├─ checkpoint (every train.save_freq steps), then commit the covered entries: ack + trained set
    └─ report (reporter.py): metrics.jsonl row, Prometheus, the trackers of metrics.loggers (TensorBoard, W&B)

Co-located (allocation `<generation>|<training>`, e.g. `embedded:d1|fsdp:d1`; issue 27; serving.py's
`Colocated` phase, chosen once at start — a disaggregated run holds `Disaggregated`, whose verbs do nothing
around the step): the servers and this pool take turns on the same devices, one phase each per step.
Once `fetch` has the batch (and the served version's validation has ended — it runs on the same
servers), rank 0 pauses the servers (abort: requests still generating come back and are resubmitted
with their tokens, to wait in the paused servers) and releases their KV cache and weights (LoRA: the KV
cache alone; `end_generation`); every rank wakes, trains, frees its gradients and moves its AdamW state
off the device; the push is the in-memory handoff into the servers' resumed weights, which stay paused;
version, row, checkpoint as above; then every rank sleeps (parameters off the device) and the servers
get their KV cache back and continue (`start_generation`). Each step logs
`co-located step: release … → wake … → train … → handoff … → sleep … → resume …` (seconds). A server that
dies around a phase switch is waited for and re-synced by a push that continues it; a learner restarted
inside a phase finds the servers released and gives their memory back before its first push.

Exactly once (DESIGN invariant 4; ledger.py): entries are committed (acked, recorded as trained) only
after a checkpoint that contains their update, so a crash replays exactly the updates the restored
model lacks. Without checkpoints (save_freq 0) a restart starts from scratch anyway, so each step
commits at once. `trained.jsonl` logs what each incarnation trained, for audits and tests.

Only rank 0 talks to Redis and the servers (`Coordinator`, coordinator.py: a composition of
collaborators with one job each — `Feed`, the serving phase, `WeightSync`, `Evaluation`, `Ledger`,
`Reporter`); the other ranks hold a `Follower` whose every method does nothing, so the loop has no
rank checks. The learner never imports the engine.
While rank 0 waits for data, a validation or a push, the others wait outside any collective
(`ParallelLayout.leader_ready`, inside `broadcast_groups` and before a checkpoint): no collective
timeout fires however long the first batch takes, and rank 0's death still stops them at once.

Server restarts (weight_sync.py; the launcher starts a restarted server with --start-paused and counts
it in `restarts:server`): before each push, and on every empty read while fetch waits, rank 0 compares the
count with the last it saw; when it grew, or when a push failed (a server died mid-push), it re-syncs:
waits for every server, re-forms the weight group (`pusher.reform()`) and pushes the served version
again (the live weights, unchanged since that push), which also continues the restarted server. Rank
0 leads it; the other ranks join its gathers from their wait. A restart during a validation that
overlaps the next train step re-syncs the restarted server with the next step's weights under the
validated version's label until the push right after (logged; no second copy of the model is kept).
After MAX_RESYNCS failed tries it raises and the learner exits non-zero.
"""

from __future__ import annotations

import argparse
import os
import signal

from areal_like.api.config import decode_config
from areal_like.api.run_files import Endpoints
from areal_like.learner.coordinator import Coordinator, Follower
from areal_like.learner.log import log

_STOP = -(2**62)  # a version no run reaches: rank 0's "stop now" to the other ranks


async def run(run_dir: str, metrics_port: int | None, incarnation: int, weight_port: int, device: str,
              launch: str, critic_link: str | None = None) -> int:
    from areal_like.learner.checkpoint import CheckpointError, CheckpointManager
    from areal_like.learner.moe import PerExpertWeights, is_moe
    from areal_like.learner.parallel import LayoutSpec, broadcast_groups
    from areal_like.learner.parallel.spawn import init_pool_from_env
    from areal_like.learner.trainer import Trainer

    with open(os.path.join(run_dir, "config.json"), "rb") as f:
        cfg = decode_config(f.read())
    import torch

    # Before any compute: `launcher replay` sets the same count, so it reproduces this run's numbers.
    torch.set_num_threads(cfg.train.torch_threads)
    rank = init_pool_from_env(cfg.train.collective_timeout_s, device)
    from allocation import parse_allocation

    alloc = parse_allocation(cfg.allocation)
    colocated = alloc.colocated  # `<generation>|<training>`: phases per step
    trainer = Trainer.from_config(cfg, LayoutSpec.from_allocation(cfg.allocation), device=device)
    if rank == 0:
        log(f"precision: {trainer.precision_policy}")  # model.dtype computes; train.master_dtype holds the state
        log(f"memory: {trainer.memory_policy}")  # model.enable_gradient_checkpointing, train.logits_chunk_tokens
        log(f"data parallel: {trainer.sharding_policy}")  # train.dp_sharding, the allocation's training d
        if trainer.lora is not None:
            log(f"LoRA: {trainer.lora_policy}")  # model.lora_rank, lora_alpha, target_modules, lora_path
    ckpt = CheckpointManager.from_config(cfg.train, run_dir=run_dir)
    try:  # every rank; verified first, falls back past an unusable newest checkpoint (`auto`)
        extra = ckpt.resume(trainer, explicit=incarnation == 0, log=log)
    except CheckpointError as e:
        log(f"cannot resume: {e}")
        return 3
    step = last_saved = extra["step"] if extra else 0
    version = extra["version"] if extra else 0
    if trainer.critic_pool and rank == 0:  # a critic on its own pool: it loads its part of the same checkpoint
        from areal_like.learner.critic_link import CriticLink

        if not critic_link:
            log(f"allocation {cfg.allocation!r} has a critic component but no --critic-link was given: start the "
                "learner with `launcher run`, which starts the critic pool and passes its address")
            return 2
        host, _, port = critic_link.rpartition(":")
        trainer.remote_critic = CriticLink.connect(host, int(port), timeout_s=cfg.critic.timeout_s)
        trainer.remote_critic.send("start", checkpoint=ckpt.resumed_from)
        started = trainer.remote_critic.recv("started", timeout_s=cfg.critic.timeout_s, what="load its checkpoint")
        log(f"critic pool at {trainer.remote_critic.address}: at step {started['step']}"
            + (f" (checkpoint {ckpt.resumed_from})" if ckpt.resumed_from else " (fresh)"))
    if rank == 0:
        # The launcher started this pool while the servers load; their endpoints come once they are healthy.
        endpoints = Endpoints.wait(run_dir, launch, max(cfg.server.health_timeout_s, 900.0) + 60.0)
        coord = Coordinator(cfg, endpoints, run_dir, incarnation, weight_port, metrics_port, colocated=colocated)
    else:
        coord = Follower()
    # What rank 0 pushes: the live weights, read one bucket at a time from the shards (the other ranks
    # join the gathers from their next leader_ready wait). Pushed when resuming (the servers may hold
    # newer weights from steps this checkpoint does not have), and again if a server restarts.
    weights = trainer.weight_source()
    sglang = alloc.generation is not None and alloc.generation.backend == "sglang"
    # SGLang loads one tensor per expert (learner/moe.py); a converter's own format (LoRA's adapter) has no experts
    if sglang and is_moe(trainer.actor.stage_module) and trainer.actor.conversion.format is None:
        weights = PerExpertWeights(weights, mixtral=trainer.actor.config.model_type == "mixtral")
    await coord.start(extra, version, trainer.layout, weights, rollback=ckpt.rollback)
    # colocate.offload_learner: the learner's state leaves the devices while the servers generate
    offload = colocated and cfg.colocate.offload_learner
    if offload and rank == 0:
        # the servers generate first: every rank sleeps until the first batch — the others on rank 0's word,
        # after they served the gathers of the push `start` made (a slept rank has no parameters to gather)
        trainer.sleep(followers=True)
    coord.set_version(version)
    coord.maybe_request_eval(version, step)
    # SIGTERM/SIGINT (launcher stop, Ctrl-C): rank 0 finishes the step in hand, tells the other
    # ranks, and every rank checkpoints and commits before exiting. Other ranks wait for rank 0's word.
    stop_requested: list[bool] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.append(True))
    stopping = lambda: bool(stop_requested)  # noqa: E731
    stopped = False

    def checkpoint_and_commit() -> None:
        """Save (collective, atomic), then commit exactly the entries the checkpoint covers."""
        nonlocal last_saved
        # Rank 0 may still be collecting a validation or pushing (minutes): the others wait for it
        # here, outside the checkpoint's collectives and their timeout.
        trainer.layout.leader_ready(f"finish step {step}'s validation and weight push, then checkpoint it")
        trainer.wake()  # co-located: the AdamW state back where the save reads it (no-op when awake)
        ckpt.save(trainer, step, coord.checkpoint_extra(step, version))
        coord.commit(step)
        last_saved = step

    while step < cfg.train.total_steps:
        batch = await coord.fetch(version, stopping)
        if batch is not None and colocated:
            # Co-located: the validation of the served version runs on the servers too; it ends before
            # they pause. Then they release the devices to this pool (no-ops when disaggregated).
            await coord.collect_eval(stopping, trained_since_push=False)
            await coord.end_generation()
        groups, shared = broadcast_groups(batch.groups if batch else [], version if batch else _STOP, trainer.layout)
        if shared == _STOP:
            stopped = True
            break
        step += 1
        wake_s = trainer.wake()  # co-located: state back on the devices (no-op when it never slept)
        stats = trainer.train_step(groups, version)  # B groups, always (fetch replaces every drop)
        if offload:  # every rank: gradients freed, AdamW state off the device before the handoff needs room
            trainer.sleep(keep_params=True)
        coord.note_phase(wake_s=wake_s, train_s=stats.step_s)
        await coord.collect_eval(stopping, trained_since_push=True)
        push = await coord.push(weights, version + 1)  # the other ranks serve its gathers from their next wait
        version += 1
        coord.published(step, version, batch)
        coord.maybe_request_eval(version, step)
        # The row first, then the checkpoint: a checkpoint at step s implies s's row is written, or held
        # for its validation inside the checkpoint (a restart resumed at s validates and writes it).
        coord.report(step, version, stats, batch, push)
        if ckpt.save_freq == 0:
            coord.commit(step)  # no checkpoint to replay from: a restart starts over anyway
        elif ckpt.should_save(step) or step == cfg.train.total_steps:
            checkpoint_and_commit()
        # Co-located: the learner sleeps (every rank) and the servers take the devices back — after the
        # checkpoint, which needs the learner's state where it trains. Disaggregated: nothing.
        await coord.start_generation(lambda: trainer.sleep(followers=True) if offload else 0.0)

    await coord.collect_eval(stopping, trained_since_push=False)  # the last validation, if one is running (none when stopping)
    # The others serve rank 0's last push from here (its gathers), and a re-sync during that validation.
    trainer.layout.leader_ready("finish the last weight push and validation")
    if stopped and ckpt.save_freq > 0 and step > last_saved:
        checkpoint_and_commit()
    # Every rank through with the pool (collectives, rank 0's store) before any leaves (exit_rank); before
    # rank 0 closes its trackers, which may take longer than a collective timeout.
    if trainer.remote_critic is not None:  # the critic pool leaves with us (no answer: its store goes with it)
        trainer.remote_critic.send("stop")
    trainer.barrier()
    await coord.close(stopped, step, version, saved=stopped and ckpt.save_freq > 0)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_like.learner.main")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--incarnation", type=int, default=0, help="how many times the launcher restarted the pool")
    p.add_argument("--weight-sync-port", type=int, required=True, help="rank 0's port for the weight-update group")
    p.add_argument("--device", required=True, help="torch device of this rank (cuda:0 under its CUDA_VISIBLE_DEVICES)")
    p.add_argument("--launch", required=True, help="the launch whose endpoints.json rank 0 waits for")
    p.add_argument("--critic-link", default=None,
                   help="HOST:PORT of the critic pool's rank 0 (a critic component in the allocation)")
    a = p.parse_args(argv)
    from areal_like.api.net import apply_gloo_interface

    apply_gloo_interface()  # before the pool's gloo groups: the interface of this node's address (issue 40)
    import uvloop

    code = uvloop.run(run(a.run_dir, a.metrics_port, a.incarnation, a.weight_sync_port, a.device, a.launch,
                          a.critic_link))
    import torch.distributed as dist

    if dist.is_initialized():  # a rank of a pool: its process ends without the interpreter's finalization
        from areal_like.learner.parallel.spawn import exit_rank

        exit_rank(code)
    return code


if __name__ == "__main__":
    from areal_like.api.process import exit_now

    exit_now(main())  # a one-rank pool too: everything is closed, skip the finalization (api/process.py)
