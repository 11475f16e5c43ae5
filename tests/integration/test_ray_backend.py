"""`launcher run --backend ray` on a real two-node Ray cluster (two raylets on this machine, loopback).

Each node declares 2 GPUs as a Ray resource (logical: the embedded engine and the learner run on
CPU, gloo), so `embedded.d2p1t1+d2p1t1` is placed as `launcher plan --nodes 2 --devices-per-node 2`
prints it: both servers on node 0, both learner ranks on node 1. The tests check the run against
that plan role by role (node, devices, the Ray node each role's actor reports), that killing actors
mid-run is survived with nothing trained twice, and that the run leaves no actor or placement group
behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

# Read by Ray when it is imported: keep a loopback cluster on loopback (see RAY_ENV).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="the `ray` extra (scripts/setup.sh installs it)")

from conftest import launcher_cli, launcher_finish, launcher_spawn  # noqa: E402
from run_audit import effective_history  # noqa: E402

pytestmark = pytest.mark.integration

ALLOC = "embedded.d2p1t1+d2p1t1"
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.fixture(scope="module")
def ray_cluster():
    """Two Ray nodes on 127.0.0.1 (2 GPUs and 8 CPUs each, logical); this process is a driver too."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=dict(node_ip_address="127.0.0.1", num_cpus=8, num_gpus=2,
                                                                include_dashboard=False))
    try:
        cluster.add_node(node_ip_address="127.0.0.1", num_cpus=8, num_gpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", namespace="areal_like", log_to_driver=False)
        yield cluster.address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def _run_argv(address: str, run_dir, model, data, *overrides: str) -> list[str]:
    return ["run", "--config", "configs/demo.yaml", "--backend", "ray", "--ray-address", address,
            "--allocation", ALLOC, "--run-dir", str(run_dir), f"model.path={model}", f"data.train_files=[{data}]",
            *overrides]


def _assert_nothing_left(run_dir) -> None:
    """No placement group of the run is alive, no actor of the run is left (named `<run id>:<role>`)."""
    pids = json.loads((run_dir / "pids.json").read_text())
    run_id = pids["ray_run_id"]
    table = ray.util.placement_group_table()
    ours = {v["name"]: v["state"] for v in table.values() if v["name"].startswith(run_id + ":")}
    assert set(ours) == set(pids["placement_groups"]) and len(ours) == 2, ours
    assert all(state == "REMOVED" for state in ours.values()), ours
    left = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(run_id + ":")]
    assert not left, left


def _plan() -> dict:
    out = subprocess.run([sys.executable, "-m", "launcher", "plan", "--allocation", ALLOC, "--nodes", "2",
                          "--devices-per-node", "2", "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_ray_run_learns_on_two_nodes_where_the_plan_says(tmp_path, demo_assets, ray_cluster):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    # ends at its criterion (train.stop_reward: the last 5 steps' mean reward ≥ 0.5), at the latest at step 120
    rc, out = launcher_cli(*_run_argv(ray_cluster, run_dir, model, data, "train.total_steps=120",
                                      "train.stop_reward=0.5"), env=RAY_ENV, timeout=400)
    assert rc == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["exit_reason"] == "reward_reached" and summary["steps"] < 120
            or summary["exit_reason"] == "completed" and summary["steps"] == 120), summary
    assert summary["reward_last"] > 0.3 and summary["reward_last"] > summary["reward_first"] + 0.2, summary

    # every role ran on the node and devices `launcher plan` printed for it
    rc, text = launcher_cli("status", "--run-dir", str(run_dir), "--json")
    assert rc == 0, text
    status = json.loads(text)
    assert status["backend"] == "ray" and not status["launcher_running"]
    roles = {r["name"]: r for r in status["roles"]}
    plan = _plan()
    expected = {f"server{s['index']}": (s["nodes"][0], s["devices"]) for s in plan["generation"]["servers"]}
    expected |= {("learner" if r["rank"] == 0 else f"learner{r['rank']}"): (r["node"], [r["device"]])
                 for r in plan["training"]["ranks"]}
    for name, (node, devices) in expected.items():
        got = roles[name]
        assert (got["node"], got["devices"]) == (node, devices), (name, got)
        assert got["ray_gpu_ids"] == devices, (name, got)  # the node is ours: Ray's ids are the plan's
        assert got["state"] == "ended" and got["pid"] > 0
    # plan node → one Ray node, the same for every role on it; two distinct Ray nodes
    by_node = {}
    for name in expected:
        by_node.setdefault(roles[name]["node"], set()).add(roles[name]["ray_node_id"])
    assert all(len(ids) == 1 for ids in by_node.values()) and len(set().union(*by_node.values())) == 2, by_node
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set().union(*by_node.values()) <= alive
    assert roles["rollout0"]["ray_node_id"] in alive
    # Redis runs beside the launcher, on the driver's node (plan node 0 here: the test's head node)
    assert roles["redis"]["node_ip"] == "127.0.0.1" and roles["redis"]["ray_node_id"] in alive, roles["redis"]
    # Prometheus targets: every role on its node's address
    targets = json.loads((run_dir / "prometheus_targets.json").read_text())
    assert {t["labels"]["role"] for t in targets} == {"server0", "server1", "learner", "rollout0", "redis"}
    # each role's log gathered into the run directory
    for name in [*expected, "rollout0"]:
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0, name
    _assert_nothing_left(run_dir)


def _wait(cond, proc, deadline, what):
    while not cond():
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.communicate()[0] if proc.poll() is not None else ""
            pytest.fail(f"{what}: launcher {'exited' if proc.poll() is not None else 'timed out'}\n{out[-4000:]}")
        time.sleep(0.1)


def _steps(run_dir) -> int:
    p = run_dir / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def test_ray_run_survives_killed_server_and_learner_actors(tmp_path, demo_assets, ray_cluster):
    """ray.kill of server1's actor, then of learner rank 1's: the server is replaced on its bundle and
    re-synced, the learner pool restarts from its checkpoint; nothing is trained twice."""
    model, data = demo_assets
    run_dir = tmp_path / "run"
    steps = 30
    proc = launcher_spawn(*_run_argv(ray_cluster, run_dir, model, data, f"train.total_steps={steps}",
                                     "train.save_freq=1", "launcher.max_restarts.learner=1",
                                     "launcher.max_restarts.server=1", "weights.timeout_s=30"), env=RAY_ENV)
    try:
        deadline = time.monotonic() + 400
        killed = []
        for name, at_step in (("server1", 5), ("learner1", 14)):
            _wait(lambda: _steps(run_dir) >= at_step, proc, deadline, f"step {at_step}")
            pids = json.loads((run_dir / "pids.json").read_text())
            old_pid = pids["roles"][name]
            ray.kill(ray.get_actor(f"{pids['ray_run_id']}:{name}", namespace="areal_like"), no_restart=True)
            killed.append(name)
            _wait(lambda: json.loads((run_dir / "pids.json").read_text())["roles"].get(name) not in (None, old_pid),
                  proc, deadline, f"{name} restarted")
        rc, out = launcher_finish(proc, timeout=max(10.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert rc == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["final_version"] == steps, summary
    assert summary["restart_counts"] == {"learner": 1, "server": 1, "rollout": 0, "judge": 0, "teacher": 0, "redis": 0}, summary
    assert [r["role"] for r in summary["restarts"]] == killed, summary["restarts"]
    assert all(r["exit_code"] == -9 for r in summary["restarts"]), summary["restarts"]  # an actor killed = SIGKILL
    history = effective_history(str(run_dir / "trained.jsonl"))
    trained = [g for _, g in history]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert sorted({s for s, _ in history}) == list(range(1, steps + 1))
    assert "re-formed the weight group" in (run_dir / "logs" / "learner.log").read_text()
    # the replacement server ran in the same bundle: same node and devices as the plan's
    status = json.loads(launcher_cli("status", "--run-dir", str(run_dir), "--json")[1])
    server1 = next(r for r in status["roles"] if r["name"] == "server1")
    assert (server1["node"], server1["devices"]) == (0, [1]), server1
    _assert_nothing_left(run_dir)


def test_ray_allocation_too_big_for_the_cluster_names_it(tmp_path, demo_assets, ray_cluster):
    model, data = demo_assets
    rc, out = launcher_cli("run", "--config", "configs/demo.yaml", "--backend", "ray", "--ray-address", ray_cluster,
                           "--allocation", "embedded.d4p1t1+d2p1t1", "--run-dir", str(tmp_path / "run"),
                           f"model.path={model}", f"data.train_files=[{data}]", env=RAY_ENV, timeout=120)
    assert rc == 1, out
    assert "does not fit the Ray cluster (2 node(s) × 2 GPU)" in out, out


def test_ray_backend_without_an_address_starts_and_ends_its_own_cluster(tmp_path, demo_assets):
    """No --ray-address and no $RAY_ADDRESS: a local Ray cluster for the run (3 logical devices for the
    CPU run), ended with it; its nodes inherit the user's environment, yet no generation or judge server
    gets the run's Redis password or the user's REDIS_* secrets (issue 24 item 11), and the Redis metrics
    endpoint is served on the driver's node. The allocation has a judge pool (issue 43 item 3): its server
    is a Ray actor on the plan's device, and grades every sample (here the demo model itself serves as the
    judge: half of each reward is its p(Y) / (p(Y) + p(N)) after the sample, half the demo's rule reward).
    And a teacher pool (issue 43 item 4): its server is a Ray actor on its own plan device, and it scores every
    sample (the demo model again; its per-token reverse KL enters the advantage at teacher.kl_coef=0.1). And a
    critic pool (issue 43 item 2, `fsdp[critic]:d1`, GAE): its rank is a Ray actor on its own plan device, asked
    for the values of every step."""
    from test_redis_exporter import DECOY, _redis_conf, _redis_target, _scrape

    model, data = demo_assets
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | RAY_ENV
    env |= {"AREAL_LIKE_REDIS_PASSWORD": DECOY, "REDIS_PASSWORD": DECOY}
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "run", "--config", "configs/demo.yaml", "--backend", "ray",
                             "--allocation", "embedded[rollout]:d1+fsdp[actor]:d1+embedded[judge]:d1+embedded[teacher]:d1"
                             "+fsdp[critic]:d1", "algorithm.adv_estimator=gae",
                             f"teacher.model_path={model}", "teacher.kl_coef=0.1",
                             "--run-dir", str(run_dir), f"model.path={model}", f"data.train_files=[{data}]",
                             "train.total_steps=100000", f"judge.model_path={model}", "judge.score_rule=verdict",
                             "judge.verdict_tokens=[Y,N]", "judge.top_logprobs_num=100", "judge.weight=0.5",
                             "judge.rule_weight=0.5", "judge.prompt_template='{question}={response}?'"],
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait(lambda: _steps(run_dir) >= 4, proc, time.monotonic() + 300, "step 4")
        password = _redis_conf(str(run_dir))["requirepass"]
        for role in ("server0", "judge0", "teacher0"):
            pid = json.loads((run_dir / "pids.json").read_text())["roles"][role]
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
            names = {kv.split(b"=", 1)[0].decode() for kv in environ.split(b"\0") if kv}
            assert password.encode() not in environ and DECOY.encode() not in environ, \
                (role, sorted(n for n in names if "REDIS" in n))
            assert "AREAL_LIKE_ADMIN_API_KEY" in names, role
        assert _scrape(_redis_target(str(run_dir)))["redis_up"] == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
    rc, out = launcher_finish(proc, timeout=300)
    assert rc == 130, out[-4000:]
    assert "local Ray cluster: no GPU here; 5 logical device(s) declared for the CPU run" in out, out[-3000:]
    status = json.loads(launcher_cli("status", "--run-dir", str(run_dir), "--json")[1])
    assert status["backend"] == "ray" and len({r["ray_node_id"] for r in status["roles"] if r.get("ray_node_id")}) == 1
    judge = next(r for r in status["roles"] if r["name"] == "judge0")
    assert (judge["node"], judge["devices"], judge["state"]) == (0, [2], "ended"), judge  # the plan's device 2
    teacher = next(r for r in status["roles"] if r["name"] == "teacher0")
    assert (teacher["node"], teacher["devices"], teacher["state"]) == (0, [3], "ended"), teacher
    critic = next(r for r in status["roles"] if r["name"] == "critic")
    assert (critic["node"], critic["devices"], critic["state"]) == (0, [4], "ended"), critic
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kls = [r.get("teacher_kl") for r in rows]
    assert kls and all(k is not None and k == k for k in kls), kls  # every step distilled (a number, not NaN)
    assert all(r["value_loss"] is not None for r in rows)  # every step's values came from the critic pool
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] >= 4 and not any(summary["reward_failures"].values()), summary
    rewards = [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # half the rule's 0 / 0.5 / 1 averages to multiples of 1/4 ÷ samples; the judge's probabilities do not
    assert all(0 < r < 1 for r in rewards) and any(abs(r * 512 - round(r * 512)) > 1e-6 for r in rewards), rewards
    assert "(score_rule verdict; reward = 0.5 × rule + 0.5 × judge)" in (run_dir / "logs" / "rollout0.log").read_text()
    # the cluster it started ended with it: nothing is left in the launcher's session
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) == proc.pid:
                left.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:200])
        except (OSError, ProcessLookupError):
            continue
    assert not left, left
