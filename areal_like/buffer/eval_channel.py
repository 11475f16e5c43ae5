"""`EvalChannel`: the validation handshake between learner rank 0 and the evaluator (rollout worker 0).

```
 learner rank 0                         Redis ({p} = the buffer's prefix)          evaluator (rollout0)
 ──────────────                         ────────────────────────────────          ────────────────────
 push v, set_version(v)
 request(v, s) ──SET──────────────────► {p}:eval:request {id, version, step}
 train step s+1 (no push: the                              ◄──GET request + GET result── next_request_async
 servers keep serving version v)                                                    eval.n × every prompt at v
                                        {p}:eval:result {id, version, results} ◄─SET─ publish_async(v, results)
 collect(v) ──GET result (poll) until its id is this request's; DEL the request
 metrics row += results; push v+1 …
```

    {p}:eval:request  STRING  JSON {"id", "version", "step", "t"}: the one evaluation the learner waits for
    {p}:eval:result   STRING  JSON {"id", "version", "step", "results" {str: float}, "error" str|null}:
                              the evaluator's answer to request `id` (TTL `ttl_s`)

One request at a time: the learner collects version v before it pushes v+1, so the servers hold
exactly v while the evaluation runs; the evaluator takes no staleness-gate slot and never writes to
the replay stream, so the staleness bound is untouched.

Request ids. `request(v, s)` makes its id once per channel object and (v, s): a repeated or retried
call rewrites the same value (idempotent). A restarted learner is a new process with new ids, so an
answer computed for its predecessor's weights — the resumed weights of version v may differ — is
never taken for its own: the evaluator sees the new request unanswered and evaluates again. An
answer is only ever matched by id, never by version alone.

Redis restarts (AOF everysec can lose the last second): each side re-asserts what it wrote last in a
restart hook on the shared endpoint (see redis_client.py) — the learner its pending request, the
evaluator its last answer. Both are plain SETs of the same value, idempotent.

No silent hangs (DESIGN invariant 7): every call goes through `RedisEndpoint` (timeouts name the
endpoint and key); `collect` gives up after its timeout with `EvalTimeout`, naming the evaluator and
the version; an evaluation that crashed is answered with its error, which `collect` raises as `EvalError`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from areal_like.buffer import scripts
from areal_like.buffer.redis_client import Call, Cmd, LuaScript, OpGen, RedisEndpoint

if TYPE_CHECKING:
    from areal_like.buffer.replay_buffer import ReplayBuffer

log = logging.getLogger(__name__)

# KEYS: request key. ARGV: the exact request payload. Deletes the request only if it is still this one.
_DEL_IF_EQUAL = LuaScript("eval_del_if_equal", """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""")


class EvalTimeout(TimeoutError):
    """The evaluator did not answer a validation request in time (the message names it and the version)."""


class EvalError(RuntimeError):
    """The evaluator answered a validation request with an error (the message names it and the version)."""


class _Request(msgspec.Struct, frozen=True):
    id: str
    version: int
    step: int
    t: float = 0.0


class _Result(msgspec.Struct, frozen=True):
    id: str
    version: int
    step: int
    results: dict[str, float | None] = {}
    error: str | None = None


_enc = msgspec.json.Encoder()
_dec_req = msgspec.json.Decoder(_Request)
_dec_res = msgspec.json.Decoder(_Result)


class EvalChannel:
    """Learner side: `request`, `collect` (sync). Evaluator side: `next_request_async`, `publish_async`.

    Cheap to construct; shares the endpoint (connections, restart detection) of the buffer it is made
    from. `evaluator` names the answering role in error messages.
    """

    def __init__(self, endpoint: RedisEndpoint, stream: str = "areal_like", *, evaluator: str = "rollout0",
                 poll_s: float = 0.05, wait_s: float = 1.0, ttl_s: int = 7 * 24 * 3600) -> None:
        self.endpoint = endpoint
        prefix = scripts.Keys.for_stream(stream).prefix  # same hash tag as the buffer's keys
        self.request_key = f"{prefix}:eval:request"
        self.result_key = f"{prefix}:eval:result"
        self.evaluator = evaluator
        self.poll_s = poll_s
        """Seconds between polls of `collect` and `next_request_async`."""
        self.wait_s = wait_s
        """How long one `next_request_async` call waits for a request before returning None."""
        self.ttl_s = ttl_s
        # learner side: (version, step) → request payload (its id is made once per (version, step))
        self._requests: dict[tuple[int, int], bytes] = {}
        self._pending: bytes | None = None  # request not yet collected: re-asserted after a Redis restart
        # evaluator side
        self._taken: dict[int, _Request] = {}  # version → the request next_request_async returned for it
        self._answered: set[str] = set()  # request ids this channel published an answer for
        self._last_result: bytes | None = None  # re-asserted after a Redis restart
        endpoint.on_restart(self._g_after_restart)

    @classmethod
    def from_buffer(cls, buffer: "ReplayBuffer", **kw: Any) -> "EvalChannel":
        """A channel on the buffer's Redis endpoint and key prefix (one run, one channel)."""
        return cls(buffer.endpoint, buffer.stream, **kw)

    def __repr__(self) -> str:
        return f"EvalChannel({self.endpoint.name}, {self.request_key})"

    # ---- operations (generators driven by RedisEndpoint.run / arun) ------------------------------
    def _g_after_restart(self) -> OpGen:
        if self._pending is not None:
            yield Call.one("re-assert the pending validation request after a Redis restart", self.request_key,
                           Cmd("set", (self.request_key, self._pending), {"ex": self.ttl_s}), idempotent=True)
        if self._last_result is not None:
            yield Call.one("re-assert the last validation result after a Redis restart", self.result_key,
                           Cmd("set", (self.result_key, self._last_result), {"ex": self.ttl_s}), idempotent=True)

    def _g_set(self, key: str, payload: bytes, what: str) -> OpGen:
        yield Call.one(what, key, Cmd("set", (key, payload), {"ex": self.ttl_s}), idempotent=True)

    def _g_get(self, key: str, what: str) -> OpGen:
        return (yield Call.one(what, key, Cmd("get", (key,)), idempotent=True))

    def _g_get_both(self) -> OpGen:
        return (yield Call("read the validation request and result", self.request_key,
                           (Cmd("get", (self.request_key,)), Cmd("get", (self.result_key,))), idempotent=True))

    def _g_withdraw(self, payload: bytes) -> OpGen:
        yield Call.one("withdraw the validation request", self.request_key,
                       Cmd.lua(_DEL_IF_EQUAL, [self.request_key], [payload]), idempotent=True)

    # ---- learner side (sync) ----------------------------------------------------------------------
    def request(self, version: int, step: int) -> None:
        """Ask the evaluator to validate the weights of `version` (pushed after `step`). Idempotent."""
        key = (int(version), int(step))
        payload = self._requests.get(key)
        if payload is None:
            rid = f"v{version}-s{step}-{uuid.uuid4().hex[:8]}"
            payload = _enc.encode(_Request(rid, int(version), int(step), time.time()))
            self._requests = {key: payload}  # one request at a time: older ones are done with
        self._pending = payload
        self.endpoint.run(self._g_set(self.request_key, payload, f"request validation of version {version}"))

    def collect(self, version: int, timeout_s: float, stopping: Callable[[], bool] | None = None,
                on_wait: Callable[[], None] | None = None) -> dict[str, float] | None:
        """Block until the evaluator answered this channel's request for `version`; returns its results
        (`val/…` keys). None if `stopping()` turned true first (the request is withdrawn). Raises
        EvalTimeout after `timeout_s`, EvalError if the evaluation failed, ValueError if `version`
        was never requested through this channel. `on_wait()` runs between polls; an exception it
        raises leaves `collect` with the request still pending (collect it again afterwards)."""
        payload = next((p for (v, _), p in self._requests.items() if v == version), None)
        if payload is None:
            raise ValueError(f"collect(version={version}): no validation of that version was requested through "
                             f"this channel (call request(version, step) first)")
        req = _dec_req.decode(payload)
        deadline = time.monotonic() + timeout_s
        while True:
            raw = self.endpoint.run(self._g_get(self.result_key, f"wait for the validation of version {version}"))
            if raw is not None:
                res = _dec_res.decode(raw)
                if res.id == req.id:
                    self._done(payload)
                    if res.error is not None:
                        raise EvalError(f"evaluator {self.evaluator} failed to validate version {version} (step "
                                        f"{req.step}): {res.error}")
                    return {k: (math.nan if v is None else float(v)) for k, v in res.results.items()}
            if stopping is not None and stopping():
                self._done(payload)
                return None
            if on_wait is not None:
                on_wait()
            left = deadline - time.monotonic()
            if left <= 0:
                self._done(payload)
                raise EvalTimeout(
                    f"evaluator {self.evaluator} did not answer the validation of version {version} (step {req.step}) "
                    f"within {timeout_s:.0f} s (redis {self.endpoint.name} key {self.result_key}): is rollout "
                    f"worker 0 alive and are data.val_files set for it? (raise eval.timeout_s for a large "
                    f"validation set)")
            time.sleep(min(self.poll_s, left))

    def _done(self, payload: bytes) -> None:
        """Forget and withdraw a request (answered, abandoned or timed out): the evaluator skips it."""
        self._pending = None
        self.endpoint.run(self._g_withdraw(payload))

    # ---- evaluator side (asyncio) -----------------------------------------------------------------
    async def next_request_async(self, after_version: int) -> tuple[int, int] | None:
        """(version, step) of the learner's request if it is not answered yet, else None after polling
        for up to `wait_s`. `after_version` is the version the caller evaluated last: a request for a
        version ≤ it is returned only when it is a new request (a restarted learner re-validating a
        version it resumed at) — an answered request never comes back."""
        deadline = time.monotonic() + self.wait_s
        while True:
            raw_req, raw_res = await self.endpoint.arun(self._g_get_both())
            if raw_req is not None:
                req = _dec_req.decode(raw_req)
                answered = req.id in self._answered
                if not answered and raw_res is not None:
                    answered = _dec_res.decode(raw_res).id == req.id
                if not answered:
                    if req.version <= after_version:
                        log.info("validation of version %d requested again (request %s, after %d): evaluating anew",
                                 req.version, req.id, after_version)
                    self._taken[req.version] = req
                    return req.version, req.step
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await asyncio.sleep(min(self.poll_s, left))

    async def publish_async(self, version: int, results: dict[str, float], *, error: str | None = None) -> None:
        """Answer the request for `version` that `next_request_async` returned (`error` = the evaluation
        failed: `collect` raises it)."""
        req = self._taken.pop(version, None)
        if req is None:
            raise ValueError(f"publish_async(version={version}): next_request_async returned no request for that "
                             f"version")
        payload = _enc.encode(_Result(req.id, req.version, req.step,
                                      {k: float(v) for k, v in results.items()}, error))
        self._last_result = payload
        await self.endpoint.arun(self._g_set(self.result_key, payload, f"publish the validation of version {version}"))
        self._answered.add(req.id)
        if len(self._answered) > 4096:
            self._answered = {req.id}
