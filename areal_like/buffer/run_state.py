"""`RunState`: the run's records beside the trajectory stream, in the buffer's Redis.

    {p}:version (+ its events stream)   the policy version the learner published (`set_version` after the
                                        weights landed; rollout workers wait on the events at a closed gate)
    counters restarts:<kind>            roles the launcher restarted (a learner re-syncs restarted servers)
    {p}:restart_requests                roles the learner asks the launcher to restart (stuck servers)
    {p}:push_in_flight                  learner rank 0's mark while an NCCL push is under way
    {p}:rollout_cursor:<k>              rollout worker k's place in its data (resumed by a restarted worker)
    counters reward_failures:<kind>, workflow_failures:<kind>, agent_completions_refused,
    dropped_in_flight_at_stop           what summary.json reports, over every worker and restart

`ReplayBuffer` (replay_buffer.py) owns the stream — add, read, commit, recover, drop — and holds one of
these as `buffer.run`, on the same endpoint (one connection, one restart hook). Nothing here reads or
writes a trajectory. Sync methods for the learner and the launcher, `*_async` twins for rollout
workers, over the same generators (`RedisEndpoint.run` / `arun`, as in replay_buffer.py).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from areal_like.buffer import scripts
from areal_like.buffer.redis_client import Call, Cmd, OpGen, RedisEndpoint

VERSION_EVENTS_MAXLEN = 64  # events kept on the version-events stream (waiters only read new ones)


def as_str(x: Any) -> str:
    """A Redis reply value (bytes or not) as text."""
    return x.decode() if isinstance(x, bytes) else str(x)


class RunState:
    """The run-control records of one run (see the module doc); `keys` are the stream's."""

    def __init__(self, endpoint: RedisEndpoint, keys: scripts.Keys) -> None:
        self.endpoint = endpoint
        self.keys = keys

    def _g_count_reward_failures(self, counts: dict[str, int], first: dict[str, str]) -> OpGen:
        k = self.keys
        cmds = [Cmd("hincrby", (k.counters, f"reward_failures:{kind}", int(n))) for kind, n in counts.items() if n]
        cmds += [Cmd("hsetnx", (k.reward_failures_first(), kind, text)) for kind, text in first.items()]
        if cmds:
            yield Call(f"count reward failures {counts}", k.counters, tuple(cmds), idempotent=False)

    def _g_reward_failures(self, first: bool) -> OpGen:
        k = self.keys
        kinds = scripts.REWARD_FAILURE_KINDS
        hmget = Cmd("hmget", (k.counters, *[f"reward_failures:{kind}" for kind in kinds]))
        if first:
            values, texts = yield Call("read reward failures", k.counters,
                                       (hmget, Cmd("hgetall", (k.reward_failures_first(),))), idempotent=True)
        else:
            values, texts = (yield Call.one("read reward failure counters", k.counters, hmget, idempotent=True)), {}
        counts = {kind: int(v) if v is not None else 0 for kind, v in zip(kinds, values)}
        if not first:
            return counts
        return counts, {as_str(f): as_str(v) for f, v in (texts or {}).items()}

    def _g_get_version(self) -> OpGen:
        v = yield Call.one("get policy version", self.keys.version, Cmd("get", (self.keys.version,)), idempotent=True)
        return int(v) if v is not None else 0

    def _g_set_version(self, version: int) -> OpGen:
        # One round trip: the SET, then an event on the version-events stream (rollout workers
        # waiting on a closed gate wake on it; a retried call only adds a spurious wake-up).
        yield Call(f"set policy version {version}", self.keys.version,
                   (Cmd("set", (self.keys.version, int(version))),
                    Cmd("xadd", (self.keys.version_events(), {"v": int(version)}),
                        {"maxlen": VERSION_EVENTS_MAXLEN, "approximate": True})), idempotent=True)

    def _g_count_agent_refusals(self, n: int) -> OpGen:
        yield Call.one(f"count {n} refused agent completion(s)", self.keys.counters,
                       Cmd("hincrby", (self.keys.counters, "agent_completions_refused", int(n))), idempotent=False)

    def _g_count(self, counts: dict[str, int]) -> OpGen:
        cmds = tuple(Cmd("hincrby", (self.keys.counters, f, int(n))) for f, n in counts.items() if n)
        if cmds:
            yield Call(f"count {counts}", self.keys.counters, cmds, idempotent=False)

    def _g_count_restart(self, kind: str) -> OpGen:
        field = f"restarts:{kind}"
        n = yield Call.one(f"count a {kind} restart", self.keys.counters,
                           Cmd("hincrby", (self.keys.counters, field, 1)), idempotent=False)
        return int(n)

    def _g_restarts(self, kind: str) -> OpGen:
        n = yield Call.one(f"read {kind} restarts", self.keys.counters,
                           Cmd("hget", (self.keys.counters, f"restarts:{kind}")), idempotent=True)
        return int(n) if n is not None else 0

    def _g_request_restart(self, role: str, reason: str) -> OpGen:
        key = self.keys.restart_requests()
        n = yield Call.one(f"ask for a restart of {role}", key,
                           Cmd("rpush", (key, json.dumps({"role": role, "reason": reason}))), idempotent=False)
        return int(n)

    def _g_take_restart_requests(self) -> OpGen:
        key = self.keys.restart_requests()
        out = yield Call("take the restart requests", key, (Cmd("lrange", (key, 0, -1)), Cmd("delete", (key,))),
                         idempotent=False, transaction=True)
        return [json.loads(as_str(x)) for x in out[0]]

    def _g_push_in_flight(self, value: dict | None) -> OpGen:
        key = self.keys.push_in_flight()
        cmd = Cmd("delete", (key,)) if value is None else Cmd("set", (key, json.dumps(value)))
        yield Call.one("mark a weight push " + ("ended" if value is None else "under way"), key, cmd, idempotent=True)

    def _g_read_push_in_flight(self) -> OpGen:
        key = self.keys.push_in_flight()
        v = yield Call.one("read the weight push under way", key, Cmd("get", (key,)), idempotent=True)
        return json.loads(as_str(v)) if v is not None else None

    def _g_rollout_cursor(self, worker: int) -> OpGen:
        key = self.keys.rollout_cursor(worker)
        raw = yield Call.one(f"get rollout{worker}'s cursor", key, Cmd("get", (key,)), idempotent=True)
        return msgspec.json.decode(raw) if raw else None

    def _g_set_rollout_cursor(self, worker: int, state: dict[str, Any]) -> OpGen:
        key = self.keys.rollout_cursor(worker)
        yield Call.one(f"set rollout{worker}'s cursor", key, Cmd("set", (key, msgspec.json.encode(state))),
                       idempotent=True)

    # ---- sync API (learner, launcher) ----------------------------------------------------------
    def reward_failures(self) -> dict[str, int]:
        """Reward failures of the run so far, by kind: {"exception": n, "timeout": n, "non_finite": n,
        "not_a_number": n} (every kind present; totals over all rollout workers, cumulative over a
        resumed run). One round trip. The learner's metrics row adds them as `reward_failures/<kind>`."""
        return self.endpoint.run(self._g_reward_failures(first=False))

    def reward_failure_details(self) -> tuple[dict[str, int], dict[str, str]]:
        """(`reward_failures()`, {kind: the first failure of that kind — message and traceback}), one
        round trip: what the launcher shows."""
        return self.endpoint.run(self._g_reward_failures(first=True))

    def count_reward_failures(self, counts: dict[str, int], first: dict[str, str] | None = None) -> None:
        """Add `counts` ({kind: n}) to the run's reward failure counters and record `first` ({kind: text})
        unless a failure of that kind was recorded before. Not retried (HINCRBY is not idempotent)."""
        self.endpoint.run(self._g_count_reward_failures(dict(counts), dict(first or {})))

    def count_restart(self, kind: str) -> int:
        """The launcher restarted a role of `kind` ("server", "rollout", "learner", "redis"): counters
        `restarts:<kind>` += 1; returns the new total. A learner polls `restarts("server")` to learn that a
        generation server came back without weights (it re-forms the weight group and pushes again)."""
        return self.endpoint.run(self._g_count_restart(kind))

    def request_restart(self, role: str, reason: str) -> int:
        """Ask the launcher to restart role `role` (e.g. "server3"), for `reason`; it takes the requests on
        its next supervision tick (`take_restart_requests`). Returns the requests now waiting."""
        return self.endpoint.run(self._g_request_restart(role, reason))

    def take_restart_requests(self) -> list[dict]:
        """The launcher's side: every waiting request ({"role", "reason"}), removed atomically."""
        return self.endpoint.run(self._g_take_restart_requests())

    def mark_push(self, value: dict | None) -> None:
        """Learner rank 0: a push is under way (`value`: its version and backend), or (None) it ended."""
        self.endpoint.run(self._g_push_in_flight(value))

    def push_in_flight(self) -> dict | None:
        """The push under way, as `mark_push` left it, or None."""
        return self.endpoint.run(self._g_read_push_in_flight())

    def restarts(self, kind: str) -> int:
        """How many times the launcher restarted a role of `kind` in this run (one HGET)."""
        return self.endpoint.run(self._g_restarts(kind))

    def get_version(self) -> int:
        return self.endpoint.run(self._g_get_version())

    def set_version(self, version: int) -> None:
        """The learner calls this only after the new weights landed on every server."""
        self.endpoint.run(self._g_set_version(version))

    # ---- asyncio API (rollout workers) — same generators ----------------------------------------
    async def count_reward_failures_async(self, counts: dict[str, int], first: dict[str, str] | None = None) -> None:
        await self.endpoint.arun(self._g_count_reward_failures(dict(counts), dict(first or {})))

    async def count_agent_refusals_async(self, n: int) -> None:
        """counters `agent_completions_refused` += n: agent completion requests the proxy refused past
        rollout.multi_turn.max_completions_per_episode (stats(), summary.json `buffer`). Not retried."""
        await self.endpoint.arun(self._g_count_agent_refusals(n))

    async def count_workflow_failures_async(self, counts: dict[str, int]) -> None:
        """counters `workflow_failures:<kind>` += n ({kind: n}, kinds of scripts.WORKFLOW_FAILURE_KINDS):
        groups whose workflow failed (stats(), summary.json `buffer.workflow_failures`). Not retried."""
        unknown = set(counts) - set(scripts.WORKFLOW_FAILURE_KINDS)
        if unknown:
            raise ValueError(f"unknown workflow failure kind(s) {sorted(unknown)}")
        await self.endpoint.arun(self._g_count({f"workflow_failures:{k}": n for k, n in counts.items()}))

    async def count_dropped_at_stop_async(self, n: int) -> None:
        """counters `dropped_in_flight_at_stop` += n: groups a rollout worker was generating when it was
        stopped (cancelled; their prompts not trained). stats(), summary.json `buffer`. Not retried."""
        await self.endpoint.arun(self._g_count({"dropped_in_flight_at_stop": n}))

    async def reward_failures_async(self) -> dict[str, int]:
        return await self.endpoint.arun(self._g_reward_failures(first=False))

    async def get_version_async(self) -> int:
        return await self.endpoint.arun(self._g_get_version())

    async def set_version_async(self, version: int) -> None:
        await self.endpoint.arun(self._g_set_version(version))

    async def rollout_cursor_async(self, worker: int) -> dict[str, Any] | None:
        """Rollout worker `worker`'s saved cursor (next group number, prompt position), or None."""
        return await self.endpoint.arun(self._g_rollout_cursor(worker))

    async def set_rollout_cursor_async(self, worker: int, state: dict[str, Any]) -> None:
        await self.endpoint.arun(self._g_set_rollout_cursor(worker, state))
