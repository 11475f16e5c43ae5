"""Continuous batching on the event loop: one scheduler task, compute on one worker thread.

```
 /generate ──► [held while paused] ──► waiting ──┐   scheduler task (this module)
                                                  ├─► executor thread: runner.step(admit, drop)
 abort / pause ──► mark seq done, resolve future ─┘        (drop finished rows, decode 1 token
                                                            for all rows, prefill admitted rows)
 weight loads ──► same single-thread executor: they run between two steps, never during one
```
The scheduler waits on `_wake` when idle or paused. Requests join and leave between decode steps.
Requests are resolved on the loop (never from the worker thread). Streaming requests carry a
`progress` event, set after every step that gave them a token and when they finish. Stop strings
are checked through the `text_stop` hook the server passes in (only for rows that have them), so
this module knows nothing of HTTP, JSON or tokenization.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from areal_like import metrics
from areal_like.engine.runner import FINISH_LENGTH, FINISH_STOP, ModelRunner, Seq

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    """A Seq plus what the HTTP side needs back."""

    seq: Seq
    future: asyncio.Future
    progress: asyncio.Event | None = None  # streaming: set on new tokens and on finish
    created: float = field(default_factory=time.perf_counter)
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    done: bool = False


class Scheduler:
    def __init__(self, runner: ModelRunner, *, max_batch_size: int, weight_version: str = "0",
                 text_stop: Callable[[Seq], str | None] | None = None):
        self.runner = runner
        metrics.export_at_zero(metrics.GEN_REQUESTS, ("stop", "length", "abort"))  # abort: interrupted
        self.text_stop = text_stop  # seq → the stop string its output now ends with, or None
        self.max_batch_size = max_batch_size
        self.weight_version = weight_version
        # One thread owns the model: steps and weight loads serialise on it.
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[Seq, Request] = {}
        self.by_rid: dict[str, Request] = {}  # every request not yet finished (held, waiting, running)
        self.held: list[Request] = []  # arrived while paused
        self._to_drop: list[Seq] = []  # finished rows the runner still holds
        self.paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self.max_running_seen = 0
        self._step_waiters: list[asyncio.Future] = []  # resolved when the next engine step completes

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="scheduler")

    async def close(self) -> None:
        self._closing = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for req in list(self.by_rid.values()):
            self._finish(req, {"type": "abort", "message": "server shutting down", "status_code": None, "err_type": None})
        self.executor.shutdown(wait=True, cancel_futures=True)

    async def run_on_engine(self, fn: Callable, *args):
        """Run `fn` on the model thread (between two decode steps)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # ---------------------------------------------------------------- requests
    def has_rid(self, rid: str) -> bool:
        return rid in self.by_rid

    def new_request(self, seq: Seq, progress: asyncio.Event | None = None) -> Request:
        return Request(seq=seq, future=asyncio.get_running_loop().create_future(), progress=progress)

    async def submit(self, seq: Seq) -> Request:
        """Queue `seq` (waiting while paused) and return its finished Request."""
        return await self.submit_request(self.new_request(seq))

    async def submit_request(self, req: Request, front: bool = False) -> Request:
        """Queue a Request made by `new_request` and wait until it finished; `front` jumps the
        queue (health checks). Cancelling the caller aborts the request and frees its row."""
        seq = req.seq
        self.by_rid[seq.rid] = req
        try:
            if self.paused:
                self.held.append(req)
                resumed = asyncio.ensure_future(self._resumed.wait())
                try:
                    await asyncio.wait([req.future, resumed], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    resumed.cancel()
                    if req in self.held:
                        self.held.remove(req)
            if not req.done:
                if front:
                    self.waiting.appendleft(req)
                else:
                    self.waiting.append(req)
                metrics.GEN_WAITING.set(len(self.waiting))
                self._wake.set()
            return await req.future
        except asyncio.CancelledError:  # client went away: stop spending compute on it
            self._abort(req, "client disconnected")
            raise

    async def next_step(self) -> None:
        """Return when the engine next completes a step (one already running counts): proof of life
        for /health even when every row is busy (SGLang's health check uses the same rule)."""
        fut = asyncio.get_running_loop().create_future()
        self._step_waiters.append(fut)
        await fut

    def _steps_completed(self) -> None:
        waiters, self._step_waiters = self._step_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def abort(self, rid: str = "", abort_all: bool = False, message: str = "aborted by request") -> int:
        """Abort by rid prefix (or all). Returns how many were aborted."""
        victims = [r for k, r in self.by_rid.items() if abort_all or k.startswith(rid)]
        for req in victims:
            self._abort(req, message)
        return len(victims)

    def _abort(self, req: Request, message: str) -> None:
        if req.done:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if self.running.pop(req.seq, None) is not None:
            self._to_drop.append(req.seq)
        self._finish(req, {"type": "abort", "message": message, "status_code": None, "err_type": None})
        self._wake.set()

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        if req.done:
            return
        req.done = True
        req.finish_reason = reason
        req.weight_version = self.weight_version
        self.by_rid.pop(req.seq.rid, None)
        metrics.GEN_REQUESTS.labels(finish_reason=reason["type"]).inc()
        if not req.future.done():
            req.future.set_result(req)
        if req.progress is not None:
            req.progress.set()

    # ---------------------------------------------------------------- pause / continue
    async def pause(self, mode: str = "abort") -> None:
        """abort: every queued/running request returns with finish_reason abort; returns once the
        runner dropped them. retract: running rows go back to the queue (KV dropped, re-prefilled on
        continue). in_place: rows keep their KV and just stop stepping."""
        self.paused = True
        self._resumed.clear()
        if mode == "abort":
            for req in list(self.waiting) + list(self.running.values()):
                self._abort(req, "paused for weight update")
        elif mode == "retract":
            for seq, req in list(self.running.items()):
                self.running.pop(seq)
                self._to_drop.append(seq)
                self.waiting.appendleft(req)
        elif mode != "in_place":
            raise ValueError(f"unknown pause mode {mode!r}: use abort, retract or in_place")
        drop, self._to_drop = self._to_drop, []
        # Waits for a step in flight to end (single-thread executor) and frees the dropped rows' KV.
        await self.run_on_engine(self.runner.release, drop)
        metrics.GEN_RUNNING.set(len(self.running))
        metrics.GEN_WAITING.set(len(self.waiting))

    def resume(self) -> None:
        self.paused = False
        self._resumed.set()
        self._wake.set()

    def loads(self) -> dict[str, int]:
        return {"num_running_reqs": len(self.running), "num_waiting_reqs": len(self.waiting) + len(self.held),
                "num_paused_waiting_reqs": len(self.held)}

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self.held)

    # ---------------------------------------------------------------- the loop
    async def _loop(self) -> None:
        while not self._closing:
            if self.paused or not (self.running or self.waiting):
                self._wake.clear()
                if self._to_drop and not self.paused:
                    drop, self._to_drop = self._to_drop, []
                    await self.run_on_engine(self.runner.release, drop)
                await self._wake.wait()
                continue
            admit: list[Request] = []
            while self.waiting and len(self.running) + len(admit) < self.max_batch_size:
                admit.append(self.waiting.popleft())
            for req in admit:
                self.running[req.seq] = req
            drop, self._to_drop = self._to_drop, []
            self.max_running_seen = max(self.max_running_seen, len(self.running))
            metrics.GEN_RUNNING.set(len(self.running))
            metrics.GEN_WAITING.set(len(self.waiting))
            try:
                out = await self.run_on_engine(self.runner.step, [r.seq for r in admit], drop)
            except Exception as e:  # a compute error fails the batch, not the server
                log.exception("engine step failed")
                for req in list(self.running.values()):
                    self.running.pop(req.seq, None)
                    self._to_drop.append(req.seq)
                    self._finish(req, {"type": "abort", "message": f"engine error: {e}", "status_code": 500,
                                       "err_type": "InternalServerError"})
                await self.run_on_engine(self.runner.release, list(self._to_drop))
                self._to_drop = []
                continue
            self._steps_completed()
            metrics.GEN_BUSY_SECONDS.inc(out.seconds)
            metrics.GEN_PROMPT_TOKENS.inc(out.prefill_tokens)
            metrics.GEN_TOKENS.inc(len(out.tokens))
            top = out.top or itertools.repeat(None)
            for seq, tok, lp, fin, tp in zip(out.seqs, out.tokens, out.logprobs, out.finish, top):
                req = self.running.get(seq)
                if req is None:  # aborted while the step ran: its token is discarded
                    continue
                seq.output_ids.append(tok)
                seq.output_logprobs.append(lp)
                if tp is not None:
                    seq.output_top.append(tp)
                if req.progress is not None:
                    req.progress.set()
                matched = None
                if fin != FINISH_STOP and seq.stop_strs and len(seq.output_ids) >= seq.min_new_tokens:
                    matched = self.text_stop(seq)  # per-row Python only for rows with stop strings
                if fin == FINISH_STOP:
                    reason = {"type": "stop", "matched": tok}
                elif matched is not None:
                    reason = {"type": "stop", "matched": matched}
                elif fin == FINISH_LENGTH:
                    reason = {"type": "length", "length": len(seq.output_ids)}
                else:
                    continue
                self.running.pop(seq)
                self._to_drop.append(seq)
                self._finish(req, reason)
