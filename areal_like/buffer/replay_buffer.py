"""`ReplayBuffer`: the Redis stream between rollout workers and the learner — one class owns it.

```
 rollout workers (asyncio)                      Redis ({p} = stream prefix)               learner
 ─────────────────────────                      ───────────────────────────               ───────
 gate.acquire(slot) ──TRY_ACQUIRE──────────────► {p}:running += slot
 generate group …
 add_group(g) ──MULTI XADD + ADD_AFTER, EXEC────► XADD {p}:stream, then in the same transaction:
   waits (poll) while depth ≥ max_groups           duplicate / trained / full → delete that entry
   or Redis answers OOM (noeviction)               else SET {p}:gid:<id>, running −= slot, accepted += 1
                                                 {p}:stream ──XREADGROUP '>'──────────────► read(B)
                                                            (entry now pending)             filter_stale
                                                                                            train, checkpoint
                                                 XACK+XDEL, ZADD {p}:trained ◄─────────── commit(pairs, step)
                                                 {p}:version ◄──────────────────────────── set_version(v+1)
                                                 own pending (XREADGROUP 0) ─────────────► recover() at start
                                                 XAUTOCLAIM (pending of a dead learner) ──► reclaim()
```

Entry states: undelivered (depth) → pending (delivered, not acked) → acked-and-deleted. Nothing is
removed from the stream before it is acknowledged (XACK + XDEL of exactly the acked ids; there is no
MAXLEN trimming), so a learner that crashes between read and commit loses nothing. Every delivered
entry ends as exactly one of acked / dropped:<reason>, so `consumed = acked + Σ dropped + pending`.

Consume-time staleness policy (`filter_stale(policy=…)`, DESIGN invariant 3): "drop" acks the stale
groups as dropped:stale; "keep" trains them anyway and counts them as stale_kept. Which groups are
stale, and the ack script that credits the gate for them, belong to buffer/staleness.py (the one
owner of the staleness policy); this class only does the I/O. Other drop reasons:
malformed (undecodable, foreign or wrong-schema entry: acked, counted, skipped — never raised),
duplicate (a group id this consumer already holds, e.g. re-added after a Redis restart while the
learner trained the original), already_trained (its group id is in the trained set).

Exactly once across learner crashes (DESIGN invariant 4) — the protocol the learner follows:

    start:   ckpt = load_checkpoint()            # None on a fresh run
             redo = buf.recover(consumer, ckpt.uncommitted if ckpt else [], ckpt.step if ckpt else 0)
               1. commit(ckpt.uncommitted, ckpt.step)   — idempotent; finishes a commit the crash cut off
               2. raises CheckpointBehindBuffer if the buffer committed a step newer than the checkpoint
                  — unless the learner rolls back on purpose (recover(rollback=…): an explicit older
                  train.resume_mode, or the fallback past an unusable newest checkpoint): then the
                  committed step and version rewind to the checkpoint's and the gate is credited the
                  undone steps' capacity (staleness.ROLLBACK); the undone steps' groups stay trained
                  (acked, deleted, in {p}:trained): never trained twice, absent from the model
               3. returns this consumer's still-pending entries (read, trained into a model state that
                  was never checkpointed) minus already-trained ones: train these first, in order
    step k:  entries = redo[:B] or buf.read(B)    → keep, _ = buf.filter_stale(entries, v, limit, policy)
             train(keep); uncommitted += [(entry_id, group.group_id) for keep]
    save:    save_checkpoint(step=k, version, model, uncommitted)   # atomically: tmp + fsync + rename
             buf.commit(uncommitted, step=k, consumer); uncommitted = []
             (commit = XACK + XDEL + ZADD {p}:trained + SET {p}:committed:<consumer> k, one script)

A crash before the checkpoint is written: the entries are still pending → `recover` returns them →
trained again into the restored (older) model: once in the final model, not lost. A crash after the
checkpoint, before or during `commit`: the checkpoint names them → `recover` commits them → not
returned, not trained twice. Commit only what a checkpoint covers (acks may lag several steps:
pending entries count neither in depth nor in the gate, so deferring them costs nothing).

Redis crashes (AOF everysec: a machine crash loses ≤ ~1 s of writes; a SIGKILL alone loses nothing
already written to the kernel). Every endpoint notices a restart (run_id, see redis_client.py) and
runs this buffer's idempotent hook before its next call proceeds:
  * producers keep a journal of the groups they added in the last `readd_window_s` (payloads up to
    `journal_max_bytes`) and re-run ADD_GROUP for each: a group whose XADD was lost is re-added
    (flag r=1, counted readded_after_restart); one whose payload fell out of the journal and whose
    marker is gone is counted lost_after_restart and logged by id — never silently missing;
  * the learner keeps a journal of its commits of the last `recommit_window_s` and commits them again
    (counted recommitted_after_restart), so a commit the crash undid is redone before the next read;
  * reads skip entries the consumer already holds (a delivery the crash undid is re-delivered) and
    check the trained set for re-added, reclaimed and post-restart entries, so neither path trains a
    group twice.
Reads are retried on connection errors. The consumer's own pending list is scanned (held ids are
skipped) by a read that reconnected — its XREADGROUP reply may have been lost — and by the first read
after any Redis restart, whichever call noticed it: a lost second can keep a delivery but lose the ack
that followed it (a drop — already_trained, duplicate, stale, malformed — is not journaled like a
commit), and such an entry would stay pending forever, unknown to the learner. Either way the
entries found go through the same checks as a read, so each ends acked, dropped or trained once.

Sync methods for the learner; `*_async` twins for rollout workers run the *same* generator code via
`RedisEndpoint.arun` (see redis_client.py), so there is one copy of the logic and one set of scripts.

This module does not choose what to train on beyond the staleness guard, does not checkpoint, and
does not bump versions on its own: the learner calls `buffer.run.set_version` after the weights landed.
The run's other records in the same Redis — version, restart counts and requests, the push mark,
rollout cursors, failure counters — are `buffer.run` (`RunState`, run_state.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from areal_like.api.config import BufferConfig
from areal_like.api.trajectory import TrajectoryGroup, decode_group, encode_group
from areal_like.buffer import scripts
from areal_like.buffer import staleness as stale_policy
from areal_like.buffer.redis_client import Call, Cmd, OpGen, RedisCallError, RedisCallTimeout, RedisEndpoint, Sleep
from areal_like.buffer.run_state import RunState, as_str
from areal_like.buffer.staleness import StalePolicy, split_stale, staleness  # noqa: F401  (re-exported)
from areal_like.metrics import (
    BUFFER_ADDED,
    BUFFER_CONSUMED,
    BUFFER_DEPTH,
    BUFFER_DROPPED,
    BUFFER_OLDEST_AGE,
    BUFFER_PENDING,
    BUFFER_RECLAIMED,
    BUFFER_RESTART_RECOVERY,
    BUFFER_STALE_KEPT,
)

log = logging.getLogger(__name__)

Entry = tuple[str, TrajectoryGroup]  # (stream entry id, group)

DROP_REASONS = ("stale", "malformed", "duplicate", "already_trained", "filtered")
"""Every `dropped:<reason>` (`areal_like_buffer_dropped_groups_total{reason}`): stale (consume-time
staleness limit), malformed, duplicate, already_trained (module docstring), filtered (the learner's
dynamic-sampling filter dropped a whole group)."""

_ACK_CHUNK = 512  # ids per ACK script call: keeps one script call (which blocks Redis) short
_COMMIT_CHUNK = 256  # (entry id, group id) pairs per COMMIT script call
_PEL_PAGE = 256  # entries per page when scanning a consumer's own pending list
_ADD_AFTER_SRC = scripts.ADD_AFTER.source.encode()  # EVAL, not EVALSHA, inside MULTI (see Call.transaction)


class BufferFullTimeout(RedisCallTimeout):
    """add_group waited longer than its timeout for the learner to drain the buffer."""


class CheckpointBehindBuffer(RuntimeError):
    """The buffer committed a learner step newer than the checkpoint being resumed: the groups of the
    steps in between were acked but are not in the model. Resume from the newest checkpoint."""


def _fields(fields: Any) -> dict[bytes, bytes] | None:
    """An entry's fields as a dict; they come as a dict (XREADGROUP) or a flat list (script reply)."""
    if fields is None:  # entry deleted while pending
        return None
    if isinstance(fields, dict):
        return fields
    return {fields[i]: fields[i + 1] for i in range(0, len(fields) - 1, 2)}


class ReplayBuffer:
    """The replay buffer stream of one run. Cheap to construct; connects on first use.

    `consumer_group` is the learner pool's group: every entry is delivered to one consumer in it.
    Each learner process reading the stream uses its own `consumer` name (e.g. "learner-0"); a
    restarted learner keeps its name, so `recover` finds what its predecessor left pending.
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
        trained_ttl_s: float = 6 * 3600,
        readd_window_s: float = 10.0,
        journal_max_bytes: int = 256 << 20,
        recommit_window_s: float = 60.0,
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
        self.trained_ttl_s = trained_ttl_s
        """How long committed group ids stay in {p}:trained; must exceed every journal window."""
        self.readd_window_s = readd_window_s
        self.journal_max_bytes = journal_max_bytes
        self.recommit_window_s = recommit_window_s
        if trained_ttl_s < 2 * max(readd_window_s, recommit_window_s):
            raise ValueError(f"trained_ttl_s={trained_ttl_s} must be ≥ 2 × the journal windows "
                             f"({readd_window_s}, {recommit_window_s} s)")
        self._check_block(block_ms)
        self._group_ready = False
        self._near_full = False  # last add saw depth near max_groups: pre-check before appending
        # consumer → {entry id: group id} delivered to this process and not yet acked/committed/dropped
        self._held: dict[str, dict[str, str]] = {}
        # producer journal: (monotonic time, group id, payload or None once over journal_max_bytes)
        self._journal: deque[tuple[float, str, bytes | None]] = deque()
        self._journal_bytes = 0
        # learner journal: (monotonic time, step, consumer, [(entry id, group id)])
        self._commits: deque[tuple[float, int, str, list[tuple[str, str]]]] = deque()
        self._recent_trained: dict[str, float] = {}  # group id → time committed by this process
        # consumer → `endpoint.restarts` when its own pending list was last reconciled (scanned, or
        # known to need no scan): a Redis restart seen since makes its next read scan the list again
        self._restarts_seen: dict[str, int] = {}
        self.endpoint.on_restart(self._g_after_restart)
        # the run's records beside the stream (version, restarts, push mark, cursors, failure counters)
        self.run = RunState(self.endpoint, self.keys)

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

    def held(self, consumer: str = "learner-0") -> dict[str, str]:
        """{entry id: group id} delivered to `consumer` in this process and not yet acked (a copy)."""
        return dict(self._held.get(consumer, {}))

    # ---- in-memory journals (for the restart hook) ----------------------------------------------
    def _journal_add(self, group_id: str, payload: bytes) -> None:
        now = time.monotonic()
        self._prune_journal(now)
        keep = payload if self._journal_bytes + len(payload) <= self.journal_max_bytes else None
        self._journal.append((now, group_id, keep))
        self._journal_bytes += len(keep) if keep is not None else 0

    def _prune_journal(self, now: float) -> None:
        while self._journal and now - self._journal[0][0] > self.readd_window_s:
            _, _, p = self._journal.popleft()
            self._journal_bytes -= len(p) if p is not None else 0

    def _prune_commits(self, now: float) -> None:
        while self._commits and now - self._commits[0][0] > self.recommit_window_s:
            self._commits.popleft()
        if len(self._recent_trained) > 4 * 4096:
            cut = now - self.recommit_window_s
            self._recent_trained = {g: t for g, t in self._recent_trained.items() if t >= cut}

    def _forget(self, entry_ids: Iterable[str]) -> None:
        entry_ids = list(entry_ids)  # may be a generator: walked once per consumer below
        for held in self._held.values():
            for eid in entry_ids:
                held.pop(eid, None)

    # ---- operations, written once as generators (see redis_client.RedisEndpoint.run/arun) -------
    def _g_ensure_group(self) -> OpGen:
        if self._group_ready:
            return
        # id "0", not "$": entries added before the group existed must still be delivered.
        yield Call.one(f"create consumer group {self.consumer_group}", self.keys.stream,
                       Cmd("xgroup_create", (self.keys.stream, self.consumer_group), {"id": "0", "mkstream": True},
                           ok_errors=("BUSYGROUP",)), idempotent=True)
        self._group_ready = True

    def _add_cmd(self, group_id: str, payload: bytes, readd: bool) -> Cmd:
        k = self.keys
        return Cmd.lua(scripts.ADD_GROUP, [k.stream, k.counters, k.running, k.group_id(group_id), k.trained],
                       [payload, self.consumer_group, self.max_groups, self.id_ttl_s, group_id, "1" if readd else "0"])

    def _g_add_group(self, group: TrajectoryGroup, timeout_s: float | None) -> OpGen:
        group.validate()  # a malformed group fails here, in the producer, before it reaches Redis
        payload = encode_group(group)
        yield from self._g_ensure_group()
        k = self.keys
        gid = group.group_id
        # Fast path: MULTI XADD + ADD_AFTER (scripts.py) — the payload never passes through Lua.
        # Idempotent as a whole: a retry after a lost EXEC reply finds the marker and undoes itself.
        # Sent pre-packed (Call.tx): redis-py's pipeline machinery cost more client CPU than the rest
        # of the add (benchmarks/RESULTS.md, buffer_throughput).
        add = Call.tx(f"add group {gid}", k.stream,
                      [(b"XADD", k.stream, b"*", b"g", payload, b"i", gid),
                       (b"EVAL", _ADD_AFTER_SRC, b"5", k.stream, k.counters, k.running, k.group_id(gid), k.trained,
                        self.consumer_group, self.max_groups, self.id_ttl_s, gid)],
                      idempotent=True)
        check = Call.one(f"check room for group {gid}", k.stream,
                         Cmd.lua(scripts.ADD_CHECK, [k.stream, k.counters, k.group_id(gid), k.trained],
                                 [self.consumer_group, self.max_groups, gid]), idempotent=True)
        # near the limit, ask first (read-only) so waiting producers do not append-and-undo payloads
        check_first = self._near_full
        deadline: float | None = None
        waited_log = time.monotonic()
        while True:
            if check_first:
                status, info = yield check
            else:
                try:
                    _eid, (status, info) = yield add
                except RedisCallError as e:  # OOM under noeviction: Redis is full — back-pressure too
                    if not any(m in str(e) for m in ("OOM", "maxmemory", "EXECABORT")):
                        raise
                    status, info = -1, f"? (Redis refused the write: OOM; raise maxmemory) {str(e)[-80:]}"
                if status == 1:
                    d = int(info)
                    self._near_full = self.max_groups > 0 and d >= self.max_groups * 0.9 - 1
                    BUFFER_ADDED.inc()
                    self._journal_add(gid, payload)
                    return True
            if status == 0:
                log.info("group %s already in %s (%s): duplicate add ignored", gid, k.stream, as_str(info))
                return False
            if status == 1:  # the check found room: add now
                check_first = False
                continue
            # buffer full: back-pressure. Poll (read-only); the learner's acks make room.
            check_first = self._near_full = True
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout_s if timeout_s is not None else float("inf")
            if now >= deadline:
                raise BufferFullTimeout(
                    f"redis {self.endpoint.name} key {k.stream}: add group {gid} waited {timeout_s:.1f} s "
                    f"for room (depth {as_str(info)} ≥ max_groups {self.max_groups}); is the learner consuming?"
                )
            if now - waited_log > 30.0:
                log.warning("add group %s: %s full (depth %s ≥ %d) for 30 s; waiting for the learner",
                            gid, k.stream, as_str(info), self.max_groups)
                waited_log = now
            yield Sleep(self.add_poll_s)

    def _g_accept(self, raw: Sequence[tuple[Any, Any]], consumer: str, check_all: bool) -> OpGen:
        """Turn raw (id, fields) pairs delivered to `consumer` into entries to train.

        Skips entries the consumer already holds (a re-delivery); acks and counts malformed ones,
        duplicates of a held group id, and groups already trained (checked in Redis for re-added
        entries, or for all when `check_all`). Returns list[Entry] in stream order."""
        held = self._held.setdefault(consumer, {})
        held_gids = set(held.values())
        cand: list[tuple[str, bytes | None]] = []
        to_check: list[str] = []
        for rid, fields in raw:
            eid = as_str(rid)
            if eid in held:
                continue  # delivered again after Redis lost the first delivery: we hold it already
            f = _fields(fields)
            cand.append((eid, f.get(b"g") if f else None))
            if f and b"i" in f and (check_all or f.get(b"r") == b"1"):
                to_check.append(as_str(f[b"i"]))  # re-added after a restart (or a recovery path): check
        trained: set[str] = set()
        if to_check:
            flags = yield Call.one(f"check {len(to_check)} group ids against the trained set", self.keys.trained,
                                   Cmd.lua(scripts.TRAINED, [self.keys.trained], to_check), idempotent=True)
            trained = {g for g, f in zip(to_check, flags) if int(f)}
        good: list[Entry] = []
        bad: dict[str, list[str]] = {}
        for eid, payload in cand:
            try:
                if payload is None:
                    raise ValueError("no field 'g'")
                g = decode_group(payload)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
                log.warning("dropping malformed entry %s of %s: %s", eid, self.keys.stream, e)
                bad.setdefault("malformed", []).append(eid)
                continue
            if g.group_id in trained or g.group_id in self._recent_trained:
                log.warning("skipping entry %s of %s: group %s was already trained", eid, self.keys.stream, g.group_id)
                bad.setdefault("already_trained", []).append(eid)
            elif g.group_id in held_gids:
                log.warning("skipping entry %s of %s: group %s is held already (re-added after a restart)", eid,
                            self.keys.stream, g.group_id)
                bad.setdefault("duplicate", []).append(eid)
            else:
                held[eid] = g.group_id
                held_gids.add(g.group_id)
                good.append((eid, g))
        for reason, eids in bad.items():
            # ack those whose delivery is pending; a re-delivered-but-unpending id acks nothing (harmless)
            n = yield from self._g_ack(eids, f"dropped:{reason}")
            BUFFER_DROPPED.labels(reason=reason).inc(len(eids))
            if n < len(eids):
                log.info("%d of %d %s entries were not pending", len(eids) - n, len(eids), reason)
        return good

    def _g_own_pending(self, consumer: str) -> OpGen:
        """The raw entries pending for `consumer` (XREADGROUP id 0 pages), in stream order."""
        k = self.keys
        start = "0"
        out: list = []
        while True:
            reply = yield Call.one(f"scan pending of {consumer} from {start}", k.stream,
                                   Cmd("xreadgroup", (self.consumer_group, consumer, {k.stream: start}),
                                       {"count": _PEL_PAGE}, ok_errors=("NOGROUP",)), idempotent=True)
            page = reply[0][1] if reply and not isinstance(reply, Exception) else []
            if not page:
                return out
            out.extend(page)
            start = as_str(page[-1][0])
            if len(page) < _PEL_PAGE:
                return out

    def _g_read(self, count: int, block_ms: int | None, consumer: str) -> OpGen:
        block_ms = self.block_ms if block_ms is None else block_ms
        self._check_block(block_ms)
        yield from self._g_ensure_group()
        k = self.keys
        kw: dict[str, Any] = {"count": count}
        if block_ms > 0:
            kw["block"] = block_ms
        ep = self.endpoint
        connects0 = ep.connects
        # restart count when this consumer's pending list was last reconciled (not: when this read began)
        restarts0 = self._restarts_seen.setdefault(consumer, ep.restarts)
        for _attempt in range(2):
            # Retried on connection errors. A lost reply leaves entries pending under `consumer`
            # unknown to us: any reconnect (connects changed) triggers the own-pending scan below.
            reply = yield Call.one(
                f"read {count} as {consumer} (group {self.consumer_group}, block {block_ms} ms)", k.stream,
                Cmd("xreadgroup", (self.consumer_group, consumer, {k.stream: ">"}), kw, ok_errors=("NOGROUP",)),
                idempotent=True,
            )
            if isinstance(reply, Exception):  # the stream or group vanished (e.g. Redis lost its data)
                log.warning("consumer group %s of %s missing (%s); recreating", self.consumer_group, k.stream, reply)
                self._group_ready = False
                yield from self._g_ensure_group()
                continue
            break
        else:
            return []
        raw = list(reply[0][1]) if reply else []
        orphans = False
        restarted = ep.restarts != restarts0
        if ep.connects != connects0 or restarted:
            # This read reconnected (its reply may have been lost), or Redis restarted since the last
            # scan — whichever call noticed it (often a commit, not a read). A restart that lost the
            # last second can keep a delivery yet lose the ack that followed it (e.g. of entries
            # dropped as already_trained): they are pending for us and we hold nothing of them. Every
            # entry pending and not held goes through _g_accept again, so it ends acked or trained.
            seen = ep.restarts  # a restart noticed during the scan makes the next read scan again
            pel = yield from self._g_own_pending(consumer)
            self._restarts_seen[consumer] = seen
            ids = {as_str(r[0]) for r in raw}
            extra = [r for r in pel if as_str(r[0]) not in ids and as_str(r[0]) not in self._held.get(consumer, {})]
            if extra:
                log.warning("%d entr(y/ies) of %s were pending for %s without our knowing (a read reply lost in a "
                            "reconnect, or an ack lost in a Redis restart): delivering them now", len(extra), k.stream,
                            consumer)
                raw = extra + raw
                orphans = True
        good = yield from self._g_accept(raw, consumer, check_all=orphans or restarted or ep.restarts != restarts0)
        BUFFER_CONSUMED.inc(len(good))
        return good

    def _g_ack(self, entry_ids: Sequence[str], field: str) -> OpGen:
        k = self.keys
        n = 0
        for i in range(0, len(entry_ids), _ACK_CHUNK):
            chunk = list(entry_ids[i:i + _ACK_CHUNK])
            n += yield Call.one(f"ack {len(chunk)} entries ({field}) in group {self.consumer_group}", k.stream,
                                Cmd.lua(stale_policy.ACK, [k.stream, k.counters], [self.consumer_group, field, *chunk]),
                                idempotent=True)
        self._forget(entry_ids)
        return n

    def _g_commit(self, pairs: Sequence[tuple[str, str]], step: int, consumer: str, recommit: bool) -> OpGen:
        k = self.keys
        n = fresh = 0
        pairs = [(str(e), str(g)) for e, g in pairs]
        for i in range(0, max(len(pairs), 1), _COMMIT_CHUNK):
            chunk = pairs[i:i + _COMMIT_CHUNK]
            last = i + _COMMIT_CHUNK >= len(pairs)
            flat = [x for pair in chunk for x in pair]
            # the committed step is raised with the last chunk only: a crash between chunks leaves it
            # behind, and `recover` redoes the whole commit from the checkpoint
            deleted, new = yield Call.one(
                f"commit {len(chunk)} entries of step {step} for {consumer}", k.stream,
                Cmd.lua(scripts.COMMIT, [k.stream, k.counters, k.trained, k.committed(consumer)],
                        [self.consumer_group, step if last else -1, int(self.trained_ttl_s * 1000),
                         "1" if recommit else "0", *flat]),
                idempotent=True)
            n += int(deleted)
            fresh += int(new)
        self._forget(e for e, _ in pairs)
        if not recommit and pairs:
            now = time.monotonic()
            self._prune_commits(now)
            self._commits.append((now, step, consumer, pairs))
            for _, g in pairs:
                self._recent_trained[g] = now
        return n if not recommit else fresh

    def _g_after_restart(self) -> OpGen:
        """Restart hook (idempotent): redo the commits and adds this process made in the window."""
        now = time.monotonic()
        self._prune_commits(now)
        self._prune_journal(now)
        recommitted = 0
        for _, step, consumer, pairs in list(self._commits):
            recommitted += yield from self._g_commit(pairs, step, consumer, recommit=True)
        if recommitted:
            BUFFER_RESTART_RECOVERY.labels(outcome="recommitted").inc(recommitted)
        self._group_ready = False  # the consumer group may be younger than the lost second
        yield from self._g_ensure_group()
        readded: list[str] = []
        lost: list[str] = []
        for _, gid, payload in list(self._journal):
            if payload is not None:
                status, _info = yield Call.one(f"re-add group {gid} after a Redis restart", self.keys.stream,
                                               self._add_cmd(gid, payload, readd=True), idempotent=True)
                if int(status) == 1:
                    readded.append(gid)
                continue
            k = self.keys
            there, trained = yield Call(f"check group {gid} after a Redis restart", k.stream,
                                        (Cmd("exists", (k.group_id(gid),)), Cmd("zscore", (k.trained, gid))),
                                        idempotent=True)
            if not there and trained is None:
                lost.append(gid)
        if readded:
            BUFFER_RESTART_RECOVERY.labels(outcome="readded").inc(len(readded))
            log.warning("Redis %s lost %d group(s) this producer had added; re-added: %s", self.endpoint.name,
                        len(readded), readded[:16])
        if lost:
            yield Call.one("count lost groups", self.keys.counters,
                           Cmd("hincrby", (self.keys.counters, "lost_after_restart", len(lost))), idempotent=False)
            BUFFER_RESTART_RECOVERY.labels(outcome="lost").inc(len(lost))
            log.error("Redis %s lost %d group(s) whose payloads were no longer journaled (journal_max_bytes=%d): %s",
                      self.endpoint.name, len(lost), self.journal_max_bytes, lost)
        if recommitted:
            log.warning("Redis %s lost %d commit(s) this learner had made: committed them again", self.endpoint.name,
                        recommitted)

    def _g_reclaim(self, min_idle_ms: int, consumer: str, count: int) -> OpGen:
        yield from self._g_ensure_group()
        k = self.keys
        start = "0-0"
        raw: list = []
        while True:
            # not idempotent (a lost reply resets idle times); a later reclaim finds the entries again
            nxt, got, _deleted = yield Call.one(
                f"reclaim entries idle ≥ {min_idle_ms} ms for {consumer}", k.stream,
                Cmd.lua(scripts.RECLAIM, [k.stream, k.counters], [self.consumer_group, consumer, min_idle_ms, start,
                                                                  count]),
                idempotent=False,
            )
            raw.extend(got)
            start = as_str(nxt)
            if start == "0-0":
                break
        out = yield from self._g_accept(raw, consumer, check_all=True)
        BUFFER_RECLAIMED.inc(len(out))
        return out

    def _g_recover(self, consumer: str, uncommitted: Sequence[tuple[str, str]], step: int,
                   rollback: tuple[int, int] | None = None) -> OpGen:
        yield from self._g_ensure_group()
        if uncommitted:
            yield from self._g_commit(uncommitted, step, consumer, recommit=False)
        k = self.keys
        committed = yield Call.one(f"read committed step of {consumer}", k.committed(consumer),
                                   Cmd("get", (k.committed(consumer),)), idempotent=True)
        if committed is not None and int(committed) > step:
            if rollback is None:
                raise CheckpointBehindBuffer(
                    f"redis {self.endpoint.name} key {k.committed(consumer)}: the buffer committed step "
                    f"{int(committed)} but the checkpoint being resumed is step {step}: groups of steps "
                    f"{step + 1}..{int(committed)} were acked and are not in this model; resume from the newest "
                    f"checkpoint, or roll back on purpose with train.resume_mode={step}")
            version, batch_size = rollback
            found, credit = yield Call.one(
                f"roll back {consumer} to step {step}", k.committed(consumer),
                Cmd.lua(stale_policy.ROLLBACK, [k.committed(consumer), k.version, k.counters],
                        [int(step), int(version), int(batch_size)]), idempotent=True)
            if int(found) > step:
                log.warning("rolled back from committed step %d to step %d (version %d): the groups of steps "
                            "%d..%d are not in the model and not trained again; gate credit +%d",
                            int(found), step, version, step + 1, int(found), int(credit))
        seen = self.endpoint.restarts
        raw = yield from self._g_own_pending(consumer)
        self._restarts_seen[consumer] = seen
        out = yield from self._g_accept(raw, consumer, check_all=True)
        BUFFER_RECLAIMED.inc(len(out))
        if out:
            log.warning("recovered %d group(s) %s read but never committed: train them again", len(out), consumer)
        return out

    def _g_stats(self) -> OpGen:
        k = self.keys
        xlen, pending, oldest, now_ms, version, running, flat = yield Call.one(
            "stats", k.stream, Cmd.lua(scripts.STATS, [k.stream, k.counters, k.version, k.running],
                                       [self.consumer_group]), idempotent=True)
        counters = {as_str(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}
        dropped = {f[len("dropped:"):]: v for f, v in counters.items() if f.startswith("dropped:")}
        oldest_s = as_str(oldest)
        age = max(0.0, (int(now_ms) - int(oldest_s.split("-")[0])) / 1000) if oldest_s else 0.0
        st = {
            "added": counters.get("accepted", 0),
            "duplicates": counters.get("duplicates", 0),
            "consumed": counters.get("acked", 0) + sum(dropped.values()) + int(pending),
            "acked": counters.get("acked", 0),
            "reclaimed": counters.get("reclaimed", 0),
            "dropped": dropped,
            "stale_kept": counters.get("stale_kept", 0),
            "readded_after_restart": counters.get("readded_after_restart", 0),
            "lost_after_restart": counters.get("lost_after_restart", 0),
            "recommitted_after_restart": counters.get("recommitted_after_restart", 0),
            "lost_in_flight": counters.get("lost_in_flight", 0),
            "restarts": {f[len("restarts:"):]: v for f, v in counters.items() if f.startswith("restarts:")},
            "reward_failures": {kind: counters.get(f"reward_failures:{kind}", 0) for kind in scripts.REWARD_FAILURE_KINDS},
            "agent_completions_refused": counters.get("agent_completions_refused", 0),
            "workflow_failures": {kind: counters.get(f"workflow_failures:{kind}", 0)
                                  for kind in scripts.WORKFLOW_FAILURE_KINDS},
            "dropped_in_flight_at_stop": counters.get("dropped_in_flight_at_stop", 0),
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

    def _g_filter_stale(self, entries: Sequence[Entry], current_version: int, max_staleness: int,
                        policy: StalePolicy) -> OpGen:
        stale_policy.check_policy(policy)
        fresh, stale = stale_policy.split_stale(entries, current_version, max_staleness)
        if not stale:
            return list(entries), []
        sample = [(e[1].group_id, e[1].min_version) for e in stale[:8]]
        if policy == "keep":
            yield Call.one(f"count {len(stale)} stale groups kept", self.keys.counters,
                           Cmd("hincrby", (self.keys.counters, "stale_kept", len(stale))), idempotent=False)
            BUFFER_STALE_KEPT.inc(len(stale))
            log.warning("training %d stale group(s) at version %d anyway (max staleness %d, policy keep): %s",
                        len(stale), current_version, max_staleness, sample)
            return list(entries), []
        yield from self._g_ack([e[0] for e in stale], "dropped:stale")
        BUFFER_DROPPED.labels(reason="stale").inc(len(stale))
        log.warning("dropped %d stale group(s) at version %d (max staleness %d): %s", len(stale), current_version,
                    max_staleness, sample)
        return fresh, stale

    # ---- sync API (learner) --------------------------------------------------------------------
    def add_group(self, group: TrajectoryGroup, timeout_s: float | None = 600.0) -> bool:
        """Append `group` unless its group_id is already in (or already trained); True if added.

        Atomically with the XADD: the gate slot named `group.group_id` is released and `accepted`
        is incremented. Waits (polling) while the buffer holds ≥ max_groups undelivered groups or
        Redis refuses writes (OOM under noeviction); raises BufferFullTimeout after `timeout_s`
        (None = wait forever). Connection errors are retried with backoff (the add is idempotent).
        """
        return self.endpoint.run(self._g_add_group(group, timeout_s))

    def read(self, count: int, block_ms: int | None = None, consumer: str = "learner-0") -> list[Entry]:
        """Up to `count` new groups for `consumer` (XREADGROUP '>'); they stay pending until acked.

        Blocks up to `block_ms` (default: the buffer's) when none are available; [] on timeout.
        Malformed, duplicate and already-trained entries are acked, counted (dropped:<reason>) and
        not returned, so fewer than `count` may come back even when more are queued.
        """
        return self.endpoint.run(self._g_read(count, block_ms, consumer))

    def ack(self, entry_ids: Sequence[str]) -> int:
        """Acknowledge and delete entries (no trained-set record; the learner uses `commit`)."""
        return self.endpoint.run(self._g_ack(list(entry_ids), "acked"))

    def commit(self, pairs: Sequence[tuple[str, str]], step: int, consumer: str = "learner-0") -> int:
        """The learner's commit of (entry id, group id) pairs after its checkpoint of `step` is saved:
        XACK + XDEL, record the group ids as trained, raise the committed step — one script.
        Idempotent. Returns the number of entries deleted. See the module doc for the protocol."""
        return self.endpoint.run(self._g_commit(list(pairs), step, consumer, recommit=False))

    def recover(self, consumer: str = "learner-0", uncommitted: Sequence[tuple[str, str]] = (),
                step: int = 0, rollback: tuple[int, int] | None = None) -> list[Entry]:
        """Call once when the learner starts, before the first read, with what its checkpoint holds:
        commits `uncommitted` (idempotent), checks the buffer is not ahead of the checkpoint
        (CheckpointBehindBuffer), and returns the entries still pending for `consumer` that were
        not trained — to be trained first, in stream order. `rollback=(version, batch_size)`: the
        learner resumes an older checkpoint on purpose — a buffer ahead of it is rewound to `step`
        and `version` (staleness.ROLLBACK) instead of refused."""
        return self.endpoint.run(self._g_recover(consumer, list(uncommitted), step, rollback))

    def drop(self, entry_ids: Sequence[str], reason: str) -> int:
        """Acknowledge and delete entries that will not be trained, counted as dropped:<reason>."""
        n = self.endpoint.run(self._g_ack(list(entry_ids), f"dropped:{reason}"))
        BUFFER_DROPPED.labels(reason=reason).inc(n)
        return n

    def reclaim(self, min_idle_ms: int, consumer: str = "learner-0", count: int = 256) -> list[Entry]:
        """Take over entries pending (read, not acked) for ≥ `min_idle_ms`, e.g. from a dead learner
        with another consumer name. They stay pending under `consumer` until acked. A learner that
        restarts under its own name uses `recover` instead."""
        return self.endpoint.run(self._g_reclaim(min_idle_ms, consumer, count))

    def filter_stale(self, entries: Sequence[Entry], current_version: int, max_staleness: int,
                     policy: StalePolicy = "drop") -> tuple[list[Entry], list[Entry]]:
        """Consume-time guard (DESIGN invariant 3): returns (to_train, dropped).

        policy "drop": groups with staleness > max_staleness are acked and counted dropped:stale.
        policy "keep": all are returned to train; the stale ones are counted as stale_kept.
        Each dropped group hands its place back to the gate in the same atomic ack (counters.gate_credit,
        as for `filtered`; see rollout/gate.py): the learner reads one replacement per drop, so every
        step trains B groups.
        """
        return self.endpoint.run(self._g_filter_stale(entries, current_version, max_staleness, policy))

    def pending(self) -> int:
        return self.stats()["pending"]

    def depth(self) -> int:
        """Groups accepted but not yet delivered to any consumer."""
        return self.stats()["depth"]

    def stats(self) -> dict[str, Any]:
        """added, duplicates, consumed, acked, reclaimed, dropped {reason: n}, stale_kept,
        readded/lost/recommitted_after_restart, lost_in_flight (groups of dead rollout workers),
        agent_completions_refused, workflow_failures {kind: n}, dropped_in_flight_at_stop (groups
        cancelled when their rollout worker was stopped),
        restarts {kind: n} (roles the launcher restarted), depth, pending, oldest_age_s (oldest undelivered
        group, by the Redis clock), version, running. Also sets the depth/pending/age gauges."""
        return self.endpoint.run(self._g_stats())

    def refresh_metrics(self) -> dict[str, Any]:
        """Set BUFFER_DEPTH / BUFFER_PENDING / BUFFER_OLDEST_AGE from Redis (the learner calls this
        once per step); counters (added, consumed, dropped, …) are counted where they happen."""
        return self.stats()

    # ---- asyncio API (rollout workers) — same generators ----------------------------------------
    async def add_group_async(self, group: TrajectoryGroup, timeout_s: float | None = 600.0) -> bool:
        return await self.endpoint.arun(self._g_add_group(group, timeout_s))

    async def read_async(self, count: int, block_ms: int | None = None, consumer: str = "learner-0") -> list[Entry]:
        return await self.endpoint.arun(self._g_read(count, block_ms, consumer))

    async def ack_async(self, entry_ids: Sequence[str]) -> int:
        return await self.endpoint.arun(self._g_ack(list(entry_ids), "acked"))

    async def commit_async(self, pairs: Sequence[tuple[str, str]], step: int, consumer: str = "learner-0") -> int:
        return await self.endpoint.arun(self._g_commit(list(pairs), step, consumer, recommit=False))

    async def recover_async(self, consumer: str = "learner-0", uncommitted: Sequence[tuple[str, str]] = (),
                            step: int = 0) -> list[Entry]:
        return await self.endpoint.arun(self._g_recover(consumer, list(uncommitted), step))

    async def filter_stale_async(self, entries: Sequence[Entry], current_version: int, max_staleness: int,
                                 policy: StalePolicy = "drop") -> tuple[list[Entry], list[Entry]]:
        return await self.endpoint.arun(self._g_filter_stale(entries, current_version, max_staleness, policy))

    async def reclaim_async(self, min_idle_ms: int, consumer: str = "learner-0", count: int = 256) -> list[Entry]:
        return await self.endpoint.arun(self._g_reclaim(min_idle_ms, consumer, count))

    async def stats_async(self) -> dict[str, Any]:
        return await self.endpoint.arun(self._g_stats())

    async def refresh_metrics_async(self) -> dict[str, Any]:
        return await self.endpoint.arun(self._g_stats())

    async def depth_async(self) -> int:
        return (await self.stats_async())["depth"]
