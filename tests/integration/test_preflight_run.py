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
    assert sorted(os.listdir(tmp_path)) == sorted([f"run{k}" for k in range(len(cases))] + [wrong.name])
    assert not os.path.exists(os.path.join(ROOT, "Qwen"))  # the hub id was not created as a local dir
