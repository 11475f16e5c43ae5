"""`launcher sbatch`: the batch script it writes, run step by step as a 2-node Slurm job would.

No Slurm controller runs here (Debian's slurmd serves one node per host; a 2-node job needs two
hosts), so the job's environment is that of a 2-node allocation — SLURM_JOB_NODELIST with two
nodes — and `scontrol`/`srun` are stand-ins that expand the node list and run a step on "its node"
(this machine, on the loopback address 127.0.0.2). Everything the script itself does is real: two `ray start --block`
nodes, the wait for them, `launcher run --backend ray` on them, and the teardown that ends the Ray
processes it started (and nothing else).
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess

import pytest

pytest.importorskip("ray", reason="the `ray` extra (scripts/setup.sh installs it)")

from conftest import free_port, launcher_cli  # noqa: E402

pytestmark = pytest.mark.integration
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SRUN = """#!/bin/bash
# srun stand-in: drop the step options (--nodes=1 --ntasks=1 -w NODE), run the command here.
while [ $# -gt 0 ]; do
  case "$1" in
    -w|--nodelist) export SLURMD_NODENAME="$2"; shift 2;;
    --*) shift;;
    *) break;;
  esac
done
echo "$SLURMD_NODENAME $*" >> "$SRUN_LOG"
exec "$@"
"""
SCONTROL = """#!/bin/bash
# scontrol stand-in: `scontrol show hostnames LIST` for a comma-separated LIST
[ "$1 $2" = "show hostnames" ] || { echo "unsupported: $*" >&2; exit 1; }
echo "$3" | tr ',' '\\n'
"""


def _shims(tmp_path):
    d = tmp_path / "slurm-bin"
    d.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        p = d / name
        p.write_text(text)
        p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return d


def test_sbatch_rejects_an_allocation_that_does_not_fit(tmp_path):
    rc, out = launcher_cli("sbatch", "--allocation", "sglang.d16p1m1+d8p2m1", "--nodes", "3", "--devices-per-node", "8",
                           "--config", "configs/demo.yaml")
    assert rc == 2 and "pass --nodes 4" in out, out


def test_sbatch_script_for_the_mission_allocation(tmp_path):
    out_file = tmp_path / "job.sbatch"
    rc, out = launcher_cli("sbatch", "--allocation", "sglang.d16p1m1+d8p2m1", "--nodes", "4", "--devices-per-node", "8",
                           "--partition", "gpu", "--time", "24:00:00", "--config", "configs/demo.yaml",
                           "--run-dir", "/shared/runs/mission", "--output", str(out_file), "model.path=/models/qwen")
    assert rc == 0, out
    text = out_file.read_text()
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --time=24:00:00",
                 "#SBATCH --exclusive"):
        assert line in text, line
    assert ("-m launcher run --backend ray --ray-address \"$RAY_ADDRESS\" --allocation sglang.d16p1m1+d8p2m1 "
            "--config configs/demo.yaml --run-dir /shared/runs/mission model.path=/models/qwen") in text
    assert "ray stop" not in text  # teardown ends only the Ray processes the job started
    assert subprocess.run(["bash", "-n", str(out_file)]).returncode == 0
    assert os.access(out_file, os.X_OK)


def test_sbatch_script_runs_a_two_node_job(tmp_path, demo_assets):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    rc, out = launcher_cli(
        "sbatch", "--allocation", "embedded.d2p1t1+d2p1t1", "--nodes", "2", "--devices-per-node", "2",
        "--config", "configs/demo.yaml", "--run-dir", str(run_dir), "--output", str(script),
        # two raylets on one machine: small object stores, no fixed agent ports
        "--ray-start-args", "--object-store-memory=150000000 --num-cpus=8 --dashboard-agent-listen-port=0 "
                            "--min-worker-port=0 --max-worker-port=0",
        "--join-timeout", "120", f"model.path={model}", f"data.train_files=[{data}]", "train.total_steps=15")
    assert rc == 0, out
    env = {**os.environ, "PATH": f"{_shims(tmp_path)}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "node-a,node-b", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
           "AREAL_LIKE_NODE_IP": "127.0.0.2", "AREAL_LIKE_RAY_PORT": str(free_port()),
           "SRUN_LOG": str(tmp_path / "srun.log")}
    env.pop("RAY_ADDRESS", None)
    # `ray start --address` refuses to join while this is 0, and with Ray's Linux default it rewrites
    # 127.0.0.1 to the interface address (unreachable here). 127.0.0.2 is loopback too, and Ray takes
    # it as a node address like any other: the job's nodes live there.
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    proc = subprocess.Popen(["bash", str(script)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the batch script did not finish:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    assert "[sbatch] 2 Ray node(s) up" in out, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["steps"] == 15, summary
    # the steps ran on the job's nodes: the head on the first, a worker on the second
    steps = (tmp_path / "srun.log").read_text().splitlines()
    assert any(s.startswith("node-a ") and " start --head " in s for s in steps), steps
    assert any(s.startswith("node-b ") and " start --address=127.0.0.2:" in s for s in steps), steps
    status = json.loads(launcher_cli("status", "--run-dir", str(run_dir), "--json")[1])
    assert len({r["ray_node_id"] for r in status["roles"] if r.get("ray_node_id")}) == 2, status
    # teardown: nothing the job started is left — no process of its session, no Ray process of its cluster
    # (raylets may start their own sessions: found by the job's Ray port in their command line)
    port = env["AREAL_LIKE_RAY_PORT"]
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            sid = os.getsid(int(pid))
        except (OSError, ProcessLookupError):
            continue
        if sid == proc.pid or f":{port}" in cmd or f"={port} " in cmd or cmd.rstrip().endswith(f"={port}"):
            left.append(f"{pid} {cmd[:200]}")
    assert not left, "processes of the job left behind:\n" + "\n".join(left)
