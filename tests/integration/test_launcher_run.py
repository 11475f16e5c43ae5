"""`launcher run` end to end: real redis-server, real server/learner/rollout processes, gloo.

These are the spine's acceptance tests: the run completes, the staleness bound holds with one and
with two rollout workers (η = 0 goes through the same code path), every role's process is gone
afterwards, and a dead role stops the run with its name and a non-zero exit.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import launcher_finish, launcher_spawn

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(run_dir, assets, *overrides, allocation="embedded.d1p1t1+d1p1t1"):
    model, data = assets
    return launcher_spawn("run", "--config", "configs/demo.yaml", "--allocation", allocation, "--run-dir",
                          str(run_dir), f"model.path={model}", f"data.train_files=[{data}]", *overrides)


_finish = launcher_finish


def _assert_all_gone(run_dir):
    with open(os.path.join(run_dir, "pids.json")) as f:
        pids = json.load(f)["roles"]
    assert pids, "no role was recorded"
    assert "redis" in pids, "the launcher's own redis-server must be recorded and stopped too"
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = {n: p for n, p in pids.items() if _alive(p)}
        time.sleep(0.1)
    assert not alive, f"processes left after launcher exit: {alive}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("eta,workers,allocation", [(0, 1, "embedded.d1p1t1+d1p1t1"), (0, 2, "embedded.d1p1t1+d1p1t1"),
                                                    (2, 2, "embedded.d1p1t1+d1p1t1"),
                                                    (1, 1, "embedded[rollout]:d1 + megatron[actor]:d2")])
def test_run_completes_within_staleness_bound(tmp_path, demo_assets, eta, workers, allocation):
    run_dir = tmp_path / "run"
    steps = 4
    proc = _launch(run_dir, demo_assets, f"rollout.max_staleness={eta}", f"rollout.workers={workers}",
                   f"train.total_steps={steps}", "train.batch_size=2", "generation.n=4",
                   allocation=allocation)
    rc, out = _finish(proc)
    assert rc == 0, out[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert summary["final_version"] == steps
    assert summary["exit_reason"] == "completed"
    assert summary["max_staleness"] == eta
    assert 0 <= summary["max_staleness_observed"] <= eta, summary
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows] == list(range(1, steps + 1))
    # B groups trained per step: fetch replaces every group the consume-time guard dropped (counted).
    assert all(r["samples"] == 2 * 4 for r in rows)
    if eta == 0:
        assert all(r["dropped_stale"] == 0 for r in rows)
    assert all(0 <= r["staleness_mean"] <= r["staleness_max"] <= eta for r in rows)
    for key in ("step", "version", "reward_mean", "staleness_max", "samples", "step_s", "push_s"):
        assert key in rows[0]
    # what the learner measured reaches the row, the once-dropped statistics too (docs/metrics.md)
    assert all(r["lr"] == pytest.approx(1e-3) and r["num_groups"] == 2 and r["push_buckets"] >= 1 for r in rows)
    assert all(r["reward_std"] >= 0 and r["critic_lr"] is None and r["version_lag_max"] >= 0 for r in rows)
    if "d2" in allocation:  # a two-rank pool (named components): both ranks ran, and both are gone afterwards
        assert {"learner", "learner1"} <= set(json.loads((run_dir / "pids.json").read_text())["roles"])
        assert (run_dir / "logs" / "learner1.log").exists()
    targets = json.loads((run_dir / "prometheus_targets.json").read_text())
    assert {t["labels"]["role"] for t in targets} >= {"server0", "learner", "rollout0"}
    _assert_all_gone(run_dir)


def _wait_for(pred, what: str, proc, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_dead_rollout_worker_is_restarted_until_its_budget_then_the_run_stops(tmp_path, demo_assets):
    """launcher.max_restarts.rollout=1: the first SIGKILL of rollout0 is survived (a new rollout0, its
    slots freed); the second ends the run, naming the role, its exit code and the budget."""
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, demo_assets, "train.total_steps=1000", "launcher.max_restarts.rollout=1")
    metrics = run_dir / "metrics.jsonl"
    _wait_for(lambda: metrics.exists() and metrics.read_text().strip(), "the first step", proc)
    _assert_every_role_serves_metrics(run_dir)
    first = json.loads((run_dir / "pids.json").read_text())["roles"]["rollout0"]
    os.kill(first, signal.SIGKILL)

    def restarted():
        pid = json.loads((run_dir / "pids.json").read_text())["roles"]["rollout0"]
        return pid if pid != first else None

    second = _wait_for(restarted, "a new rollout0", proc)
    steps_then = len(metrics.read_text().splitlines())
    # the run goes on with the new worker: more steps are trained
    _wait_for(lambda: len(metrics.read_text().splitlines()) >= steps_then + 3, "steps after the restart", proc)
    os.kill(second, signal.SIGKILL)
    rc, out = _finish(proc, timeout=120)
    assert rc != 0
    assert "rollout0 exited with code -9: restarted" in out  # the first death, with its restart
    assert "launcher.max_restarts.rollout=1" in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "rollout0" in summary["exit_reason"] and "max_restarts.rollout" in summary["exit_reason"]
    assert [(r["role"], r["exit_code"]) for r in summary["restarts"]] == [("rollout0", -9)]
    assert summary["restart_counts"] == {"learner": 0, "server": 0, "rollout": 1, "judge": 0, "teacher": 0, "redis": 0}
    # the groups the dead worker had in flight are counted, not silently gone
    lost = re.search(r"restarted; (\d+) group\(s\) it had in flight counted as lost_in_flight", out)
    assert lost, out[-3000:]
    assert summary["buffer"]["lost_in_flight"] == int(lost.group(1))
    _assert_all_gone(run_dir)


def _assert_every_role_serves_metrics(run_dir):
    """Each role's /metrics (from prometheus_targets.json, what Prometheus scrapes) has its metrics."""
    import urllib.request

    want = {
        "server0": ["areal_like_generated_tokens_total", "areal_like_server_busy_seconds_total",
                    "areal_like_server_weight_version"],
        "learner": ["areal_like_policy_version", "areal_like_learner_step", "areal_like_weight_push_seconds",
                    "areal_like_staleness_max"],
        "rollout0": ["areal_like_rollout_groups_total", "areal_like_rollout_samples_total"],
    }
    targets = {t["labels"]["role"]: t["targets"][0] for t in json.loads((run_dir / "prometheus_targets.json").read_text())}
    for role, names in want.items():
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(f"http://{targets[role]}/metrics", timeout=10) as r:
                text = r.read().decode()
            missing = [n for n in names if n not in text]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not missing, f"{role} /metrics lacks {missing}"
    # the learner's version gauge is live, not a constant
    with urllib.request.urlopen(f"http://{targets['learner']}/metrics", timeout=10) as r:
        line = next(ln for ln in r.read().decode().splitlines() if ln.startswith("areal_like_policy_version "))
    assert float(line.split()[1]) >= 1


def test_sigint_checkpoints_and_stops_everything(tmp_path, demo_assets):
    """Ctrl-C: rollouts stop, the learner finishes its step, checkpoints and commits, all roles end."""
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, demo_assets, "train.total_steps=1000", "train.save_freq=500")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    rc, out = _finish(proc, timeout=120)
    assert rc == 130, out[-3000:]
    _assert_all_gone(run_dir)
    last_step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert last_step < 500  # so the checkpoint below can only come from the stop
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{last_step:08d}", (latest, last_step)
    assert "checkpoint saved and committed" in (run_dir / "logs" / "learner.log").read_text()


def test_bad_config_key_fails_before_starting(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "launcher", "run", "--config", os.path.join(ROOT, "configs/demo.yaml"),
                           "--run-dir", str(tmp_path / "run"), "train.lrr=1"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert "lrr" in proc.stderr and "train" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_unrunnable_allocations_fail_before_starting(tmp_path):
    import importlib.util

    cases = [("embedded.d1p1t1", "training part"), ("vllm.d1p1t1+d1p1t1", "vllm"),
             ("embedded.d1p1t2+d1p1t1", "one device per server"), ("embedded.d1+d1x", "invalid allocation"),
             # a critic pool needs GAE, a learner backend and a disaggregated generation part
             ("embedded[rollout]:d1+fsdp[actor]:d1|fsdp[critic]:d1", "set algorithm.adv_estimator=gae"),
             ("embedded[rollout]:d1|fsdp[actor]:d1+fsdp[critic]:d1 algorithm.adv_estimator=gae",
              "co-located generation part"),
             ("embedded[rollout]:d1+fsdp[actor]:d1+archon[critic]:d1 algorithm.adv_estimator=gae",
              "use fsdp[critic]:d1"),
             # named components beyond one rollout, actor, critic, judge and teacher pool are planned
             # (launcher plan) but not started
             ("embedded[rollout]:d1+fsdp[actor]:d1+fsdp[ref]:d1", "fsdp[ref] (role ref)"),
             ("embedded[rollout]:d1+megatron[actor]:d1+embedded[judge]:d1", "judge.model_path is not set"),
             ("embedded[rollout]:d1+fsdp[actor]:d1+vllm[judge]:d1 judge.model_path=demo:tiny-qwen2",
              "use embedded[judge]:d1 or sglang[judge]:d1"),
             ("embedded[rollout]:d1+fsdp[actor]:d1|embedded[judge]:d1 "
              "judge.model_path=demo:tiny-qwen2", "co-located"),
             ("embedded.d1p1t1+d1p1t1 judge.model_path=demo:tiny-qwen2", "has no judge component"),
             # a teacher pool (on-policy distillation) likewise: embedded, a pool of its own, with its model
             ("embedded[rollout]:d1+fsdp[actor]:d1+embedded[teacher]:d1", "teacher.model_path is not set"),
             ("embedded:d1+archon:d1", "training backend 'archon' can be planned but not run")]
    if importlib.util.find_spec("sglang") is None:  # on GPU machines with sglang this one would start
        cases.append(("sglang.d1p1t1+d1p1t1", "scripts/setup.sh --sglang"))  # names server.python too
        # SGLang judge and teacher servers likewise (tests/integration/test_sglang_launch_secrets.py starts them)
        cases.append(("embedded[rollout]:d1+fsdp[actor]:d1+sglang[judge]:d1 judge.model_path=demo:tiny-qwen2",
                      "scripts/setup.sh --sglang"))
        cases.append(("embedded[rollout]:d1+fsdp[actor]:d1+sglang[teacher]:d1 teacher.model_path=demo:tiny-qwen2",
                      "scripts/setup.sh --sglang"))
    for case, words in cases:
        alloc, *overrides = case.split()
        proc = subprocess.run([sys.executable, "-m", "launcher", "run", "--allocation", alloc,
                               "--run-dir", str(tmp_path / "run"), *overrides], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 2, (alloc, proc.stderr)
        assert words in proc.stderr, (alloc, proc.stderr)
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()


def test_status_and_stop_from_another_shell(tmp_path, demo_assets):
    """Also runs with metrics.prometheus=false: no role gets a metrics port or serves /metrics."""
    run_dir = tmp_path / "run"
    proc = _launch(run_dir, demo_assets, "train.total_steps=1000", "metrics.prometheus=false")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (run_dir / "metrics.jsonl").exists():
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    _assert_no_role_serves_metrics(run_dir)
    status = subprocess.run([sys.executable, "-m", "launcher", "status", "--run-dir", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    for role in ("redis", "server0", "learner", "rollout0"):
        assert any(line.startswith(role) and line.rstrip().endswith("running") for line in status.stdout.splitlines()), \
            status.stdout
    assert "step " in status.stdout
    stop = subprocess.run([sys.executable, "-m", "launcher", "stop", "--run-dir", str(run_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stderr
    rc, out = _finish(proc, timeout=60)
    assert rc == 130 and "stopped by SIGTERM" in out, out[-2000:]
    assert out.count("metrics.prometheus=false: no role serves /metrics") == 1, out[-2000:]
    _assert_all_gone(run_dir)
    after = subprocess.run([sys.executable, "-m", "launcher", "status", "--run-dir", str(run_dir)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert "running" not in after.stdout and "summary:" in after.stdout


def _assert_no_role_serves_metrics(run_dir):
    """metrics.prometheus=false: no targets, no metrics ports, no --metrics-port, servers' /metrics 404."""
    import urllib.error
    import urllib.request

    assert json.loads((run_dir / "prometheus_targets.json").read_text()) == []
    endpoints = json.loads((run_dir / "endpoints.json").read_text())
    assert endpoints["metrics_ports"] == {}
    roles = json.loads((run_dir / "pids.json").read_text())["roles"]
    for name in ("server0", "learner", "rollout0"):
        with open(f"/proc/{roles[name]}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        assert b"--metrics-port" not in argv, (name, argv)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(endpoints["servers"][0] + "/metrics", timeout=10)
    assert e.value.code == 404


def test_chat_prompts_and_custom_reward_function(tmp_path, demo_assets):
    """verl-format parquet with chat-list prompts + custom_reward_function.path/name, end to end."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model, _ = demo_assets
    data = tmp_path / "chat.parquet"
    rows = [{"prompt": [{"role": "user", "content": f"{i}+1=?"}], "data_source": "my/task",
             "reward_model": {"ground_truth": str((i + 1) % 10), "style": "rule"},
             "extra_info": {"index": i}} for i in range(32)]
    pq.write_table(pa.Table.from_pylist(rows), data)
    reward = tmp_path / "my_reward.py"
    # Scores every completion 0.75 and records what it was called with: only this function can
    # make the reward exactly 0.75, and the record shows verl's argument order.
    reward.write_text(
        "import json, os\n"
        "def my_score(data_source, solution_str, ground_truth, extra_info):\n"
        f"    with open({str(tmp_path / 'calls.jsonl')!r}, 'a') as f:\n"
        "        f.write(json.dumps([data_source, ground_truth, extra_info.get('index')]) + '\\n')\n"
        "    return {'score': 0.75}\n")
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "launcher", "run", "--config", os.path.join(ROOT, "configs/demo.yaml"),
            "--run-dir", str(run_dir), f"model.path={model}", f"data.train_files=[{data}]",
            f"custom_reward_function.path={reward}", "custom_reward_function.name=my_score",
            "train.total_steps=2", "train.batch_size=2", "generation.n=2"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows_out = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in rows_out] == [0.75, 0.75]
    calls = [json.loads(x) for x in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls and all(ds == "my/task" and gt == str((idx + 1) % 10) for ds, gt, idx in calls)
