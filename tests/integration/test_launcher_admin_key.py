"""`launcher run` starts every embedded server with a random admin key (issue 11, item 4).

The key is generated into the run's config.json (owner-only), reaches the servers through their
environment (not argv, which every local user can read) and the learner's weight pusher through
config.json; the servers refuse admin calls without it, and the key is printed nowhere."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_launcher_starts_servers_with_a_random_admin_key(tmp_path, demo_assets):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "launcher", "run", "--config", os.path.join(ROOT, "configs/demo.yaml"),
            "--allocation", "embedded.d1p1t1+d1p1t1", "--run-dir", str(run_dir), f"model.path={model}",
            f"data.train_files=[{data}]", "train.total_steps=1000", "train.batch_size=2", "generation.n=2"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the run never completed a step"
            time.sleep(0.2)
        # a step completed: the learner pushed its weights with the key (the servers demand one)
        cfg_path = run_dir / "config.json"
        assert os.stat(cfg_path).st_mode & 0o777 == 0o600
        key = json.loads(cfg_path.read_text())["server"]["admin_api_key"]
        assert isinstance(key, str) and len(key) >= 32
        (url,) = json.loads((run_dir / "endpoints.json").read_text())["servers"]
        req = urllib.request.Request(url + "/pause_generation", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401
        server_pid = json.loads((run_dir / "pids.json").read_text())["roles"]["server0"]
        with open(f"/proc/{server_pid}/cmdline", "rb") as f:
            assert key.encode() not in f.read()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)  # the launcher stops its roles and exits
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    assert key not in out
    for dirpath, _, files in os.walk(run_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            if path == str(cfg_path) or not os.path.isfile(path):
                continue
            with open(path, "rb") as f:
                assert key.encode() not in f.read(), f"the admin key leaked into {path}"
