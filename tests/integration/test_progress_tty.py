"""`launcher run`'s progress, seen as a user sees it (launcher/progress.py).

In a real terminal (a tmux pane, 200×50): one bar updated in place with step/total and an ETA; a
message printed meanwhile (a restart, to stderr) goes above the bar instead of breaking it. With stdout
to a file: the plain `[launcher] step N/T …` lines, no escape codes, no bar.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 60
BAR = re.compile(r"^\[launcher\] step (\d+)/(\d+) .*ETA (-:--:--|\d+:\d\d:\d\d)\s+elapsed")
EXIT = re.compile(r"^\[exit (\d+)\]$", re.M)


def _argv(run_dir, assets, *overrides):
    model, data = assets
    return [sys.executable, "-m", "launcher", "run", "--config", "configs/demo.yaml", "--run-dir", str(run_dir),
            f"model.path={model}", f"data.train_files=[{data}]", "train.test_freq=0", *overrides]


class _Tmux:
    """A tmux server of our own (-L socket): only it is ever killed."""

    def __init__(self):
        if shutil.which("tmux") is None:  # CI installs it; a silent skip would hide a broken set-up
            pytest.fail("tmux is not on PATH: run `bash scripts/setup.sh` (installs it with apt-get)", pytrace=False)
        self.socket = f"areal-progress-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-u", "-L", self.socket, *args], check=True, capture_output=True, text=True,
                              timeout=30).stdout

    def pane(self, history: bool = False) -> list[str]:
        return self("capture-pane", "-p", "-t", "run", *(["-S", "-"] if history else [])).splitlines()

    def kill(self) -> None:
        path = subprocess.run(["tmux", "-L", self.socket, "display-message", "-p", "#{socket_path}"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)
        if path.endswith(self.socket) and os.path.exists(path):  # tmux leaves its socket file behind
            os.unlink(path)


def test_terminal_shows_one_updating_bar_with_eta_and_messages_above_it(tmp_path, demo_assets):
    run_dir = tmp_path / "run"
    # COLUMNS/LINES from the test's environment would override the pane's size for rich
    cmd = (f"cd {shlex.quote(ROOT)} && env -u COLUMNS -u LINES "
           + " ".join(shlex.quote(a) for a in _argv(run_dir, demo_assets, f"train.total_steps={STEPS}"))
           + '; echo "[exit $?]"; sleep 600')
    tmux = _Tmux()
    try:
        tmux("new-session", "-d", "-s", "run", "-x", "200", "-y", "50", cmd)
        steps_seen, etas, killed, rc = set(), set(), None, None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            lines = tmux.pane()
            if m := EXIT.search("\n".join(lines)):
                rc = int(m.group(1))
                break
            bars = [m for m in map(BAR.match, lines) if m]
            assert len(bars) <= 1, "more than one progress line on the screen:\n" + "\n".join(lines)
            if bars:
                step, total, eta = int(bars[0].group(1)), int(bars[0].group(2)), bars[0].group(3)
                assert total == STEPS
                steps_seen.add(step)
                etas.add(eta)
                if killed is None and step >= 3:  # a restart message, printed while the bar is shown
                    killed = json.loads((run_dir / "pids.json").read_text())["roles"]["rollout0"]
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.25)
        else:
            tmux("send-keys", "-t", "run", "C-c")  # the launcher ends its roles on Ctrl-C
            time.sleep(30)
            pytest.fail("launcher run did not finish in 300 s:\n" + "\n".join(tmux.pane(history=True)[-40:]))
        history = tmux.pane(history=True)
    finally:
        tmux.kill()
    text = "\n".join(history)
    assert rc == 0, text[-4000:]
    assert killed is not None, f"the bar never showed step ≥ 3: {sorted(steps_seen)}\n{text[-4000:]}"
    assert len(steps_seen) >= 3, f"the bar was not updated: steps seen {sorted(steps_seen)}"
    assert any(e != "-:--:--" for e in etas), f"no ETA shown: {etas}"
    # the whole scrollback: the bar was redrawn in place, so it is there once, at its final state
    bars = [m for m in map(BAR.match, history) if m]
    assert len(bars) == 1, text[-4000:]
    assert bars[0].group(1) == str(STEPS) and "reward " in bars[0].string and "samples/s " in bars[0].string
    assert "staleness max " in bars[0].string and "buffer " in bars[0].string
    assert "restarts: rollout 1" in bars[0].string
    # the restart message is whole lines above the bar, not mixed into it
    restart = [i for i, line in enumerate(history) if line.startswith("[launcher] rollout0 exited with code -9: restarted")]
    assert len(restart) == 1, text[-4000:]
    assert restart[0] < history.index(bars[0].string)
    assert sum("step " in line and f"/{STEPS}" in line for line in history) == 1, text[-4000:]


def test_plain_lines_when_stdout_is_a_file(tmp_path, demo_assets):
    run_dir, log = tmp_path / "run", tmp_path / "out.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(_argv(run_dir, demo_assets, "train.total_steps=4"), cwd=ROOT, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"launcher run did not finish in 300 s:\n{log.read_text()[-3000:]}")
    out = log.read_text()
    assert rc == 0, out[-4000:]
    lines = re.findall(r"^\[launcher\] step (\d+)/4  version \d+  reward [\d.]+  samples/s [\d.]+  staleness max \d+  "
                       r"buffer \d+  step [\d.]+s push [\d.]+s$", out, re.M)
    assert lines and lines[-1] == "4", out[-4000:]  # the final line, after the last step
    assert "\r" not in out and "\x1b[" not in out and "━" not in out and "ETA" not in out
