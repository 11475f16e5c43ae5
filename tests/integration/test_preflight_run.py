"""`launcher run` refuses bad paths before anything starts (no Redis, no server, no learner), names
the key and the fix, and creates nothing at the path the user gave."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_typo_and_hub_id_and_bad_columns_stop_before_anything_starts(tmp_path, run_launcher):
    cases = [
        ("model.path=Qwen/Qwen2.5-0.5B", "huggingface-cli download Qwen/Qwen2.5-0.5B"),
        (f"model.path={tmp_path / 'typo_model'}", "does not exist"),
        (f"data.train_files=[{tmp_path / 'typo.parquet'}]", "data.train_files[0]="),
    ]
    wrong = tmp_path / "wrong_columns.parquet"
    pq.write_table(pa.table({"question": ["1+1"], "reward_model": [{"ground_truth": "2"}]}), wrong)
    cases.append((f"data.train_files=[{wrong}]", "no column 'prompt'"))
    for k, (override, message) in enumerate(cases):
        run_dir = tmp_path / f"run{k}"
        rc, out = run_launcher(run_dir, override, timeout=60)
        assert rc != 0, out
        assert message in out, out
        assert "redis-server pid" not in out and not (run_dir / "redis").exists()  # nothing was started
        assert not (run_dir / "pids.json").exists() or '"roles": {}' in (run_dir / "pids.json").read_text()
    assert sorted(os.listdir(tmp_path)) == [wrong.name]  # not even the run directories were created
    assert not os.path.exists(os.path.join(ROOT, "Qwen"))  # the hub id was not created as a local dir


# ---- issue 24 item 11 / Deliver 2: everything a file can get wrong, refused before anything starts -----

def _nothing_started(run_dir, out):
    assert "redis-server pid" not in out and "generation server" not in out, out
    assert not (run_dir / "redis").exists() and not (run_dir / "config.json").exists(), out
    assert not (run_dir / "pids.json").exists() or '"roles": {}' in (run_dir / "pids.json").read_text()


def _demo_rows(data, n=None):
    rows = pq.read_table(data).to_pylist()
    return rows[:n] if n is not None else rows


def _bad_tools_yaml(tmp_path, data):
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - class_name: python\n    config: {timeout: 5}\n")  # the key is timeout_s
    return ([f"rollout.tools_config={bad}", "rollout.workflow=tool_agent"],
            [f"rollout.tools_config={bad}", "tools[0] (python).config", "timeout"])


def _workflow_name_typo(tmp_path, data):
    wf = tmp_path / "my_flow.py"
    wf.write_text("async def my_flow(ctx, row):\n    return None\n")
    return [f"rollout.workflow={wf}:my_flwo"], [f"rollout.workflow={wf}:my_flwo", "defines no 'my_flwo'"]


def _row_agent_name_typo(tmp_path, data):
    rows = _demo_rows(data, 16)
    for i, r in enumerate(rows):
        r["agent_name"] = "rlvrr" if i == 5 else "rlvr"
    path = tmp_path / "agents.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return [f"data.train_files=[{path}]"], [f"data.train_files[0]={path} row 5", "agent_name", "'rlvrr'", "rlvr"]


def _null_prompt(tmp_path, data):
    rows = _demo_rows(data, 16)
    rows[7]["prompt"] = None
    path = tmp_path / "null_prompt.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return [f"data.train_files=[{path}]"], [f"data.train_files[0]={path} row 7", "'prompt'", "null"]


def _empty_val_file(tmp_path, data):
    table = pq.read_table(data)
    path = tmp_path / "empty_val.parquet"
    pq.write_table(table.slice(0, 0), path)
    return [f"data.val_files=[{path}]", "train.test_freq=2"], [f"data.val_files[0]={path} has no rows"]


@pytest.mark.parametrize("case", [_bad_tools_yaml, _workflow_name_typo, _row_agent_name_typo, _null_prompt,
                                  _empty_val_file], ids=lambda f: f.__name__.strip("_"))
def test_file_mistakes_stop_before_anything_starts(tmp_path, run_launcher, demo_assets, case):
    """A bad tools YAML, a workflow the file does not define, a row's unknown agent_name, a null prompt cell
    and an empty validation file: `launcher run` exits 2 naming the key, the file and the row, before Redis,
    any server or the learner started (they used to start, and the rollout worker was restarted 3 times)."""
    overrides, messages = case(tmp_path, demo_assets[1])
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, *overrides, timeout=120)
    assert rc == 2, out
    for m in messages:
        assert m in out, (m, out)
    assert "max_prompt_length" not in out, out  # an empty file is not a length problem
    _nothing_started(run_dir, out)


def test_overrides_before_between_and_after_options(tmp_path, demo_assets):
    """`launcher run --run-dir X key=value --config c key=value`: every override is applied wherever it
    stands among the options (argparse used to reject the ones after an option: "unrecognized arguments")."""
    from conftest import launcher_cli

    model, data = demo_assets
    typo = tmp_path / "typo.parquet"
    rc, out = launcher_cli("run", f"model.path={model}", "--run-dir", str(tmp_path / "run1"),
                           f"data.train_files=[{typo}]", "--config", "configs/demo.yaml", "train.total_steps=3",
                           timeout=120)
    assert rc == 2 and "unrecognized arguments" not in out, out
    assert f"data.train_files[0]={typo} does not exist" in out, out  # the override after the options was read
    rc, out = launcher_cli("run", f"data.train_files=[{data}]", "--run-dir", str(tmp_path / "run2"),
                           f"model.path={tmp_path / 'typo_model'}", timeout=120)
    assert rc == 2 and f"model.path={tmp_path / 'typo_model'} does not exist" in out, out
    rc, out = launcher_cli("run", "--run-dir", str(tmp_path / "run3"), "train.total_steps=3", "--no-such-option",
                           timeout=120)
    assert rc == 2 and "unrecognized arguments: --no-such-option" in out, out  # a real typo is still refused


def test_prompts_all_too_long_stop_the_run_without_restarts(tmp_path, run_launcher, demo_assets):
    """The one data mistake the preflight leaves to the rollout worker (lengths need the tokenizer): every
    validation prompt longer than data.max_prompt_length. The worker says so, naming data.val_files and
    the key to raise, and the run stops at once: restarting the worker would read the same file (it used
    to be restarted 3 times)."""
    import json

    rows = _demo_rows(demo_assets[1], 4)
    for r in rows:
        r["prompt"] = "1234567890" * 10
    val = tmp_path / "long_val.parquet"
    pq.write_table(pa.Table.from_pylist(rows), val)
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, f"data.val_files=[{val}]", "data.max_prompt_length=16", timeout=180)
    assert rc != 0, out
    assert "all 4 are longer than data.max_prompt_length=16 tokens: raise data.max_prompt_length" in out, out
    assert f"data.val_files=['{val}']" in out and "rollout0 stopped: its data files cannot be used" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restart_counts"]["rollout"] == 0 and summary["restarts"] == [], summary
