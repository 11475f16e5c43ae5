"""`launcher run` resolves issue 23's derived settings once and hands the same values to every role:
`server.dtype=auto` (float32 for CPU servers), `server.max_context_len=null` (data + generation
lengths), `rollout.max_concurrent_groups=null` (the servers' capacity). The servers start with them
(their log line) and config.json, which the learner and the rollout workers read, holds them."""

from __future__ import annotations

import json
import os

import pytest

from conftest import launcher_finish, launcher_spawn

pytestmark = pytest.mark.integration


def test_run_resolves_dtype_context_and_concurrency(tmp_path, demo_assets):
    model, data = demo_assets
    run_dir = tmp_path / "run"
    proc = launcher_spawn("run", "--config", "configs/demo.yaml", "--run-dir", str(run_dir), f"model.path={model}",
                          f"data.train_files=[{data}]", "train.total_steps=2", "metrics.prometheus=false",
                          "rollout.max_concurrent_groups=null", "server.max_context_len=null",
                          "data.max_prompt_length=40", "generation.max_new_tokens=7", "eval.max_new_tokens=9",
                          "server.max_batch_size=12")
    rc, out = launcher_finish(proc, timeout=300)
    assert rc == 0, out[-3000:]
    with open(run_dir / "config.json") as f:
        cfg = json.load(f)
    n = cfg["generation"]["n"]
    assert cfg["server"]["dtype"] == "float32"  # auto on a CPU server
    assert cfg["server"]["max_context_len"] is None  # derived the same way by every role
    assert cfg["rollout"]["max_concurrent_groups"] == -(-2 * 1 * 12 // (n * cfg["rollout"]["workers"]))
    with open(os.path.join(run_dir, "logs", "server0.log")) as f:
        log = f.read()
    assert "dtype float32, context 49 tokens" in log  # 40 prompt + 9 (eval's budget, the larger)
    with open(os.path.join(run_dir, "logs", "rollout0.log")) as f:
        assert f"{cfg['rollout']['max_concurrent_groups']} groups in flight at most" in f.read()
