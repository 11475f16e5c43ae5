"""Issue 24, items 4 and 9: the run directory against another local account and against a second launcher.

Another account is played by `setpriv --reuid=65534` (nobody): the tests run as root, which reads
anything, so only a real second uid shows what the file modes allow. The directories live under a
world-traversable base made here (pytest's tmp_path sits in a 0700 /tmp/pytest-of-<user>/, which would
hide a world-readable file behind its parent and let the tests pass without the fix).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import redis
from _uid import as_nobody, open_base_dir
from conftest import launcher_finish, launcher_spawn

from areal_like.buffer.redis_server import RedisServer

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def open_base():
    """A 0755 directory under /tmp: every account can traverse to what is made inside it."""
    base = open_base_dir()
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _redis_files(redis_dir: str) -> list[str]:
    """Every file redis-server keeps: config (password), log, AOF manifest, base and increments."""
    out = []
    for root, _dirs, files in os.walk(redis_dir):
        out += [os.path.join(root, f) for f in files]
    return out


def test_redis_aof_and_log_are_unreadable_to_another_account(open_base):
    """Item 4: the AOF (every trajectory and reward) and Redis' log: 0600 files in a 0700 directory,
    also when the directory already existed world-readable (a run dir from before, a user's umask)."""
    rdir = os.path.join(open_base, "redis")
    os.mkdir(rdir)
    os.chmod(rdir, 0o755)
    with RedisServer(rdir) as srv:
        client = redis.Redis(host=srv.host, port=srv.port, password=srv.password, socket_timeout=5)
        client.set("trajectory", "secret-reward-1.0")
        client.close()
        files = _redis_files(rdir)
        assert any(".aof" in f for f in files) and str(srv.log_path) in files, files
        for path in files:
            assert os.stat(path).st_mode & 0o077 == 0, (path, oct(os.stat(path).st_mode))
            res = as_nobody("cat", path)
            assert res.returncode != 0 and "Permission denied" in res.stderr, (path, res.returncode, res.stdout[:200])
        assert os.stat(rdir).st_mode & 0o777 == 0o700
        res = as_nobody("ls", rdir)
        assert res.returncode != 0 and "Permission denied" in res.stderr, res


def _demo_argv(run_dir, assets, *overrides):
    model, data = assets
    return ("run", "--config", "configs/demo.yaml", "--allocation", "embedded.d1p1t1+d1p1t1", "--run-dir",
            str(run_dir), f"model.path={model}", f"data.train_files=[{data}]", *overrides)


def test_second_launcher_on_the_same_run_dir_is_refused(open_base, demo_assets):
    """Item 9: a second `launcher run` on a live run's directory exits at once naming the holder's pid and
    the way out, touches none of the first run's files (config.json bytes equal: its admin key stays the
    learner's), and the first run completes. Item 4 at run level: the run dir is shut to other accounts."""
    run_dir = os.path.join(open_base, "run")
    steps = 40  # long enough that the first run is still training when the second is refused
    first = launcher_spawn(*_demo_argv(run_dir, demo_assets, f"train.total_steps={steps}"))
    try:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not os.path.exists(metrics):
            assert first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.2)
        assert first.poll() is None, "the first run ended before the second could be started"
        with open(os.path.join(run_dir, "config.json"), "rb") as f:
            config_before = f.read()
        with open(os.path.join(run_dir, "pids.json")) as f:
            pids_before = f.read()

        rc, out = launcher_finish(launcher_spawn(*_demo_argv(run_dir, demo_assets, f"train.total_steps={steps}")),
                                  timeout=120)
        assert rc != 0, out[-3000:]
        assert f"pid {first.pid}" in out and run_dir in out, out[-3000:]
        assert f"launcher stop --run-dir {run_dir}" in out and "--run-dir" in out, out[-3000:]
        assert "redis-server pid" not in out, "the refused run started a Redis of its own"
        with open(os.path.join(run_dir, "config.json"), "rb") as f:
            assert f.read() == config_before, "the refused run rewrote config.json"
        with open(os.path.join(run_dir, "pids.json")) as f:
            assert f.read() == pids_before, "the refused run rewrote pids.json"
        assert not os.path.exists(os.path.join(run_dir, "summary.json")), "the refused run wrote a summary"

        # `launcher status` reads the run dir while the lock is held
        status = subprocess.run([sys.executable, "-m", "launcher", "status", "--run-dir", run_dir], cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and "running" in status.stdout, status.stderr

        # another account can neither list the run dir nor read the AOF by its full path
        assert os.stat(run_dir).st_mode & 0o077 == 0, oct(os.stat(run_dir).st_mode)
        res = as_nobody("ls", run_dir)
        assert res.returncode != 0 and "Permission denied" in res.stderr, res
        files = _redis_files(os.path.join(run_dir, "redis"))
        assert any(".aof" in f for f in files), files
        for path in files:
            res = as_nobody("cat", path)
            assert res.returncode != 0 and "Permission denied" in res.stderr, (path, res)
    finally:
        rc, out = launcher_finish(first, timeout=600)
    assert rc == 0, out[-3000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["exit_reason"] == "completed" and summary["steps"] == steps, summary
