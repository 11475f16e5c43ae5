"""`FailureReporter`: a rollout worker's reward failures → the run's Redis counters, batched.

    RewardFn.on_failure(kind, text, first) ──► record() (in memory, no I/O)
    run(stop): every `interval_s` (at once after a kind's first failure) ──► flush():
        ReplayBuffer.run.count_reward_failures_async({kind: n}, {kind: first text})
          HINCRBY {p}:counters reward_failures:<kind> n;  HSETNX {p}:reward_failures:first <kind> text

The launcher reads them for its progress line, summary.json and the console (the first failure of each
kind with its traceback, printed once); the learner for its metrics.jsonl row
(`ReplayBuffer.run.reward_failures()`). A flush that fails (Redis unreachable) keeps its counts for the next.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable


class FailureReporter:
    def __init__(self, buffer: Any, *, producer: str, interval_s: float = 1.0,
                 log: Callable[[str], None] = print):
        self.buffer = buffer
        self.producer = producer
        self.interval_s = interval_s
        self.log = log
        self._counts: dict[str, int] = {}
        self._first: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._warned = False

    def record(self, kind: str, text: str, first: bool) -> None:
        """RewardFn's on_failure hook."""
        self._counts[kind] = self._counts.get(kind, 0) + 1
        if first:
            self._first[kind] = f"[{self.producer}] {text}"
            self._wake.set()

    async def flush(self) -> None:
        if not self._counts and not self._first:
            return
        counts, first = self._counts, self._first
        self._counts, self._first = {}, {}
        try:
            await self.buffer.run.count_reward_failures_async(counts, first)
            self._warned = False
        except Exception as e:  # Redis away (restarting): keep them for the next flush
            for k, n in counts.items():
                self._counts[k] = self._counts.get(k, 0) + n
            for k, t in first.items():
                self._first.setdefault(k, t)
            if not self._warned:
                self.log(f"could not record reward failures in Redis ({type(e).__name__}: {e}); will retry")
                self._warned = True

    async def run(self, stop: asyncio.Event) -> None:
        """Flush periodically until `stop` is set, then once more."""
        while not stop.is_set():
            waits = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(stop.wait())]
            try:
                await asyncio.wait(waits, timeout=self.interval_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            self._wake.clear()
            await self.flush()
        await self.flush()
