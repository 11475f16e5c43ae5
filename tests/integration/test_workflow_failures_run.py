"""Issue 24 item 8 (and one point of item 11) through real `launcher run`s: a workflow that hangs is
cut off by `rollout.episode_timeout_s` and counted; a workflow that always fails (raises, or an agent
returning the string "1.0") stops the run by `rollout.max_failure_fraction`, naming the workflow, the
key and the first traceback, without flooding the log; groups in flight at Ctrl-C are counted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import launcher_cli, launcher_finish, launcher_spawn

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ("train.total_steps=4", "train.batch_size=2", "generation.n=4", "train.test_freq=0", "data.val_files=[]",
        "metrics.prometheus=false", "rollout.max_concurrent_groups=2")


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


HANG_SOME = """
import asyncio
import zlib

from areal_like.workflow import rlvr


def hangs(prompt_id):
    return zlib.crc32(prompt_id.encode()) % 4 == 0


async def hang_some(ctx, row):
    # 1 prompt in 4 never finishes (a stuck tool, an agent loop waiting on nothing)
    if hangs(row.prompt_id):
        await asyncio.Event().wait()
    return await rlvr(ctx, row)
"""


def test_hanging_workflow_times_out_and_the_run_finishes(tmp_path, run_launcher):
    """Hanging on 1 prompt in 4 with 2 slots: without a per-episode timeout two hanging prompts hold both
    slots for good and the run stops making steps, with no error. With rollout.episode_timeout_s the run
    reaches train.total_steps and summary.json counts the timeouts; the first is logged with the workflow
    and the prompt id."""
    wf = tmp_path / "hang.py"
    wf.write_text(HANG_SOME)
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, *TINY, "train.total_steps=6", f"rollout.workflow={wf}:hang_some",
                           "rollout.episode_timeout_s=2", timeout=200)
    assert rc == 0, out[-3000:]
    summary = _summary(run_dir)
    assert summary["exit_reason"] == "completed"
    failures = summary["buffer"]["workflow_failures"]
    assert failures["timeout"] >= 1, summary["buffer"]
    assert failures["exception"] == failures["bad_result"] == 0, summary["buffer"]
    log = (run_dir / "logs" / "rollout0.log").read_text()
    assert "first workflow failure of kind timeout" in log, log[-3000:]
    assert f"workflow {wf}:hang_some ran past rollout.episode_timeout_s" in log and "(prompt " in log, log[-3000:]
    assert "cancelled after 2 s (rollout.episode_timeout_s)" in log
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 6


ALWAYS_RAISES = """
def parse_answer(row):
    raise RuntimeError("my workflow cannot parse " + row.prompt_id)


async def always_raises(ctx, row):
    return parse_answer(row)
"""


def _assert_stopped_by_the_budget(run_dir, out: str, workflow: str, kind: str, error_line: str) -> dict:
    assert "rollout.max_failure_fraction=0.5" in out and f"workflow {workflow} failed on" in out, out[-4000:]
    assert f"First failure of kind {kind}" in out and error_line in out, out[-4000:]
    summary = _summary(run_dir)
    assert summary["exit_reason"] != "completed" and "rollout0" in summary["exit_reason"], summary["exit_reason"]
    assert "rollout.max_failure_fraction" in summary["exit_reason"]
    assert summary["buffer"]["workflow_failures"][kind] > 4, summary["buffer"]  # > 0.5 × window 8
    # not one log line per failure: the first with its traceback, then the stop message
    log = (run_dir / "logs" / "rollout0.log").read_text()
    assert log.count(error_line) == 2, log[-4000:]
    return summary


def test_always_raising_workflow_stops_the_run(tmp_path, run_launcher):
    wf = tmp_path / "broken_workflow.py"
    wf.write_text(ALWAYS_RAISES)
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, *TINY, f"rollout.workflow={wf}:always_raises", "rollout.failure_window=8",
                           timeout=200)
    assert rc != 0, out[-3000:]
    _assert_stopped_by_the_budget(run_dir, out, f"{wf}:always_raises", "exception",
                                  "RuntimeError: my workflow cannot parse")
    assert "in parse_answer" in out, out[-4000:]  # the user's traceback


STR_REWARD_AGENT = '''
import openai


class StrRewardAgent:
    """Makes one completion, then returns its reward as a string."""

    async def run(self, data, *, base_url, api_key, model, **kwargs):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)
        try:
            await client.chat.completions.create(model=model, max_tokens=4,
                                                 messages=[{"role": "user", "content": "2+2?"}])
        finally:
            await client.close()
        return "1.0"
'''


def test_agent_returning_a_string_reward_stops_the_run(tmp_path):
    data = tmp_path / "data"
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "openai_agent", "build_data.py"), "--out",
                    str(data), "--n", "16"], check=True, capture_output=True)
    agent = tmp_path / "str_agent.py"
    agent.write_text(STR_REWARD_AGENT)
    run_dir = tmp_path / "run"
    rc, out = launcher_cli("run", "--config", "examples/openai_agent/config.yaml", "--run-dir", str(run_dir),
                           f"data.train_files=[{data}/train.parquet]", "train.total_steps=2", "generation.n=2",
                           "train.batch_size=2", "metrics.prometheus=false", f"rollout.workflow={agent}:StrRewardAgent",
                           "rollout.failure_window=8", timeout=240)
    assert rc != 0, out[-3000:]
    _assert_stopped_by_the_budget(run_dir, out, f"{agent}:StrRewardAgent", "bad_result",
                                  "the agent's reward must be a finite number, got '1.0'")


HANG_ALL = """
import asyncio
import os


async def hang_all(ctx, row):
    with open(os.environ["HANG_MARKER"], "a") as f:
        f.write(ctx.group_id + "\\n")
    await asyncio.Event().wait()
"""


def test_groups_in_flight_at_ctrl_c_are_counted(tmp_path, demo_assets):
    """Item 11: the groups the rollout worker was generating when the run was stopped (SIGINT to the
    launcher) are cancelled; summary.json counts them (`buffer.dropped_in_flight_at_stop`)."""
    wf = tmp_path / "hang_all.py"
    wf.write_text(HANG_ALL)
    marker = tmp_path / "started.txt"
    run_dir = tmp_path / "run"
    model, data = demo_assets
    proc = launcher_spawn("run", "--config", "configs/demo.yaml", "--run-dir", str(run_dir), f"model.path={model}",
                          f"data.train_files=[{data}]", *TINY, f"rollout.workflow={wf}:hang_all",
                          env={"HANG_MARKER": str(marker)})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not (marker.exists() and len(marker.read_text().split()) >= 2):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    started = marker.read_text().split()
    assert len(started) == 2, started  # rollout.max_concurrent_groups=2: both slots generating
    proc.send_signal(signal.SIGINT)
    rc, out = launcher_finish(proc, timeout=120)
    assert rc == 130, out[-3000:]
    buffer = _summary(run_dir)["buffer"]
    assert buffer["dropped_in_flight_at_stop"] == 2, buffer
    assert buffer["added"] == 0 and buffer["workflow_failures"] == {"exception": 0, "timeout": 0, "bad_result": 0,
                                                                     "generation": 0}, buffer
