"""Rank 0's side of the learner's loop, and the other ranks' (`Follower`): the verbs main.py's loop calls.

Only rank 0 talks to Redis and the generation servers. Its `Coordinator` composes collaborators with one
job each and adds only what joins them (the start-up order, no more fetching once train.stop_reward is
reached, the row a checkpoint stores while it waits for its validation):

    feed.py         Feed          B groups per step: redo entries, reads, stale and DAPO drops → a Batch
    serving.py      phase         what the servers do around a step: Disaggregated or Colocated (pause,
                                  release, handoff, resume, the co-located log line), chosen once
    weight_sync.py  WeightSync    push through GenerationControl; re-sync restarted servers, failed pushes
    evaluation.py   Evaluation    request a validation of a version, wait for its results
    ledger.py       Ledger        publish the version; trained entries, committed once a checkpoint has them
    reporter.py     Reporter      the step's metrics row (held for its validation), trackers, Prometheus,
                                  the train.stop_reward window

Every other rank holds a `Follower`, whose every verb does nothing, so the loop has no rank checks.
"""

from __future__ import annotations

import os

from areal_like.api.config import ExperimentConfig
from areal_like.api.run_files import Endpoints
from areal_like.api.step_stats import PushResult, TrainStats
from areal_like.learner.evaluation import Evaluation
from areal_like.learner.feed import Batch, Feed
from areal_like.learner.ledger import Ledger
from areal_like.learner.log import log
from areal_like.learner.reporter import Reporter, serve_metrics
from areal_like.learner.serving import make_phase
from areal_like.learner.weight_sync import WeightSync

CONSUMER = "learner-0"  # the learner's name as the buffer's consumer, fixed across restarts


class Coordinator:
    """Rank 0: the loop's verbs, each handed to the collaborator whose job it is."""

    def __init__(self, cfg: ExperimentConfig, endpoints: Endpoints, run_dir: str, incarnation: int,
                 weight_port: int, metrics_port: int | None, *, colocated: bool = False):
        from areal_like.buffer.eval_channel import EvalChannel
        from areal_like.buffer.replay_buffer import ReplayBuffer
        from areal_like.metrics.loggers import make_loggers
        from areal_like.weights.factory import make_weight_pusher

        self.cfg = cfg
        serve_metrics(cfg, metrics_port)
        self.buffer = ReplayBuffer.from_config(cfg.buffer, url=os.environ["AREAL_LIKE_REDIS_URL"])
        # the servers' handle (weights.control.GenerationControl), its transport picked by weights.mode
        self.pusher = make_weight_pusher(cfg, endpoints, model_path=cfg.model.path, run_dir=run_dir,
                                         weight_port=weight_port, incarnation=incarnation)
        # co-located (`<generation>|<training>`): the servers and this pool take turns on the same devices
        self.phase = make_phase(cfg, self.pusher, colocated)
        self.sync = WeightSync(cfg, self.pusher, self.buffer.run, self.phase)
        self.feed = Feed(cfg, self.buffer, CONSUMER, on_idle=self.sync.resync_if_restarted)
        self.evaluation = Evaluation(cfg, EvalChannel.from_buffer(self.buffer) if cfg.data.val_files else None,
                                     self.sync)
        self.ledger = Ledger(self.buffer, run_dir, incarnation, CONSUMER)
        self.reporter = Reporter(cfg, self.buffer, run_dir, incarnation,
                                 make_loggers(cfg, run_dir, incarnation, on_error=log))

    @property
    def seen_restarts(self) -> int:
        """The server restarts counted when the servers were last known in sync (`WeightSync`)."""
        return self.sync.seen_restarts

    async def start(self, extra: dict | None, version: int, layout, weights, rollback: bool = False) -> None:
        """Recover the buffer (`Ledger.recover`: its redo entries go first into the feed), take back a
        row held for its validation, and make every server serve `weights` (a `WeightSource`, or a list
        of (name, tensor)) as `version` (`WeightSync.start`: pushed when resuming, co-located or LoRA)."""
        step = extra["step"] if extra else 0
        uncommitted = [tuple(p) for p in (extra or {}).get("uncommitted", [])]
        self.feed.redo = self.ledger.recover(uncommitted, step,
                                             (version, self.cfg.train.batch_size) if rollback else None)
        self.sync.serve_from(weights, version)
        held = (extra or {}).get("held_row")
        if held is not None:  # the previous learner died before writing it (waiting for its validation)
            self.reporter.restore_held(held, validating=self.evaluation.enabled)
        await self.sync.start(resumed=extra is not None)
        if extra is not None:
            log(f"resumed from step {step} (version {version}); servers reloaded")
        self.ledger.started(step)
        log(f"ready: B={self.cfg.train.batch_size} groups/step, η={self.cfg.rollout.max_staleness}, "
            f"layout {layout.spec}, algorithm {self.cfg.algorithm.adv_estimator}, {len(self.pusher.server_urls)} "
            f"server(s), weights.mode={self.cfg.resolved_weights_mode()}")

    async def fetch(self, version: int, stopping) -> Batch | None:
        """The step's B groups (`Feed.fetch`, re-syncing restarted servers while it waits); None when asked
        to stop, or once `train.stop_reward` was reached (the run ends as on a stop, reading nothing more)."""
        if self.reporter.reward_reached is not None:
            return None
        return await self.feed.fetch(version, stopping)

    async def end_generation(self) -> None:
        """Co-located: the servers pause and give the devices to the learner. Disaggregated: nothing."""
        await self.phase.end_generation()

    async def start_generation(self, sleep) -> None:
        """Co-located: the learner sleeps (`sleep()`), the servers take the devices back and continue.
        Disaggregated: nothing (the push continued the servers)."""
        await self.phase.start_generation(sleep, self.sync.resync)

    def note_phase(self, **seconds: float) -> None:
        """Co-located phase timings (wake_s, train_s) for the step's log line."""
        self.phase.note(**seconds)

    async def push(self, weights, version: int) -> PushResult:
        """The step's weights to every server as `version`, through the serving phase's handoff."""
        return await self.phase.handoff(lambda in_phase: self.sync.push(weights, version, in_phase=in_phase))

    def set_version(self, version: int) -> None:
        self.ledger.set_version(version)

    def published(self, step: int, version: int, batch: Batch) -> None:
        self.ledger.published(step, version, batch)

    def commit(self, step: int) -> None:
        self.ledger.commit(step)

    def checkpoint_extra(self, step: int, version: int) -> dict:
        """The ledger's record, and the step's row if it waits for its validation."""
        extra = self.ledger.checkpoint_extra(step, version)
        held = self.reporter.held_for(step)
        if held is not None:
            extra["held_row"] = held
        return extra

    def maybe_request_eval(self, version: int, step: int) -> None:
        self.evaluation.maybe_request(version, step)

    async def collect_eval(self, stopping, *, trained_since_push: bool) -> None:
        """Wait for the pending validation, if any (`Evaluation.collect`), and write the held row of the
        step it evaluated with its results (none if asked to stop)."""
        self.reporter.validated(await self.evaluation.collect(stopping, trained_since_push=trained_since_push))

    def report(self, step: int, version: int, stats: TrainStats, batch: Batch, push: PushResult) -> None:
        """The step's row, held while the weights it published are being validated."""
        self.reporter.report(step, version, stats, batch, push, hold=self.evaluation.pending == version)

    async def close(self, stopped: bool, step: int, version: int, *, saved: bool) -> None:
        if stopped:
            log(f"stopped after step {step} (version {version})" + ("; checkpoint saved and committed" if saved else ""))
        else:
            log(f"done: {step} steps, final version {version}")
        self.reporter.close()
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
