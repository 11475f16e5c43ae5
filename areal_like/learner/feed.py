"""The learner's feed (rank 0): B groups to train per step, read from the replay buffer.

Redo entries first (read by an earlier incarnation but not covered by its checkpoint), then the stream.
Two guards drop groups on the way: the consume-time staleness split (buffer/staleness.py's
`StalenessPolicy` owns the limit and the policy) and DAPO dynamic sampling (`algorithm.filter_groups`:
groups whose rewards are all equal). Each drop is acked with a credit to the gate in the same atomic
script and replaced by one more read, so a step always trains B groups.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from areal_like.api.config import ExperimentConfig
from areal_like.buffer.staleness import StalenessPolicy
from areal_like.learner.log import log


@dataclass
class Batch:
    """What one step consumed from the buffer (rank 0)."""

    ids: list[str] = field(default_factory=list)  # entry ids of the groups to train
    groups: list = field(default_factory=list)
    dropped_stale: int = 0
    filtered: int = 0  # DAPO: all-equal-reward groups dropped and replaced
    fetch_s: float = 0.0


class Feed:
    """Fills a step's `Batch` from the buffer: redo entries, then reads; stale and DAPO-filtered groups
    dropped (crediting the gate) and replaced. `on_idle` runs on every empty read while it waits."""

    def __init__(self, cfg: ExperimentConfig, buffer, consumer: str, on_idle: Callable[[], Awaitable[None]]):
        self.cfg = cfg
        self.buffer = buffer  # buffer.replay_buffer.ReplayBuffer
        self.consumer = consumer
        self.on_idle = on_idle
        # η, B, the consume-time limit, stale policy, DAPO budget: buffer/staleness.py owns the rules
        self.policy = StalenessPolicy.from_config(cfg)
        self.redo: list = []  # entries recovered at start (`Ledger.recover`): trained before any new read

    async def fetch(self, version: int, stopping: Callable[[], bool]) -> Batch | None:
        """B groups to train, always (`StepTake` of buffer/staleness.py: the gate admits (η+v+1)·B
        (+ credit) groups in total, so the learner consumes B entries per version net). Each group
        dropped on the way — stale (the policy's consume-time split) or filtered (DAPO: all rewards
        equal, at most filter_groups_max_extra per step) — returns its place to the gate in the same
        atomic ack (gate_credit) and is replaced by one more read, so a step never trains fewer than B.

        Every empty read awaits `on_idle` (the learner re-syncs servers the launcher restarted there:
        a restarted server holds its requests until weights are pushed). None when asked to stop
        meanwhile: what was read stays pending and is recovered next time."""
        pol = self.policy
        t0 = time.monotonic()
        b = Batch()
        take = pol.step()
        while take.need > 0:
            if stopping():
                return None
            got = [self.redo.pop(0) for _ in range(min(take.need, len(self.redo)))]
            if not got:
                got = self.buffer.read(take.need, self.cfg.buffer.block_ms, self.consumer)
            if not got:
                await self.on_idle()
                continue
            take.read(len(got))
            # the policy's split; acks and counts the dropped, crediting the gate in the same script
            keep, dropped = self.buffer.filter_stale(got, version, pol.limit, pol.stale_policy)
            if dropped:
                take.replace_stale(len(dropped))
                log(f"dropped {len(dropped)} group(s) older than {pol.limit} versions at v={version}; "
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
