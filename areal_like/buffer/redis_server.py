"""`RedisServer`: one real `redis-server` process owned by whoever started it.

Started in a directory it owns (config, AOF, log all live there), bound to 127.0.0.1, with a
generated password, AOF on (`appendfsync everysec`: at most ~1 s of writes lost on a crash),
`maxmemory-policy noeviction` (a full buffer must refuse writes, never silently evict groups) and no
RDB snapshots (the AOF is the only persistence, so a restart has one source of truth).

Stopped by PID only (SIGTERM, then SIGKILL after a timeout) — never by process name. `kill()` is
SIGKILL for crash tests; `restart()` brings the same port/dir/password back and Redis reloads the AOF.

This module does not build clients for the buffer (see `redis_client.py`) and knows nothing of
streams or trajectories.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import redis

from areal_like.api.net import free_port

log = logging.getLogger(__name__)

REDIS_SERVER_BIN = "redis-server"


def _tail(path: Path, n: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log at {path}: {e})"
    return "\n".join(lines[-n:]) or "(log is empty)"


class RedisServerError(RuntimeError):
    """redis-server failed to start or stop; the message names the port and the log file."""


class RedisServer:
    """A `redis-server` child process in `directory`. Use as a context manager or start()/stop()."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        port: int | None = None,
        password: str | None = None,
        host: str = "127.0.0.1",
        maxmemory: str | None = None,
        start_timeout_s: float = 15.0,
        stop_timeout_s: float = 10.0,
        binary: str = REDIS_SERVER_BIN,
    ) -> None:
        self.dir = Path(directory).resolve()
        self.host = host
        self._fixed_port = port
        self.port: int = port or 0
        # token_urlsafe: only [A-Za-z0-9_-], so the password needs no quoting inside a URL
        self.password = password or secrets.token_urlsafe(24)
        self.maxmemory = maxmemory
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.binary = binary
        self.proc: subprocess.Popen | None = None

    # ---- paths and URLs -------------------------------------------------------------------------
    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    @property
    def conf_path(self) -> Path:
        return self.dir / "redis.conf"

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def safe_url(self) -> str:
        """The URL without the password (for logs and error messages)."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # ---- lifecycle ------------------------------------------------------------------------------
    def _write_conf(self) -> None:
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            "protected-mode yes",
            f"requirepass {self.password}",
            "daemonize no",
            f'dir "{self.dir}"',
            f'logfile "{self.log_path}"',
            "appendonly yes",
            "appendfsync everysec",
            'appendfilename "appendonly.aof"',
            'save ""',  # no RDB snapshots: the AOF is the single source of truth on restart
            "maxmemory-policy noeviction",  # a full buffer refuses writes instead of evicting groups
            "tcp-keepalive 60",
        ]
        if self.maxmemory:
            lines.append(f"maxmemory {self.maxmemory}")
        # The AOF holds every trajectory and reward, the log the clients' addresses: owner-only (issue 24).
        # 0700 on the directory (also one made before this rule, or by a user's umask) shuts out every other
        # account whatever mode the files inside got; the process umask below makes new files 0600 too.
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        # the file holds the password (not the command line, which `ps` shows to everyone): 0600
        fd = os.open(self.conf_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")

    def start(self) -> "RedisServer":
        if self.is_running():
            return self
        attempts = 1 if (self._fixed_port or self.port) else 3
        last: Exception | None = None
        for _ in range(attempts):
            if not self.port:
                self.port = free_port(self.host)
            try:
                self._start_once()
                return self
            except RedisServerError as e:
                last = e
                if self._fixed_port or "Address already in use" not in str(e):
                    raise
                self.port = 0  # someone took the free port between our probe and the bind: pick another
        assert last is not None
        raise last

    def _start_once(self) -> None:
        self._write_conf()
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.proc = subprocess.Popen(
            [self.binary, str(self.conf_path)],
            cwd=self.dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C in the terminal reaches our supervisor, not Redis first
            umask=0o077,  # redis-server creates its AOF, AOF manifest and log with its process umask: 0600
        )
        client = redis.Redis(
            host=self.host, port=self.port, password=self.password,
            socket_timeout=1.0, socket_connect_timeout=1.0, retry=None,
        )
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    rc = self.proc.returncode
                    self.proc = None
                    raise RedisServerError(
                        f"redis-server on {self.host}:{self.port} exited with code {rc} during start; "
                        f"log {self.log_path}:\n{self._log_since(log_offset)}"
                    )
                try:
                    if client.ping():
                        log.info("redis-server pid %d ready at %s (dir %s)", self.proc.pid, self.safe_url, self.dir)
                        return
                except redis.exceptions.BusyLoadingError:
                    pass  # still replaying the AOF
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self._signal_and_wait(signal.SIGKILL, 5.0)
                    raise RedisServerError(
                        f"redis-server on {self.host}:{self.port} did not answer PING within "
                        f"{self.start_timeout_s:.0f} s; log {self.log_path}:\n{self._log_since(log_offset)}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return _tail(self.log_path)
        return "\n".join(text.splitlines()[-20:]) or "(log is empty)"

    def _signal_and_wait(self, sig: int, timeout_s: float) -> bool:
        """Send `sig` to our child by PID; True if it exited within the timeout."""
        if self.proc is None:
            return True
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> None:
        """SIGTERM (Redis fsyncs the AOF and exits), then SIGKILL after `stop_timeout_s`."""
        if self.proc is None:
            return
        if not self._signal_and_wait(signal.SIGTERM, self.stop_timeout_s):
            log.warning("redis-server pid %d on port %d ignored SIGTERM for %.0f s; sending SIGKILL (log %s)",
                        self.proc.pid, self.port, self.stop_timeout_s, self.log_path)
            if not self._signal_and_wait(signal.SIGKILL, 5.0):
                raise RedisServerError(f"redis-server pid {self.proc.pid} on port {self.port} survived SIGKILL")
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, no shutdown fsync: what a machine crash or OOM kill looks like (crash tests)."""
        if self.proc is None:
            return
        self._signal_and_wait(signal.SIGKILL, 5.0)
        self.proc = None

    def restart(self) -> "RedisServer":
        """Same port, directory and password; Redis reloads the AOF before it answers PING."""
        self.stop()
        self._fixed_port = self.port  # must come back where clients expect it
        return self.start()

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RedisServer({self.safe_url}, pid={self.pid}, dir={self.dir})"
