"""Validation of the served policy (rank 0): requested every `train.test_freq` steps, collected later.

Rollout worker 0 validates a version while the learner trains on (buffer/eval_channel.py carries the
request and the results). The servers must keep serving that version until its validation ends, so the
learner collects it before the next push. The results go into the metrics row of the step that
produced the version (reporter.py holds that row until then).
"""

from __future__ import annotations

import time
from typing import Callable

from areal_like.api.config import ExperimentConfig
from areal_like.learner.log import log
from areal_like.learner.weight_sync import WeightSync


class _ServersRestarted(Exception):
    """Raised between polls of a validation wait: a server restarted and must be re-synced first."""


class Evaluation:
    """Requests validations of pushed versions and waits for their results, re-syncing restarted servers."""

    def __init__(self, cfg: ExperimentConfig, channel, sync: WeightSync):
        self.cfg = cfg
        self.channel = channel  # buffer.eval_channel.EvalChannel; None without data.val_files
        self.sync = sync
        self.pending: int | None = None  # version whose validation was requested, not collected

    @property
    def enabled(self) -> bool:
        return self.channel is not None

    def maybe_request(self, version: int, step: int) -> None:
        """Request the validation of `version` (pushed after `step`) when one is due: before training
        (`train.val_before_train`, step 0) and every `train.test_freq` steps."""
        t = self.cfg.train
        due = (step == 0 and t.val_before_train) or (step > 0 and t.test_freq > 0 and step % t.test_freq == 0)
        if self.channel is not None and due:
            self.channel.request(version, step)
            self.pending = version

    async def collect(self, stopping: Callable[[], bool], *, trained_since_push: bool) -> dict | None:
        """Wait for the pending validation (the servers must keep its version until it ends): its results,
        {} if asked to stop meanwhile; None when none is pending.

        A server restarted meanwhile is re-synced without abandoning the wait: it may hold the
        validation's requests paused. The push reads the learner's live weights; after a train step
        (`trained_since_push`) those are the next version's, so the restarted server serves them under
        the validated version's label until the push that follows this wait (the log says so): no rank
        keeps a second copy of the model for this rare case."""
        if self.channel is None or self.pending is None:
            return None
        deadline = time.monotonic() + self.cfg.eval.timeout_s
        while True:
            try:
                res = self.channel.collect(self.pending, max(0.0, deadline - time.monotonic()), stopping,
                                           on_wait=self._raise_if_restarted) or {}
                break
            except _ServersRestarted:
                if trained_since_push:
                    log(f"a server restarted during the validation of version {self.pending}; the learner "
                        "holds only the next step's weights: the restarted server serves those, labelled "
                        f"{self.pending}, until the push that follows this validation")
                await self.sync.resync_if_restarted()
        self.pending = None
        return res

    def _raise_if_restarted(self) -> None:
        if self.sync.restarted() is not None:
            raise _ServersRestarted
