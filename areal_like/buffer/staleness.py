"""The staleness policy — its one owner (DESIGN invariants 2 and 3): capacity, a group's staleness,
the consume-time split, what a learner step takes, and the Lua scripts that apply them in Redis.

η = max staleness (`rollout.max_staleness`), B = groups per training step (`train.batch_size`),
v = policy version ({p}:version, bumped by the learner once the new weights are on every server).

A group's life, and who moves it (η = 0 runs through exactly the same path):

```
 ROLLOUT WORKER                           the group                                  LEARNER
 ──────────────                           ─────────                                  ───────
                                   ┌─────────────┐
 for each prompt ────────────────► │   WAITING   │ ◄── refused: poll with backoff (GATE_REJECTIONS +1)
                                   └──────┬──────┘
 gate.acquire(slot): TRY_ACQUIRE          │ accepted + running + 1 ≤ (η + v + 1)·B + credit ?
                                          ▼ yes, in one script: ZADD {p}:running slot
                                   ┌─────────────┐
 generate, reward                  │  IN FLIGHT  │ ── failed: release(slot) → WAITING (prompt retried)
                                   └──────┬──────┘ ── worker died: reap / release_worker (lost_in_flight)
 buffer.add_group(g) ─────────────────────┤ one script: XADD, running −1, accepted +1 (never decreases)
                                          ▼
                                   ┌─────────────┐
                                   │  ACCEPTED   │ in {p}:stream ──────► fetch: read(take.need), blocking
                                   └──────┬──────┘                       until rollouts added enough
                                          │ split_stale(entries, v, limit) at the learner's version v
                   staleness(g, v) ≤ limit│            staleness(g, v) > limit (policy drop),
              (or policy keep: stale_kept)│            or all rewards equal (DAPO filter)
                        ┌─────────────────┴────────────────────┐
                        ▼                                      ▼
                 ┌─────────────┐                      ┌─────────────────┐  ACK: dropped:<reason> and
                 │   TRAINED   │                      │     DROPPED     │  gate_credit +1 in one script;
                 └──────┬──────┘                      │ stale/filtered  │  StepTake reads one more
                        │ push, set_version(v + 1);   └────────┬────────┘
                        │ commit after its checkpoint          │
                        ▼                                      ▼
                    capacity +B                          capacity +1  ──► frees WAITING workers
```

What each side waits on:
  * a rollout worker waits only on the gate (besides its local concurrency and the buffer's
    back-pressure `buffer.max_groups`): it starts a group only while
    `accepted + running + 1 ≤ (η + v + 1)·B + credit`, so it waits for the learner to publish v + 1
    (capacity +B) or to drop a stale / filtered group (capacity +1, the credit). It never reads
    anything else of the learner's.
  * for data, the learner waits only on the buffer: a step takes B groups to train (`StepTake`); it blocks in
    the read until rollouts produced them, drops the ones older than the consume-time limit
    (default η) and reads one replacement per drop. It never waits on the gate.

Why it holds: the gate bounds counts, not ages. The learner consumes B accepted groups per version
net (every drop that is replaced credits the gate, so replacements never eat into the next version's
capacity — without the credit η = 0 would deadlock). For η = 0 capacity (v + 1)·B admits exactly the
B groups of step v, so every trained group has staleness 0. For η > 0 a straggler (a group whose
generation outlived η steps) can be older than η when read: the consume-time split catches it.
Drops for other reasons (malformed, duplicate, already trained) are not replaced and credit nothing.

Who calls this module: `rollout/gate.py` (the worker's gate client: TRY_ACQUIRE, GATE_STATE and the
slot scripts), `buffer/replay_buffer.py` (`filter_stale` = `split_stale` + the ACK script below),
`learner/feed.py` (`StalenessPolicy`: limit, stale policy, `StepTake`), `learner/reporter.py`
(`trained_staleness` for metrics) and
`learner/trainer.py` (`max_trained_staleness` for its stats). Nothing else computes staleness
(tests/unit/test_staleness.py checks the package for it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from areal_like.buffer.redis_client import LuaScript
from areal_like.buffer.scripts import NOW_MS_LUA

if TYPE_CHECKING:
    from areal_like.api.trajectory import TrajectoryGroup

StalePolicy = Literal["drop", "keep"]
STALE_POLICIES: tuple[str, ...] = ("drop", "keep")
CREDITED_DROPS: tuple[str, ...] = ("filtered", "stale")
"""Drop reasons that are replaced by one more read and so hand their place back to the gate (gate_credit)."""

E = TypeVar("E")  # an entry: (stream entry id, TrajectoryGroup)


# ---- pure policy --------------------------------------------------------------------------------
def check_bounds(max_staleness: int, batch_size: int) -> None:
    """η ≥ 0 (0 = synchronous RL) and B ≥ 1, or ValueError."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be ≥ 0 (0 = synchronous RL), got {max_staleness}")
    if batch_size < 1:
        raise ValueError(f"batch_size (groups per training step) must be ≥ 1, got {batch_size}")


def capacity(max_staleness: int, version: int, batch_size: int, credit: int = 0) -> int:
    """(η + v + 1)·B + credit — the most groups that may be accepted or running at policy version v.
    `credit`: groups the learner dropped as `stale` or `filtered` (DAPO) and replaced by an
    extra read, so that it still consumes B entries per version net. TRY_ACQUIRE / GATE_STATE compute
    the same in Lua (the authority at run time)."""
    return (max_staleness + version + 1) * batch_size + credit


def allowed(accepted: int, running: int, max_staleness: int, version: int, batch_size: int, credit: int = 0) -> bool:
    """Pure form of the gate's check (the Lua script is the authority; this is for tests and logs)."""
    return accepted + running + 1 <= capacity(max_staleness, version, batch_size, credit)


def staleness(group: TrajectoryGroup, current_version: int) -> int:
    """Policy versions between the group's oldest generated token and the learner's version.

    A group without generated tokens (min_version −1) has staleness 0: no policy is behind it.
    """
    mv = group.min_version
    return 0 if mv < 0 else current_version - mv


def split_stale(entries: Iterable[tuple[Any, TrajectoryGroup]], current_version: int,
                max_staleness: int) -> tuple[list, list]:
    """The consume-time split: (fresh, stale) with stale = staleness > max_staleness, order kept."""
    keep: list = []
    drop: list = []
    for e in entries:
        (drop if staleness(e[1], current_version) > max_staleness else keep).append(e)
    return keep, drop


def consume_limit(max_staleness: int, max_consume_staleness: int | None) -> int:
    """The learner's consume-time limit: `train.max_consume_staleness`, by default η."""
    return max_staleness if max_consume_staleness is None else max_consume_staleness


def check_policy(policy: str) -> None:
    if policy not in STALE_POLICIES:
        raise ValueError(f"stale policy must be 'drop' or 'keep', got {policy!r}")


def trained_staleness(groups: Iterable[TrajectoryGroup], version: int) -> list[int]:
    """Staleness of each group trained at policy version `version` that has generated tokens (for
    metrics: the `areal_like_staleness` histogram and a step's `staleness_max`)."""
    return [staleness(g, version) for g in groups if g.min_version >= 0]


def max_trained_staleness(groups: Iterable[TrajectoryGroup], version: int, default: int = 0) -> int:
    """The largest `trained_staleness`; `default` when no group has generated tokens."""
    return max(trained_staleness(groups, version), default=default)


# ---- what a learner step takes -----------------------------------------------------------------
@dataclass
class StepTake:
    """One learner step's quota: B groups to train, always. A group dropped as stale (consume-time
    split) or filtered (DAPO, at most `filter_budget` per step) is replaced by one more read — it
    credited the gate in the same ack — so a step never trains fewer than B groups.

        take = policy.step()
        while take.need > 0:
            got = read(take.need); take.read(len(got))
            fresh, stale = split …; take.replace_stale(len(stale))
            uniform = …[:take.filter_room]; take.replace_filtered(len(uniform))
    """

    batch_size: int
    filter_budget: int = 0
    need: int = field(init=False)
    dropped_stale: int = 0
    filtered: int = 0

    def __post_init__(self) -> None:
        self.need = self.batch_size

    def read(self, n: int) -> None:
        """`n` entries were read (or taken from the redo list)."""
        self.need -= n

    def replace_stale(self, n: int) -> None:
        self.dropped_stale += n
        self.need += n

    @property
    def filter_room(self) -> int:
        """How many more groups this step may drop as filtered (DAPO)."""
        return self.filter_budget - self.filtered

    def replace_filtered(self, n: int) -> None:
        self.filtered += n
        self.need += n


@dataclass(frozen=True)
class StalenessPolicy:
    """The run's policy as the learner applies it (the gate side takes η and B: `rollout/gate.py`)."""

    max_staleness: int  # η
    batch_size: int  # B
    limit: int  # consume-time limit (default η)
    stale_policy: StalePolicy = "drop"
    filter_budget: int = 0  # DAPO: filtered groups a step may replace

    def __post_init__(self) -> None:
        check_bounds(self.max_staleness, self.batch_size)
        check_policy(self.stale_policy)

    @classmethod
    def from_config(cls, cfg: Any) -> "StalenessPolicy":
        """From an ExperimentConfig: rollout.max_staleness, train.batch_size, train.max_consume_staleness,
        train.consume_stale_policy, algorithm.filter_groups(_max_extra)."""
        alg = cfg.algorithm
        return cls(max_staleness=cfg.rollout.max_staleness, batch_size=cfg.train.batch_size,
                   limit=consume_limit(cfg.rollout.max_staleness, cfg.train.max_consume_staleness),
                   stale_policy=cfg.train.consume_stale_policy,
                   filter_budget=alg.filter_groups_max_extra if alg.filter_groups else 0)

    def capacity(self, version: int, credit: int = 0) -> int:
        return capacity(self.max_staleness, version, self.batch_size, credit)

    def split(self, entries: Iterable[E], version: int) -> tuple[list[E], list[E]]:
        return split_stale(entries, version, self.limit)  # type: ignore[arg-type]

    def step(self) -> StepTake:
        return StepTake(self.batch_size, self.filter_budget)


# ---- Lua: the same policy inside Redis -----------------------------------------------------------
# Keys are scripts.Keys ({p}:version, {p}:counters, {p}:running, {p}:trained, {p}:stream).

# KEYS: version, counters, running   ARGV: slot, eta, batch_size
# Invariant 2: start a group only while accepted + running + 1 ≤ (η + v + 1)·B + credit — checked and
# incremented in one atomic step (= `allowed`/`capacity` above). Idempotent: a slot already held is
# granted again (a retried call). credit (counters.gate_credit) = groups the learner dropped as
# `stale` (consume-time split) or `filtered` (DAPO dynamic sampling) and replaced by an extra read,
# so the learner still consumes B entries per version net.
# Returns {granted 0|1, v, accepted, running (after), capacity}.
TRY_ACQUIRE = LuaScript("gate_try_acquire", """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local accepted = tonumber(redis.call('HGET', KEYS[2], 'accepted') or '0')
local running = redis.call('ZCARD', KEYS[3])
local cap = (tonumber(ARGV[2]) + v + 1) * tonumber(ARGV[3]) + tonumber(redis.call('HGET', KEYS[2], 'gate_credit') or '0')
if redis.call('ZSCORE', KEYS[3], ARGV[1]) then return {1, v, accepted, running, cap} end
if accepted + running + 1 <= cap then
  local t = redis.call('TIME')
  redis.call('ZADD', KEYS[3], tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), ARGV[1])
  return {1, v, accepted, running + 1, cap}
end
return {0, v, accepted, running, cap}
""")

# KEYS: version, counters, running   ARGV: eta, batch_size
GATE_STATE = LuaScript("gate_state", """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local accepted = tonumber(redis.call('HGET', KEYS[2], 'accepted') or '0')
local credit = tonumber(redis.call('HGET', KEYS[2], 'gate_credit') or '0')
return {v, accepted, redis.call('ZCARD', KEYS[3]), (tonumber(ARGV[1]) + v + 1) * tonumber(ARGV[2]) + credit}
""")

# KEYS: stream, counters   ARGV: group, counter field, id...
# The buffer's ack (XACK + XDEL: the stream keeps only unacknowledged entries). Only ids that were
# pending are deleted, so a wrong id can never delete an undelivered group. Idempotent: a second ack
# of the same id acks nothing, deletes nothing and counts nothing.
# A group the learner drops as stale (consume-time split) or filtered (DAPO dynamic sampling) — the
# CREDITED_DROPS — is replaced by an extra read, so every step trains B groups: it hands its place back
# to the staleness gate (capacity + gate_credit), in the same atomic step as the ack. Other drop
# reasons credit nothing.
ACK = LuaScript("ack", """
local n = 0
for i = 3, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], ARGV[2], n) end
if n > 0 and (""" + " or ".join(f"ARGV[2] == 'dropped:{r}'" for r in CREDITED_DROPS) + """) then
  redis.call('HINCRBY', KEYS[2], 'gate_credit', n)
end
return n
""")

# KEYS: committed-key, version, counters   ARGV: step, version, batch_size
# A deliberate rollback of the learner (issue 24: resuming a checkpoint older than the buffer's
# committed step — an explicit train.resume_mode step, or the fallback past an unusable newest
# checkpoint): the committed step goes back to the checkpoint's, the policy version to its version,
# and the gate gets back the capacity of the versions undone, (v_redis − version)·B as gate_credit —
# the learner trains those steps again from groups not generated yet, so without it a rollback
# by more than η steps would close the gate for good. The groups the undone steps trained stay in
# {p}:trained (acked and deleted: they are not trained twice, they are not in the model either).
# Idempotent: a retry finds the committed step already ≤ step and changes nothing.
# Returns {the committed step found, the credit granted}.
ROLLBACK = LuaScript("rollback", """
local c = tonumber(redis.call('GET', KEYS[1]) or '-1')
local step = tonumber(ARGV[1])
if c <= step then return {c, 0} end
local v = tonumber(redis.call('GET', KEYS[2]) or '0')
local credit = math.max(0, v - tonumber(ARGV[2])) * tonumber(ARGV[3])
redis.call('SET', KEYS[1], step)
redis.call('SET', KEYS[2], ARGV[2])
if credit > 0 then redis.call('HINCRBY', KEYS[3], 'gate_credit', credit) end
redis.call('HINCRBY', KEYS[3], 'rolled_back_steps', c - step)
return {c, credit}
""")

# ---- Lua: the gate's slots (the IN FLIGHT state) ---------------------------------------------------
# KEYS: running, trained   ARGV: prefix, slot ids — after a Redis restart the gate re-asserts the
# slots this worker still holds: a slot whose ZADD was lost is added back, unless its group was
# accepted meanwhile (its idempotency marker {p}:gid:<slot> exists) or trained (in {p}:trained — a
# re-add refused as already trained writes no marker). Returns {re-added count, done slot ids}.
REASSERT = LuaScript("gate_reassert", NOW_MS_LUA + """
local now = now_ms()
local added, accepted = 0, {}
for i = 2, #ARGV do
  if redis.call('EXISTS', ARGV[1] .. ':gid:' .. ARGV[i]) == 1 or redis.call('ZSCORE', KEYS[2], ARGV[i]) then
    redis.call('ZREM', KEYS[1], ARGV[i])
    accepted[#accepted + 1] = ARGV[i]
  elseif redis.call('ZADD', KEYS[1], 'NX', now, ARGV[i]) == 1 then
    added = added + 1
  end
end
return {added, accepted}
""")

# KEYS: running   ARGV: max_age_ms — frees slots held longer than that (their worker died).
REAP = LuaScript("gate_reap", """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now_ms - tonumber(ARGV[1])))
""")

# KEYS: running, counters   ARGV: slot-id prefix (e.g. "w3-") — frees every slot a dead rollout worker
# held (its groups were in flight and will never arrive) and counts them as lost_in_flight, in one
# atomic step, so the gate admits replacements. Returns how many were freed.
RELEASE_WORKER = LuaScript("gate_release_worker", """
local prefix, n = ARGV[1], 0
for _, slot in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.sub(slot, 1, #prefix) == prefix then
    redis.call('ZREM', KEYS[1], slot)
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], 'lost_in_flight', n) end
return n
""")


__all__ = [
    "ACK", "CREDITED_DROPS", "GATE_STATE", "REAP", "REASSERT", "RELEASE_WORKER", "STALE_POLICIES", "TRY_ACQUIRE",
    "StalePolicy", "StalenessPolicy", "StepTake", "allowed", "capacity", "check_bounds", "check_policy",
    "consume_limit", "max_trained_staleness", "split_stale", "staleness", "trained_staleness",
]
