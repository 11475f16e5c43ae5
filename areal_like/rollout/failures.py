"""`WorkflowFailures`: one rollout worker's failed groups — counted by kind, logged without flooding,
backed off, and measured against `rollout.max_failure_fraction`.

    worker: group finished ──► ok()                     (the streak of failures ends: no backoff)
            group failed   ──► failed(kind, group_id, prompt_id, exc)
                                 ├─ the first of its kind in this worker: logged with its traceback
                                 ├─ later ones: one summary line per kind every LOG_EVERY_S at most
                                 ├─ counted (Prometheus now; Redis `workflow_failures:<kind>` by flush())
                                 └─ more than max_failure_fraction × failure_window of the last
                                    failure_window finished groups failed → limit_message (once)
            before starting a group ──► backoff_s()      (0 after a success; doubles per failure, ≤ cap)

Kinds (buffer/scripts.py WORKFLOW_FAILURE_KINDS): `exception` (the workflow raised), `timeout` (it ran
past rollout.episode_timeout_s), `bad_result` (WorkflowResultError: it returned something that is not
a group), `generation` (a generation request failed for good: the servers' fault — counted, backed
off, but not measured against the budget).
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from typing import Any, Callable

from areal_like.buffer.scripts import WORKFLOW_FAILURE_KINDS

LOG_EVERY_S = 30.0
BACKOFF_FIRST_S = 0.05
BACKOFF_MAX_S = 5.0
_BUDGET_KINDS = ("exception", "timeout", "bad_result")
_WHAT = {"exception": "raised", "timeout": "ran past rollout.episode_timeout_s", "bad_result": "returned a bad result",
         "generation": "failed in generation"}


class WorkflowFailures:
    def __init__(self, label: str, *, max_failure_fraction: float = 0.5, failure_window: int = 64,
                 timeout_s: float | None = None, log: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic):
        self.label = label
        """The workflow as configured (rollout.workflow), named in every message."""
        self.max_failure_fraction = max_failure_fraction
        self.failure_window = failure_window
        self.timeout_s = timeout_s
        self.log = log
        self.clock = clock
        self.counts: dict[str, int] = dict.fromkeys(WORKFLOW_FAILURE_KINDS, 0)
        self.unflushed: dict[str, int] = {}
        self.first: dict[str, str] = {}
        self.limit_message: str | None = None
        self.streak = 0
        self._window: deque[bool] = deque(maxlen=failure_window)
        self._window_failed = 0
        self._last_log: dict[str, float] = {}
        self._unlogged: dict[str, int] = dict.fromkeys(WORKFLOW_FAILURE_KINDS, 0)

    def ok(self) -> None:
        """A group finished (accepted, duplicate or skipped)."""
        self.streak = 0
        self._record(False)

    def failed(self, kind: str, group_id: str, prompt_id: str, exc: BaseException | None, workflow: str | None = None) -> bool:
        """Count one failed group; True when this failure crossed the budget (limit_message is set)."""
        if kind not in self.counts:
            raise ValueError(f"unknown workflow failure kind {kind!r}")
        self.counts[kind] += 1
        self.unflushed[kind] = self.unflushed.get(kind, 0) + 1
        self.streak += 1
        wf = workflow or self.label
        if kind == "timeout":
            after = f"{self.timeout_s:g} s" if self.timeout_s is not None else "its time limit"
            detail = f"cancelled after {after} (rollout.episode_timeout_s)"
        elif exc is None:
            detail = "(no details)"
        else:
            detail = "".join(traceback.format_exception(exc)).rstrip()
        text = f"group {group_id} (prompt {prompt_id}): workflow {wf} {_WHAT[kind]}: {detail}"
        now = self.clock()
        if kind not in self.first:
            self.first[kind] = text
            self._last_log[kind] = now
            self.log(f"first workflow failure of kind {kind} (group not made, prompt retried later; counted in "
                     f"summary.json buffer.workflow_failures.{kind}; further ones only counted):\n{text}")
        else:
            self._unlogged[kind] += 1
            if now - self._last_log[kind] >= LOG_EVERY_S:
                last = text.splitlines()[-1][:300]
                self.log(f"{self._unlogged[kind]} more workflow failure(s) of kind {kind} (total {self.counts[kind]}), "
                         f"e.g. {last}")
                self._unlogged[kind] = 0
                self._last_log[kind] = now
        if kind not in _BUDGET_KINDS:
            return False
        return self._record(True)

    def _record(self, failed: bool) -> bool:
        if len(self._window) == self._window.maxlen and self._window[0]:
            self._window_failed -= 1
        self._window.append(failed)
        self._window_failed += failed
        # Past the limit as soon as more than fraction × window of the last window failed (even before
        # the window is full: the fraction cannot come back under it), as reward.max_failure_fraction.
        if not (failed and self.limit_message is None
                and self._window_failed > self.max_failure_fraction * self.failure_window):
            return False
        counts = ", ".join(f"{k} {v}" for k, v in self.counts.items() if v)
        kind = max(_BUDGET_KINDS, key=lambda k: self.counts[k])
        first = self.first.get(kind, "")
        lines = first.splitlines()
        if len(lines) > 12:  # the head (group, prompt) and the end of the traceback
            first = "\n".join([lines[0], "  …", *lines[-10:]])
        self.limit_message = (
            f"workflow {self.label} failed on {self._window_failed} of the last {len(self._window)} groups "
            f"(rollout.max_failure_fraction={self.max_failure_fraction:g} of rollout.failure_window="
            f"{self.failure_window}; failures so far: {counts}). Fix the workflow (or raise "
            f"rollout.max_failure_fraction; 1 = never stop). First failure of kind {kind}:\n{first}")
        return True

    def backoff_s(self) -> float:
        """Seconds to wait before starting the next group: 0 after a success, then doubling per failure in
        a row up to BACKOFF_MAX_S — a workflow that fails at once must not spin (and fill the log)."""
        if self.streak == 0:
            return 0.0
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self.streak - 1))

    def take_unflushed(self) -> dict[str, int]:
        out, self.unflushed = self.unflushed, {}
        return out

    def put_back(self, counts: dict[str, Any]) -> None:
        for k, n in counts.items():
            self.unflushed[k] = self.unflushed.get(k, 0) + n
