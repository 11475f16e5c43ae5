"""`ReplayBuffer`: the Redis stream between rollout workers and the learner — one class owns it.

```
 rollout workers (asyncio)                      Redis ({p} = stream prefix)               learner
 ─────────────────────────                      ───────────────────────────               ───────
 gate.acquire(slot) ──TRY_ACQUIRE──────────────► {p}:running += slot
 generate group …
 add_group(g) ──ADD_GROUP (one script)─────────► SET NX {p}:gid:<id>   (retry = duplicate, no-op)
   waits (poll) while depth ≥ max_groups         XADD {p}:stream
                                                 {p}:running −= slot, accepted += 1
                                                 {p}:stream ──XREADGROUP '>'──────────────► read(B)
                                                            (entry now pending)             filter_stale
                                                                                            train, commit
                                                 XACK + XDEL ◄──────────────────────── ack(ids)
                                                 {p}:version ◄──────────────────────── set_version(v+1)
                                                 XAUTOCLAIM (pending of a dead learner) ──► reclaim()
```

Entry states: undelivered (depth) → pending (delivered, not acked) → acked-and-deleted. Nothing is
removed from the stream before it is acknowledged, so a learner that crashes between read and
commit loses nothing: its pending entries are reclaimed (`reclaim`) by its successor; acked ones are
gone and never replayed (DESIGN invariant 4). Every delivered entry ends as exactly one of
acked / dropped:<reason>, so `consumed = acked + Σ dropped + pending` needs no extra counter.

Malformed or foreign entries (undecodable, wrong schema) are acked, counted as dropped:malformed and
skipped — a bad record never stops the reader. Stale groups are dropped by `filter_stale` (consume
time guard, DESIGN invariant 3) and counted as dropped:stale.

Sync methods for the learner; `*_async` twins for rollout workers run the *same* generator code via
`RedisEndpoint.arun` (see redis_client.py), so there is one copy of the logic and one set of scripts.

This module does not choose what to train on beyond the staleness guard, and does not bump versions
on its own: the learner calls `set_version` after the weights landed on every server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from areal_like.api.config import BufferConfig
from areal_like.api.trajectory import TrajectoryGroup, decode_group, encode_group
from areal_like.buffer import scripts
from areal_like.buffer.redis_client import Call, Cmd, OpGen, RedisCallTimeout, RedisEndpoint, Sleep
from areal_like.metrics import (
    BUFFER_ADDED,
    BUFFER_CONSUMED,
    BUFFER_DEPTH,
    BUFFER_DROPPED,
    BUFFER_OLDEST_AGE,
    BUFFER_PENDING,
    BUFFER_RECLAIMED,
)

log = logging.getLogger(__name__)

Entry = tuple[str, TrajectoryGroup]  # (stream entry id, group)

_ACK_CHUNK = 512  # ids per ACK script call: keeps one script call (which blocks Redis) short


class BufferFullTimeout(RedisCallTimeout):
    """add_group waited longer than its timeout for the learner to drain the buffer."""


def staleness(group: TrajectoryGroup, current_version: int) -> int:
    """Policy versions between the group's oldest generated token and the learner's version.

    A group without generated tokens (min_version −1) has staleness 0: no policy is behind it.
    """
    mv = group.min_version
    return 0 if mv < 0 else current_version - mv


def split_stale(entries: Iterable[Entry], current_version: int, max_staleness: int) -> tuple[list[Entry], list[Entry]]:
    """Pure part of `filter_stale`: (keep, drop) with drop = staleness > max_staleness."""
    keep: list[Entry] = []
    drop: list[Entry] = []
    for e in entries:
        (drop if staleness(e[1], current_version) > max_staleness else keep).append(e)
    return keep, drop


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def _payload(fields: Any) -> bytes | None:
    """Field `g` of an entry; fields come as a dict (XREADGROUP) or a flat list (script reply)."""
    if fields is None:  # entry deleted while pending
        return None
    if isinstance(fields, dict):
        return fields.get(b"g")
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == b"g":
            return fields[i + 1]
    return None


class ReplayBuffer:
    """The replay buffer stream of one run. Cheap to construct; connects on first use.

    `consumer_group` is the learner pool's group: every entry is delivered to one consumer in it.
    Each learner process reading the stream uses its own `consumer` name (e.g. "learner-0").
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        stream: str = "areal_like",
        consumer_group: str = "learner",
        max_groups: int = 1024,
        block_ms: int = 1000,
        socket_timeout_s: float = 10.0,
        password_env: str | None = "AREAL_LIKE_REDIS_PASSWORD",
        id_ttl_s: int = 7 * 24 * 3600,
        add_poll_s: float = 0.05,
        endpoint: RedisEndpoint | None = None,
    ) -> None:
        if endpoint is None:
            if not url:
                raise ValueError("ReplayBuffer needs a redis URL or an endpoint")
            endpoint = RedisEndpoint(url, password_env=password_env, socket_timeout_s=socket_timeout_s)
        self.endpoint = endpoint  # may be shared with the gate of the same process
        self.stream = stream
        self.keys = scripts.Keys.for_stream(stream)
        self.consumer_group = consumer_group
        self.max_groups = max_groups
        self.block_ms = block_ms
        self.id_ttl_s = id_ttl_s
        self.add_poll_s = add_poll_s
        self._check_block(block_ms)
        self._group_ready = False

    @classmethod
    def from_config(cls, cfg: BufferConfig, url: str | None = None, **kw: Any) -> "ReplayBuffer":
        """`url` overrides `cfg.redis_url` (the launcher passes the URL of the Redis it started)."""
        url = url or cfg.redis_url
        if not url:
            raise ValueError("buffer.redis_url is not set and no URL was given: set buffer.redis_url=redis://…")
        return cls(url, stream=cfg.stream, max_groups=cfg.max_groups, block_ms=cfg.block_ms,
                   socket_timeout_s=cfg.socket_timeout_s, password_env=cfg.password_env, **kw)

    def __repr__(self) -> str:
        return f"ReplayBuffer({self.endpoint.name}, stream={self.keys.stream}, group={self.consumer_group})"

    def _check_block(self, block_ms: int) -> None:
        # A BLOCK longer than the socket timeout would time out client-side on an idle stream.
        if block_ms / 1000 + 1.0 > self.endpoint.socket_timeout_s:
            raise ValueError(
                f"block_ms={block_ms} needs socket_timeout_s > {block_ms / 1000 + 1.0:.1f} "
                f"(is {self.endpoint.socket_timeout_s}): raise buffer.socket_timeout_s or lower buffer.block_ms"
            )

    # ---- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        self.endpoint.close()

    async def aclose(self) -> None:
        await self.endpoint.aclose()

    def __enter__(self) -> "ReplayBuffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- operations, written once as generators (see redis_client.RedisEndpoint.run/arun) -------
    def _g_ensure_group(self) -> OpGen:
        if self._group_ready:
            return
        # id "0", not "$": entries added before the group existed must still be delivered.
        yield Call.one(f"create consumer group {self.consumer_group}", self.keys.stream,
                       Cmd("xgroup_create", (self.keys.stream, self.consumer_group), {"id": "0", "mkstream": True},
                           ok_errors=("BUSYGROUP",)), idempotent=True)
        self._group_ready = True

    def _g_add_group(self, group: TrajectoryGroup, timeout_s: float | None) -> OpGen:
        group.validate()  # a malformed group fails here, in the producer, before it reaches Redis
        payload = encode_group(group)
        yield from self._g_ensure_group()
        k = self.keys
        cmd = Cmd.lua(scripts.ADD_GROUP, [k.stream, k.counters, k.running, k.group_id(group.group_id)],
                      [payload, self.consumer_group, self.max_groups, self.id_ttl_s, group.group_id])
        deadline: float | None = None
        waited_log = time.monotonic()
        while True:
            # idempotent by group_id, so a retry after a lost reply cannot duplicate the group
            status, info = yield Call.one(f"add group {group.group_id}", k.stream, cmd, idempotent=True)
            if status == 1:
                BUFFER_ADDED.inc()
                return True
            if status == 0:
                log.info("group %s already in %s (entry %s): duplicate add ignored", group.group_id, k.stream, _s(info))
                return False
            # buffer full: back-pressure. Poll; the learner's acks make room.
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout_s if timeout_s is not None else float("inf")
            if now >= deadline:
                raise BufferFullTimeout(
                    f"redis {self.endpoint.name} key {k.stream}: add group {group.group_id} waited {timeout_s:.1f} s "
                    f"for room (depth {_s(info)} ≥ max_groups {self.max_groups}); is the learner consuming?"
                )
            if now - waited_log > 30.0:
                log.warning("add group %s: %s full (depth %s ≥ %d) for 30 s; waiting for the learner",
                            group.group_id, k.stream, _s(info), self.max_groups)
                waited_log = now
            yield Sleep(self.add_poll_s)

    def _decode(self, raw: Sequence[tuple[Any, Any]]) -> OpGen:
        """Decode raw (id, fields) pairs; ack + count malformed ones. Returns list[Entry]."""
        good: list[Entry] = []
        bad: list[str] = []
        for rid, fields in raw:
            eid = _s(rid)
            payload = _payload(fields)
            try:
                if payload is None:
                    raise ValueError("no field 'g'")
                good.append((eid, decode_group(payload)))
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
                log.warning("dropping malformed entry %s of %s: %s", eid, self.keys.stream, e)
                bad.append(eid)
        if bad:
            yield from self._g_ack(bad, "dropped:malformed")
            BUFFER_DROPPED.labels(reason="malformed").inc(len(bad))
        return good

    def _g_read(self, count: int, block_ms: int | None, consumer: str) -> OpGen:
        block_ms = self.block_ms if block_ms is None else block_ms
        self._check_block(block_ms)
        yield from self._g_ensure_group()
        k = self.keys
        kw: dict[str, Any] = {"count": count}
        if block_ms > 0:
            kw["block"] = block_ms
        for attempt in range(2):
            # not idempotent: a lost reply leaves entries pending under `consumer`; reclaim finds them
            reply = yield Call.one(
                f"read {count} as {consumer} (group {self.consumer_group}, block {block_ms} ms)", k.stream,
                Cmd("xreadgroup", (self.consumer_group, consumer, {k.stream: ">"}), kw, ok_errors=("NOGROUP",)),
                idempotent=False,
            )
            if isinstance(reply, Exception):  # the stream or group vanished (e.g. Redis lost its data)
                log.warning("consumer group %s of %s missing (%s); recreating", self.consumer_group, k.stream, reply)
                self._group_ready = False
                yield from self._g_ensure_group()
                continue
            break
        else:
            return []
        raw = reply[0][1] if reply else []
        good = yield from self._decode(raw)
        BUFFER_CONSUMED.inc(len(good))
        return good

    def _g_ack(self, entry_ids: Sequence[str], field: str) -> OpGen:
        k = self.keys
        n = 0
        for i in range(0, len(entry_ids), _ACK_CHUNK):
            chunk = list(entry_ids[i:i + _ACK_CHUNK])
            n += yield Call.one(f"ack {len(chunk)} entries ({field}) in group {self.consumer_group}", k.stream,
                                Cmd.lua(scripts.ACK, [k.stream, k.counters], [self.consumer_group, field, *chunk]),
                                idempotent=True)
        return n

    def _g_reclaim(self, min_idle_ms: int, consumer: str, count: int) -> OpGen:
        yield from self._g_ensure_group()
        k = self.keys
        start = "0-0"
        out: list[Entry] = []
        while True:
            # not idempotent (a lost reply resets idle times); a later reclaim finds the entries again
            nxt, raw, _deleted = yield Call.one(
                f"reclaim entries idle ≥ {min_idle_ms} ms for {consumer}", k.stream,
                Cmd.lua(scripts.RECLAIM, [k.stream, k.counters], [self.consumer_group, consumer, min_idle_ms, start,
                                                                  count]),
                idempotent=False,
            )
            got = yield from self._decode(raw)
            out.extend(got)
            start = _s(nxt)
            if start == "0-0":
                break
        BUFFER_RECLAIMED.inc(len(out))
        return out

    def _g_stats(self) -> OpGen:
        k = self.keys
        xlen, pending, oldest, now_ms, version, running, flat = yield Call.one(
            "stats", k.stream, Cmd.lua(scripts.STATS, [k.stream, k.counters, k.version, k.running],
                                       [self.consumer_group]), idempotent=True)
        counters = {_s(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        dropped = {f[len("dropped:"):]: v for f, v in counters.items() if f.startswith("dropped:")}
        oldest_s = _s(oldest)
        age = max(0.0, (int(now_ms) - int(oldest_s.split("-")[0])) / 1000) if oldest_s else 0.0
        st = {
            "added": counters.get("accepted", 0),
            "duplicates": counters.get("duplicates", 0),
            "consumed": counters.get("acked", 0) + sum(dropped.values()) + int(pending),
            "acked": counters.get("acked", 0),
            "reclaimed": counters.get("reclaimed", 0),
            "dropped": dropped,
            "depth": int(xlen) - int(pending),
            "pending": int(pending),
            "oldest_age_s": age,
            "version": int(version),
            "running": int(running),
        }
        BUFFER_DEPTH.set(st["depth"])
        BUFFER_PENDING.set(st["pending"])
        BUFFER_OLDEST_AGE.set(age)
        return st

    def _g_get_version(self) -> OpGen:
        v = yield Call.one("get policy version", self.keys.version, Cmd("get", (self.keys.version,)), idempotent=True)
        return int(v) if v is not None else 0

    def _g_set_version(self, version: int) -> OpGen:
        yield Call.one(f"set policy version {version}", self.keys.version,
                       Cmd("set", (self.keys.version, int(version))), idempotent=True)

    def _g_filter_stale(self, entries: Sequence[Entry], current_version: int, max_staleness: int) -> OpGen:
        keep, drop = split_stale(entries, current_version, max_staleness)
        if drop:
            yield from self._g_ack([e[0] for e in drop], "dropped:stale")
            BUFFER_DROPPED.labels(reason="stale").inc(len(drop))
            log.warning("dropped %d stale group(s) at version %d (max staleness %d): %s", len(drop), current_version,
                        max_staleness, [(e[1].group_id, e[1].min_version) for e in drop[:8]])
        return keep, drop

    # ---- sync API (learner) --------------------------------------------------------------------
    def add_group(self, group: TrajectoryGroup, timeout_s: float | None = 600.0) -> bool:
        """Append `group` unless its group_id is already in; True if added, False if a duplicate.

        Atomically with the XADD: the gate slot named `group.group_id` is released and `accepted`
        is incremented. Waits (polling) while the buffer holds ≥ max_groups undelivered groups;
        raises BufferFullTimeout after `timeout_s` (None = wait forever).
        """
        return self.endpoint.run(self._g_add_group(group, timeout_s))

    def read(self, count: int, block_ms: int | None = None, consumer: str = "learner-0") -> list[Entry]:
        """Up to `count` new groups for `consumer` (XREADGROUP '>'); they stay pending until acked.

        Blocks up to `block_ms` (default: the buffer's) when none are available; [] on timeout.
        Malformed entries are acked, counted (dropped:malformed) and not returned, so fewer than
        `count` may come back even when more are queued.
        """
        return self.endpoint.run(self._g_read(count, block_ms, consumer))

    def ack(self, entry_ids: Sequence[str]) -> int:
        """Acknowledge and delete entries — call only after the learner committed the step."""
        return self.endpoint.run(self._g_ack(list(entry_ids), "acked"))

    def drop(self, entry_ids: Sequence[str], reason: str) -> int:
        """Acknowledge and delete entries that will not be trained, counted as dropped:<reason>."""
        n = self.endpoint.run(self._g_ack(list(entry_ids), f"dropped:{reason}"))
        BUFFER_DROPPED.labels(reason=reason).inc(n)
        return n

    def reclaim(self, min_idle_ms: int, consumer: str = "learner-0", count: int = 256) -> list[Entry]:
        """Take over entries pending (read, not acked) for ≥ `min_idle_ms`, e.g. from a dead learner.

        They are returned to be trained now and stay pending under `consumer` until acked. A learner
        restarting under its old consumer name reclaims its own entries with min_idle_ms=0 — only
        do that when no other live consumer shares the group.
        """
        return self.endpoint.run(self._g_reclaim(min_idle_ms, consumer, count))

    def filter_stale(self, entries: Sequence[Entry], current_version: int,
                     max_staleness: int) -> tuple[list[Entry], list[Entry]]:
        """Consume-time guard: drop (ack, count dropped:stale) groups with staleness > max_staleness.

        Dropped groups still count as consumed for the gate (see rollout/gate.py): the learner
        takes B entries per step and trains on the kept ones.
        """
        return self.endpoint.run(self._g_filter_stale(entries, current_version, max_staleness))

    def pending(self) -> int:
        return self.stats()["pending"]

    def depth(self) -> int:
        """Groups accepted but not yet delivered to any consumer."""
        return self.stats()["depth"]

    def stats(self) -> dict[str, Any]:
        """added, duplicates, consumed, acked, reclaimed, dropped {reason: n}, depth, pending,
        oldest_age_s (oldest undelivered group, by the Redis clock), version, running."""
        return self.endpoint.run(self._g_stats())

    def get_version(self) -> int:
        return self.endpoint.run(self._g_get_version())

    def set_version(self, version: int) -> None:
        """The learner calls this only after the new weights landed on every server."""
        self.endpoint.run(self._g_set_version(version))

    # ---- asyncio API (rollout workers) — same generators ----------------------------------------
    async def add_group_async(self, group: TrajectoryGroup, timeout_s: float | None = 600.0) -> bool:
        return await self.endpoint.arun(self._g_add_group(group, timeout_s))

    async def read_async(self, count: int, block_ms: int | None = None, consumer: str = "learner-0") -> list[Entry]:
        return await self.endpoint.arun(self._g_read(count, block_ms, consumer))

    async def ack_async(self, entry_ids: Sequence[str]) -> int:
        return await self.endpoint.arun(self._g_ack(list(entry_ids), "acked"))

    async def filter_stale_async(self, entries: Sequence[Entry], current_version: int,
                                 max_staleness: int) -> tuple[list[Entry], list[Entry]]:
        return await self.endpoint.arun(self._g_filter_stale(entries, current_version, max_staleness))

    async def reclaim_async(self, min_idle_ms: int, consumer: str = "learner-0", count: int = 256) -> list[Entry]:
        return await self.endpoint.arun(self._g_reclaim(min_idle_ms, consumer, count))

    async def stats_async(self) -> dict[str, Any]:
        return await self.endpoint.arun(self._g_stats())

    async def depth_async(self) -> int:
        return (await self.stats_async())["depth"]

    async def get_version_async(self) -> int:
        return await self.endpoint.arun(self._g_get_version())

    async def set_version_async(self, version: int) -> None:
        await self.endpoint.arun(self._g_set_version(version))
