"""The serving phase (rank 0): what the generation servers do around a train step, chosen once per run.

`Disaggregated`: the servers have devices of their own and keep generating while this pool trains; a
weight push pauses and continues them itself, so there is nothing to do around the step.

`Colocated` (allocation `<generation>|<training>`, issue 27): the servers and this pool take turns on
the same devices. Once the step's batch is complete the servers pause and release their memory
(`end_generation`); the push is the handoff into their weights while they stay paused (`handoff`,
`prepare_update`); after the checkpoint the learner sleeps and the servers get their KV cache back and
continue (`start_generation`), which logs the step's phases. With LoRA (`model.lora_rank > 0`) only the
KV cache is released: a push carries the adapter alone and the servers keep their frozen base.

Both have the same verbs, so neither the coordinator nor the weight sync asks which one it holds.
"""

from __future__ import annotations

import time
from typing import Awaitable, Callable

from areal_like.api.config import ExperimentConfig
from areal_like.api.step_stats import PushResult
from areal_like.learner.log import log
from areal_like.weights.admin import WeightPushError
from areal_like.weights.control import GenerationControl

Push = Callable[[bool], Awaitable[PushResult]]  # push(in_phase): the step's weight update
Resync = Callable[[str], Awaitable[object]]  # resync(reason): push the served weights again


class Disaggregated:
    """The servers generate throughout; the step needs nothing from them but the push."""

    in_phase = False  # never holds the servers paused
    push_at_start = False  # a fresh start continues the servers, which serve model.path already

    async def end_generation(self) -> None:
        """Nothing: the servers keep generating while the learner trains."""

    async def handoff(self, push: Push) -> PushResult:
        """The push pauses and continues the servers itself."""
        return await push(False)

    async def prepare_update(self, in_phase: bool) -> None:
        """Nothing: the servers hold all their memory."""

    async def start_generation(self, sleep: Callable[[], float], resync: Resync) -> None:
        """Nothing: the push continued the servers."""

    def note(self, **seconds: float) -> None:
        """No phase log line to time."""


class Colocated:
    """The servers and this pool take turns on the same devices, one phase each per step."""

    push_at_start = True  # in memory, cheap; a learner that died in its phase left the servers released

    def __init__(self, pusher: GenerationControl, *, release: bool, lora: bool):
        self.pusher = pusher
        self.release = release  # colocate.release_memory: false pauses the servers without releasing
        # What the servers release for a training phase: everything (None), or with LoRA only the KV
        # cache — a push carries the adapter alone, so the servers keep their frozen base.
        self.tags: list[str] | None = ["kv_cache"] if lora else None
        self.in_phase = False  # the servers are paused (and released) for this pool's training
        self.times: dict[str, float] = {}  # the step's phase timings, for its log line

    async def end_generation(self) -> None:
        """The step's batch is complete, the servers give the devices to the learner — pause → release
        the KV cache and weights (LoRA: the KV cache alone, the servers keep the base). Requests still
        generating (η ≥ 1) are aborted: their clients resubmit them with the tokens so far, which wait in
        the paused servers and continue after the handoff (partial rollout; the client records each
        token's version — a retract would return them all under the version that finishes them)."""
        t0 = time.monotonic()
        try:
            await self.pusher.pause("abort")
            if self.release:
                await self.pusher.release_memory(self.tags)
        except WeightPushError as e:  # a server died: train anyway; the handoff re-syncs every server
            log(f"could not hand the devices over to the learner ({e}): training anyway, the weight push "
                "re-syncs the servers and continues them")
            self.in_phase = False
        else:
            self.in_phase = True
        self.times = {"release_s": time.monotonic() - t0}

    async def handoff(self, push: Push) -> PushResult:
        """The push inside the training phase: the servers get their weights' memory back and load the
        new ones, and stay paused (`start_generation` continues them). Timed for the log line."""
        t0 = time.monotonic()
        res = await push(self.in_phase)
        self.times["handoff_s"] = time.monotonic() - t0
        return res

    async def prepare_update(self, in_phase: bool) -> None:
        """Before each weight update (and each re-sync's): inside a phase, the weights' memory back
        when it was released (a restarted server has nothing released); outside one (start, re-sync, a
        phase a server's death broke), all memory back first — the update then pauses and continues
        the servers itself."""
        if in_phase:
            if self.release and self.tags is None:
                await self.pusher.resume_memory(["weights"])
        else:
            await self.pusher.resume_memory(self.tags)

    async def start_generation(self, sleep: Callable[[], float], resync: Resync) -> None:
        """After the handoff (and the step's checkpoint): the learner sleeps (`sleep()`, its state off
        the devices), the servers get their KV cache back and continue. A server that died meanwhile is
        waited for, given its memory back and continued by `resync` (a push). Logs the step's phases."""
        sleep_s = sleep()
        t1 = time.monotonic()
        if self.in_phase:
            self.in_phase = False
            try:
                if self.release:
                    await self.pusher.resume_memory(["kv_cache"])
                await self.pusher.resume()
            except WeightPushError as e:
                await resync(f"resuming generation failed ({e})")
        p = self.times | {"sleep_s": sleep_s, "resume_s": time.monotonic() - t1}
        self.times = {}
        log("co-located step: " + " → ".join(f"{k[:-2]} {p[k]:.3f} s" for k in
                                             ("release_s", "wake_s", "train_s", "handoff_s", "sleep_s", "resume_s")
                                             if k in p)
            + ("" if self.release else " (colocate.release_memory=false: paused, not released)"))

    def note(self, **seconds: float) -> None:
        """Record phase timings (wake_s, train_s) for the step's log line."""
        self.times.update(seconds)


def make_phase(cfg: ExperimentConfig, pusher: GenerationControl, colocated: bool) -> Disaggregated | Colocated:
    """The run's serving phase: co-located when the allocation shares devices (`<generation>|<training>`)."""
    if colocated:
        return Colocated(pusher, release=cfg.colocate.release_memory, lora=cfg.model.lora_rank > 0)
    return Disaggregated()
