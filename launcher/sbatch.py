"""`launcher sbatch`: a Slurm batch script that runs `launcher run --backend ray` on the job's nodes.

    sbatch job (N nodes, exclusive)
      ├─ srun -w node0  ray start --head --block      (this step's PID kept)
      ├─ srun -w nodeK  ray start --address … --block (one per other node)
      ├─ wait until N Ray nodes declare the devices
      ├─ launcher run --backend ray --ray-address node0:PORT …   (the batch step, on node 0)
      └─ on exit (done, failed, scancel): SIGTERM to those srun steps → `ray start --block` ends the
         Ray processes it started on each node (no `ray stop`: nothing else on a node is touched)

The plan is checked when the script is written (`--nodes × --devices-per-node` must fit the
allocation), so a bad allocation fails here, not after the queue wait. Node addresses are the first
address of each node's host name, or $AREAL_LIKE_NODE_IP where that is not the right interface.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from allocation.errors import AllocationError
from allocation.parser import parse_allocation
from allocation.placement import place

TEMPLATE = r"""#!/bin/bash
# Written by `launcher sbatch` — {alloc} on {nodes} node(s) × {g} device(s) ({used} used).
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
{sbatch_lines}
set -uo pipefail
cd {root}
PY={python}
RAY={ray}
RAY_PORT="${{AREAL_LIKE_RAY_PORT:-{ray_port}}}"
RAY_START_ARGS=({ray_start_args})

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if [ "${{#NODES[@]}}" -lt {nodes} ]; then
  echo "launcher sbatch: the job has ${{#NODES[@]}} node(s), the plan needs {nodes}" >&2; exit 2
fi
node_ip() {{  # the address Ray and the roles use on node $1
  if [ -n "${{AREAL_LIKE_NODE_IP:-}}" ]; then echo "$AREAL_LIKE_NODE_IP"; return; fi
  srun --nodes=1 --ntasks=1 -w "$1" hostname --ip-address | awk '{{print $1}}'
}}
STEP_PIDS=()
teardown() {{  # only the Ray processes this job started: SIGTERM ends each `ray start --block`
  for pid in "${{STEP_PIDS[@]}}"; do kill -TERM "$pid" 2>/dev/null; done
  for pid in "${{STEP_PIDS[@]}}"; do wait "$pid" 2>/dev/null; done
}}
trap teardown EXIT

HEAD_IP=$(node_ip "${{NODES[0]}}")
export RAY_ADDRESS="$HEAD_IP:$RAY_PORT"
echo "[sbatch] Ray head on ${{NODES[0]}} ($RAY_ADDRESS)"
srun --nodes=1 --ntasks=1 -w "${{NODES[0]}}" "$RAY" start --head --node-ip-address="$HEAD_IP" --port="$RAY_PORT" \
  --num-gpus={g} --include-dashboard=false --disable-usage-stats --block "${{RAY_START_ARGS[@]}}" &
STEP_PIDS+=($!)
"$PY" - "$RAY_ADDRESS" 1 {timeout} <<'WAIT' || exit 1
{wait_py}
WAIT
for node in "${{NODES[@]:1:{nodes_minus_1}}}"; do
  ip=$(node_ip "$node")
  echo "[sbatch] Ray worker on $node ($ip)"
  srun --nodes=1 --ntasks=1 -w "$node" "$RAY" start --address="$RAY_ADDRESS" --node-ip-address="$ip" \
    --num-gpus={g} --disable-usage-stats --block "${{RAY_START_ARGS[@]}}" &
  STEP_PIDS+=($!)
done
"$PY" - "$RAY_ADDRESS" {nodes} {timeout} <<'WAIT' || exit 1
{wait_py}
WAIT
AREAL_LIKE_NODE_IP="$HEAD_IP" "$PY" -m launcher run --backend ray --ray-address "$RAY_ADDRESS" {run_args}
rc=$?
echo "[sbatch] launcher run exited with $rc"
exit $rc
"""

WAIT_PY = r"""import os, sys, time
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray
address, want, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
host = address.rsplit(":", 1)[0]
kw = {"_node_ip_address": host} if host.startswith("127.") else {}
deadline = time.monotonic() + timeout
while True:
    try:
        ray.init(address=address, log_to_driver=False, **kw)
        break
    except Exception as e:  # the head is still starting
        if time.monotonic() > deadline:
            sys.exit(f"[sbatch] no Ray head at {address} after {timeout:.0f}s: {e}")
        time.sleep(1)
while True:
    n = sum(1 for node in ray.nodes() if node["Alive"] and node["Resources"].get("GPU", 0) >= 1)
    if n >= want:
        print(f"[sbatch] {n} Ray node(s) up", flush=True)
        break
    if time.monotonic() > deadline:
        sys.exit(f"[sbatch] only {n} of {want} Ray node(s) joined {address} after {timeout:.0f}s")
    time.sleep(1)
ray.shutdown()"""


def build_script(*, allocation: str, nodes: int, devices_per_node: int, config: str, overrides: list[str],
                 run_dir: str | None = None, partition: str | None = None, time_limit: str | None = None,
                 account: str | None = None, job_name: str | None = None, log_file: str | None = None,
                 ray_port: int = 6379, ray_start_args: str = "", join_timeout_s: float = 300.0,
                 python: str | None = None, root: str | None = None) -> str:
    """The batch script's text; raises AllocationError when the allocation does not fit the nodes."""
    alloc = parse_allocation(allocation)
    plan = place(alloc, nodes=nodes, devices_per_node=devices_per_node)
    python = python or sys.executable
    root = root or os.getcwd()
    lines = []
    if devices_per_node:
        lines.append(f"#SBATCH --gpus-per-node={devices_per_node}")
    for flag, value in (("partition", partition), ("time", time_limit), ("account", account), ("output", log_file)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    run_args = ["--allocation", allocation, "--config", config]
    if run_dir:
        run_args += ["--run-dir", run_dir]
    run_args += list(overrides)
    return TEMPLATE.format(
        alloc=allocation, nodes=nodes, g=devices_per_node, used=len(plan.used_devices),
        job_name=job_name or "areal_like", sbatch_lines="\n".join(lines), root=shlex.quote(root),
        python=shlex.quote(python), ray=shlex.quote(os.path.join(os.path.dirname(python), "ray")),
        ray_port=int(ray_port), ray_start_args=" ".join(shlex.quote(a) for a in shlex.split(ray_start_args)),
        timeout=float(join_timeout_s), wait_py=WAIT_PY, nodes_minus_1=nodes - 1,
        run_args=" ".join(shlex.quote(a) for a in run_args))


def cmd_sbatch(args) -> int:
    try:
        text = build_script(allocation=args.allocation, nodes=args.nodes, devices_per_node=args.devices_per_node,
                            config=args.config, overrides=list(args.overrides or []), run_dir=args.run_dir,
                            partition=args.partition, time_limit=args.time, account=args.account,
                            job_name=args.job_name, log_file=args.log, ray_port=args.ray_port,
                            ray_start_args=args.ray_start_args or "", join_timeout_s=args.join_timeout)
    except AllocationError as e:
        print(f"launcher sbatch: allocation {args.allocation!r} on --nodes {args.nodes} × --devices-per-node "
              f"{args.devices_per_node}:\n{e}", file=sys.stderr)
        return 2
    if not os.path.exists(args.config):
        print(f"launcher sbatch: --config {args.config} does not exist", file=sys.stderr)
        return 2
    from launcher.devices import colocated_ray_refusal

    # the script runs `launcher run --backend ray` on GPU nodes (devices_per_node GPUs each)
    why = colocated_ray_refusal(args.allocation, cuda=bool(args.devices_per_node))
    if why:
        print(f"launcher sbatch: {why}", file=sys.stderr)
        return 2
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
        os.chmod(args.output, 0o755)
    elif not args.submit:
        sys.stdout.write(text)
    if args.submit:
        path = args.output
        if path is None:
            import tempfile

            fd, path = tempfile.mkstemp(prefix="areal_like-", suffix=".sbatch", dir=".")
            with os.fdopen(fd, "w") as f:
                f.write(text)
        try:
            out = subprocess.run(["sbatch", path], capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            print("launcher sbatch: `sbatch` is not on PATH: run it on a Slurm login node, or drop --submit and "
                  f"submit {path} yourself", file=sys.stderr)
            return 2
        except subprocess.TimeoutExpired:
            print("launcher sbatch: `sbatch` did not answer within 60 s (slurmctld unreachable?)", file=sys.stderr)
            return 1
        sys.stdout.write(out.stdout)
        sys.stderr.write(out.stderr)
        return out.returncode
    return 0
