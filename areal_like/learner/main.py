"""The learner process (one per rank of the pool): the RL loop of a training run, on one screen.

    resume: checkpoint (if any; verified, falling back past unusable ones) → buffer.recover (finish a
            cut-off commit; pending entries to redo; rewind a buffer ahead of a deliberate rollback)
            → push the restored weights so every server serves the policy we resume from
    ┌─ fetch B groups to train (rank 0; redo entries first; blocks until rollouts produced them)
    │    ├─ consume-time guard: drop groups older than the limit (counted; ~0 when the gate works)
    │    ├─ DAPO dynamic sampling: drop groups whose rewards are all equal
    │    └─ each drop credits the gate (same atomic ack) and is replaced by one more read
    ├─ broadcast the groups to every rank (msgpack bytes)
    ├─ train   (every rank: forward-only passes, advantages, ppo_epochs × ppo_minibatches updates)
    ├─ collect the validation of the served version, if one is running (servers must not change under
    │  it); its results go into the metrics row of the step that produced that version
    ├─ push weights to every server (rank 0: pause → buckets → continue)  ← generation waits only here
    │    each bucket gathered from the shards as it goes: the other ranks join its gathers from their
    │    wait for rank 0 (`leader_command`), so no rank ever holds the whole model
    ├─ bump the policy version v (only now: the new weights are on every server) → frees the gate
    ├─ request a validation of v every train.test_freq steps (rollout0 runs it while we train on)
    ├─ checkpoint (every train.save_freq steps), then commit the covered entries: ack + trained set
    └─ report: metrics.jsonl row, Prometheus, the trackers of metrics.loggers (TensorBoard, W&B)

Co-located (allocation `<generation>|<training>`, e.g. `embedded:d1|fsdp:d1`; issue 27): the servers and
this pool take turns on the same devices, one phase each per step. Once `fetch` has the batch (and the
served version's validation has ended — it runs on the same servers), rank 0 pauses the servers (abort:
requests still generating come back and are resubmitted with their tokens, to wait in the paused servers)
and releases their KV cache and weights (`end_generation`); every rank wakes, trains, frees its gradients
and moves its AdamW state off the device; the push is the in-memory handoff into the servers' resumed
weights, which stay paused; version, row, checkpoint as above; then every rank sleeps (parameters off the
device) and the servers get their KV cache back and continue (`start_generation`). Each step logs
`co-located step: release … → wake … → train … → handoff … → sleep … → resume …` (seconds). A server that
dies around a phase switch is waited for and re-synced by a push that continues it; a learner restarted
inside a phase finds the servers released and gives their memory back before its first push.

Exactly once (DESIGN invariant 4): entries are committed (acked, recorded as trained) only after a
checkpoint that contains their update, so a crash replays exactly the updates the restored model
lacks. Without checkpoints (save_freq 0) a restart starts from scratch anyway, so each step
commits at once. `trained.jsonl` logs what each incarnation trained, for audits and tests.

Only rank 0 talks to Redis and the servers (`Coordinator`); the other ranks hold a `Follower`
whose every method does nothing, so the loop has no rank checks. The learner never imports the engine.
While rank 0 waits for data, a validation or a push, the others wait outside any collective
(`ParallelLayout.leader_ready`, inside `broadcast_groups` and before a checkpoint): no collective
timeout fires however long the first batch takes, and rank 0's death still stops them at once.

Server restarts (the launcher starts a restarted server with --start-paused and counts it in
`restarts:server`): before each push, and on every empty read while fetch waits, rank 0 compares the
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
import asyncio
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from areal_like import metrics as M
from areal_like.api.config import ExperimentConfig, decode_config
from areal_like.api.run_files import Endpoints, StepMetrics, append_metrics, reward_reached
from areal_like.api.step_stats import PushResult, TrainStats
from areal_like.buffer.staleness import StalenessPolicy, trained_staleness
from areal_like.weights.admin import WeightPushError
from areal_like.weights.control import GenerationControl

CONSUMER = "learner-0"
MAX_RESYNCS = 3  # re-syncs (wait, re-form, push) one push may take before the learner gives up
_STOP = -(2**62)  # a version no run reaches: rank 0's "stop now" to the other ranks


def _log(msg: str) -> None:
    print(f"[learner] {msg}", flush=True)


def _append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


class _ServersRestarted(Exception):
    """Raised between polls of a validation wait: a server restarted and must be re-synced first."""


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
                 weight_port: int, metrics_port: int | None, *, colocated: bool = False):
        from areal_like.buffer.eval_channel import EvalChannel
        from areal_like.buffer.replay_buffer import DROP_REASONS, ReplayBuffer
        from areal_like.weights.factory import make_weight_pusher

        self.cfg = cfg
        self.run_dir = run_dir
        self.incarnation = incarnation
        if metrics_port:
            M.serve(metrics_port)
        M.STALENESS_LIMIT.set(cfg.rollout.max_staleness)
        M.export_at_zero(M.BUFFER_DROPPED, DROP_REASONS)
        self.buffer = ReplayBuffer.from_config(cfg.buffer, url=os.environ["AREAL_LIKE_REDIS_URL"])
        # η, B, the consume-time limit, stale policy, DAPO budget: buffer/staleness.py owns the rules
        self.policy = StalenessPolicy.from_config(cfg)
        # the servers' handle (weights.control.GenerationControl), its transport picked by weights.mode
        self.pusher: GenerationControl = make_weight_pusher(cfg, endpoints, model_path=cfg.model.path,
                                                            run_dir=run_dir, weight_port=weight_port,
                                                            incarnation=incarnation)
        # co-located (`<generation>|<training>`): the servers and this pool take turns on the same devices
        self.colocated = colocated
        self.phase_log: dict[str, float] = {}  # the co-located step's phase timings, for its log line
        self.in_phase = False  # co-located: the servers are paused (and released) for this pool's training
        self.evals = EvalChannel.from_buffer(self.buffer) if cfg.data.val_files else None
        self.eval_pending: int | None = None  # version whose validation was requested, not collected
        self.held_row: StepMetrics | None = None  # that step's metrics row, written with the results
        self.held_extra: dict = {}  # the trackers' buffer_* values of the held row's step
        self.carry_val: dict[str, float] = {}  # results of version 0 (val_before_train), for step 1's row
        self.redo: list = []
        self.uncommitted: list[tuple[str, str]] = []  # (entry id, group id) trained, not yet committed
        self.trained_log = os.path.join(run_dir, "trained.jsonl")
        # (weights, version) the servers serve: what a re-sync pushes again. The weights are the learner's
        # live ones (`Trainer.weight_source`), unchanged until the next train step, after which the next
        # push replaces them (a re-sync during a validation in between: see `collect_eval`).
        self.pushed: tuple[Any, int] | None = None
        self.seen_restarts = 0  # buffer.run.restarts("server") when the servers were last known in sync
        from areal_like.metrics.loggers import make_loggers

        self.loggers = make_loggers(cfg, run_dir, incarnation, on_error=_log)  # TensorBoard, W&B (rank 0 only)
        self.rewards: list[float] = []  # reward_mean of each step of this start, for train.stop_reward
        self.reward_reached: float | None = None  # their window's mean once it reached train.stop_reward

    async def start(self, extra: dict | None, version: int, layout, weights, rollback: bool = False) -> None:
        """Recover the buffer, set up weight sync and make every server serve `weights` (a
        `WeightSource`, or a list of (name, tensor)) as `version`:
        pushed when resuming from a checkpoint (the servers may hold newer weights); on a fresh start
        the servers already serve version 0 (model.path) and are only continued (one restarted with
        --start-paused before this learner started waits for that). Co-located: always pushed (in memory,
        cheap): a learner that died in its training phase left the servers paused and released."""
        step = extra["step"] if extra else 0
        uncommitted = [tuple(p) for p in (extra or {}).get("uncommitted", [])]
        # rollback: this start resumes an older checkpoint on purpose (explicit train.resume_mode, disable,
        # or the fallback past an unusable newest one): a buffer that committed later steps is rewound
        self.redo = self.buffer.recover(CONSUMER, uncommitted, step,
                                        rollback=(version, self.cfg.train.batch_size) if rollback else None)
        if self.redo:
            _log(f"recovered {len(self.redo)} entr(ies) read but not covered by a checkpoint: training them first")
        self.seen_restarts = self.buffer.run.restarts("server")
        self.pushed = (weights, version)
        held = (extra or {}).get("held_row")
        if held is not None:  # the previous learner died before writing it (waiting for its validation)
            self.held_row = StepMetrics.from_row(json.loads(held))
            if self.evals is None:  # no validation any more (data.val_files unset on resume): write it as is
                self._write_row(self.held_row)
                self.held_row = None
        resync = None
        try:
            await self.pusher.init()
            # Co-located: a learner that died inside its training phase left the servers paused with their
            # memory released; the push below gives it back first (`_push`) and continues them.
            if extra is None and not self.colocated and self.cfg.model.lora_rank == 0:
                await self.pusher.resume()
        except WeightPushError as e:
            resync = f"setting up weight sync failed ({e})"
        # LoRA: the servers start with the base alone, and every request names the run's adapter — it is
        # pushed before anything generates (a fresh adapter leaves the base's outputs unchanged)
        if extra is not None or resync is not None or self.colocated or self.cfg.model.lora_rank > 0:
            await self._push(weights, version, resync=resync)
        if extra is not None:
            _log(f"resumed from step {step} (version {version}); servers reloaded")
        _append_jsonl(self.trained_log, {"event": "start", "incarnation": self.incarnation, "resumed_from_step": step})
        _log(f"ready: B={self.cfg.train.batch_size} groups/step, η={self.cfg.rollout.max_staleness}, "
             f"layout {layout.spec}, algorithm {self.cfg.algorithm.adv_estimator}, {len(self.pusher.server_urls)} server(s), "
             f"weights.mode={self.cfg.resolved_weights_mode()}")

    # ---- fetch --------------------------------------------------------------------------------------
    async def fetch(self, version: int, stopping) -> Batch | None:
        """B groups to train, always (`StepTake` of buffer/staleness.py: the gate admits (η+v+1)·B
        (+ credit) groups in total, so the learner consumes B entries per version net). Each group
        dropped on the way — stale (the policy's consume-time split) or filtered (DAPO: all rewards
        equal, at most filter_groups_max_extra per step) — returns its place to the gate in the same
        atomic ack (gate_credit) and is replaced by one more read, so a step never trains fewer than B.

        While it waits for data it re-syncs servers the launcher restarted (a restarted server holds
        its requests until weights are pushed: without this a run whose only server restarted stalls).
        None when asked to stop meanwhile: what was read stays pending and is recovered next time —
        or once `train.stop_reward` was reached (the run ends as on a stop, reading nothing more)."""
        if self.reward_reached is not None:
            return None
        pol = self.policy
        t0 = time.monotonic()
        b = Batch()
        take = pol.step()
        while take.need > 0:
            if stopping():
                return None
            got = [self.redo.pop(0) for _ in range(min(take.need, len(self.redo)))]
            if not got:
                got = self.buffer.read(take.need, self.cfg.buffer.block_ms, CONSUMER)
            if not got:
                await self._resync_if_restarted()
                continue
            take.read(len(got))
            # the policy's split; acks and counts the dropped, crediting the gate in the same script
            keep, dropped = self.buffer.filter_stale(got, version, pol.limit, pol.stale_policy)
            if dropped:
                take.replace_stale(len(dropped))
                _log(f"dropped {len(dropped)} group(s) older than {pol.limit} versions at v={version}; "
                     f"reading replacements")
            if self.cfg.algorithm.filter_groups:
                uniform = [e for e in keep if len({t.reward for t in e[1].trajectories}) <= 1][:take.filter_room]
                if uniform:
                    self.buffer.drop([eid for eid, _ in uniform], "filtered")  # credits the gate
                    take.replace_filtered(len(uniform))
                    gone = {eid for eid, _ in uniform}
                    keep = [e for e in keep if e[0] not in gone]
            b.ids += [eid for eid, _ in keep]
            b.groups += [g for _, g in keep]
        b.dropped_stale, b.filtered = take.dropped_stale, take.filtered
        b.fetch_s = time.monotonic() - t0
        return b

    # ---- co-located phases ---------------------------------------------------------------------------
    @property
    def _release(self) -> bool:
        return self.colocated and self.cfg.colocate.release_memory

    @property
    def _released_tags(self) -> list[str] | None:
        """What the servers release for a co-located training phase: everything (None), or with LoRA only
        the KV cache — a push carries the adapter alone, so the servers keep their frozen base."""
        return ["kv_cache"] if self.cfg.model.lora_rank > 0 else None

    async def end_generation(self) -> None:
        """Co-located: the step's batch is complete, the servers give the devices to the learner —
        pause → release the KV cache and weights (LoRA: the KV cache alone, the servers keep the base).
        Requests still generating (η ≥ 1) are aborted: their
        clients resubmit them with the tokens so far, which wait in the paused servers and continue
        after the handoff (partial rollout; the client records each token's version — a retract would
        return them all under the version that finishes them). Disaggregated: nothing (the servers keep
        generating while the learner trains)."""
        if not self.colocated:
            return
        t0 = time.monotonic()
        try:
            await self.pusher.pause("abort")
            if self._release:
                await self.pusher.release_memory(self._released_tags)
        except WeightPushError as e:  # a server died: train anyway; the handoff re-syncs every server
            _log(f"could not hand the devices over to the learner ({e}): training anyway, the weight push "
                 "re-syncs the servers and continues them")
            self.in_phase = False
        else:
            self.in_phase = True
        self.phase_log = {"release_s": time.monotonic() - t0}

    async def start_generation(self, sleep) -> None:
        """Co-located, after the handoff (and the step's checkpoint): the learner sleeps (`sleep()`, its
        state off the devices), the servers get their KV cache back and continue. Logs the step's
        phases. Disaggregated: nothing (`update` continued the servers)."""
        if not self.colocated:
            return
        sleep_s = sleep()
        t1 = time.monotonic()
        if self.in_phase:
            self.in_phase = False
            try:
                if self._release:
                    await self.pusher.resume_memory(["kv_cache"])
                await self.pusher.resume()
            except WeightPushError as e:  # a server died: wait for it, give memory back, push again (continues)
                weights, version = self.pushed
                await self._push(weights, version, resync=f"resuming generation failed ({e})")
        p = self.phase_log | {"sleep_s": sleep_s, "resume_s": time.monotonic() - t1}
        self.phase_log = {}
        _log("co-located step: " + " → ".join(f"{k[:-2]} {p[k]:.3f} s" for k in
                                              ("release_s", "wake_s", "train_s", "handoff_s", "sleep_s", "resume_s")
                                              if k in p)
             + ("" if self._release else " (colocate.release_memory=false: paused, not released)"))

    def note_phase(self, **seconds: float) -> None:
        """Record co-located phase timings (wake_s, train_s) for the step's log line."""
        self.phase_log.update(seconds)

    # ---- push, re-sync, version, commit ----------------------------------------------------------------
    async def push(self, weights, version: int) -> PushResult:
        """Push the step's weights as `version`, re-syncing first if a server restarted since the last
        push, and after a failed push (see `_push`). Co-located: the handoff inside the training phase —
        the servers get their weights' memory back and load the new ones, and stay paused
        (`start_generation` continues them)."""
        t0 = time.monotonic()
        res = await self._push(weights, version, resync=self._restarted(), in_phase=self.in_phase)
        if self.colocated:
            self.phase_log["handoff_s"] = time.monotonic() - t0
        return res

    def _restarted(self) -> str | None:
        n = self.buffer.run.restarts("server")
        return f"server(s) restarted ({n - self.seen_restarts} restart(s))" if n > self.seen_restarts else None

    def _raise_if_restarted(self) -> None:
        if self._restarted() is not None:
            raise _ServersRestarted

    async def _resync_if_restarted(self) -> None:
        """A server restarted while nothing is being pushed: push the weights the others serve again."""
        reason = self._restarted()
        if reason is not None and self.pushed is not None:
            weights, version = self.pushed
            await self._push(weights, version, resync=reason)

    async def _push(self, weights, version: int, resync: str | None = None, in_phase: bool = False) -> PushResult:
        """Push `weights` as `version`. With `resync` (why), and after a push that failed (a server
        died mid-push), re-sync: wait until every server answers, re-form the weight group, push
        (pause → buckets → continue, which also continues a server started paused). At most
        MAX_RESYNCS re-syncs, then WeightPushError: the learner exits, the launcher restarts it.
        `in_phase`: a co-located training phase holds the servers paused, their memory released: the
        weights' memory is resumed first and the servers stay paused afterwards."""
        reason, err, how = resync, None, ""
        seen, t0 = self.seen_restarts, time.monotonic()
        for attempt in range(MAX_RESYNCS + 1 if resync is None else MAX_RESYNCS):
            try:
                if reason is not None:
                    seen = self.buffer.run.restarts("server")  # before: a restart during the re-sync triggers another
                    how = await self.pusher.reform()
                if in_phase and self._release and self._released_tags is None:
                    await self.pusher.resume_memory(["weights"])  # a restarted server has nothing released
                elif self.colocated and not in_phase:
                    # outside a phase (start, re-sync, a phase a server's death broke): all memory back
                    # first, then the update pauses and continues the servers itself
                    await self.pusher.resume_memory(self._released_tags)
                nccl = getattr(self.pusher, "backend", None) == "nccl"
                if nccl:  # the launcher restarts the servers if this learner dies before it ends
                    self.buffer.run.mark_push({"version": version, "backend": "nccl"})
                res = await self.pusher.update(weights, version, paused=in_phase)
                if nccl:
                    self.buffer.run.mark_push(None)
            except WeightPushError as e:
                err = e
                reason = reason or "a weight push failed"
                _log(f"weight sync of version {version} failed ({e}): re-syncing the servers")
                await self._restart_stuck_servers()
                continue
            again = " again" if self.pushed is not None and self.pushed[1] == version else ""
            self.pushed = (weights, version)
            if reason is not None:
                self.seen_restarts = max(self.seen_restarts, seen)
                M.WEIGHT_RESYNCS.inc()
                _log(f"{reason}: {how}, pushed version {version}{again} in {time.monotonic() - t0:.1f} s")
            return res
        raise WeightPushError(f"could not push version {version} to every server after {MAX_RESYNCS} re-sync(s) "
                              f"({reason}); last error: {err}")

    async def _restart_stuck_servers(self) -> None:
        """After a failed NCCL push, the servers whose update call never answered are inside a broadcast
        that will not complete, and SGLang gives its side of the weight group torch's default 30-minute
        timeout with no route to end it (tests/conformance checks SGLang's code for it): ask the launcher to
        restart them (Redis `restart_requests`), then wait until it counted them back up — bounded by
        server.health_timeout_s (900 s at least for SGLang, whose load takes minutes) — before the
        re-sync re-forms the group. Gloo groups time out on both sides (weights.timeout_s): nothing to do."""
        stuck = list(getattr(self.pusher, "stuck", []) or [])
        if getattr(self.pusher, "backend", None) != "nccl" or not stuck:
            return
        before = self.buffer.run.restarts("server")
        names = [f"server{self.pusher.server_urls.index(u)}" for u in stuck]
        for name, url in zip(names, stuck):
            self.buffer.run.request_restart(name, f"stuck in an NCCL weight broadcast at {url} after a failed push")
        wait_s = max(self.cfg.server.health_timeout_s, 900.0)
        _log(f"asked the launcher to restart {', '.join(names)} (stuck in the failed broadcast); waiting up to "
             f"{wait_s:.0f} s for them")
        deadline = time.monotonic() + wait_s
        while self.buffer.run.restarts("server") < before + len(names):
            if time.monotonic() > deadline:
                raise WeightPushError(f"{', '.join(names)} did not come back within {wait_s:.0f} s after the launcher "
                                      "was asked to restart them (server.health_timeout_s)")
            await asyncio.sleep(1.0)

    def set_version(self, version: int) -> None:
        self.buffer.run.set_version(version)
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
        extra = {"step": step, "version": version, "uncommitted": [list(p) for p in self.uncommitted]}
        if self.held_row is not None and self.held_row.step == step:
            # waiting for its validation: a learner restarted from this checkpoint writes it with the results
            # (as a JSON string: json keeps NaN statistics, msgspec's JSON would turn them into null)
            extra["held_row"] = json.dumps(self.held_row.to_row())
        return extra

    # ---- validation ----------------------------------------------------------------------------------
    def maybe_request_eval(self, version: int, step: int) -> None:
        t = self.cfg.train
        due = (step == 0 and t.val_before_train) or (step > 0 and t.test_freq > 0 and step % t.test_freq == 0)
        if self.evals is not None and due:
            self.evals.request(version, step)
            self.eval_pending = version

    async def collect_eval(self, stopping, *, trained_since_push: bool) -> None:
        """Wait for the pending validation (the servers must keep its version until it ends) and write
        the held metrics row of the step it evaluated, results included (none if asked to stop).

        A server restarted meanwhile is re-synced without abandoning the wait: it may hold the
        validation's requests paused. The push reads the learner's live weights; after a train step
        (`trained_since_push`) those are the next version's, so the restarted server serves them under
        the validated version's label until the push that follows this wait (the log says so): no rank
        keeps a second copy of the model for this rare case."""
        if self.evals is not None and self.eval_pending is not None:
            deadline = time.monotonic() + self.cfg.eval.timeout_s
            while True:
                try:
                    res = self.evals.collect(self.eval_pending, max(0.0, deadline - time.monotonic()), stopping,
                                             on_wait=self._raise_if_restarted) or {}
                    break
                except _ServersRestarted:
                    if trained_since_push:
                        _log(f"a server restarted during the validation of version {self.eval_pending}; the learner "
                             "holds only the next step's weights: the restarted server serves those, labelled "
                             f"{self.eval_pending}, until the push that follows this validation")
                    await self._resync_if_restarted()
            self.eval_pending = None
            M.set_val_metrics(res)
            if self.held_row is not None:
                self.held_row.val = res
            else:  # version 0 (train.val_before_train): no step produced it; it goes into step 1's row
                self.carry_val = res
        if self.held_row is not None:
            self._write_row(self.held_row, self.held_extra)
            self.held_row = None

    # ---- report --------------------------------------------------------------------------------------
    def report(self, step: int, version: int, stats: TrainStats, batch: Batch, push: PushResult) -> None:
        """The step's metrics row and Prometheus. A step whose weights are being validated has its row
        held until `collect_eval` adds the results (before the next push, or at the end)."""
        staleness = trained_staleness(batch.groups, version - 1)  # trained at version − 1; `version` is published
        buffer_stats = self.buffer.refresh_metrics()  # also sets the buffer gauges
        row = StepMetrics(
            step=step, version=version, staleness_max=max(staleness, default=0),
            staleness_mean=sum(staleness) / len(staleness) if staleness else float("nan"),
            dropped_stale=batch.dropped_stale, filtered=batch.filtered, fetch_s=batch.fetch_s,
            incarnation=self.incarnation, time=time.time(), reward_failures=buffer_stats.get("reward_failures", {}),
            val=self.carry_val, train=stats, push=push)
        self.carry_val = {}
        # buffer state for the trackers (`buffer/…`); metrics.jsonl rows carry what StepMetrics has
        extra = {f"buffer_{k}": buffer_stats[k] for k in ("depth", "pending", "oldest_age_s") if k in buffer_stats}
        if self.eval_pending == version:
            self.held_row, self.held_extra = row, extra
        else:
            self._write_row(row, extra)
        M.POLICY_VERSION.set(version)
        M.LEARNER_STEP.set(step)
        M.FETCH_SECONDS.observe(row.fetch_s)  # push seconds: the pushers observe them (re-syncs too)
        M.observe_train(stats)  # every TrainStats field with a series (api/step_stats.py)
        M.STALENESS_MAX.set(row.staleness_max)
        for s in staleness:
            M.STALENESS.observe(s)
        self.rewards.append(stats.reward_mean)
        t = self.cfg.train
        self.reward_reached = reward_reached(self.rewards, t.stop_reward, t.stop_reward_window)
        if self.reward_reached is not None:
            _log(f"train.stop_reward={t.stop_reward} reached at step {step}: mean reward "
                 f"{self.reward_reached:.3f} over the last {t.stop_reward_window} steps; the run ends")

    def _write_row(self, row: StepMetrics, extra: dict | None = None) -> None:
        """A step's row: metrics.jsonl (always), then every tracker of `metrics.loggers`."""
        append_metrics(self.run_dir, row)
        self.loggers.log_row({**(extra or {}), **row.to_row()})

    async def close(self, stopped: bool, step: int, version: int, *, saved: bool) -> None:
        if stopped:
            _log(f"stopped after step {step} (version {version})" + ("; checkpoint saved and committed" if saved else ""))
        else:
            _log(f"done: {step} steps, final version {version}")
        self.loggers.close()
        await self.pusher.close()
        self.buffer.close()


class Follower:
    """Every rank but 0: the coordinator's verbs, doing nothing (rank 0 alone talks to Redis and servers)."""

    async def start(self, *a, **kw) -> None: ...
    async def fetch(self, version: int, stopping) -> Batch: return Batch()  # noqa: E704
    async def push(self, weights, version: int) -> PushResult: return PushResult()  # noqa: E704
    async def end_generation(self) -> None: ...
    async def start_generation(self, sleep) -> None: ...
    def note_phase(self, **seconds: float) -> None: ...
    def set_version(self, version: int) -> None: ...
    def published(self, *a) -> None: ...
    def commit(self, step: int) -> None: ...
    def checkpoint_extra(self, step: int, version: int) -> dict: return {"step": step, "version": version}  # noqa: E704
    def maybe_request_eval(self, *a) -> None: ...
    async def collect_eval(self, stopping, *, trained_since_push: bool) -> None: ...
    def report(self, *a) -> None: ...
    async def close(self, *a, **kw) -> None: ...


async def run(run_dir: str, metrics_port: int | None, incarnation: int, weight_port: int, device: str,
              launch: str) -> int:
    from areal_like.learner.checkpoint import CheckpointError, CheckpointManager
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

    colocated = parse_allocation(cfg.allocation).colocated  # `<generation>|<training>`: phases per step
    trainer = Trainer.from_config(cfg, LayoutSpec.from_allocation(cfg.allocation), device=device)
    if rank == 0:
        _log(f"precision: {trainer.precision_policy}")  # model.dtype computes; train.master_dtype holds the state
        _log(f"memory: {trainer.memory_policy}")  # model.enable_gradient_checkpointing, train.logits_chunk_tokens
        _log(f"data parallel: {trainer.sharding_policy}")  # train.dp_sharding, the allocation's training d
        if trainer.lora is not None:
            _log(f"LoRA: {trainer.lora_policy}")  # model.lora_rank, lora_alpha, target_modules, lora_path
    ckpt = CheckpointManager.from_config(cfg.train, run_dir=run_dir)
    try:  # every rank; verified first, falls back past an unusable newest checkpoint (`auto`)
        extra = ckpt.resume(trainer, explicit=incarnation == 0, log=_log)
    except CheckpointError as e:
        _log(f"cannot resume: {e}")
        return 3
    step = last_saved = extra["step"] if extra else 0
    version = extra["version"] if extra else 0
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
    a = p.parse_args(argv)
    from areal_like.api.net import apply_gloo_interface

    apply_gloo_interface()  # before the pool's gloo groups: the interface of this node's address (issue 40)
    import uvloop

    code = uvloop.run(run(a.run_dir, a.metrics_port, a.incarnation, a.weight_sync_port, a.device, a.launch))
    import torch.distributed as dist

    if dist.is_initialized():  # a rank of a pool: its process ends without the interpreter's finalization
        from areal_like.learner.parallel.spawn import exit_rank

        exit_rank(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
