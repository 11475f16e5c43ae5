"""Key names and the Lua scripts of the replay buffer and the staleness gate — the only copy.

All keys of one run share the hash tag `{stream}` so they live in one Redis Cluster slot and a
script may touch all of them atomically:

    {p}:stream     STREAM  one entry per accepted group, field `g` = msgpack TrajectoryGroup
    {p}:version    STRING  policy version v (set by the learner after weights landed everywhere)
    {p}:counters   HASH    accepted, duplicates, acked, reclaimed, dropped:<reason>
    {p}:running    ZSET    gate slots held by groups being generated; member = slot id (the group
                           id the worker will produce), score = acquire time (ms, Redis clock)
    {p}:gid:<id>   STRING  idempotency marker of an accepted group (value = its entry id; TTL)

The scripts use only commands allowed in scripts and Redis's own clock (TIME), so every client on
every host sees one ordering and one time.
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_like.buffer.redis_client import LuaScript


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str
    stream: str
    version: str
    counters: str
    running: str

    @staticmethod
    def for_stream(stream: str) -> "Keys":
        p = "{" + stream + "}"
        return Keys(prefix=p, stream=f"{p}:stream", version=f"{p}:version", counters=f"{p}:counters",
                    running=f"{p}:running")

    def group_id(self, group_id: str) -> str:
        return f"{self.prefix}:gid:{group_id}"


# Undelivered depth = XLEN − PEL size: acked entries are XDEL'd, so the stream holds exactly the
# undelivered entries plus the delivered-but-unacked (pending) ones.
_DEPTH = """
local function depth(stream, group)
  local n = redis.call('XLEN', stream)
  if n == 0 then return 0 end
  local ok, p = pcall(redis.call, 'XPENDING', stream, group)
  if ok then return n - p[1] end
  return n  -- no consumer group yet: nothing was delivered
end
"""

# KEYS: stream, counters, running, gid-key   ARGV: payload, group, max_groups, id_ttl_s, group_id
# Returns {1, entry_id} accepted | {0, entry_id} duplicate | {-1, depth} buffer full (retry later).
ADD_GROUP = LuaScript("add_group", _DEPTH + """
local prev = redis.call('GET', KEYS[4])
if prev then
  redis.call('ZREM', KEYS[3], ARGV[5])  -- a retried add: the slot was freed by the first one
  redis.call('HINCRBY', KEYS[2], 'duplicates', 1)
  return {0, prev}
end
local max_groups = tonumber(ARGV[3])
if max_groups > 0 then
  local d = depth(KEYS[1], ARGV[2])
  if d >= max_groups then return {-1, tostring(d)} end
end
local id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[1])
redis.call('SET', KEYS[4], id, 'EX', tonumber(ARGV[4]))
redis.call('ZREM', KEYS[3], ARGV[5])        -- running -= 1 (no-op if the producer held no slot)
redis.call('HINCRBY', KEYS[2], 'accepted', 1) -- accepted += 1, in the same atomic step as the XADD
return {1, id}
""")

# KEYS: stream, counters   ARGV: group, counter field, id...
# XACK + XDEL: the stream keeps only unacknowledged entries. Only ids that were pending are deleted,
# so a wrong id can never delete an undelivered group. Idempotent: a second ack of the same id acks
# nothing, deletes nothing and counts nothing.
ACK = LuaScript("ack", """
local n = 0
for i = 3, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[2], ARGV[2], n) end
return n
""")

# KEYS: stream, counters   ARGV: group, consumer, min_idle_ms, start, count
# Returns XAUTOCLAIM's reply {next_start, entries, deleted_ids}; counts the claimed entries.
RECLAIM = LuaScript("reclaim", """
local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
if #r[2] > 0 then redis.call('HINCRBY', KEYS[2], 'reclaimed', #r[2]) end
return r
""")

# KEYS: stream, counters, version, running   ARGV: group
# Returns {xlen, pending, oldest_unconsumed_id or '', now_ms, version, running, {counter, value, ...}}
STATS = LuaScript("stats", """
local xlen = redis.call('XLEN', KEYS[1])
local pending = 0
local oldest = ''
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
if ok then
  for _, g in ipairs(groups) do
    local name, last = nil, nil
    for i = 1, #g, 2 do
      if g[i] == 'name' then name = g[i + 1] end
      if g[i] == 'last-delivered-id' then last = g[i + 1] end
    end
    if name == ARGV[1] then
      pending = redis.call('XPENDING', KEYS[1], ARGV[1])[1]
      local e = redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', 1)
      if #e > 0 then oldest = e[1][1] end
    end
  end
elseif xlen > 0 then
  oldest = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1][1]
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {xlen, pending, oldest, now_ms, redis.call('GET', KEYS[3]) or '0', redis.call('ZCARD', KEYS[4]),
        redis.call('HGETALL', KEYS[2])}
""")

# ---- staleness gate ------------------------------------------------------------------------------
# KEYS: version, counters, running   ARGV: slot, eta, batch_size
# Invariant 2: start a group only while accepted + running + 1 ≤ (η + v + 1)·B — checked and
# incremented in one atomic step. Idempotent: a slot already held is granted again (a retried call).
# Returns {granted 0|1, v, accepted, running (after), capacity}.
TRY_ACQUIRE = LuaScript("gate_try_acquire", """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local accepted = tonumber(redis.call('HGET', KEYS[2], 'accepted') or '0')
local running = redis.call('ZCARD', KEYS[3])
local cap = (tonumber(ARGV[2]) + v + 1) * tonumber(ARGV[3])
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
return {v, accepted, redis.call('ZCARD', KEYS[3]), (tonumber(ARGV[1]) + v + 1) * tonumber(ARGV[2])}
""")

# KEYS: running   ARGV: max_age_ms — frees slots held longer than that (their worker died).
REAP = LuaScript("gate_reap", """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now_ms - tonumber(ARGV[1])))
""")
