"""`launcher.cpu_affinity`: the config key is checked at load (kinds, CPU lists, CPUs this process may
use, local backend only) and the local backend pins every role of a kind — a started role, what it
spawns, and the launcher's redis-server (every thread)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from areal_like.api.config import ConfigError, cpu_sets, load_config, parse_cpu_list
from launcher.procs import ProcessTable, pin_running, pinned_argv, role_kind

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
ALLOWED = sorted(os.sched_getaffinity(0))


def test_parse_cpu_list():
    assert parse_cpu_list("0") == {0}
    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    assert parse_cpu_list(" 1 , 3-3 ") == {1, 3}
    for bad in ("", "a", "1-", "-1", "2-1", "0,,1", "1.5"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_config_accepts_cpu_lists_and_ints():
    cfg = load_config(DEMO, [f"launcher.cpu_affinity.server={ALLOWED[0]}",
                             f"launcher.cpu_affinity.learner={ALLOWED[-1]}",
                             f"launcher.cpu_affinity.rollout={ALLOWED[0]}-{ALLOWED[-1]}"])
    assert {k: str(v) for k, v in cfg.launcher.cpu_affinity.items()} == {
        "server": str(ALLOWED[0]), "learner": str(ALLOWED[-1]), "rollout": f"{ALLOWED[0]}-{ALLOWED[-1]}"}
    assert load_config(DEMO).launcher.cpu_affinity == {}  # default: no pinning


@pytest.mark.parametrize("override, words", [
    ("launcher.cpu_affinity.gpu=0", ["launcher.cpu_affinity.gpu", "server, learner, rollout, redis"]),
    ("launcher.cpu_affinity.server=zero", ["launcher.cpu_affinity.server", "CPU list"]),
    ("launcher.cpu_affinity.server=3-1", ["launcher.cpu_affinity.server", "backwards"]),
    (f"launcher.cpu_affinity.learner={max(ALLOWED) + 1}", ["launcher.cpu_affinity.learner", "not available",
                                                            "pick CPUs"]),
])
def test_config_refuses_bad_values(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, [override])
    for w in words:
        assert w in str(e.value)


def test_config_refuses_the_key_under_ray():
    with pytest.raises(ConfigError, match="local backend only"):
        load_config(DEMO, ["launcher.cpu_affinity.server=0", "launcher.backend=ray"])
    load_config(DEMO, ["launcher.backend=ray"])  # without the key: fine


def test_role_kind():
    assert [role_kind(n) for n in ("server0", "server12", "learner", "learner3", "rollout1", "redis", "critic",
                                   "critic2")] == ["server", "server", "learner", "learner", "rollout", "redis",
                                                   "critic", "critic"]
    assert role_kind("serverx") is None and role_kind("proxy") is None


def _affinity_of(log_path: str) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = open(log_path).read().strip()
        if text.endswith("]"):
            return json.loads(text.splitlines()[-1])
        time.sleep(0.05)
    raise AssertionError(f"no output in {log_path}")


CHILD = ("import json, os, subprocess, sys; print(json.dumps(sorted(os.sched_getaffinity(0))), flush=True);"
         "subprocess.run([sys.executable, '-c', 'import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))'])")


def test_process_table_pins_by_kind(tmp_path):
    cpu = ALLOWED[-1]
    cfg = load_config(DEMO, [f"launcher.cpu_affinity.server={cpu}"])
    table = ProcessTable(str(tmp_path), cpu_affinity=cpu_sets(cfg.launcher))
    assert table.cpu_affinity == {"server": {cpu}}
    pinned = table.start("server0", [sys.executable, "-c", CHILD], dict(os.environ))
    free = table.start("rollout0", [sys.executable, "-c", CHILD], dict(os.environ))
    assert pinned.proc.wait(30) == 0 and free.proc.wait(30) == 0
    lines = open(pinned.log_path).read().split()
    assert lines == [f"[{cpu}]", f"[{cpu}]"]  # the role and what it spawned
    assert _affinity_of(free.log_path) == ALLOWED
    assert pinned.argv == [sys.executable, "-c", CHILD]  # a restart pins again from the plain argv
    assert json.loads((tmp_path / "pids.json").read_text())["roles"]["server0"] == pinned.pid


def test_pinned_argv_keeps_the_pid_and_resolves_path(tmp_path):
    cpu = ALLOWED[0]
    proc = subprocess.Popen(pinned_argv(["sh", "-c", "echo $$; grep Cpus_allowed_list /proc/self/status"], {cpu}),
                            stdout=subprocess.PIPE, text=True)
    out = proc.communicate(timeout=30)[0].split()
    assert int(out[0]) == proc.pid  # exec, not a child
    assert out[-1] == str(cpu)


def test_pin_running_pins_every_thread():
    if len(ALLOWED) < 2:
        pytest.skip("needs 2 CPUs")
    code = ("import threading, time, sys; [threading.Thread(target=time.sleep, args=(30,), daemon=True).start() "
            "for _ in range(3)]; print('up', flush=True); time.sleep(30)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        pin_running(proc.pid, {ALLOWED[1]})
        tids = os.listdir(f"/proc/{proc.pid}/task")
        assert len(tids) >= 4
        for tid in tids:
            assert os.sched_getaffinity(int(tid)) == {ALLOWED[1]}
    finally:
        proc.kill()
        proc.wait()


def test_add_service_pins_it(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        ProcessTable(str(tmp_path), cpu_affinity={"redis": {ALLOWED[0]}}).add_service("redis", proc.pid)
        assert os.sched_getaffinity(proc.pid) == {ALLOWED[0]}
    finally:
        proc.kill()
        proc.wait()


def test_no_cpu_affinity_means_no_pinning(tmp_path):
    table = ProcessTable(str(tmp_path))
    assert table.cpus("server0") is None
