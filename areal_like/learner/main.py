"""The learner process (one per rank of the pool): the RL loop of a training run, on one screen.

    resume: checkpoint (if any) → buffer.recover (finish a cut-off commit; pending entries to redo)
            → push the restored weights so every server serves the policy we resume from
    ┌─ fetch exactly B entries (rank 0; redo entries first; blocks until rollouts produced them)
    │    ├─ consume-time guard: drop groups older than the limit (counted; ~0 when the gate works)
    │    └─ DAPO dynamic sampling: drop groups whose rewards are all equal, read replacements
    ├─ broadcast the groups to every rank (msgpack bytes)
    ├─ train   (every rank: forward-only passes, advantages, ppo_epochs × ppo_minibatches updates)
    ├─ collect the validation of the served version, if one is running (servers must not change under
    │  it); its results go into the metrics row of the step that produced that version
    ├─ push weights to every server (rank 0: pause → buckets → continue)  ← generation waits only here
    ├─ bump the policy version v (only now: the new weights are on every server) → frees the gate
    ├─ request a validation of v every train.test_freq steps (rollout0 runs it while we train on)
    ├─ checkpoint (every train.save_freq steps), then commit the covered entries: ack + trained set
    └─ report: metrics.jsonl row, Prometheus

Exactly once (DESIGN invariant 4): entries are committed (acked, recorded as trained) only after a
checkpoint that contains their update, so a crash replays exactly the updates the restored model
lacks. Without checkpoints (save_freq 0) a restart starts from scratch anyway, so each step
commits at once. `trained.jsonl` logs what each incarnation trained, for audits and tests.

Only rank 0 talks to Redis and the servers (`Coordinator`); the other ranks hold a `Follower`
whose every method does nothing, so the loop has no rank checks. The learner never imports the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field

from areal_like import metrics as M
from areal_like.api.config import ExperimentConfig, decode_config
from areal_like.api.run_files import Endpoints, StepMetrics, append_metrics

CONSUMER = "learner-0"
_STOP = -(2**62)  # a version no run reaches: rank 0's "stop now" to the other ranks


def _log(msg: str) -> None:
    print(f"[learner] {msg}", flush=True)


def _append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


@dataclass
class Batch:
    """What one step consumed from the buffer (rank 0)."""

    ids: list[str] = field(default_factory=list)  # entry ids of the groups to train
    groups: list = field(default_factory=list)
    dropped_stale: int = 0
    filtered: int = 0  # DAPO: all-equal-reward groups dropped and replaced
    fetch_s: float = 0.0


class Coordinator:
    """Rank 0's side of the loop: buffer I/O, weight push, policy version, validation, metrics files."""

    def __init__(self, cfg: ExperimentConfig, endpoints: Endpoints, run_dir: str, incarnation: int,
                 weight_port: int, metrics_port: int | None):
        from areal_like.buffer.eval_channel import EvalChannel
        from areal_like.buffer.replay_buffer import ReplayBuffer
        from areal_like.weights.factory import make_weight_pusher

        self.cfg = cfg
        self.run_dir = run_dir
        self.incarnation = incarnation
        if metrics_port:
            M.serve(metrics_port)
        self.buffer = ReplayBuffer.from_config(cfg.buffer, url=os.environ["AREAL_LIKE_REDIS_URL"])
        limit = cfg.train.max_consume_staleness
        self.limit = cfg.rollout.max_staleness if limit is None else limit
        self.pusher = make_weight_pusher(cfg, endpoints, model_path=cfg.model.path, run_dir=run_dir,
                                         weight_port=weight_port, incarnation=incarnation)  # weights.mode
        self.evals = EvalChannel.from_buffer(self.buffer) if cfg.data.val_files else None
        self.eval_pending: int | None = None  # version whose validation was requested, not collected
        self.held_row: StepMetrics | None = None  # that step's metrics row, written with the results
        self.carry_val: dict[str, float] = {}  # results of version 0 (val_before_train), for step 1's row
        self.redo: list = []
        self.uncommitted: list[tuple[str, str]] = []  # (entry id, group id) trained, not yet committed
        self.trained_log = os.path.join(run_dir, "trained.jsonl")

    async def start(self, extra: dict | None, version: int, layout, n_servers: int) -> None:
        step = extra["step"] if extra else 0
        uncommitted = [tuple(p) for p in (extra or {}).get("uncommitted", [])]
        self.redo = self.buffer.recover(CONSUMER, uncommitted, step)
        if self.redo:
            _log(f"recovered {len(self.redo)} entr(ies) read but not covered by a checkpoint: training them first")
        await self.pusher.init()
        _append_jsonl(self.trained_log, {"event": "start", "incarnation": self.incarnation, "resumed_from_step": step})
        _log(f"ready: B={self.cfg.train.batch_size} groups/step, η={self.cfg.rollout.max_staleness}, "
             f"layout {layout.spec}, algorithm {self.cfg.algorithm.adv_estimator}, {n_servers} server(s), "
             f"weights.mode={self.cfg.weights.mode}")

    # ---- fetch --------------------------------------------------------------------------------------
    def fetch(self, version: int, stopping) -> Batch | None:
        """Exactly B entries net: the gate admits (η+v+1)·B (+ credit) groups in total, so the learner
        consumes B entries per version — stale drops included — plus one replacement per group that
        DAPO's filter dropped (each such drop returns its place to the gate, in the same atomic ack).

        None when asked to stop meanwhile: what was read stays pending and is recovered next time."""
        alg = self.cfg.algorithm
        t0 = time.monotonic()
        b = Batch()
        need = self.cfg.train.batch_size
        budget = alg.filter_groups_max_extra if alg.filter_groups else 0
        while need > 0:
            if stopping():
                return None
            got = [self.redo.pop(0) for _ in range(min(need, len(self.redo)))]
            if not got:
                got = self.buffer.read(need, self.cfg.buffer.block_ms, CONSUMER)
            if not got:
                continue
            need -= len(got)
            keep, dropped = self.buffer.filter_stale(got, version, self.limit,  # acks and counts the dropped
                                                     self.cfg.train.consume_stale_policy)
            if dropped:
                b.dropped_stale += len(dropped)
                _log(f"dropped {len(dropped)} group(s) older than {self.limit} versions at v={version}")
            if alg.filter_groups:
                uniform = [e for e in keep if len({t.reward for t in e[1].trajectories}) <= 1][:budget - b.filtered]
                if uniform:
                    self.buffer.drop([eid for eid, _ in uniform], "filtered")  # credits the gate
                    b.filtered += len(uniform)
                    need += len(uniform)
                    gone = {eid for eid, _ in uniform}
                    keep = [e for e in keep if e[0] not in gone]
            b.ids += [eid for eid, _ in keep]
            b.groups += [g for _, g in keep]
        b.fetch_s = time.monotonic() - t0
        return b

    # ---- push, version, commit ------------------------------------------------------------------------
    async def push(self, tensors, version: int) -> dict:
        return await self.pusher.push(tensors, version)

    async def reload(self, tensors, version: int, step: int) -> None:
        await self.pusher.push(tensors, version)
        _log(f"resumed from step {step} (version {version}); servers reloaded")

    def set_version(self, version: int) -> None:
        self.buffer.set_version(version)
        M.POLICY_VERSION.set(version)

    def published(self, step: int, version: int, batch: Batch) -> None:
        """The step's weights are on every server as `version`: tell the gate, remember what to commit."""
        self.set_version(version)
        self.uncommitted += [(eid, g.group_id) for eid, g in zip(batch.ids, batch.groups)]
        _append_jsonl(self.trained_log, {"event": "trained", "incarnation": self.incarnation, "step": step,
                                         "groups": [g.group_id for g in batch.groups]})

    def commit(self, step: int) -> None:
        if self.uncommitted:
            self.buffer.commit(self.uncommitted, step, CONSUMER)
        self.uncommitted = []

    def checkpoint_extra(self, step: int, version: int) -> dict:
        return {"step": step, "version": version, "uncommitted": [list(p) for p in self.uncommitted]}

    # ---- validation ----------------------------------------------------------------------------------
    def maybe_request_eval(self, version: int, step: int) -> None:
        t = self.cfg.train
        due = (step == 0 and t.val_before_train) or (step > 0 and t.test_freq > 0 and step % t.test_freq == 0)
        if self.evals is not None and due:
            self.evals.request(version, step)
            self.eval_pending = version

    def collect_eval(self, stopping) -> None:
        """Wait for the pending validation (the servers must keep its version until it ends) and write
        the held metrics row of the step it evaluated, results included (none if asked to stop)."""
        if self.evals is not None and self.eval_pending is not None:
            res = self.evals.collect(self.eval_pending, self.cfg.eval.timeout_s, stopping) or {}
            self.eval_pending = None
            M.set_val_metrics(res)
            if self.held_row is not None:
                self.held_row.val = res
            else:  # version 0 (train.val_before_train): no step produced it; it goes into step 1's row
                self.carry_val = res
        if self.held_row is not None:
            append_metrics(self.run_dir, self.held_row)
            self.held_row = None

    # ---- report --------------------------------------------------------------------------------------
    def report(self, step: int, version: int, stats: dict, batch: Batch, push: dict) -> None:
        """The step's metrics row and Prometheus. A step whose weights are being validated has its row
        held until `collect_eval` adds the results (before the next push, or at the end)."""
        staleness = [version - 1 - g.min_version for g in batch.groups if g.min_version >= 0]
        buffer_stats = self.buffer.refresh_metrics()  # also sets the buffer gauges
        row = StepMetrics(
            step=step, version=version, reward_mean=stats["reward_mean"], staleness_max=max(staleness, default=0),
            dropped_stale=batch.dropped_stale, filtered=batch.filtered, samples=stats["num_samples"],
            step_s=stats["step_s"], push_s=push["push_s"], pause_window_s=push.get("pause_window_s"),
            fetch_s=batch.fetch_s, loss=stats["loss"], grad_norm=stats["grad_norm"], clipfrac=stats["clipfrac"],
            approx_kl=stats["approx_kl"], behav_w_min=stats["behav_w_min"], behav_w_max=stats["behav_w_max"],
            behav_tokens_capped=stats["behav_tokens_capped"], kl_ref=stats["kl_ref"], entropy=stats["entropy"],
            value_loss=stats["value_loss"], adv_abs_mean=stats["adv_abs_mean"],
            optimizer_steps=stats["optimizer_steps"], loss_tokens=stats["loss_tokens"], skipped=stats["skipped"],
            incarnation=self.incarnation, reward_failures=buffer_stats.get("reward_failures", {}), val=self.carry_val)
        self.carry_val = {}
        if self.eval_pending == version:
            self.held_row = row
        else:
            append_metrics(self.run_dir, row)
        M.POLICY_VERSION.set(version)
        M.LEARNER_STEP.set(step)
        M.STEP_SECONDS.observe(stats["step_s"])
        M.PUSH_SECONDS.observe(push["push_s"])
        for gauge, key in ((M.REWARD_MEAN, "reward_mean"), (M.LOSS, "loss"), (M.CLIPFRAC, "clipfrac"),
                           (M.APPROX_KL, "approx_kl"), (M.KL_REF, "kl_ref"), (M.ENTROPY, "entropy"),
                           (M.GRAD_NORM, "grad_norm"), (M.VALUE_LOSS, "value_loss"), (M.BEHAV_W_MAX, "behav_w_max")):
            if stats[key] is not None:
                gauge.set(stats[key])
        M.STALENESS_MAX.set(row.staleness_max)
        for s in staleness:
            M.STALENESS.observe(s)
        M.TRAINED_TOKENS.inc(stats["loss_tokens"])

    async def close(self, stopped: bool, step: int, version: int, *, saved: bool) -> None:
        if stopped:
            _log(f"stopped after step {step} (version {version})" + ("; checkpoint saved and committed" if saved else ""))
        else:
            _log(f"done: {step} steps, final version {version}")
        await self.pusher.close()
        self.buffer.close()


class Follower:
    """Every rank but 0: the coordinator's verbs, doing nothing (rank 0 alone talks to Redis and servers)."""

    async def start(self, *a) -> None: ...
    def fetch(self, version: int, stopping) -> Batch: return Batch()  # noqa: E704
    async def push(self, tensors, version: int) -> dict: return {"push_s": 0.0}  # noqa: E704
    async def reload(self, *a) -> None: ...
    def set_version(self, version: int) -> None: ...
    def published(self, *a) -> None: ...
    def commit(self, step: int) -> None: ...
    def checkpoint_extra(self, step: int, version: int) -> dict: return {"step": step, "version": version}  # noqa: E704
    def maybe_request_eval(self, *a) -> None: ...
    def collect_eval(self, stopping) -> None: ...
    def report(self, *a) -> None: ...
    async def close(self, *a, **kw) -> None: ...


async def run(run_dir: str, metrics_port: int | None, incarnation: int, weight_port: int) -> int:
    from areal_like.learner.checkpoint import CheckpointManager
    from areal_like.learner.parallel import LayoutSpec, broadcast_groups
    from areal_like.learner.parallel.spawn import init_pool_from_env
    from areal_like.learner.trainer import Trainer

    with open(os.path.join(run_dir, "config.json"), "rb") as f:
        cfg = decode_config(f.read())
    endpoints = Endpoints.load(run_dir)
    rank = init_pool_from_env(cfg.train.collective_timeout_s, endpoints.learner_device)
    trainer = Trainer.from_config(cfg, LayoutSpec.from_allocation(cfg.allocation), device=endpoints.learner_device)
    ckpt = CheckpointManager.from_config(cfg.train, run_dir=run_dir)
    extra = ckpt.resume(trainer)  # every rank
    step = last_saved = extra["step"] if extra else 0
    version = extra["version"] if extra else 0
    coord = Coordinator(cfg, endpoints, run_dir, incarnation, weight_port, metrics_port) if rank == 0 else Follower()
    await coord.start(extra, version, trainer.layout, len(endpoints.servers))
    if extra is not None:  # the servers may hold newer weights from steps this checkpoint does not have
        await coord.reload(trainer.named_tensors_for_push(), version, step)  # collective gather; rank 0 pushes
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
        ckpt.save(trainer, step, coord.checkpoint_extra(step, version))
        coord.commit(step)
        last_saved = step

    while step < cfg.train.total_steps:
        batch = coord.fetch(version, stopping)
        groups, shared = broadcast_groups(batch.groups if batch else [], version if batch else _STOP, trainer.layout)
        if shared == _STOP:
            stopped = True
            break
        step += 1
        stats = trainer.train_step(groups, version) if groups else _empty_stats()
        tensors = trainer.named_tensors_for_push()  # collective; full tensors on rank 0
        coord.collect_eval(stopping)
        push = await coord.push(tensors, version + 1)
        version += 1
        coord.published(step, version, batch)
        coord.maybe_request_eval(version, step)
        if ckpt.save_freq == 0:
            coord.commit(step)  # no checkpoint to replay from: a restart starts over anyway
        elif ckpt.should_save(step) or step == cfg.train.total_steps:
            checkpoint_and_commit()
        coord.report(step, version, stats, batch, push)

    coord.collect_eval(stopping)  # the last validation, if one is running (none when stopping)
    if stopped and ckpt.save_freq > 0 and step > last_saved:
        checkpoint_and_commit()
    await coord.close(stopped, step, version, saved=stopped and ckpt.save_freq > 0)
    return 0


def _empty_stats() -> dict:
    """A step whose every group was dropped by the consume-time guard: nothing to train on."""
    nan = float("nan")
    return {"reward_mean": nan, "num_samples": 0, "step_s": 0.0, "loss": nan, "grad_norm": nan, "clipfrac": nan,
            "approx_kl": nan, "behav_w_min": nan, "behav_w_max": nan, "behav_tokens_capped": 0, "kl_ref": None,
            "entropy": nan, "value_loss": None, "adv_abs_mean": nan, "optimizer_steps": 0, "loss_tokens": 0,
            "skipped": True}


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
