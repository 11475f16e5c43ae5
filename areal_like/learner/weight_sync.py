"""The weight sync (rank 0): every server serves the learner's weights, pushed through `GenerationControl`.

It remembers what the servers serve (the weights and their version) and the server restarts it has seen
(the launcher counts them in `restarts:server` and starts a restarted server with --start-paused). A
push whose servers restarted since the last one, or that failed (a server died mid-push), re-syncs:
wait for every server, re-form the weight group (`pusher.reform()`), push again — which also continues
a restarted server. After a failed NCCL push it first has the launcher restart the servers stuck in
the broken broadcast. After MAX_RESYNCS failed tries it raises WeightPushError and the learner exits.
The serving phase (serving.py) gets the servers' memory ready before each update.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from areal_like import metrics as M
from areal_like.api.config import ExperimentConfig
from areal_like.api.step_stats import PushResult
from areal_like.learner.log import log
from areal_like.learner.serving import Colocated, Disaggregated
from areal_like.weights.admin import WeightPushError
from areal_like.weights.control import GenerationControl

MAX_RESYNCS = 3  # re-syncs (wait, re-form, push) one push may take before the learner gives up


class WeightSync:
    """Pushes weights to every server and re-syncs the servers that restarted or missed a push."""

    def __init__(self, cfg: ExperimentConfig, pusher: GenerationControl, run, phase: Disaggregated | Colocated):
        self.cfg = cfg
        self.pusher = pusher
        self.run = run  # buffer.run_state.RunState: restart counts and requests, the push-in-flight mark
        self.phase = phase
        # (weights, version) the servers serve: what a re-sync pushes again. The weights are the learner's
        # live ones (`Trainer.weight_source`), unchanged until the next train step, after which the next
        # push replaces them (a re-sync during a validation in between: see `Evaluation.collect`).
        self.pushed: tuple[Any, int] | None = None
        self.seen_restarts = 0  # run.restarts("server") when the servers were last known in sync

    def serve_from(self, weights, version: int) -> None:
        """What the servers serve as the learner starts, and the server restarts counted so far."""
        self.seen_restarts = self.run.restarts("server")
        self.pushed = (weights, version)

    async def start(self, *, resumed: bool) -> None:
        """Set up weight sync and make every server serve `pushed`: pushed when resuming from a
        checkpoint (the servers may hold newer weights), when the serving phase asks for it
        (co-located: a learner that died in its training phase left the servers paused and released)
        and with LoRA (the servers start with the base alone and every request names the run's adapter:
        it is pushed before anything generates; a fresh adapter leaves the base's outputs unchanged).
        Otherwise the servers already serve version 0 (model.path) and are only continued (one
        restarted with --start-paused before this learner started waits for that)."""
        must_push = resumed or self.phase.push_at_start or self.cfg.model.lora_rank > 0
        resync = None
        try:
            await self.pusher.init()
            if not must_push:
                await self.pusher.resume()
        except WeightPushError as e:
            resync = f"setting up weight sync failed ({e})"
        if must_push or resync is not None:
            weights, version = self.pushed
            await self._push(weights, version, resync=resync)

    async def push(self, weights, version: int, *, in_phase: bool = False) -> PushResult:
        """Push the step's weights as `version`, re-syncing first if a server restarted since the last
        push, and after a failed push (see `_push`). `in_phase`: inside a co-located training phase."""
        return await self._push(weights, version, resync=self.restarted(), in_phase=in_phase)

    def restarted(self) -> str | None:
        """Why a re-sync is due (a server restarted since the servers were last in sync), else None."""
        n = self.run.restarts("server")
        return f"server(s) restarted ({n - self.seen_restarts} restart(s))" if n > self.seen_restarts else None

    async def resync(self, reason: str) -> PushResult:
        """Push the weights the servers serve again (see `_push`)."""
        weights, version = self.pushed
        return await self._push(weights, version, resync=reason)

    async def resync_if_restarted(self) -> None:
        """A server restarted while nothing is being pushed: push the weights the others serve again."""
        reason = self.restarted()
        if reason is not None and self.pushed is not None:
            await self.resync(reason)

    async def _push(self, weights, version: int, resync: str | None = None, in_phase: bool = False) -> PushResult:
        """Push `weights` as `version`. With `resync` (why), and after a push that failed (a server
        died mid-push), re-sync: wait until every server answers, re-form the weight group, push
        (pause → buckets → continue, which also continues a server started paused). At most
        MAX_RESYNCS re-syncs, then WeightPushError: the learner exits, the launcher restarts it.
        `in_phase`: a co-located training phase holds the servers paused, their memory released: the
        serving phase gives the weights' memory back first and the servers stay paused afterwards."""
        reason, err, how = resync, None, ""
        seen, t0 = self.seen_restarts, time.monotonic()
        for attempt in range(MAX_RESYNCS + 1 if resync is None else MAX_RESYNCS):
            try:
                if reason is not None:
                    seen = self.run.restarts("server")  # before: a restart during the re-sync triggers another
                    how = await self.pusher.reform()
                await self.phase.prepare_update(in_phase)
                nccl = getattr(self.pusher, "backend", None) == "nccl"
                if nccl:  # the launcher restarts the servers if this learner dies before it ends
                    self.run.mark_push({"version": version, "backend": "nccl"})
                res = await self.pusher.update(weights, version, paused=in_phase)
                if nccl:
                    self.run.mark_push(None)
            except WeightPushError as e:
                err = e
                reason = reason or "a weight push failed"
                log(f"weight sync of version {version} failed ({e}): re-syncing the servers")
                await self._restart_stuck_servers()
                continue
            again = " again" if self.pushed is not None and self.pushed[1] == version else ""
            self.pushed = (weights, version)
            if reason is not None:
                self.seen_restarts = max(self.seen_restarts, seen)
                M.WEIGHT_RESYNCS.inc()
                log(f"{reason}: {how}, pushed version {version}{again} in {time.monotonic() - t0:.1f} s")
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
        before = self.run.restarts("server")
        names = [f"server{self.pusher.server_urls.index(u)}" for u in stuck]
        for name, url in zip(names, stuck):
            self.run.request_restart(name, f"stuck in an NCCL weight broadcast at {url} after a failed push")
        wait_s = max(self.cfg.server.health_timeout_s, 900.0)
        log(f"asked the launcher to restart {', '.join(names)} (stuck in the failed broadcast); waiting up to "
            f"{wait_s:.0f} s for them")
        deadline = time.monotonic() + wait_s
        while self.run.restarts("server") < before + len(names):
            if time.monotonic() > deadline:
                raise WeightPushError(f"{', '.join(names)} did not come back within {wait_s:.0f} s after the launcher "
                                      "was asked to restart them (server.health_timeout_s)")
            await asyncio.sleep(1.0)
