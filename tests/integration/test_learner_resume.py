"""Kill the learner right after step k's checkpoint (SIGKILL, no clean-up), restart it with
resume_mode=auto: step k+1's loss equals the uninterrupted run's, exactly (CPU, fixed seeds).

Each rank is a real `python -m areal_like.learner.parallel.spawn` process with the usual
torch.distributed environment, forked by the launcher's fork server — the same way `launcher run` starts
the learner pool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from areal_like.api.net import free_port
from areal_like.data.tiny_model import build_tiny_model
from launcher.forkserver import ForkServer

pytestmark = pytest.mark.integration

K = 2  # killed after step K; step K+1 is compared
TRAIN = {"lr": 1e-2, "grad_clip": 1.0, "micro_batch_tokens": 48, "seed": 5, "warmup_steps": 2, "lr_schedule": "cosine",
         "total_steps": 4, "save_freq": 1, "resume_mode": "auto", "collective_timeout_s": 120}


_HOST = {}  # "forkserver": the module's fork server (see `pool_host`)


@pytest.fixture(scope="module", autouse=True)
def pool_host(tmp_path_factory):
    """The launcher's own fork server (launcher/forkserver.py), as `launcher run` starts the learner pool
    with it: torch and transformers imported once for every rank of every pool of this module."""
    host = ForkServer(dict(os.environ, OMP_NUM_THREADS="1"), str(tmp_path_factory.mktemp("fs") / "forkserver.log"))
    _HOST["forkserver"] = host
    yield host
    host.close()


def _run_pool(model: str, layout: str, world: int, out: str, steps: int, die_after: int = 0, **train_over) -> list[int]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        train = dict(TRAIN, checkpoint_dir=os.path.join(os.path.dirname(out), "ckpt"), **train_over)
        log = f"{out}.rank{rank}.log"
        procs.append((_HOST["forkserver"].spawn(
            [sys.executable, "-m", "areal_like.learner.parallel.spawn", "--model", model, "--layout", layout,
             "--steps", str(steps), "--out", out, "--train-cfg", json.dumps(train), "--die-after", str(die_after)],
            env, log, None), log))
    codes = []
    for p, log in procs:
        try:
            p.wait(timeout=240)
        except subprocess.TimeoutExpired:
            for q, _ in procs:
                q.kill()
            raise
        codes.append(p.returncode)
        if p.returncode not in (0, -signal.SIGKILL):
            raise AssertionError(f"learner rank exited {p.returncode}: {open(log).read()[-3000:]}")
    return codes


def _losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "m"), hidden_size=32, intermediate_size=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, seed=1)


# d2: FSDP2 (train.dp_sharding=full, the default) — each rank's optimizer file holds its own shards
@pytest.mark.parametrize("layout,world", [("d1", 1), ("t2", 2), ("p2", 2), ("d2", 2)])
def test_kill_after_step_k_and_resume(model_dir, tmp_path, layout, world):
    full = tmp_path / "full" / "losses.jsonl"
    full.parent.mkdir()
    _run_pool(model_dir, layout, world, str(full), steps=K + 1)
    crash = tmp_path / "crash" / "losses.jsonl"
    crash.parent.mkdir()
    codes = _run_pool(model_dir, layout, world, str(crash), steps=K + 1, die_after=K)
    assert all(c == -signal.SIGKILL for c in codes)
    assert sorted(_losses(str(crash))) == list(range(1, K + 1))  # nothing after the crash
    ckpt = crash.parent / "ckpt"
    assert (ckpt / "latest").read_text() == f"step_{K:08d}"
    _run_pool(model_dir, layout, world, str(crash), steps=K + 1)  # resume_mode=auto
    a, b = _losses(str(full)), _losses(str(crash))
    assert sorted(b) == list(range(1, K + 2))  # step K+1 ran once, after the restart
    assert b[K + 1] == a[K + 1], (a, b)  # bit-exact
    with open(ckpt / f"step_{K + 1:08d}" / "meta.json") as f:
        meta = json.load(f)
    assert meta["dp_sharding"] == ("full" if layout == "d2" else "none")
    assert meta["step"] == K + 1 and meta["extra"]["resumed_from"] == K and meta["layout"] == str(layout).replace(
        "d1", "d1p1t1").replace("t2", "d1p1t2").replace("p2", "d1p2t1").replace("d2", "d2p1t1")


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    return build_tiny_model(str(tmp_path_factory.mktemp("moe") / "m"), arch="qwen3_moe", hidden_size=32,
                            num_layers=2, num_heads=4, num_kv_heads=2, seed=1)


# d2e2 (issue 44): a MoE model's experts split over the two ranks (expert parallel), their AdamW state saved by
# each rank for its own experts — DCP records the global shapes, so one process reads them all back
@pytest.mark.parametrize("model,layout", [("dense", "d2"), ("moe", "d2e2")])
def test_sharded_checkpoint_resumes_at_another_dp(model_dir, moe_dir, tmp_path, model, layout):
    """Step K's checkpoint of a d2 FSDP pool (each rank wrote its own AdamW shards, DCP) resumes on one
    process (d1, replicated): the optimizer state is resharded, and step K+1's loss equals the
    uninterrupted d2 run's (fp32; 1e-6 — one process sums the same numbers in another order)."""
    model_dir = moe_dir if model == "moe" else model_dir
    full = tmp_path / "full" / "losses.jsonl"
    full.parent.mkdir()
    _run_pool(model_dir, layout, 2, str(full), steps=K + 1)
    run = tmp_path / "run"
    run.mkdir()
    _run_pool(model_dir, layout, 2, str(run / "losses.jsonl"), steps=K)
    files = sorted(os.listdir(run / "ckpt" / f"step_{K:08d}"))
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files), files  # one shard file per rank
    _run_pool(model_dir, "d1", 1, str(run / "losses_d1.jsonl"), steps=K + 1)  # resume_mode=auto
    a, b = _losses(str(full)), _losses(str(run / "losses_d1.jsonl"))
    assert sorted(b) == [K + 1]  # resumed: only step K+1 ran
    assert b[K + 1] == pytest.approx(a[K + 1], abs=1e-6, rel=1e-6), (a, b)
    with open(run / "ckpt" / f"step_{K + 1:08d}" / "meta.json") as f:
        meta = json.load(f)
    assert meta["layout"] == "d1p1t1" and meta["extra"]["resumed_from"] == K
