"""Experiment tracking and the run report on one real short demo run (`launcher run` of
configs/demo.yaml: real redis-server, embedded server, learner and rollout processes) with
`metrics.loggers=[jsonl,tensorboard,wandb]` and W&B offline. Each tracker's files are read back with
that library's own reader: TensorBoard's EventAccumulator; for W&B the offline run's `.wandb` file,
records decoded with wandb's own protobuf `Record` (wandb ≥ 0.2x ships no Python reader of the file:
its framing — the LevelDB log format with CRC-32 — is read here, checksums verified). Then
`launcher report --run-dir` on the same run dir.

Nothing leaves the machine: W&B runs offline (WANDB_MODE=offline besides metrics.wandb.mode), with
its config, cache and data dirs under the test's tmp dir and error reporting off.
"""

from __future__ import annotations

import base64
import glob
import json
import math
import os
import re
import struct
import zlib

import pytest
from conftest import launcher_cli

pytestmark = pytest.mark.integration

STEPS = 6


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, demo_assets):
    """(run dir, launcher output) of a 6-step demo run with every tracker on; validation at steps 3, 6."""
    model, data = demo_assets
    base = tmp_path_factory.mktemp("tracked")
    run_dir = base / "tracked-run"
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
           "WANDB_CONFIG_DIR": str(base / "wandb-config"), "WANDB_CACHE_DIR": str(base / "wandb-cache"),
           "WANDB_DATA_DIR": str(base / "wandb-data"), "WANDB_BASE_URL": "http://127.0.0.1:9"}
    rc, out = launcher_cli("run", "--config", "configs/demo.yaml", "--run-dir", str(run_dir), f"model.path={model}",
                           f"data.train_files=[{data}]", f"train.total_steps={STEPS}", "train.batch_size=2",
                           "generation.n=4", "train.test_freq=3", "metrics.loggers=[jsonl,tensorboard,wandb]",
                           "metrics.wandb.mode=offline", "metrics.wandb.project=areal-like-test", env=env)
    assert rc == 0, out[-4000:]
    return run_dir, out


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    return ea


def _wandb_records(path: str):
    """The protobuf `Record`s of a `.wandb` file (wandb's datastore framing: a 7-byte file header
    `:W&B` magic version, then 32 KiB blocks of chunks `<crc32 u32><length u16><type u8><data>`;
    type 1 = a whole record, 2/3/4 = first/middle/last piece; crc32 of the data seeded with the type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = struct.unpack_from("<4sHB", data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), data[:7]
    pos, block, pieces = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little room for a chunk header: the block's rest is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        pos += 7
        chunk = data[pos:pos + length]
        pos += length
        if kind == 0:
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad checksum at {pos}"
        if kind == 2:
            pieces = chunk
            continue
        if kind == 3:
            pieces += chunk
            continue
        rec = pb.Record()
        rec.ParseFromString(chunk if kind == 1 else pieces + chunk)
        yield rec


def test_tensorboard_event_files(tracked_run):
    run_dir, _ = tracked_run
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ea = _tensorboard(run_dir)
    tags = set(ea.Tags()["scalars"])
    for key in ("train/loss", "train/grad_norm", "train/clipfrac", "train/approx_kl", "train/entropy",
                "train/behav_w_max", "rollout/reward_mean", "rollout/samples", "rollout/staleness_max",
                "rollout/dropped_stale", "perf/step_s", "perf/push_s", "perf/fetch_s", "perf/samples_per_s",
                "buffer/depth", "buffer/pending", "val/all/mean@4", "val/all/pass@4"):
        assert key in tags, (key, sorted(tags))
    assert {t.split("/")[0] for t in tags} <= {"train", "rollout", "val", "perf", "buffer"}, sorted(tags)
    reward = ea.Scalars("rollout/reward_mean")
    assert [e.step for e in reward] == [r["step"] for r in rows]
    assert [e.value for e in reward] == pytest.approx([r["reward_mean"] for r in rows])
    assert [e.step for e in ea.Scalars("val/all/mean@4")] == [3, 6]  # the validated steps' rows
    # the resolved config, once, as a text summary (secrets blanked)
    (text,) = ea.Tensors("config/text_summary")
    config = text.tensor_proto.string_val[0].decode()
    assert config.startswith("```json") and '"max_staleness": 1' in config
    admin = json.loads((run_dir / "config.json").read_text())["server"]["admin_api_key"]
    assert admin and admin not in config and '"admin_api_key": "***"' in config


def test_wandb_offline_run(tracked_run):
    run_dir, _ = tracked_run
    rows = _rows(run_dir)
    runs = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, os.listdir(run_dir / "wandb")
    records = list(_wandb_records(runs[0]))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "tracked-run" and run.project == "areal-like-test" and run.run_group == "tracked-run"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update({i.key: json.loads(i.value_json) for i in r.config.update})
    assert config["rollout"]["max_staleness"] == 1 and config["train"]["total_steps"] == STEPS
    assert config["server"]["admin_api_key"] == "***"
    history = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    assert [h["_step"] for h in history] == [r["step"] for r in rows]
    assert [h["rollout/reward_mean"] for h in history] == pytest.approx([r["reward_mean"] for r in rows])
    assert [h["_step"] for h in history if "val/all/mean@4" in h] == [3, 6]
    # the same keys as TensorBoard's, under the same namespaces
    tb = set(_tensorboard(run_dir).Tags()["scalars"])
    wb = {k for h in history for k in h if not k.startswith("_")}
    assert wb == tb, (sorted(wb ^ tb))
    for h, row in zip(history, rows):
        loss = h["train/loss"]
        assert (math.isnan(row["loss"]) and math.isnan(loss)) or loss == pytest.approx(row["loss"])


def test_launcher_report_on_the_run(tracked_run):
    run_dir, _ = tracked_run
    rc, out = launcher_cli("report", "--run-dir", str(run_dir), timeout=120)
    assert rc == 0, out
    assert str(run_dir / "report.html") in out
    html = (run_dir / "report.html").read_text(encoding="utf-8")
    imgs = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"[^>]*data-file="([^"]+)"', html)
    assert html.count("<img ") == len(imgs)
    names = {name for _, name in imgs}
    for fig in ("reward", "validation", "samples_per_s", "staleness", "seconds", "drops"):
        assert f"report/{fig}.png" in names, names
    for src, name in imgs:  # inline (self-contained) and the same PNG on disk
        png = base64.b64decode(src)
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and (run_dir / name).read_bytes() == png
    assert "Finished: <b>completed</b>" in html
    assert "Generation busy fraction" in html  # figure or note, never silently missing
    # a run dir that is not one
    rc, out = launcher_cli("report", "--run-dir", str(run_dir / "nope"), timeout=60)
    assert rc == 2 and "not a directory" in out


_TRACKER_PROC = r"""
import sys, time
from areal_like.api.config import load_config
from areal_like.metrics.loggers import make_loggers
run_dir, incarnation, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = load_config(None, ["metrics.loggers=[jsonl,tensorboard,wandb]", "metrics.wandb.mode=offline"])
trackers = make_loggers(cfg, run_dir, incarnation)  # what learner rank 0 makes
assert [t.name for t in trackers.loggers] == ["tensorboard", "wandb"], trackers.loggers
for step in range(first, last + 1):
    trackers.log_row({"step": step, "reward_mean": step / 10 + incarnation, "incarnation": incarnation})
print("logged", flush=True)
if incarnation == 0:
    time.sleep(600)  # killed here, like a learner that dies mid-run
trackers.close()
"""


def test_trackers_survive_a_learner_restart(tmp_path):
    """A learner SIGKILLed after step 4 and restarted from its step-2 checkpoint (it redoes 3, 4): the
    new process's trackers start in the same run dir; TensorBoard shows steps 1–6 once, the redone
    steps from the new process; W&B has a second offline run `<name>-restart1`; the killed process's
    wandb-core helper does not outlive it."""
    import signal
    import subprocess
    import sys
    import time

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "WANDB_BASE_URL": "http://127.0.0.1:9"}
    first = subprocess.Popen([sys.executable, "-c", _TRACKER_PROC, str(run_dir), "0", "1", "4"],
                             stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert first.stdout.readline().strip() == "logged"
        # W&B writes the run's file every WandbLogger.FLUSH_S; kill once the 4 rows are on disk
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            files = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
            if files and sum(r.WhichOneof("record_type") == "history" for r in _wandb_records(files[0])) == 4:
                break
            time.sleep(0.2)
        with open(f"/proc/{first.pid}/task/{first.pid}/children") as f:
            helpers = [int(p) for p in f.read().split()]
    finally:
        first.kill()
        first.wait()
    second = subprocess.run([sys.executable, "-c", _TRACKER_PROC, str(run_dir), "1", "3", "6"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]

    events = _tensorboard(run_dir).Scalars("rollout/reward_mean")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    assert [round(e.value, 3) for e in events] == [0.1, 0.2, 1.3, 1.4, 1.5, 1.6]  # 3, 4 as redone
    assert len(list((run_dir / "tensorboard").iterdir())) == 2  # one event file per learner process

    names, steps = [], []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        records = list(_wandb_records(path))
        names += [r.run.display_name for r in records if r.WhichOneof("record_type") == "run"]
        steps.append([r.history.step.num for r in records if r.WhichOneof("record_type") == "history"])
    assert sorted(names) == ["run", "run-restart1"]
    assert sorted(steps) == [[1, 2, 3, 4], [3, 4, 5, 6]]
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{p}") for p in helpers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in helpers if os.path.exists(f"/proc/{p}")]
    for p in left:  # ours to end (a test must not leave processes behind), by PID
        os.kill(p, signal.SIGKILL)
    assert not left, f"wandb helper process(es) {left} outlived the killed learner"
