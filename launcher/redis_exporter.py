"""`RedisExporter`: Debian's `prometheus-redis-exporter` beside the launcher's own redis-server.

The dashboards' buffer row shows Redis's memory and command rate (`redis_memory_used_bytes`,
`redis_commands_processed_total`, …) from this exporter. The launcher starts it right after its Redis
(`metrics.redis_exporter`: `auto` = when the binary is installed, true = required, false = never) and
lists it in prometheus_targets.json as role `redis`. The password reaches it in the environment
(`REDIS_PASSWORD`), never on the command line (`ps` shows that to everyone). It is a helper: if it
dies the run goes on and the Redis panels go empty; it is stopped by PID with the run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request

from areal_like.api.net import free_port
from launcher.procs import end_process_group

BINARY = "prometheus-redis-exporter"
START_TIMEOUT_S = 15.0


class RedisExporterError(RuntimeError):
    """The exporter did not start; the message names its port and log."""


def installed() -> str | None:
    """Path of the exporter binary, or None when it is not installed."""
    return shutil.which(BINARY)


class RedisExporter:
    def __init__(self, redis_host: str, redis_port: int, password: str, log_path: str, *, host: str = "127.0.0.1"):
        self.redis_addr = f"redis://{redis_host}:{redis_port}"
        self.password = password
        self.log_path = log_path
        self.host = host
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "RedisExporter":
        binary = installed()
        if binary is None:
            raise RedisExporterError(f"{BINARY} is not installed: `bash scripts/setup.sh` installs it "
                                     "(apt prometheus-redis-exporter), or set metrics.redis_exporter=false")
        self.port = free_port(self.host)
        env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_")}
        env.update(REDIS_ADDR=self.redis_addr, REDIS_PASSWORD=self.password)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [binary, "-web.listen-address", self.address, "-ping-on-connect"],
                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        url = f"http://{self.address}/metrics"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisExporterError(f"{BINARY} exited with code {self.proc.returncode} at start; "
                                         f"its log: {self.log_path}")
            try:
                with urllib.request.urlopen(url, timeout=2.0) as r:
                    if b"redis_up 1" in r.read():
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RedisExporterError(f"{BINARY} did not report `redis_up 1` at {url} within {START_TIMEOUT_S:.0f} s "
                                 f"(Redis at {self.redis_addr}); its log: {self.log_path}")

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is not None:
            end_process_group(self.proc.pid, self.proc, timeout_s)  # its own session: TERM, wait, KILL
            self.proc = None
