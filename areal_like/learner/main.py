"""The learner process (one per rank of the pool): the RL loop of a training run, on one screen.

    resume: checkpoint (if any) → buffer.recover (finish a cut-off commit; pending entries to redo)
            → push the restored weights so every server serves the policy we resume from
    ┌─ fetch exactly B entries (rank 0; redo entries first; blocks until rollouts produced them)
    │    └─ consume-time guard: drop groups older than the limit (counted; ~0 when the gate works)
    ├─ broadcast the groups to every rank (msgpack bytes)
    ├─ train   (every rank: π_prox, advantages, decoupled PPO, optimizer step)
    ├─ push weights to every server (rank 0: pause → buckets → continue)  ← generation waits only here
    ├─ bump the policy version v (only now: the new weights are on every server) → frees the gate
    └─ checkpoint (every train.save_freq steps), then commit the covered entries: ack + trained set

Exactly once (DESIGN invariant 4): entries are committed (acked, recorded as trained) only after a
checkpoint that contains their update, so a crash replays exactly the updates the restored model
lacks. Without checkpoints (save_freq 0) a restart starts from scratch anyway, so each step
commits at once. `trained.jsonl` logs what each incarnation trained, for audits and tests.

Only rank 0 talks to Redis and the servers; the learner never imports the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

from areal_like import metrics as M
from areal_like.api.config import decode_config

CONSUMER = "learner-0"


def _log(msg: str) -> None:
    print(f"[learner] {msg}", flush=True)


def _append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


class _Rank0:
    """What only rank 0 does: buffer I/O, weight push, version, metrics files."""

    def __init__(self, cfg, endpoints: dict, run_dir: str, incarnation: int, weight_port: int):
        from areal_like.buffer.replay_buffer import ReplayBuffer
        from areal_like.weights.push import WeightPusher

        self.cfg = cfg
        self.run_dir = run_dir
        self.incarnation = incarnation
        self.buffer = ReplayBuffer.from_config(cfg.buffer, url=os.environ["AREAL_LIKE_REDIS_URL"])
        limit = cfg.train.max_consume_staleness
        self.limit = cfg.rollout.max_staleness if limit is None else limit
        # A fresh group name per incarnation: a learner that died mid-push leaves its group behind.
        self.pusher = WeightPusher(
            endpoints["servers"], master_addr="127.0.0.1", master_port=weight_port,
            backend=endpoints.get("weight_backend", "gloo"), bucket_bytes=int(cfg.weights.bucket_mb * 2**20),
            timeout_s=cfg.weights.timeout_s, admin_api_key=cfg.server.admin_api_key,
            devices_per_server=endpoints.get("server_devices"), group_name=f"weight_update_group_{incarnation}",
        )
        self.redo: list = []
        self.uncommitted: list[tuple[str, str]] = []  # (entry id, group id) trained, not yet committed

    def recover(self, extra: dict | None) -> None:
        step = extra["step"] if extra else 0
        uncommitted = [tuple(p) for p in (extra or {}).get("uncommitted", [])]
        self.redo = self.buffer.recover(CONSUMER, uncommitted, step)
        if self.redo:
            _log(f"recovered {len(self.redo)} entr(ies) read but not covered by a checkpoint: training them first")

    def fetch(self, B: int, version: int, stopping) -> tuple[list, list, int] | None:
        """Exactly B entries, drops included: the gate admits (η+v+1)·B groups in total, so taking
        more than B per version to replace dropped ones would starve the producers.

        None when asked to stop meanwhile: what was read stays pending and is recovered next time."""
        entries, groups, n_dropped = [], [], 0
        while len(entries) + n_dropped < B:
            if stopping():
                return None
            want = B - len(entries) - n_dropped
            got = [self.redo.pop(0) for _ in range(min(want, len(self.redo)))]
            if not got:
                got = self.buffer.read(want, self.cfg.buffer.block_ms, CONSUMER)
            if not got:
                continue
            keep, dropped = self.buffer.filter_stale(got, version, self.limit,  # acks and counts the dropped
                                                     self.cfg.train.consume_stale_policy)
            if dropped:
                n_dropped += len(dropped)
                _log(f"dropped {len(dropped)} group(s) older than {self.limit} versions at v={version}")
            entries += keep
        return [eid for eid, _ in entries], [g for _, g in entries], n_dropped

    def commit(self, step: int) -> None:
        if self.uncommitted:
            self.buffer.commit(self.uncommitted, step, CONSUMER)
        self.uncommitted = []


async def run(run_dir: str, metrics_port: int | None, incarnation: int, weight_port: int) -> int:
    from areal_like.learner.checkpoint import CheckpointManager
    from areal_like.learner.parallel import LayoutSpec, ParallelLearner, broadcast_groups
    from areal_like.learner.parallel.spawn import init_pool_from_env

    with open(os.path.join(run_dir, "config.json"), "rb") as f:
        cfg = decode_config(f.read())
    with open(os.path.join(run_dir, "endpoints.json")) as f:
        endpoints = json.load(f)
    device = endpoints.get("learner_device", "cpu")
    rank = init_pool_from_env(cfg.train.collective_timeout_s, device)
    learner = ParallelLearner(cfg.model.path, cfg.train, LayoutSpec.from_allocation(cfg.allocation),
                              temperature=cfg.generation.temperature, device=device, dtype=cfg.model.dtype)
    ckpt = CheckpointManager.from_config(cfg.train, run_dir=run_dir)
    extra = ckpt.resume(learner)  # every rank
    start_step = extra["step"] if extra else 0
    version = extra["version"] if extra else 0
    r0 = None
    if rank == 0:
        if metrics_port:
            M.serve(metrics_port)
        r0 = _Rank0(cfg, endpoints, run_dir, incarnation, weight_port)
        r0.recover(extra)
        await r0.pusher.init()
        trained_log = os.path.join(run_dir, "trained.jsonl")
        _append_jsonl(trained_log, {"event": "start", "incarnation": incarnation, "resumed_from_step": start_step})
    if extra is not None:
        tensors = learner.named_tensors_for_push()  # collective; full tensors on rank 0
        if r0 is not None:
            # The servers may hold newer weights from steps this checkpoint does not have.
            await r0.pusher.push(tensors, version)
            _log(f"resumed from step {start_step} (version {version}); servers reloaded")
    if r0 is not None:
        r0.buffer.set_version(version)
        M.POLICY_VERSION.set(version)
        _log(f"ready: B={cfg.train.batch_size} groups/step, η={cfg.rollout.max_staleness}, "
             f"layout {learner.layout.spec}, servers={endpoints['servers']}")
    B = cfg.train.batch_size
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    # SIGTERM/SIGINT (launcher stop, Ctrl-C): rank 0 finishes the step in hand, tells the other
    # ranks, and every rank checkpoints and commits before exiting. Other ranks wait for rank 0's word.
    stop_requested = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.append(True))
    last_saved, step, stopped = start_step, start_step, False

    for step in range(start_step + 1, cfg.train.total_steps + 1):
        # ---- fetch (rank 0) and share --------------------------------------------------------
        t_fetch = time.monotonic()
        fetched = r0.fetch(B, version, lambda: bool(stop_requested)) if r0 is not None else ([], None, 0)
        ids, groups, n_dropped = fetched if fetched is not None else ([], [], 0)
        groups, shared_version = broadcast_groups(groups, version if fetched is not None else _STOP, learner.layout)
        if shared_version == _STOP:
            step, stopped = step - 1, True  # this step never ran
            break
        version = shared_version
        fetch_s = time.monotonic() - t_fetch

        # ---- train (every rank) ---------------------------------------------------------------
        stats = learner.train_step(groups, version) if groups else _empty_stats()
        tensors = learner.named_tensors_for_push()  # collective; full tensors on rank 0

        # ---- push, then bump the version (rank 0) --------------------------------------------
        push = {"push_s": 0.0, "pause_window_s": 0.0}
        if r0 is not None:
            push = await r0.pusher.push(tensors, version + 1)
        version += 1
        if r0 is not None:
            r0.buffer.set_version(version)
            r0.uncommitted += [(eid, g.group_id) for eid, g in zip(ids, groups)]
            _append_jsonl(trained_log, {"event": "trained", "incarnation": incarnation, "step": step,
                                        "groups": [g.group_id for g in groups]})

        # ---- checkpoint, then commit what it covers -----------------------------------------
        if ckpt.save_freq == 0:
            if r0 is not None:
                r0.commit(step)
        elif ckpt.should_save(step) or step == cfg.train.total_steps:
            _checkpoint_and_commit(ckpt, learner, r0, step, version)
            last_saved = step

        # ---- report (rank 0) ------------------------------------------------------------------
        if r0 is not None:
            staleness = [version - 1 - g.min_version for g in groups if g.min_version >= 0]
            row = {
                "step": step, "version": version, "reward_mean": stats["reward_mean"],
                "staleness_max": max(staleness, default=0), "dropped_stale": n_dropped,
                "samples": stats["num_samples"], "step_s": stats["step_s"], "push_s": push["push_s"],
                "pause_window_s": push.get("pause_window_s"), "fetch_s": fetch_s, "loss": stats["loss"],
                "grad_norm": stats["grad_norm"], "clipfrac": stats["clipfrac"], "approx_kl": stats["approx_kl"],
                "behav_w_max": stats["behav_w_max"], "loss_tokens": stats["loss_tokens"],
                "skipped": stats["skipped"], "incarnation": incarnation,
            }
            _append_jsonl(metrics_path, row)
            M.POLICY_VERSION.set(version)
            M.LEARNER_STEP.set(step)
            M.STEP_SECONDS.observe(stats["step_s"])
            M.PUSH_SECONDS.observe(push["push_s"])
            M.REWARD_MEAN.set(stats["reward_mean"])
            M.LOSS.set(stats["loss"])
            M.STALENESS_MAX.set(row["staleness_max"])
            for s in staleness:
                M.STALENESS.observe(s)
            M.TRAINED_TOKENS.inc(stats["loss_tokens"])
            r0.buffer.refresh_metrics()

    if stopped:
        if ckpt.save_freq > 0 and step > last_saved:
            _checkpoint_and_commit(ckpt, learner, r0, step, version)
        if r0 is not None:
            _log(f"stopped after step {step} (version {version})"
                 + ("; checkpoint saved and committed" if ckpt.save_freq > 0 else ""))
    if r0 is not None:
        await r0.pusher.close()
        r0.buffer.close()
        if not stopped:
            _log(f"done: {cfg.train.total_steps} steps, final version {version}")
    return 0


_STOP = -(2**62)  # a version no run reaches: rank 0's "stop now" to the other ranks


def _checkpoint_and_commit(ckpt, learner, r0, step: int, version: int) -> None:
    """Save (collective, atomic), then commit exactly the entries the checkpoint covers."""
    extra_out = {"step": step, "version": version,
                 "uncommitted": [list(p) for p in r0.uncommitted] if r0 is not None else []}
    ckpt.save(learner, step, extra_out)
    if r0 is not None:
        r0.commit(step)


def _empty_stats() -> dict:
    """A step whose every group was dropped by the consume-time guard: nothing to train on."""
    nan = float("nan")
    return {"reward_mean": nan, "num_samples": 0, "step_s": 0.0, "loss": nan, "grad_norm": nan,
            "clipfrac": nan, "approx_kl": nan, "behav_w_max": nan, "loss_tokens": 0, "skipped": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_like.learner.main")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--metrics-port", type=int, default=None)
    p.add_argument("--incarnation", type=int, default=0, help="how many times the launcher restarted the pool")
    p.add_argument("--weight-sync-port", type=int, required=True, help="rank 0's port for the weight-update group")
    a = p.parse_args(argv)
    import uvloop

    return uvloop.run(run(a.run_dir, a.metrics_port, a.incarnation, a.weight_sync_port))


if __name__ == "__main__":
    sys.exit(main())
