"""`RedisMetricsEndpoint`: the run's Redis metrics, served by the launcher itself (metrics.redis_exporter).

The dashboards' buffer row reads Redis's memory and command rate under the names Debian's
prometheus-redis-exporter uses (`redis_up`, `redis_memory_used_bytes`, `redis_commands_processed_total`,
`redis_connected_clients`, `redis_db_keys{db}`, `redis_aof_current_size_bytes`, …). That exporter was
dropped (issue 24): it honours `GET /scrape?target=HOST:PORT`, so any local user could point it at a
listener of theirs and receive `AUTH <password>`; Debian's build has no way to require auth or turn
/scrape off.

This endpoint is a thread of the launcher: on each scrape it runs INFO on the run's own Redis — host,
port and password fixed when it is made, never taken from a request (query strings are ignored) — with
a short socket timeout; if Redis does not answer, it serves `redis_up 0` and nothing else. It serves
only `/metrics` (anything else is 404) and returns numbers only (nothing from INFO's text fields).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

INFO_TIMEOUT_S = 2.0

# INFO field → (metric name as prometheus-redis-exporter names it, help, counter?)
_FIELDS = {
    "used_memory": ("redis_memory_used_bytes", "Bytes of memory Redis has allocated (INFO used_memory)", False),
    "used_memory_rss": ("redis_memory_used_rss_bytes", "Resident memory of redis-server (INFO used_memory_rss)", False),
    "maxmemory": ("redis_memory_max_bytes", "Redis maxmemory (0 = no limit)", False),
    "total_commands_processed": ("redis_commands_processed_total", "Commands processed by Redis", True),
    "total_connections_received": ("redis_connections_received_total", "Connections accepted by Redis", True),
    "connected_clients": ("redis_connected_clients", "Client connections open", False),
    "blocked_clients": ("redis_blocked_clients", "Clients blocked in a blocking call (XREADGROUP BLOCK, …)", False),
    "uptime_in_seconds": ("redis_uptime_in_seconds", "Seconds since redis-server started", False),
    "aof_current_size": ("redis_aof_current_size_bytes", "Size of the append-only file", False),
    "rejected_connections": ("redis_rejected_connections_total", "Connections refused (maxclients)", True),
    "evicted_keys": ("redis_evicted_keys_total", "Keys evicted (the buffer's noeviction policy keeps 0)", True),
}


class RedisInfoCollector:
    """A prometheus_client collector: INFO on one fixed Redis per collect()."""

    def __init__(self, host: str, port: int, password: str | None, timeout_s: float = INFO_TIMEOUT_S):
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._client = redis.Redis(host=host, port=port, password=password, socket_timeout=timeout_s,
                                   socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
        self._lock = threading.Lock()  # one INFO at a time on the shared connection pool

    def _info(self) -> dict | None:
        try:
            with self._lock:
                return self._client.info("all")
        except (redis.RedisError, OSError):
            return None

    def collect(self):
        info = self._info()
        up = GaugeMetricFamily("redis_up", "1 when the run's Redis answered INFO at this scrape, else 0")
        up.add_metric([], 0.0 if info is None else 1.0)
        yield up
        if info is None:
            return
        for field, (name, doc, counter) in _FIELDS.items():
            value = info.get(field)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            family = CounterMetricFamily(name, doc) if counter else GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family
        keys = GaugeMetricFamily("redis_db_keys", "Keys per database", labels=["db"])
        expires = GaugeMetricFamily("redis_db_keys_expiring", "Keys with an expiry per database", labels=["db"])
        for db, stats in info.items():
            if isinstance(db, str) and db.startswith("db") and db[2:].isdigit() and isinstance(stats, dict):
                keys.add_metric([db], float(stats.get("keys", 0)))
                expires.add_metric([db], float(stats.get("expires", 0)))
        yield keys
        yield expires

    def close(self) -> None:
        self._client.close()


class RedisMetricsEndpoint:
    """`GET /metrics` on host:port (a daemon thread of the caller) with the Redis INFO metrics."""

    def __init__(self, redis_host: str, redis_port: int, password: str | None, *, host: str = "127.0.0.1",
                 port: int = 0):
        self.collector = RedisInfoCollector(redis_host, redis_port, password)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        self.host, self.port = host, port
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> "RedisMetricsEndpoint":
        registry = self.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 — http.server's name
                if self.path.split("?", 1)[0] != "/metrics":  # the query string is ignored, never read
                    self.send_error(404, "only /metrics is served here")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args):  # noqa: A002 — no access log on the launcher's output
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self._server = Server((self.host, self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="redis-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.collector.close()
