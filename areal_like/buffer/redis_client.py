"""Redis clients with explicit timeouts, and one driver that runs buffer/gate logic sync or async.

Two rules every Redis call in areal_like follows (DESIGN invariant 7):

* **Every call has a timeout, and a failure names the peer.** Clients are built with an explicit
  `socket_timeout` and `socket_connect_timeout` — never redis-py's defaults. An error is raised as
  `RedisCallError` / `RedisCallTimeout` with `host:port/db`, the key, and what we were doing; the
  password never appears in a message.
* **Only idempotent calls are retried.** redis-py ≥ 6 silently retries *every* command on
  connection errors; that would re-run a non-idempotent XREADGROUP. We switch its retry off and
  retry ourselves, with exponential backoff, only for calls marked `idempotent=True`.

Sync/async without twin logic: the buffer and the gate write each operation once, as a generator
that yields `Call` (one round trip: one command or a non-transactional pipeline) or `Sleep`, and
receives the reply. `RedisEndpoint.run(gen)` drives it with a sync client, `await .arun(gen)` with a
`redis.asyncio` client. The logic cannot drift between the two because there is only one copy.

This module knows nothing of streams, trajectories or the gate arithmetic.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio
import redis.exceptions as rexc


class RedisCallError(RuntimeError):
    """A Redis call failed. The message names host:port/db, the key and the operation."""


class RedisCallTimeout(RedisCallError, TimeoutError):
    """A Redis call timed out (or the connection could not be made in time)."""


def endpoint_name(url: str) -> str:
    """`host:port/db` of a redis:// or rediss:// URL — safe to log (no user, no password)."""
    u = urlsplit(url)
    db = (u.path or "/0").lstrip("/") or "0"
    tls = " (tls)" if u.scheme == "rediss" else ""
    return f"{u.hostname or 'localhost'}:{u.port or 6379}/{db}{tls}"


def _client_kwargs(
    url: str,
    password_env: str | None,
    socket_timeout_s: float,
    connect_timeout_s: float,
    health_check_interval_s: int,
) -> dict[str, Any]:
    u = urlsplit(url)
    if u.scheme not in ("redis", "rediss"):
        raise ValueError(f"redis URL must start with redis:// or rediss:// (got scheme {u.scheme!r} for "
                         f"{endpoint_name(url)})")
    kw: dict[str, Any] = dict(
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=connect_timeout_s,
        health_check_interval=health_check_interval_s,
        retry_on_timeout=False,
        socket_keepalive=True,
    )
    if not u.password and password_env and os.environ.get(password_env):
        kw["password"] = os.environ[password_env]  # a password in the URL wins (from_url semantics)
    return kw


def make_client(
    url: str,
    *,
    password_env: str | None = "AREAL_LIKE_REDIS_PASSWORD",
    socket_timeout_s: float = 10.0,
    connect_timeout_s: float = 5.0,
    health_check_interval_s: int = 30,
) -> redis.Redis:
    """A sync client for `url` (redis:// or rediss://) with explicit timeouts and no implicit retries.

    The password comes from the URL, else from the environment variable `password_env`.
    `socket_timeout_s` must exceed any BLOCK time used on this client (the caller checks).
    """
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw = _client_kwargs(url, password_env, socket_timeout_s, connect_timeout_s, health_check_interval_s)
    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **kw)


def make_async_client(
    url: str,
    *,
    password_env: str | None = "AREAL_LIKE_REDIS_PASSWORD",
    socket_timeout_s: float = 10.0,
    connect_timeout_s: float = 5.0,
    health_check_interval_s: int = 30,
) -> redis.asyncio.Redis:
    """The `redis.asyncio` twin of `make_client` (same timeouts, no implicit retries)."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    kw = _client_kwargs(url, password_env, socket_timeout_s, connect_timeout_s, health_check_interval_s)
    return redis.asyncio.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **kw)


# ---- operations as data ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LuaScript:
    """A Lua script run by EVALSHA, falling back to EVAL after a server restart flushed the cache."""

    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


@dataclass(frozen=True, slots=True)
class Cmd:
    """One Redis command: a redis-py client method name and its arguments, or a script call."""

    method: str
    args: tuple = ()
    kwargs: dict | None = None
    script: LuaScript | None = None
    ok_errors: tuple[str, ...] = ()
    """ResponseError prefixes (e.g. "BUSYGROUP") returned as values instead of raised."""

    @staticmethod
    def lua(script: LuaScript, keys: list[str] | tuple[str, ...], args: list | tuple = ()) -> "Cmd":
        return Cmd("evalsha", (script.sha, len(keys), *keys, *args), script=script)


@dataclass(frozen=True, slots=True)
class Call:
    """One round trip. Several commands are sent as one non-transactional pipeline."""

    what: str  # "add group g-17", "read 4 entries as learner-0": goes into error messages
    key: str
    cmds: tuple[Cmd, ...]
    idempotent: bool

    @staticmethod
    def one(what: str, key: str, cmd: Cmd, *, idempotent: bool) -> "Call":
        return Call(what, key, (cmd,), idempotent)


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


Op = Call | Sleep
OpGen = Generator[Op, Any, Any]


# ---- the driver --------------------------------------------------------------------------------
_RETRYABLE = (rexc.ConnectionError, rexc.TimeoutError)
_NOT_RETRYABLE = (rexc.AuthenticationError, rexc.AuthorizationError)


class RedisEndpoint:
    """One Redis URL plus lazily built sync and asyncio clients; runs operation generators.

    Share one endpoint between the buffer and the gate of a process to share its connections.
    The asyncio client is bound to the event loop it was created in; a new loop gets a new client.
    """

    def __init__(
        self,
        url: str,
        *,
        password_env: str | None = "AREAL_LIKE_REDIS_PASSWORD",
        socket_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        health_check_interval_s: int = 30,
        retries: int = 6,
        backoff_base_s: float = 0.05,
        backoff_cap_s: float = 2.0,
    ) -> None:
        self.url = url
        self.name = endpoint_name(url)
        self.password_env = password_env
        self.socket_timeout_s = socket_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.health_check_interval_s = health_check_interval_s
        self.retries = retries
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        _client_kwargs(url, None, 1, 1, 0)  # validate the scheme now, not at the first call
        self._sync: redis.Redis | None = None
        self._async: redis.asyncio.Redis | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"RedisEndpoint({self.name})"

    # -- clients --
    @property
    def client(self) -> redis.Redis:
        if self._sync is None:
            self._sync = make_client(
                self.url, password_env=self.password_env, socket_timeout_s=self.socket_timeout_s,
                connect_timeout_s=self.connect_timeout_s, health_check_interval_s=self.health_check_interval_s,
            )
        return self._sync

    @property
    def async_client(self) -> redis.asyncio.Redis:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:
            self._async = make_async_client(
                self.url, password_env=self.password_env, socket_timeout_s=self.socket_timeout_s,
                connect_timeout_s=self.connect_timeout_s, health_check_interval_s=self.health_check_interval_s,
            )
            self._async_loop = loop
        return self._async

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    async def aclose(self) -> None:
        if self._async is not None and self._async_loop is asyncio.get_running_loop():
            await self._async.aclose()
        self._async = None
        self._async_loop = None

    # -- errors and backoff --
    def _delay(self, attempt: int) -> float:
        d = min(self.backoff_cap_s, self.backoff_base_s * (2**attempt))
        return d * (0.5 + random.random() / 2)  # jitter: many workers must not retry in lockstep

    def _error(self, call: Call, e: BaseException, attempts: int) -> RedisCallError:
        cls = RedisCallTimeout if isinstance(e, (rexc.TimeoutError, TimeoutError)) else RedisCallError
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        return cls(f"redis {self.name} key {call.key}: {call.what} failed{tries}: {type(e).__name__}: {e}")

    def _retry(self, call: Call, e: BaseException, attempt: int) -> bool:
        if isinstance(e, _NOT_RETRYABLE) or not isinstance(e, _RETRYABLE):
            return False
        return call.idempotent and attempt < self.retries

    @staticmethod
    def _ok_error(cmd: Cmd, e: rexc.ResponseError) -> bool:
        return any(str(e).startswith(p) for p in cmd.ok_errors)

    # -- sync --
    def _cmd_sync(self, client: Any, cmd: Cmd) -> Any:
        try:
            try:
                return getattr(client, cmd.method)(*cmd.args, **(cmd.kwargs or {}))
            except rexc.NoScriptError:
                # the server restarted (or flushed scripts): EVAL sends the source and caches it again
                assert cmd.script is not None
                return client.eval(cmd.script.source, *cmd.args[1:])
        except rexc.ResponseError as e:
            if self._ok_error(cmd, e):
                return e
            raise

    def _call_sync(self, call: Call) -> Any:
        attempt = 0
        while True:
            try:
                if len(call.cmds) == 1:
                    return self._cmd_sync(self.client, call.cmds[0])
                pipe = self.client.pipeline(transaction=False)
                for c in call.cmds:
                    getattr(pipe, c.method)(*c.args, **(c.kwargs or {}))
                return pipe.execute()
            except rexc.RedisError as e:
                if self._retry(call, e, attempt):
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise self._error(call, e, attempt + 1) from e

    def run(self, gen: OpGen) -> Any:
        """Drive an operation generator with the sync client; returns the generator's return value."""
        reply: Any = None
        while True:
            try:
                op = gen.send(reply)
            except StopIteration as stop:
                return stop.value
            if isinstance(op, Sleep):
                time.sleep(op.seconds)
                reply = None
            else:
                reply = self._call_sync(op)

    # -- asyncio --
    async def _cmd_async(self, client: Any, cmd: Cmd) -> Any:
        try:
            try:
                return await getattr(client, cmd.method)(*cmd.args, **(cmd.kwargs or {}))
            except rexc.NoScriptError:
                assert cmd.script is not None
                return await client.eval(cmd.script.source, *cmd.args[1:])
        except rexc.ResponseError as e:
            if self._ok_error(cmd, e):
                return e
            raise

    async def _call_async(self, call: Call) -> Any:
        attempt = 0
        while True:
            try:
                client = self.async_client
                if len(call.cmds) == 1:
                    return await self._cmd_async(client, call.cmds[0])
                pipe = client.pipeline(transaction=False)
                for c in call.cmds:
                    getattr(pipe, c.method)(*c.args, **(c.kwargs or {}))
                return await pipe.execute()
            except rexc.RedisError as e:
                if self._retry(call, e, attempt):
                    await asyncio.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise self._error(call, e, attempt + 1) from e

    async def arun(self, gen: OpGen) -> Any:
        """Drive an operation generator with the asyncio client."""
        reply: Any = None
        while True:
            try:
                op = gen.send(reply)
            except StopIteration as stop:
                return stop.value
            if isinstance(op, Sleep):
                await asyncio.sleep(op.seconds)
                reply = None
            else:
                reply = await self._call_async(op)
