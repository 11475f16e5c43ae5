"""The learner's report (rank 0): each step's metrics row, its trackers and gauges, and the stop criterion.

A step's `StepMetrics` row (its `TrainStats`, `PushResult`, staleness, drops, the buffer's reward
failures) goes to metrics.jsonl and to every tracker of `metrics.loggers` (TensorBoard, W&B, with the
buffer's `buffer_*` state); the Prometheus series are set at the same time. A step whose weights are
being validated has its row held until the results come (`validated`); a checkpoint taken meanwhile
stores it (`held_for`), and a learner resumed from that checkpoint holds it again (`restore_held`). The
results of version 0 (`train.val_before_train`) go into step 1's row. After each row the reward window
of `train.stop_reward` is checked (`reward_reached`: the run ends at the next fetch).
"""

from __future__ import annotations

import json
import time

from areal_like import metrics as M
from areal_like.api.config import ExperimentConfig
from areal_like.api.run_files import StepMetrics, append_metrics, reward_reached
from areal_like.api.step_stats import PushResult, TrainStats
from areal_like.buffer.staleness import trained_staleness
from areal_like.learner.feed import Batch
from areal_like.learner.log import log


def serve_metrics(cfg: ExperimentConfig, port: int | None) -> None:
    """Rank 0's Prometheus endpoint (when the launcher gave a port), and the series set from the start."""
    from areal_like.buffer.replay_buffer import DROP_REASONS

    if port:
        M.serve(port)
    M.STALENESS_LIMIT.set(cfg.rollout.max_staleness)
    M.export_at_zero(M.BUFFER_DROPPED, DROP_REASONS)


class Reporter:
    """Turns each step's statistics into its metrics row, tracker entries and gauges."""

    def __init__(self, cfg: ExperimentConfig, buffer, run_dir: str, incarnation: int, loggers):
        self.cfg = cfg
        self.buffer = buffer  # buffer.replay_buffer.ReplayBuffer: its state and gauges, per row
        self.run_dir = run_dir
        self.incarnation = incarnation
        self.loggers = loggers  # metrics.loggers.Loggers: TensorBoard, W&B (rank 0 only)
        self.held_row: StepMetrics | None = None  # a step's row waiting for its validation's results
        self.held_extra: dict = {}  # the trackers' buffer_* values of the held row's step
        self.carry_val: dict[str, float] = {}  # results of version 0 (val_before_train), for step 1's row
        self.rewards: list[float] = []  # reward_mean of each step of this start, for train.stop_reward
        self.reward_reached: float | None = None  # their window's mean once it reached train.stop_reward

    def restore_held(self, row: str, *, validating: bool) -> None:
        """The held row a checkpoint stored (its learner died waiting for the validation): held again for
        the validation this learner requests, or written as is when there is none any more
        (data.val_files unset on resume)."""
        self.held_row = StepMetrics.from_row(json.loads(row))
        if not validating:
            self.write(self.held_row)
            self.held_row = None

    def report(self, step: int, version: int, stats: TrainStats, batch: Batch, push: PushResult, *,
               hold: bool) -> None:
        """The step's metrics row and Prometheus; `hold`: its weights are being validated, the row waits
        for `validated` to add the results (before the next push, or at the end)."""
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
        if hold:
            self.held_row, self.held_extra = row, extra
        else:
            self.write(row, extra)
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
            log(f"train.stop_reward={t.stop_reward} reached at step {step}: mean reward "
                f"{self.reward_reached:.3f} over the last {t.stop_reward_window} steps; the run ends")

    def validated(self, results: dict[str, float] | None) -> None:
        """A validation's `results` (None: none was pending) into the held row — or, for version 0, which
        no step produced, into step 1's row — then the held row written."""
        if results is not None:
            M.set_val_metrics(results)
            if self.held_row is not None:
                self.held_row.val = results
            else:
                self.carry_val = results
        if self.held_row is not None:
            self.write(self.held_row, self.held_extra)
            self.held_row = None

    def held_for(self, step: int) -> str | None:
        """Step `step`'s row while it waits for its validation, for the checkpoint of that step: a learner
        restarted from it writes the row with the results (a JSON string: json keeps NaN statistics,
        msgspec's JSON would turn them into null)."""
        if self.held_row is not None and self.held_row.step == step:
            return json.dumps(self.held_row.to_row())
        return None

    def write(self, row: StepMetrics, extra: dict | None = None) -> None:
        """A step's row: metrics.jsonl (always), then every tracker of `metrics.loggers`."""
        append_metrics(self.run_dir, row)
        self.loggers.log_row({**(extra or {}), **row.to_row()})

    def close(self) -> None:
        self.loggers.close()
