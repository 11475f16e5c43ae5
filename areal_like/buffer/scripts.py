"""Key names and the Lua scripts of the replay buffer — the only copy. The staleness policy's scripts
(the gate's, and the ack that credits the gate) live beside that policy in buffer/staleness.py.

All keys of one run share the hash tag `{stream}` so they live in one Redis Cluster slot and a
script may touch all of them atomically:

    {p}:stream     STREAM  one entry per accepted group: field `g` = msgpack TrajectoryGroup,
                           field `i` = its group id (lets a script check an entry without decoding),
                           field `r` = "1" on a group re-added after a Redis restart
    {p}:version    STRING  policy version v (set by the learner after weights landed everywhere)
    {p}:counters   HASH    accepted, duplicates, acked, reclaimed, dropped:<reason>, stale_kept,
                           readded_after_restart, lost_after_restart, recommitted_after_restart,
                           lost_in_flight (groups of dead rollout workers), restarts:<kind>,
                           gate_credit (groups dropped as `stale` or `filtered` and replaced by the learner),
                           reward_failures:<kind> (reward calls that failed, by REWARD_FAILURE_KINDS;
                           rollout workers add to them, the launcher and the learner read them)
                           workflow_failures:<kind> (groups whose workflow failed, by
                           WORKFLOW_FAILURE_KINDS), dropped_in_flight_at_stop (groups a rollout worker
                           was generating when it was stopped: cancelled, their prompts not trained)
    {p}:running    ZSET    gate slots held by groups being generated; member = slot id (the group
                           id the worker will produce), score = acquire time (ms, Redis clock)
    {p}:gid:<id>   STRING  idempotency marker of an accepted group (value = its entry id; TTL)
    {p}:trained    ZSET    group ids committed by the learner (score = commit time, ms, Redis
                           clock), written in the same script as their XACK; pruned after a TTL
    {p}:committed:<consumer>  STRING  the highest learner step committed by that consumer
    {p}:reward_failures:first  HASH  kind → the first reward failure of that kind in the run (HSETNX;
                           message + traceback), for the launcher to print once
    {p}:rollout_cursor:<k>  STRING  JSON {seq, epoch, position, …}: rollout worker k's next group
                           number and prompt cursor, so a re-run continues instead of regenerating
    {p}:eval:request, {p}:eval:result  STRING  the learner ↔ evaluator validation handshake
                           (no script touches them; buffer/eval_channel.py owns them)

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
    trained: str

    @staticmethod
    def for_stream(stream: str) -> "Keys":
        p = "{" + stream + "}"
        return Keys(prefix=p, stream=f"{p}:stream", version=f"{p}:version", counters=f"{p}:counters",
                    running=f"{p}:running", trained=f"{p}:trained")

    def group_id(self, group_id: str) -> str:
        return f"{self.prefix}:gid:{group_id}"

    def committed(self, consumer: str) -> str:
        return f"{self.prefix}:committed:{consumer}"

    def reward_failures_first(self) -> str:
        return f"{self.prefix}:reward_failures:first"

    def rollout_cursor(self, worker: int) -> str:
        return f"{self.prefix}:rollout_cursor:{worker}"

    def restart_requests(self) -> str:
        """A list of roles the learner asks the launcher to restart (JSON {"role", "reason"}): generation
        servers stuck inside an NCCL weight broadcast that will never complete (issue 40 item 1)."""
        return f"{self.prefix}:restart_requests"

    def push_in_flight(self) -> str:
        """Set by learner rank 0 from a push's pause to its end ({"version", "backend"}): the launcher reads it
        when the learner dies — servers in an NCCL broadcast then wait 30 minutes for a sender that is gone."""
        return f"{self.prefix}:push_in_flight"

    def version_events(self) -> str:
        """A short stream the learner appends to on every `set_version` (after the SET): waiters on
        the staleness gate block on it (XREAD BLOCK) instead of sleeping a fixed poll interval."""
        return f"{self.prefix}:version_events"


# Kinds of reward failure (each scores 0): the user's function raised (or its worker process died),
# took longer than custom_reward_function.timeout_s (or waited that long for a free worker), returned
# NaN/±inf, returned something that is not a number (a string, None, a dict without "score").
REWARD_FAILURE_KINDS: tuple[str, ...] = ("exception", "timeout", "non_finite", "not_a_number")

# Kinds of workflow failure (the group is not made; its prompt is retried later): the workflow raised,
# ran past rollout.episode_timeout_s, returned something that is not a group (bad_result: e.g. a
# reward "1.0"), or a generation request failed for good (generation: the servers' fault, not counted
# against rollout.max_failure_fraction).
WORKFLOW_FAILURE_KINDS: tuple[str, ...] = ("exception", "timeout", "bad_result", "generation")


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

NOW_MS_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

# KEYS: stream, counters, running, gid-key, trained
# ARGV: payload, group, max_groups, id_ttl_s, group_id, readd ("1" = re-add after a Redis restart)
# Returns {1, entry_id} accepted | {0, entry_id or 'trained'} duplicate | {-1, depth} buffer full.
# A re-add skips back-pressure (it restores what the buffer held) and is counted, not `duplicates`.
ADD_GROUP = LuaScript("add_group", _DEPTH + """
local readd = ARGV[6] == '1'
local prev = redis.call('GET', KEYS[4])
if not prev and redis.call('ZSCORE', KEYS[5], ARGV[5]) then prev = 'trained' end
if prev then
  redis.call('ZREM', KEYS[3], ARGV[5])  -- a retried add: the slot was freed by the first one
  if not readd then redis.call('HINCRBY', KEYS[2], 'duplicates', 1) end
  return {0, prev}
end
local max_groups = tonumber(ARGV[3])
if max_groups > 0 and not readd then
  local d = depth(KEYS[1], ARGV[2])
  if d >= max_groups then return {-1, tostring(d)} end
end
local id
if readd then
  id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[1], 'i', ARGV[5], 'r', '1')
  redis.call('HINCRBY', KEYS[2], 'readded_after_restart', 1)
else
  id = redis.call('XADD', KEYS[1], '*', 'g', ARGV[1], 'i', ARGV[5])
end
redis.call('SET', KEYS[4], id, 'EX', tonumber(ARGV[4]))
redis.call('ZREM', KEYS[3], ARGV[5])        -- running -= 1 (no-op if the producer held no slot)
redis.call('HINCRBY', KEYS[2], 'accepted', 1) -- accepted += 1, in the same atomic step as the XADD
return {1, id}
""")

# The fast path of add_group (the payload never enters Lua, which would double Redis's CPU per add):
#     MULTI;  XADD {p}:stream * g <payload> i <group id>;  EVAL ADD_AFTER …;  EXEC
# The transaction makes the XADD and this script one atomic step (also in the AOF). The script
# decides; when the add must not happen (duplicate, already trained, buffer full) it deletes the
# entry the XADD just appended — the stream's last entry, since nothing runs between them.
# KEYS: stream, counters, running, gid-key, trained   ARGV: group, max_groups, id_ttl_s, group_id
# Returns {1, depth after} accepted | {0, prev} duplicate | {-1, depth} buffer full.
ADD_AFTER = LuaScript("add_after", _DEPTH + """
local function undo()
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
  redis.call('XDEL', KEYS[1], last[1][1])
end
local prev = redis.call('GET', KEYS[4])
if not prev and redis.call('ZSCORE', KEYS[5], ARGV[4]) then prev = 'trained' end
if prev then
  undo()
  redis.call('ZREM', KEYS[3], ARGV[4])
  redis.call('HINCRBY', KEYS[2], 'duplicates', 1)
  return {0, prev}
end
local max_groups = tonumber(ARGV[2])
local d = -1
if max_groups > 0 then
  d = depth(KEYS[1], ARGV[1]) - 1  -- not counting the entry just appended
  if d >= max_groups then undo(); return {-1, tostring(d)} end
end
redis.call('SET', KEYS[4], '1', 'EX', tonumber(ARGV[3]))
redis.call('ZREM', KEYS[3], ARGV[4])
redis.call('HINCRBY', KEYS[2], 'accepted', 1)
return {1, tostring(d + 1)}
""")

# KEYS: stream, counters, gid-key, trained   ARGV: group, max_groups, group_id — read-only pre-check
# while the buffer is (nearly) full, so waiting producers do not append-and-undo big payloads.
# Returns {0, prev} duplicate | {-1, depth} full | {1, depth} room.
ADD_CHECK = LuaScript("add_check", _DEPTH + """
local prev = redis.call('GET', KEYS[3])
if not prev and redis.call('ZSCORE', KEYS[4], ARGV[3]) then prev = 'trained' end
if prev then return {0, prev} end
local max_groups = tonumber(ARGV[2])
local d = depth(KEYS[1], ARGV[1])
if max_groups > 0 and d >= max_groups then return {-1, tostring(d)} end
return {1, tostring(d)}
""")

# KEYS: stream, counters, trained, committed-key
# ARGV: group, step, trained_ttl_ms, recommit ("1" after a Redis restart), then entry_id, group_id pairs
# The learner's commit (exactly-once protocol, see replay_buffer.py): for each pair XACK + XDEL and
# ZADD the group id to the trained set, and raise the committed step — one atomic step, so Redis
# never holds "acked but not recorded as trained" or the reverse. Idempotent: committing again acks
# nothing twice and only refreshes the trained-set scores. An entry that is no longer pending (its
# delivery was lost in a Redis crash) is deleted only if its field `i` names the same group, so a
# wrong id never deletes someone else's group.
# Returns {entries deleted, group ids newly recorded as trained}; on a re-commit the second number
# is what the crash had lost (counted recommitted_after_restart).
COMMIT = LuaScript("commit", NOW_MS_LUA + """
local now = now_ms()
local n, fresh = 0, 0
for i = 5, #ARGV, 2 do
  local eid, gid = ARGV[i], ARGV[i + 1]
  if redis.call('XACK', KEYS[1], ARGV[1], eid) == 1 then
    redis.call('XDEL', KEYS[1], eid)
    n = n + 1
  else
    local e = redis.call('XRANGE', KEYS[1], eid, eid)
    if #e > 0 then
      local f = e[1][2]
      for j = 1, #f, 2 do
        if f[j] == 'i' and f[j + 1] == gid then redis.call('XDEL', KEYS[1], eid); n = n + 1 end
      end
    end
  end
  fresh = fresh + redis.call('ZADD', KEYS[3], now, gid)
end
if n > 0 then redis.call('HINCRBY', KEYS[2], 'acked', n) end
if ARGV[4] == '1' and fresh > 0 then redis.call('HINCRBY', KEYS[2], 'recommitted_after_restart', fresh) end
local step = tonumber(ARGV[2])
if step >= 0 and step > tonumber(redis.call('GET', KEYS[4]) or '-1') then redis.call('SET', KEYS[4], step) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. (now - tonumber(ARGV[3])))
return {n, fresh}
""")

# KEYS: trained   ARGV: group ids — which of them the learner already committed (1/0 each).
TRAINED = LuaScript("trained", """
local out = {}
for i = 1, #ARGV do out[i] = redis.call('ZSCORE', KEYS[1], ARGV[i]) and 1 or 0 end
return out
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
