"""Resume without waste: running the same command on the same run dir continues the rollout workers'
group numbers and prompt order, so no group is generated only to be discarded as already trained."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_rerun_continues_and_discards_no_group(tmp_path, run_launcher):
    run_dir = tmp_path / "run"
    common = ("train.batch_size=2", "generation.n=4", "train.save_freq=2", "train.test_freq=0")
    rc, out = run_launcher(run_dir, "train.total_steps=4", *common)
    assert rc == 0, out[-4000:]
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["buffer"]["duplicates"] == 0
    trained_first = [g for ln in (run_dir / "trained.jsonl").read_text().splitlines()
                     for g in json.loads(ln).get("groups", [])]

    rc, out = run_launcher(run_dir, "train.total_steps=8", *common)  # the same run dir: resume
    assert rc == 0, out[-4000:]
    second = json.loads((run_dir / "summary.json").read_text())
    assert second["steps"] == 8 and second["exit_reason"] == "completed"
    assert second["buffer"]["duplicates"] == 0, second  # nothing regenerated and discarded
    log = (run_dir / "logs" / "rollout0.log").read_text()
    assert "resuming at group w0-" in log, log[-2000:]
    trained = [g for ln in (run_dir / "trained.jsonl").read_text().splitlines()
               for g in json.loads(ln).get("groups", [])]
    assert len(trained) == len(set(trained)) == 8 * 2  # every step's groups, none twice
    assert set(trained_first) < set(trained)


# ---- issue 24: checkpoints verified before use, fallback, explicit rollback, a failed start keeps files ----

_CKPT = ("train.batch_size=2", "generation.n=4", "train.save_freq=1", "train.test_freq=0")


def _truncate(path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)


def _trained_groups(run_dir) -> list[str]:
    return [g for ln in (run_dir / "trained.jsonl").read_text().splitlines()
            for g in json.loads(ln).get("groups", [])]


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, run_launcher):
    """The probe: the newest checkpoint's model file truncated, the same command run again. It must
    resume from the previous checkpoint, say which one it skipped and why, and finish."""
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, "train.total_steps=2", *_CKPT)
    assert rc == 0, out[-4000:]
    newest, previous = run_dir / "checkpoints" / "step_00000002", run_dir / "checkpoints" / "step_00000001"
    _truncate(newest / "model.safetensors")

    rc, out = run_launcher(run_dir, "train.total_steps=2", *_CKPT)
    log = (run_dir / "logs" / "learner.log").read_text()
    assert rc == 0, out[-4000:] + log[-3000:]
    assert f"checkpoint {newest} is unusable: model.safetensors is" in log, log[-3000:]
    assert f"falling back to the previous checkpoint {previous}" in log, log[-3000:]
    assert "resumed from step 1" in log, log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["steps"] == 2, summary
    assert (run_dir / "checkpoints" / "step_00000002.corrupt").is_dir()  # kept for inspection, never resumed
    trained = _trained_groups(run_dir)
    assert len(trained) == len(set(trained)) == 3 * 2  # step 2 trained again on new groups, none twice


def test_no_usable_checkpoint_fails_clearly_and_keeps_the_finished_runs_files(tmp_path, run_launcher):
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, "train.total_steps=2", *_CKPT)
    assert rc == 0, out[-4000:]
    before = (run_dir / "summary.json").read_bytes()
    for step in (1, 2):
        _truncate(run_dir / "checkpoints" / f"step_{step:08d}" / "rank00000.pt")

    rc, out = run_launcher(run_dir, "train.total_steps=2", *_CKPT)
    log = (run_dir / "logs" / "learner.log").read_text()
    assert rc != 0, out[-4000:]
    assert f"no usable checkpoint in {run_dir / 'checkpoints'} (run dir {run_dir})" in log, log[-3000:]
    assert "step_00000002: rank00000.pt is" in log and "step_00000001: rank00000.pt is" in log, log[-3000:]
    assert "train.resume_mode=disable" in log, log[-3000:]
    assert (run_dir / "summary.json").read_bytes() == before  # the finished run's summary, untouched
    assert "previous summary.json and report" in out, out[-3000:]
    failed = json.loads((run_dir / "summary.failed_start.json").read_text())
    assert failed["exit_reason"] != "completed", failed

    # the key the message names starts the run over in the same run dir (buffer rewound to step 0)
    rc, out = run_launcher(run_dir, "train.total_steps=2", "train.resume_mode=disable", *_CKPT)
    assert rc == 0, out[-4000:]
    assert json.loads((run_dir / "summary.json").read_text())["exit_reason"] == "completed"
    trained = _trained_groups(run_dir)
    assert len(trained) == len(set(trained)) == 4 * 2  # steps 1..2 twice over, on new groups each time


def test_explicit_resume_at_an_older_step_rolls_back(tmp_path, run_launcher):
    """`train.resume_mode=1` after a run that committed step 3: the learner goes back to step 1, the
    buffer's committed step with it, and steps 2..3 are trained again on new groups (none twice)."""
    run_dir = tmp_path / "run"
    rc, out = run_launcher(run_dir, "train.total_steps=3", "train.keep_checkpoints=3", *_CKPT)
    assert rc == 0, out[-4000:]

    rc, out = run_launcher(run_dir, "train.total_steps=3", "train.keep_checkpoints=3", "train.resume_mode=1", *_CKPT)
    log = (run_dir / "logs" / "learner.log").read_text()
    assert rc == 0, out[-4000:] + log[-3000:]
    assert "rolling back to" in log and "step_00000001" in log, log[-3000:]
    assert "resumed from step 1" in log, log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_reason"] == "completed" and summary["steps"] == 3, summary
    trained = _trained_groups(run_dir)
    assert len(trained) == len(set(trained)) == (3 + 2) * 2, trained
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "step_00000003" in ckpts and "step_00000003.rolled_back" in ckpts, ckpts
