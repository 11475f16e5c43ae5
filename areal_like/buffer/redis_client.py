"""Redis clients with explicit timeouts, and one driver that runs buffer/gate logic sync or async.

Two rules every Redis call in areal_like follows (DESIGN invariant 7):

* **Every call has a timeout, and a failure names the peer.** Clients are built with an explicit
  `socket_timeout` and `socket_connect_timeout` — never redis-py's defaults. An error is raised as
  `RedisCallError` / `RedisCallTimeout` with `host:port/db`, the key, and what we were doing; the
  password never appears in a message.
* **Only idempotent calls are retried.** redis-py ≥ 6 silently retries *every* command on
  connection errors; that would re-run a non-idempotent XREADGROUP. We switch its retry off and
  retry ourselves, with exponential backoff and jitter, only for calls marked `idempotent=True`:
  at least `retries` times and for as long as `reconnect_timeout_s` after the first failure, so a
  producer or the learner rides out a redis-server restart (SIGKILL → restart → AOF reload, during
  which Redis answers LOADING) instead of failing.

Restart detection (DESIGN invariant 4 across Redis crashes). With `appendfsync everysec` a crash of
the machine can lose the last ~1 s of writes; a process that wrote in that second must redo its part
(see replay_buffer.py). The endpoint counts the connections its clients open (`redis_connect_func`);
after a call during which a new connection was opened it reads the server's `run_id` (INFO server),
which changes on every restart. A changed run_id runs the restart hooks (`on_restart`) — operation
generators registered by the buffer and the gate that re-add, re-commit or re-assert what this
process knows it wrote recently. Hooks must be idempotent: they may run after a restart that lost
nothing, and run again if a second crash interrupts them (the new run_id is recorded only once every
hook finished). redis-py reconnects silently when it checks a dead pooled connection out, so counting
connections — not errors — is what makes detection reliable.

Sync/async without twin logic: the buffer and the gate write each operation once, as a generator
that yields `Call` (one round trip: one command or a non-transactional pipeline) or `Sleep`, and
receives the reply. `RedisEndpoint.run(gen)` drives it with a sync client, `await .arun(gen)` with a
`redis.asyncio` client. The logic cannot drift between the two because there is only one copy.

This module knows nothing of streams, trajectories or the gate arithmetic.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio
import redis.exceptions as rexc

log = logging.getLogger(__name__)

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


def is_loopback(host: str | None) -> bool:
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name: assume it leaves the machine


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


def check_url_security(url: str, password_env: str | None = None) -> list[str]:
    """Warnings (also logged) for a URL that sends secrets or trajectories in the clear off this host,
    or reaches a remote Redis without any password. Empty for loopback or rediss:// with a password."""
    u = urlsplit(url)
    has_pw = bool(u.password) or bool(password_env and os.environ.get(password_env))
    out: list[str] = []
    if not is_loopback(u.hostname):
        if u.scheme == "redis":
            out.append(f"redis {endpoint_name(url)} is not on this host and the URL is redis:// (no TLS): the password "
                       f"and every trajectory cross the network in clear text; use rediss://")
        if not has_pw:
            out.append(f"redis {endpoint_name(url)} is not on this host and no password is set (URL or "
                       f"${password_env}): anyone who can reach it can read and write the buffer")
    for w in out:
        log.warning(w)
    return out


def make_client(
    url: str,
    *,
    password_env: str | None = "AREAL_LIKE_REDIS_PASSWORD",
    socket_timeout_s: float = 10.0,
    connect_timeout_s: float = 5.0,
    health_check_interval_s: int = 30,
    on_connect: Callable[[], None] | None = None,
) -> redis.Redis:
    """A sync client for `url` (redis:// or rediss://) with explicit timeouts and no implicit retries.

    The password comes from the URL, else from the environment variable `password_env`.
    `socket_timeout_s` must exceed any BLOCK time used on this client (the caller checks).
    `on_connect()` is called after each new connection has authenticated.
    """
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kw = _client_kwargs(url, password_env, socket_timeout_s, connect_timeout_s, health_check_interval_s)
    if on_connect is not None:
        def connect_func(conn: Any) -> None:
            conn.on_connect()  # AUTH, SELECT, … — what redis-py does when no callback is given
            on_connect()

        kw["redis_connect_func"] = connect_func
    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **kw)


def make_async_client(
    url: str,
    *,
    password_env: str | None = "AREAL_LIKE_REDIS_PASSWORD",
    socket_timeout_s: float = 10.0,
    connect_timeout_s: float = 5.0,
    health_check_interval_s: int = 30,
    on_connect: Callable[[], None] | None = None,
) -> redis.asyncio.Redis:
    """The `redis.asyncio` twin of `make_client` (same timeouts, no implicit retries)."""
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    kw = _client_kwargs(url, password_env, socket_timeout_s, connect_timeout_s, health_check_interval_s)
    if on_connect is not None:
        async def connect_func(conn: Any) -> None:
            await conn.on_connect()
            on_connect()

        kw["redis_connect_func"] = connect_func
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
    """ResponseError message prefixes (e.g. "BUSYGROUP") or redis-py class names (e.g.
    "OutOfMemoryError") returned as values instead of raised."""

    @staticmethod
    def lua(script: LuaScript, keys: list[str] | tuple[str, ...], args: list | tuple = ()) -> "Cmd":
        return Cmd("evalsha", (script.sha, len(keys), *keys, *args), script=script)

    @staticmethod
    def eval(script: LuaScript, keys: list[str] | tuple[str, ...], args: list | tuple = ()) -> "Cmd":
        """EVAL with the source: for use inside MULTI (cannot fail with NOSCRIPT)."""
        return Cmd("eval", (script.source, len(keys), *keys, *args))


@dataclass(frozen=True, slots=True)
class Call:
    """One round trip. Several commands are sent as one non-transactional pipeline."""

    what: str  # "add group g-17", "read 4 entries as learner-0": goes into error messages
    key: str
    cmds: tuple[Cmd, ...]
    idempotent: bool
    transaction: bool = False
    """Send the commands as MULTI … EXEC (atomic). Scripts in it must be `Cmd.eval` — an EVALSHA
    failing with NOSCRIPT inside EXEC would leave the other commands applied."""

    packed: tuple[bytes, ...] = ()
    """A MULTI … EXEC transaction already in wire format (`Call.tx`): sent as is on one pooled
    connection, bypassing redis-py's command packing and pipeline machinery (the add hot path)."""
    replies: int = 0
    """Replies `packed` produces (MULTI's OK, one QUEUED per command, EXEC's array)."""

    @staticmethod
    def one(what: str, key: str, cmd: Cmd, *, idempotent: bool) -> "Call":
        return Call(what, key, (cmd,), idempotent)

    @staticmethod
    def tx(what: str, key: str, commands: list[tuple], *, idempotent: bool) -> "Call":
        """MULTI, `commands` (each a tuple of str/bytes/int arguments, e.g. ("XADD", key, "*", …)), EXEC —
        atomic like `transaction=True`. The reply is EXEC's list; an error reply to any command (e.g.
        OOM at queue time, then EXECABORT) is raised as redis-py's ResponseError for it, like a pipeline.
        Scripts in it must be EVAL (not EVALSHA), for the reason given at `transaction`."""
        return Call(what, key, (), idempotent, True, _pack([(b"MULTI",), *commands, (b"EXEC",)]),
                    len(commands) + 2)


_BIG_ARG = 1 << 16  # arguments at least this long are sent as their own buffer (never copied)


def _arg(a: Any) -> bytes:
    if isinstance(a, str):
        return a.encode()
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return repr(a).encode()  # as redis-py encodes numbers
    if isinstance(a, (bytes, bytearray, memoryview)):
        return bytes(a)
    raise TypeError(f"redis argument of type {type(a).__name__}: want str, bytes, int or float")


def _pack(commands: list[tuple]) -> tuple[bytes, ...]:
    """Commands in RESP wire format as few buffers: small arguments joined, big ones on their own."""
    out: list[bytes] = []
    buf: list[bytes] = []
    put = buf.append
    for args in commands:
        put(b"*%d\r\n" % len(args))
        for a in args:
            if type(a) is not bytes:
                a = _arg(a)
            n = len(a)
            if n >= _BIG_ARG:
                put(b"$%d\r\n" % n)
                out.append(b"".join(buf))
                out.append(a)
                buf.clear()
                put(b"\r\n")
            else:
                put(b"$%d\r\n" % n)
                put(a)
                put(b"\r\n")
    out.append(b"".join(buf))
    return tuple(out)


def _tx_result(replies: list[Any]) -> Any:
    """EXEC's reply of a packed transaction, or the first error among all replies raised."""
    for r in replies:
        if isinstance(r, rexc.ResponseError):
            raise r
    res = replies[-1]
    if isinstance(res, list):
        for r in res:
            if isinstance(r, rexc.ResponseError):  # a command that failed while EXEC ran it
                raise r
    return res


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


Op = Call | Sleep
OpGen = Generator[Op, Any, Any]


# ---- the driver --------------------------------------------------------------------------------
_RETRYABLE = (rexc.ConnectionError, rexc.TimeoutError)  # BusyLoadingError (AOF reload) is a ConnectionError
_NOT_RETRYABLE = (rexc.AuthenticationError, rexc.AuthorizationError)

RestartHook = Callable[[], OpGen]


def _server_id(info: Any) -> str:
    if isinstance(info, Exception):  # INFO not allowed for this ACL user: every reconnect counts as a restart
        return f"unknown-{time.monotonic_ns()}"
    return str(info.get("run_id", ""))


class RedisEndpoint:
    """One Redis URL plus lazily built sync and asyncio clients; runs operation generators.

    Share one endpoint between the buffer and the gate of a process to share its connections.
    The asyncio client is bound to the event loop it was created in; a new loop gets a new client.

    Errors: a failed call raises `RedisCallError`/`RedisCallTimeout` *into* the operation generator
    (`gen.throw`), so an operation may handle it; uncaught, it leaves `run`/`arun`.
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
        reconnect_timeout_s: float = 60.0,
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
        self.reconnect_timeout_s = reconnect_timeout_s
        """Idempotent calls keep retrying connection errors this long (after `retries` attempts)."""
        _client_kwargs(url, None, 1, 1, 0)  # validate the scheme now, not at the first call
        check_url_security(url, password_env)
        self._sync: redis.Redis | None = None
        self._async: redis.asyncio.Redis | None = None
        self._async_loop: asyncio.AbstractEventLoop | None = None
        # restart detection
        self.connects = 0  # connections opened by our clients (sync + async)
        self._checked_connects = 0  # `connects` when the server identity was last read
        self.run_id: str | None = None  # server identity (INFO server run_id) last seen
        self.restarts = 0  # server restarts seen by this endpoint
        self._hooks: list[RestartHook] = []
        self._in_check = False
        self._sync_lock = threading.Lock()
        self._async_lock: asyncio.Lock | None = None

    def __repr__(self) -> str:
        return f"RedisEndpoint({self.name})"

    def on_restart(self, hook: RestartHook) -> None:
        """Register an idempotent operation run after a server restart is detected (see module doc)."""
        self._hooks.append(hook)

    def _count_connect(self) -> None:
        self.connects += 1

    # -- clients --
    @property
    def client(self) -> redis.Redis:
        if self._sync is None:
            self._sync = make_client(
                self.url, password_env=self.password_env, socket_timeout_s=self.socket_timeout_s,
                connect_timeout_s=self.connect_timeout_s, health_check_interval_s=self.health_check_interval_s,
                on_connect=self._count_connect,
            )
        return self._sync

    @property
    def async_client(self) -> redis.asyncio.Redis:
        loop = asyncio.get_running_loop()
        if self._async is None or self._async_loop is not loop:
            self._async = make_async_client(
                self.url, password_env=self.password_env, socket_timeout_s=self.socket_timeout_s,
                connect_timeout_s=self.connect_timeout_s, health_check_interval_s=self.health_check_interval_s,
                on_connect=self._count_connect,
            )
            self._async_loop = loop
            self._async_lock = asyncio.Lock()
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

    def _retry(self, call: Call, e: BaseException, attempt: int, first_fail: float) -> bool:
        if isinstance(e, _NOT_RETRYABLE) or not isinstance(e, _RETRYABLE) or not call.idempotent:
            return False
        if attempt < self.retries or time.monotonic() - first_fail < self.reconnect_timeout_s:
            if attempt == 0:
                log.warning("redis %s key %s: %s: %s: %s; retrying with backoff for up to %.0f s", self.name,
                            call.key, call.what, type(e).__name__, e, self.reconnect_timeout_s)
            return True
        return False

    def _recovered(self, call: Call, attempt: int, first_fail: float) -> None:
        if attempt:
            log.warning("redis %s key %s: %s succeeded after %d retries (%.1f s)", self.name, call.key, call.what,
                        attempt, time.monotonic() - first_fail)

    @staticmethod
    def _ok_error(cmd: Cmd, e: rexc.ResponseError) -> bool:
        return any(str(e).startswith(p) or type(e).__name__ == p for p in cmd.ok_errors)

    # -- restart detection: one generator, driven by run/arun --
    def _needs_check(self) -> bool:
        return self.connects != self._checked_connects and not self._in_check

    def _g_check_server(self) -> OpGen:
        """Read the server's run_id; on a change run every restart hook, then record the new id."""
        info = yield Call.one("read server identity (INFO server)", "-",
                              Cmd("info", ("server",), ok_errors=("NOPERM",)), idempotent=True)
        # connections opened so far belong to this identity (the INFO call itself may have opened one)
        self._checked_connects = self.connects
        rid = _server_id(info)
        if self.run_id is None:
            self.run_id = rid  # first contact: the baseline, nothing to redo
            return
        if rid == self.run_id:
            return
        log.warning("redis %s restarted (run_id %s… → %s…): running %d recovery hook(s)", self.name,
                    self.run_id[:8], rid[:8], len(self._hooks))
        for hook in self._hooks:
            yield from hook()
        self.run_id = rid  # only now: a crash during the hooks makes the next check run them again
        self.restarts += 1
        from areal_like.metrics import REDIS_RESTARTS

        REDIS_RESTARTS.inc()

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

    def _packed_sync(self, call: Call) -> Any:
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(call.packed)
            replies: list[Any] = []
            for _ in range(call.replies):  # read every reply, errors too: the connection stays in step
                try:
                    replies.append(conn.read_response())
                except rexc.ResponseError as e:
                    replies.append(e)
        except BaseException:
            conn.disconnect()  # a reply may be half read: never hand this connection out again as is
            raise
        finally:
            pool.release(conn)
        return _tx_result(replies)

    def _call_sync(self, call: Call) -> Any:
        attempt = 0
        first_fail = 0.0
        while True:
            try:
                if call.packed:
                    out = self._packed_sync(call)
                elif len(call.cmds) == 1:
                    out = self._cmd_sync(self.client, call.cmds[0])
                else:
                    pipe = self.client.pipeline(transaction=call.transaction)
                    for c in call.cmds:
                        getattr(pipe, c.method)(*c.args, **(c.kwargs or {}))
                    out = pipe.execute()
                self._recovered(call, attempt, first_fail)
                return out
            except rexc.RedisError as e:
                if attempt == 0:
                    first_fail = time.monotonic()
                if self._retry(call, e, attempt, first_fail):
                    time.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise self._error(call, e, attempt + 1) from e

    def _check_sync(self) -> None:
        with self._sync_lock:
            if not self._needs_check():
                return
            self._in_check = True
            try:
                self._drive_sync(self._g_check_server())
            finally:
                self._in_check = False

    def _drive_sync(self, gen: OpGen) -> Any:
        reply: Any = None
        err: BaseException | None = None
        while True:
            try:
                op = gen.send(reply) if err is None else gen.throw(err)
            except StopIteration as stop:
                return stop.value
            err = reply = None
            if isinstance(op, Sleep):
                time.sleep(op.seconds)
                continue
            try:
                reply = self._call_sync(op)
            except RedisCallError as e:
                err = e
                continue
            if self._needs_check():
                self._check_sync()

    def run(self, gen: OpGen) -> Any:
        """Drive an operation generator with the sync client; returns the generator's return value."""
        return self._drive_sync(gen)

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

    async def _packed_async(self, client: Any, call: Call) -> Any:
        pool = client.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(call.packed)
            replies: list[Any] = []
            for _ in range(call.replies):
                try:
                    replies.append(await conn.read_response())
                except rexc.ResponseError as e:
                    replies.append(e)
        except BaseException:
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)
        return _tx_result(replies)

    async def _call_async(self, call: Call) -> Any:
        attempt = 0
        first_fail = 0.0
        while True:
            try:
                client = self.async_client
                if call.packed:
                    out = await self._packed_async(client, call)
                elif len(call.cmds) == 1:
                    out = await self._cmd_async(client, call.cmds[0])
                else:
                    pipe = client.pipeline(transaction=call.transaction)
                    for c in call.cmds:
                        getattr(pipe, c.method)(*c.args, **(c.kwargs or {}))
                    out = await pipe.execute()
                self._recovered(call, attempt, first_fail)
                return out
            except rexc.RedisError as e:
                if attempt == 0:
                    first_fail = time.monotonic()
                if self._retry(call, e, attempt, first_fail):
                    await asyncio.sleep(self._delay(attempt))
                    attempt += 1
                    continue
                raise self._error(call, e, attempt + 1) from e

    async def _check_async(self) -> None:
        assert self._async_lock is not None
        async with self._async_lock:  # concurrent coroutines: one of them runs the hooks
            if not self._needs_check():
                return
            self._in_check = True
            try:
                await self._drive_async(self._g_check_server())
            finally:
                self._in_check = False

    async def _drive_async(self, gen: OpGen) -> Any:
        reply: Any = None
        err: BaseException | None = None
        while True:
            try:
                op = gen.send(reply) if err is None else gen.throw(err)
            except StopIteration as stop:
                return stop.value
            err = reply = None
            if isinstance(op, Sleep):
                await asyncio.sleep(op.seconds)
                continue
            try:
                reply = await self._call_async(op)
            except RedisCallError as e:
                err = e
                continue
            if self._needs_check():
                await self._check_async()

    async def arun(self, gen: OpGen) -> Any:
        """Drive an operation generator with the asyncio client."""
        return await self._drive_async(gen)
