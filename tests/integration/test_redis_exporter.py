"""metrics.redis_exporter: Debian's prometheus-redis-exporter beside the launcher's own redis-server.

A real exporter against a real redis-server reports `redis_up 1` and Redis's memory; the password
reaches it in the environment, not on its command line; a missing binary or an unreachable Redis is
an error naming the fix or the address and log. Through `launcher run`: `false` starts none and lists no
`redis` target; `true` starts it, lists it as role/kind `redis` and stops it with the run. (`auto` is
driven by test_dashboard_prometheus.py, whose Redis panels read it.)
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from areal_like.buffer.redis_server import RedisServer
from launcher import redis_exporter
from launcher.redis_exporter import RedisExporter, RedisExporterError

pytestmark = pytest.mark.integration


def test_exporter_reads_the_runs_redis_with_the_password_kept_off_its_command_line(tmp_path):
    assert redis_exporter.installed(), "prometheus-redis-exporter is missing: run `bash scripts/setup.sh`"
    with RedisServer(tmp_path / "redis") as redis:
        exp = RedisExporter(redis.host, redis.port, redis.password, str(tmp_path / "exporter.log"))
        try:
            exp.start()
            with urllib.request.urlopen(f"http://{exp.address}/metrics", timeout=10) as r:
                text = r.read().decode()
            assert "redis_up 1" in text
            assert "redis_memory_used_bytes" in text and "redis_commands_processed_total" in text
            with open(f"/proc/{exp.pid}/cmdline", "rb") as f:
                assert redis.password.encode() not in f.read()
        finally:
            exp.stop()
        assert exp.pid is None


def test_exporter_that_cannot_reach_redis_fails_naming_redis_and_its_log(tmp_path):
    with RedisServer(tmp_path / "redis") as redis:
        exp = RedisExporter(redis.host, redis.port, "wrong-password", str(tmp_path / "exporter.log"))
        exp_error = None
        try:
            import launcher.redis_exporter as mod

            old, mod.START_TIMEOUT_S = mod.START_TIMEOUT_S, 3.0
            try:
                exp.start()
            except RedisExporterError as e:
                exp_error = str(e)
            finally:
                mod.START_TIMEOUT_S = old
        finally:
            exp.stop()
    assert exp_error is not None and f"redis://{redis.host}:{redis.port}" in exp_error and "exporter.log" in exp_error


def test_missing_exporter_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(redis_exporter.shutil, "which", lambda name: None)
    with pytest.raises(RedisExporterError, match="metrics.redis_exporter=false"):
        RedisExporter("127.0.0.1", 1, "x", str(tmp_path / "log")).start()


def test_launcher_run_redis_exporter_off_and_on(tmp_path, run_launcher):
    rc, out = run_launcher(tmp_path / "off", "train.total_steps=2", "metrics.redis_exporter=false")
    assert rc == 0, out[-3000:]
    targets = json.load(open(tmp_path / "off" / "prometheus_targets.json"))
    assert "redis" not in {t["labels"]["role"] for t in targets}
    assert {t["labels"]["kind"] for t in targets} == {"server", "learner", "rollout"}
    assert all(t["labels"]["experiment"] == "demo" and t["labels"]["run"] == "off" for t in targets)
    assert "prometheus-redis-exporter" not in out
    assert not (tmp_path / "off.targets.json").exists()  # the file_sd copy is removed at the end

    sd = tmp_path / "file_sd"  # metrics.file_sd_dir: where Prometheus's file discovery looks
    rc, out = run_launcher(tmp_path / "on", "train.total_steps=2", "metrics.redis_exporter=true",
                           f"metrics.file_sd_dir={sd}")
    assert rc == 0, out[-3000:]
    assert sd.is_dir() and list(sd.iterdir()) == []  # on.targets.json was written there, then removed
    targets = json.load(open(tmp_path / "on" / "prometheus_targets.json"))
    (redis,) = [t for t in targets if t["labels"]["role"] == "redis"]
    assert redis["labels"]["kind"] == "redis"
    pids = json.load(open(tmp_path / "on" / "pids.json"))
    assert "redis_exporter" in pids["roles"]
    with pytest.raises(ProcessLookupError):  # stopped with the run
        os.kill(pids["roles"]["redis_exporter"], 0)
