"""`launcher stop` / `launcher status` decide whether a recorded process still runs: a zombie (exited,
not yet reaped by its parent) is not running — `launcher stop` used to wait its full 60 s for one."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from areal_like.api.process import process_running as _running


def test_an_exited_unreaped_process_is_not_running():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # wait until it exited, without reaping it (no wait/poll)
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    assert os.path.exists(f"/proc/{child.pid}")  # the zombie keeps its /proc entry…
    assert not _running(child.pid)  # …but is not a running process
    child.wait()
    assert not _running(child.pid)  # reaped: gone
    assert _running(os.getpid())
