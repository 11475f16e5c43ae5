"""`launcher run` with `launcher.cpu_affinity` really pins its roles: while the run goes, every
thread of the server, the learner, the rollout worker and the launcher's redis-server (pids.json)
is allowed only the CPUs its kind was given."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _allowed(pid: int) -> set[str]:
    """Cpus_allowed_list of every thread of `pid`."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            out |= {line.split()[1] for line in f if line.startswith("Cpus_allowed_list:")}
    return out


@pytest.mark.parametrize("colocated", [False, True])
def test_launcher_run_pins_roles_by_kind(tmp_path, demo_assets, colocated):
    """Disaggregated: each kind on its own CPUs. Co-located (`embedded:d1|fsdp:d1`): the server and the
    learner share the devices, so `launcher.cpu_affinity.server` alone pins both."""
    model, data = demo_assets
    cpus = sorted(os.sched_getaffinity(0))
    gen, train = str(cpus[0]), str(cpus[-1])
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "launcher", "run", "--config", os.path.join(ROOT, "configs/demo.yaml"),
            "--run-dir", str(run_dir), f"model.path={model}", f"data.train_files=[{data}]", "data.val_files=[]",
            "train.test_freq=0", "train.total_steps=1000", "train.batch_size=2", "generation.n=2",
            f"launcher.cpu_affinity.server={gen}",
            f"launcher.cpu_affinity.rollout={gen}", f"launcher.cpu_affinity.redis={train}"]
    argv += ["--allocation", "embedded:d1|fsdp:d1"] if colocated else [f"launcher.cpu_affinity.learner={train}"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ((run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the run never completed a step"
            time.sleep(0.2)
        roles = json.loads((run_dir / "pids.json").read_text())["roles"]
        want = {"server0": gen, "learner": gen if colocated else train, "rollout0": gen, "redis": train}
        got = {name: _allowed(roles[name]) for name in want}
        assert got == {name: {c} for name, c in want.items()}
        assert len(os.listdir(f"/proc/{roles['server0']}/task")) > 1  # a threaded role: all its threads
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)  # the launcher stops its roles and exits
        try:
            proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
