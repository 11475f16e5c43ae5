"""Staleness gate client (DESIGN invariant 2): may this rollout worker start one more group?

A worker may start a new group only while

        accepted + running + 1  ≤  (η + v + 1) · B  (+ credit: groups the learner dropped as
                                                    `stale` or `filtered` and replaced by an extra read)

B = groups per training step, η = max staleness, v = policy version ({p}:version), accepted = groups
ever accepted into the buffer, running = slots held by groups being generated. The check and the
increment are one Lua script (buffer/staleness.py: TRY_ACQUIRE), and the counters live in Redis, so the
bound holds across any number of workers on any number of hosts. η = 0 is synchronous RL through this
same code: capacity (v + 1)·B means exactly the B groups of step v can be started, and no more
until the learner has consumed them and published v + 1.

Accounting — a group's life as the counters see it:

```
   try_acquire(slot) ─► running +1 ──┬─ add_group(g)  ── one script ─► running −1, accepted +1 ─► stream
         │  (refused: wait)          │  (buffer/replay_buffer.py)                                  │
         ▼                           ├─ release(slot)  (failed/rejected group) ─► running −1        │
   GATE_REJECTIONS +1                ├─ release_worker(k) (worker k died; the launcher frees its     │
                                     │   slots before restarting it) ─► running −n, lost_in_flight +n ▼
                                     └─ reap(max_age)  (a worker nobody supervises died) ─► running −1
                                                                              learner reads B per step:
                                                                              trains the fresh ones,
                                                                              drops stale/bad ones
```

`accepted` only grows: a group counts from the moment it enters the stream (with or without a slot),
whether the learner later trains it or drops it (stale, malformed, filtered). The gate relies on the
learner consuming B accepted groups per version net: it trains B groups per step, and every group it
drops as stale (consume-time guard) or filtered (DAPO) is acked with a gate credit (gate_credit += 1,
same script) and replaced by one more read, so replacements never eat into the next version's
capacity. Drops for other reasons (malformed, duplicate, already trained) are not replaced and
credit nothing.

Learner restart (DESIGN invariant 4): the learner acks only what its last checkpoint covers, so on
restart everything after it is still pending; it reclaims those entries (`ReplayBuffer.reclaim`),
re-trains them in stream order and may `set_version(v_ckpt)`. Capacity then shrinks and rollouts
wait until v catches up again — no counter needs repair, because `accepted` and `running` describe
the stream and the slots, not the learner.

Slots are named (the group id the worker will produce), so every call is idempotent and safe to retry
after a lost reply: acquiring a held slot grants it again, releasing twice frees it once, and an add
of a group whose slot is already gone frees nothing. Slots of a worker that died are freed by
`reap(max_age_s)` (the supervisor calls it; it is not automatic, because a generation may be long).

Redis crashes (AOF everysec; see buffer/replay_buffer.py). A machine crash can lose the last ~1 s
of writes, and with them recent changes of the counters:
  * lost slot grants (ZADD to running) make `running` too small by the number of slots granted in
    the lost second. Each gate remembers the slots it granted and has not released; when its
    endpoint detects the restart (run_id changed) it re-asserts them (REASSERT: ZADD NX, unless the
    group was accepted meanwhile), so `running` is exact again once every live worker has made one
    Redis call. Until then other workers may be granted up to that many extra slots: the bound can
    be exceeded by at most the number of grants in the lost second, once, and those groups are
    ≤ ⌈extra/B⌉ versions staler than η allows — the learner's consume-time guard drops or counts
    them (stale / stale_kept). Slots of a worker that died with Redis are freed by `reap`.
  * lost accepts (the XADD and `accepted += 1` go together in one script, so they are lost
    together) are re-added by the producer's journal, which restores `accepted`; a group the
    producer could not re-add is counted lost_after_restart and its slot is not held by anyone.
  * a lost `set_version` makes v (and the capacity) smaller until the learner sets it again (the
    learner re-sets v every step) — that only delays workers, never over-admits.

The bound is on counts. For η = 0 it makes staleness exactly 0. For η > 0 a group whose generation
outlives η training steps (a straggler) can still be older than η when consumed; the learner's
consume-time guard (`ReplayBuffer.filter_stale`) drops and counts those (DESIGN invariant 3).

The policy itself — capacity, a group's staleness, the consume-time split, what a learner step takes,
and every Lua script of the gate — lives in buffer/staleness.py (its docstring draws a group's
lifecycle); this module is the client that runs those scripts for a rollout worker and computes none
of it. This module does not generate, and does not touch the stream.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from areal_like.api.config import BufferConfig
from areal_like.buffer import scripts, staleness
from areal_like.buffer.redis_client import Call, Cmd, OpGen, RedisCallTimeout, RedisEndpoint, Sleep
from areal_like.buffer.staleness import allowed, capacity  # re-exported: the policy's pure forms
from areal_like.metrics import GATE_REJECTIONS


class GateDecision(msgspec.Struct, frozen=True):
    granted: bool
    version: int
    accepted: int
    running: int  # after this decision
    capacity: int  # (η + v + 1)·B


class GateTimeout(RedisCallTimeout):
    """acquire() waited longer than its timeout; the message carries the gate's counters."""


class StalenessGate:
    """The gate of one run (keys under `{stream}`); sync methods and `*_async` / `acquire` for asyncio."""

    def __init__(
        self,
        url: str | None = None,
        *,
        max_staleness: int,
        batch_size: int,
        stream: str = "areal_like",
        socket_timeout_s: float = 10.0,
        password_env: str | None = "AREAL_LIKE_REDIS_PASSWORD",
        poll_s: float = 0.01,
        max_poll_s: float = 0.25,
        endpoint: RedisEndpoint | None = None,
    ) -> None:
        staleness.check_bounds(max_staleness, batch_size)
        if endpoint is None:
            if not url:
                raise ValueError("StalenessGate needs a redis URL or an endpoint")
            endpoint = RedisEndpoint(url, password_env=password_env, socket_timeout_s=socket_timeout_s)
        self.endpoint = endpoint  # may be shared with the ReplayBuffer of the same process
        self.keys = scripts.Keys.for_stream(stream)
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.poll_s = poll_s
        self.max_poll_s = max_poll_s
        # slots granted to this process and not released here (some were freed by add_group; the
        # next re-assert forgets those): re-asserted after a Redis restart
        self._held: dict[str, None] = {}
        self._grants_since_prune = 0
        self.prune_every = 1024
        self.endpoint.on_restart(self._g_reassert)

    @classmethod
    def from_config(cls, cfg: BufferConfig, *, max_staleness: int, batch_size: int, url: str | None = None,
                    **kw: Any) -> "StalenessGate":
        """η from `rollout.max_staleness`, B from `train.batch_size`; `url` overrides `cfg.redis_url`."""
        url = url or cfg.redis_url
        if not url and "endpoint" not in kw:
            raise ValueError("buffer.redis_url is not set and no URL was given: set buffer.redis_url=redis://…")
        return cls(url, max_staleness=max_staleness, batch_size=batch_size, stream=cfg.stream,
                   socket_timeout_s=cfg.socket_timeout_s, password_env=cfg.password_env, **kw)

    def __repr__(self) -> str:
        return (f"StalenessGate({self.endpoint.name}, {self.keys.prefix}, η={self.max_staleness}, "
                f"B={self.batch_size})")

    # ---- generators (one copy of the logic) -----------------------------------------------------
    def _g_try(self, slot_id: str) -> OpGen:
        k = self.keys
        g, v, a, r, c = yield Call.one(
            f"gate try_acquire slot {slot_id}", k.running,
            Cmd.lua(staleness.TRY_ACQUIRE, [k.version, k.counters, k.running], [slot_id, self.max_staleness,
                                                                               self.batch_size]),
            idempotent=True,
        )
        d = GateDecision(bool(g), int(v), int(a), int(r), int(c))
        if not d.granted:
            GATE_REJECTIONS.inc()
        elif slot_id not in self._held:
            self._held[slot_id] = None
            self._grants_since_prune += 1
            if self._grants_since_prune >= self.prune_every:
                yield from self._g_reassert()  # also forgets slots whose groups were accepted
        return d

    def _g_reassert(self) -> OpGen:
        """Restart hook (idempotent): put back the slots this process holds; forget accepted ones."""
        self._grants_since_prune = 0
        slots = list(self._held)
        k = self.keys
        added = 0
        for i in range(0, len(slots), 512):
            chunk = slots[i:i + 512]
            n, accepted = yield Call.one(f"gate re-assert {len(chunk)} slots", k.running,
                                         Cmd.lua(staleness.REASSERT, [k.running, k.trained], [k.prefix, *chunk]), idempotent=True)
            added += int(n)
            for sl in accepted:
                self._held.pop(sl.decode() if isinstance(sl, bytes) else str(sl), None)
        return added

    def _g_acquire(self, slot_id: str, timeout_s: float | None) -> OpGen:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = self.poll_s
        while True:
            d = yield from self._g_try(slot_id)
            if d.granted:
                return d
            if deadline is not None and time.monotonic() >= deadline:
                raise GateTimeout(
                    f"redis {self.endpoint.name} key {self.keys.running}: gate refused slot {slot_id} for "
                    f"{timeout_s:.1f} s (accepted {d.accepted} + running {d.running} + 1 > capacity {d.capacity} "
                    f"at v={d.version}, η={self.max_staleness}, B={self.batch_size}); is the learner consuming?"
                )
            yield Sleep(delay)
            delay = min(self.max_poll_s, delay * 1.5)  # back off while the learner trains

    def _g_wait_version(self, timeout_s: float) -> OpGen:
        """Block until the learner's next `set_version` (an event on the version-events stream, see
        ReplayBuffer.set_version) or `timeout_s`, whichever is first. True if woken by an event. An
        event landing just before the call is missed (the wait then lasts `timeout_s`): callers re-check
        the gate after every return, as they would after a fixed sleep."""
        key = self.keys.version_events()
        reply = yield Call.one("wait for a policy version bump", key,
                               Cmd("xread", ({key: "$"},), {"count": 1, "block": max(1, int(timeout_s * 1000))}),
                               idempotent=True)
        return bool(reply)

    def _g_release(self, slot_id: str) -> OpGen:
        self._held.pop(slot_id, None)
        n = yield Call.one(f"gate release slot {slot_id}", self.keys.running,
                           Cmd("zrem", (self.keys.running, slot_id)), idempotent=True)
        return bool(n)

    def _g_state(self) -> OpGen:
        k = self.keys
        v, a, r, c = yield Call.one("gate state", k.running,
                                    Cmd.lua(staleness.GATE_STATE, [k.version, k.counters, k.running],
                                            [self.max_staleness, self.batch_size]), idempotent=True)
        return {"version": int(v), "accepted": int(a), "running": int(r), "capacity": int(c)}

    def _g_reap(self, max_age_s: float) -> OpGen:
        n = yield Call.one(f"gate reap slots older than {max_age_s} s", self.keys.running,
                           Cmd.lua(staleness.REAP, [self.keys.running], [int(max_age_s * 1000)]), idempotent=True)
        return int(n)

    def _g_release_worker(self, prefix: str) -> OpGen:
        n = yield Call.one(f"gate free the slots of {prefix}*", self.keys.running,
                           Cmd.lua(staleness.RELEASE_WORKER, [self.keys.running, self.keys.counters], [prefix]),
                           idempotent=True)
        return int(n)

    # ---- sync ---------------------------------------------------------------------------------
    def try_acquire(self, slot_id: str) -> bool:
        """Take a slot for the group `slot_id` if the bound allows; never waits."""
        return self.endpoint.run(self._g_try(slot_id)).granted

    def try_acquire_detail(self, slot_id: str) -> GateDecision:
        """try_acquire plus the counters the decision was made on (v at acquire time, etc.)."""
        return self.endpoint.run(self._g_try(slot_id))

    def acquire_blocking(self, slot_id: str, timeout_s: float | None = None) -> GateDecision:
        """Wait (polling with backoff) until granted; GateTimeout after `timeout_s`."""
        return self.endpoint.run(self._g_acquire(slot_id, timeout_s))

    def release(self, slot_id: str) -> bool:
        """Free the slot of a group that failed or was rejected; True if it was held."""
        return self.endpoint.run(self._g_release(slot_id))

    def state(self) -> dict[str, int]:
        """{version, accepted, running, capacity}, read atomically."""
        return self.endpoint.run(self._g_state())

    def reassert(self) -> int:
        """Put back this process's slots after a Redis restart (runs by itself when one is detected);
        returns how many were missing."""
        return self.endpoint.run(self._g_reassert())

    def reap(self, max_age_s: float) -> int:
        """Free slots held for longer than `max_age_s` (workers that died mid-group); returns how many."""
        return self.endpoint.run(self._g_reap(max_age_s))

    def release_worker(self, index: int) -> int:
        """Free every slot rollout worker `index` holds (it died: its groups in flight will never be
        added) and count them as `lost_in_flight`; returns how many. Call before restarting it."""
        return self.endpoint.run(self._g_release_worker(f"w{index}-"))

    def close(self) -> None:
        self.endpoint.close()

    # ---- asyncio (rollout workers) ---------------------------------------------------------------
    async def acquire(self, slot_id: str, timeout_s: float | None = None) -> GateDecision:
        """Wait until the gate grants `slot_id`; GateTimeout after `timeout_s` (None = no limit)."""
        return await self.endpoint.arun(self._g_acquire(slot_id, timeout_s))

    async def try_acquire_async(self, slot_id: str) -> bool:
        return (await self.endpoint.arun(self._g_try(slot_id))).granted

    async def try_acquire_detail_async(self, slot_id: str) -> GateDecision:
        return await self.endpoint.arun(self._g_try(slot_id))

    async def wait_version_async(self, timeout_s: float) -> bool:
        """Wait for the learner's next version bump, at most `timeout_s` (see `_g_wait_version`)."""
        return await self.endpoint.arun(self._g_wait_version(timeout_s))

    async def release_async(self, slot_id: str) -> bool:
        return await self.endpoint.arun(self._g_release(slot_id))

    async def state_async(self) -> dict[str, int]:
        return await self.endpoint.arun(self._g_state())

    async def aclose(self) -> None:
        await self.endpoint.aclose()


__all__ = ["GateDecision", "GateTimeout", "StalenessGate", "allowed", "capacity"]
