"""The fork server (`launcher.forkserver`): a forked role behaves as the `python -m` process it stands for
(environment, session, log, CPUs, threads, exit status), and `launcher run` forks its roles there —
or not, with `launcher.forkserver=false`."""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time

import pytest

from launcher.procs import end_process_group
from launcher.forkserver import ForkServer, ForkServerError

pytestmark = pytest.mark.integration

PROBE = textwrap.dedent('''
    import json, os, sys
    import numpy, torch
    what = sys.argv[1]
    if what == "report":
        print(json.dumps({"env": os.environ.get("PROBE_VALUE"), "omp": os.environ.get("OMP_NUM_THREADS"),
                          "threads": torch.get_num_threads(), "sid": os.getsid(0), "pid": os.getpid(),
                          "cwd": os.getcwd(), "cpus": sorted(os.sched_getaffinity(0)), "argv": sys.argv,
                          "main": __name__, "draw": int(numpy.random.randint(1 << 30))}), flush=True)
    elif what == "exit":
        sys.exit(int(sys.argv[2]))
    elif what == "raise":
        raise ValueError("the probe's own error")
    elif what == "sleep":
        import time
        print("sleeping", flush=True)
        time.sleep(600)
''')


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """One fork server for the module's probes (its imports cost ~5 CPU-s), the probe module on its path."""
    tmp_path = tmp_path_factory.mktemp("forkserver")
    (tmp_path / "probe_role.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    h = ForkServer(env, str(tmp_path / "forkserver.log"))
    yield h, tmp_path
    h.close()


def _spawn(host, tmp_path, name, *args, env=None, cpus=None):
    log = str(tmp_path / f"{name}.log")
    proc = host.spawn([sys.executable, "-m", "probe_role", *args], {**os.environ, **(env or {})}, log, cpus)
    return proc, log


def test_a_forked_role_runs_as_its_own_python_m_process(host):
    h, tmp = host
    workdir = tmp / "work"
    workdir.mkdir()
    cpu = min(os.sched_getaffinity(0))
    procs = []
    for k, threads in enumerate(("1", "2")):
        env = {"PROBE_VALUE": f"v{k}", "OMP_NUM_THREADS": threads}
        old = os.getcwd()
        os.chdir(workdir)  # the role runs in the launcher's working directory of the moment
        try:
            procs.append(_spawn(h, tmp, f"r{k}", "report", env=env, cpus={cpu} if k else None))
        finally:
            os.chdir(old)
    reports = []
    for proc, log in procs:
        assert proc.wait(timeout=60) == 0, open(log).read()
        reports.append(json.loads(open(log).read().strip().splitlines()[-1]))
    for k, (r, (proc, _)) in enumerate(zip(reports, procs)):
        assert r["env"] == f"v{k}" and r["omp"] == ("1", "2")[k]
        assert r["threads"] == (1, 2)[k], "torch's thread count follows the role's OMP_NUM_THREADS"
        assert r["pid"] == proc.pid and r["sid"] == proc.pid, "each role leads a session of its own"
        assert r["cwd"] == str(workdir)
        assert r["main"] == "__main__" and r["argv"][1:] == ["report"]
    assert reports[1]["cpus"] == [cpu], "the role's CPUs are set before its code runs"
    assert reports[0]["draw"] != reports[1]["draw"], "numpy's global generator is not the host's copy"
    hostlog = open(tmp / "forkserver.log").read()
    assert f"forked pid {procs[0][0].pid}: python -m probe_role" in hostlog


def test_exit_status_is_what_python_m_would_give(host):
    h, tmp = host
    ok, _ = _spawn(h, tmp, "ok", "exit", "0")
    three, _ = _spawn(h, tmp, "three", "exit", "3")
    raised, raised_log = _spawn(h, tmp, "raised", "raise")
    assert ok.wait(timeout=60) == 0
    assert three.wait(timeout=60) == 3
    assert raised.wait(timeout=60) == 1
    text = open(raised_log).read()
    assert "Traceback" in text and "ValueError: the probe's own error" in text


def test_a_role_is_ended_by_its_process_group_and_its_signal_is_its_status(host):
    h, tmp = host
    proc, log = _spawn(h, tmp, "sleeper", "sleep")
    deadline = time.monotonic() + 60
    while "sleeping" not in open(log).read() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    end_process_group(proc.pid, proc, timeout_s=10)
    assert proc.returncode == -signal.SIGTERM


def test_a_dead_host_is_an_error_naming_its_log(tmp_path):
    h = ForkServer({**os.environ}, str(tmp_path / "forkserver.log"))
    os.killpg(h.proc.pid, signal.SIGKILL)
    h.proc.wait(timeout=30)
    with pytest.raises(ForkServerError, match="forkserver.log"):
        h.spawn([sys.executable, "-m", "json.tool", "--help"], dict(os.environ), str(tmp_path / "x.log"), None)
    h.close()


def test_launcher_run_forks_its_roles_from_the_host_or_not(run_launcher, tmp_path):
    hosted = tmp_path / "hosted"
    rc, out = run_launcher(hosted, "train.total_steps=2")
    assert rc == 0, out[-3000:]
    pids = json.loads((hosted / "pids.json").read_text())["roles"]
    hostlog = (hosted / "logs" / "forkserver.log").read_text()
    for name in ("server0", "learner", "rollout0"):
        assert f"forked pid {pids[name]}: python -m areal_like." in hostlog, (name, hostlog)
    plain = tmp_path / "plain"
    rc, out = run_launcher(plain, "train.total_steps=2", "launcher.forkserver=false")
    assert rc == 0, out[-3000:]
    assert not (plain / "logs" / "forkserver.log").exists()
