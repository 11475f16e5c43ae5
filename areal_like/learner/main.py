"""The learner process: the RL loop of one training run, on one screen.

    ┌─ fetch B groups from the replay buffer (blocks until the rollout workers produced them)
    │    └─ consume-time guard: drop groups older than the limit (counted; ~0 when the gate works)
    ├─ train  (recompute π_prox, advantages, decoupled PPO, optimizer step)
    ├─ push weights to every server (pause → buckets → continue)     ← generation waits only here
    ├─ bump the policy version v  (only now: the new weights are on every server)  → frees the gate
    └─ commit: ack the step's entries, append metrics.jsonl

The learner never imports the engine; it talks to servers only through the weight pusher.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

from areal_like import metrics as M
from areal_like.api.config import decode_config


def _log(msg: str) -> None:
    print(f"[learner] {msg}", flush=True)


async def run(run_dir: str, metrics_port: int | None) -> int:
    from areal_like.buffer.replay_buffer import ReplayBuffer
    from areal_like.learner.trainer import Learner
    from areal_like.weights.push import WeightPusher

    with open(os.path.join(run_dir, "config.json"), "rb") as f:
        cfg = decode_config(f.read())
    with open(os.path.join(run_dir, "endpoints.json")) as f:
        endpoints = json.load(f)
    if metrics_port:
        M.serve(metrics_port)

    redis_url = os.environ["AREAL_LIKE_REDIS_URL"]
    buffer = ReplayBuffer.from_config(cfg.buffer, url=redis_url)
    B = cfg.train.batch_size
    limit = cfg.train.max_consume_staleness
    if limit is None:
        limit = cfg.rollout.max_staleness
    learner = Learner(cfg.model.path, cfg.train, temperature=cfg.generation.temperature,
                      device=endpoints.get("learner_device", "cpu"), dtype=cfg.model.dtype)
    pusher = WeightPusher(
        endpoints["servers"], master_addr="127.0.0.1", master_port=endpoints["weight_sync_master_port"],
        backend=endpoints.get("weight_backend", "gloo"), bucket_bytes=int(cfg.weights.bucket_mb * 2**20),
        timeout_s=cfg.weights.timeout_s, admin_api_key=cfg.server.admin_api_key,
        devices_per_server=endpoints.get("server_devices"),
    )
    await pusher.init()
    version = 0
    buffer.set_version(version)
    M.POLICY_VERSION.set(version)
    consumer = "learner0"
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    _log(f"ready: B={B} groups/step, η={cfg.rollout.max_staleness}, servers={endpoints['servers']}")

    for step in range(1, cfg.train.total_steps + 1):
        # ---- fetch: exactly B entries per step, drops included ------------------------------
        # The gate admits (η+v+1)·B groups in total, so taking more than B per version to replace
        # dropped ones would starve the producers; a step trains on the groups it keeps.
        t_fetch = time.monotonic()
        batch_ids, groups, staleness, n_dropped = [], [], [], 0
        while len(batch_ids) + n_dropped < B:
            entries = buffer.read(B - len(batch_ids) - n_dropped, cfg.buffer.block_ms, consumer)
            if not entries:
                continue
            keep, dropped = buffer.filter_stale(entries, version, limit)  # acks and counts the dropped
            if dropped:
                n_dropped += len(dropped)
                _log(f"dropped {len(dropped)} group(s) older than {limit} versions at v={version}")
            for entry_id, g in keep:
                batch_ids.append(entry_id)
                groups.append(g)
                staleness.append(version - g.min_version if g.min_version >= 0 else 0)
        fetch_s = time.monotonic() - t_fetch

        # ---- train ----------------------------------------------------------------------------
        stats = learner.train_step(groups, version) if groups else _empty_stats()

        # ---- push, then bump the version ---------------------------------------------------
        push = await pusher.push(learner.named_tensors_for_push(), version + 1)
        version += 1
        buffer.set_version(version)

        # ---- commit ---------------------------------------------------------------------------
        buffer.ack(batch_ids)
        row = {
            "step": step, "version": version, "reward_mean": stats["reward_mean"],
            "staleness_max": max(staleness, default=0), "dropped_stale": n_dropped, "samples": stats["num_samples"], "step_s": stats["step_s"],
            "push_s": push["push_s"], "pause_window_s": push.get("pause_window_s"), "fetch_s": fetch_s,
            "loss": stats["loss"], "grad_norm": stats["grad_norm"], "clipfrac": stats["clipfrac"],
            "approx_kl": stats["approx_kl"], "behav_w_max": stats["behav_w_max"],
            "loss_tokens": stats["loss_tokens"], "skipped": stats["skipped"],
        }
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        M.POLICY_VERSION.set(version)
        M.LEARNER_STEP.set(step)
        M.STEP_SECONDS.observe(stats["step_s"])
        M.PUSH_SECONDS.observe(push["push_s"])
        M.REWARD_MEAN.set(stats["reward_mean"])
        M.LOSS.set(stats["loss"])
        M.STALENESS_MAX.set(max(staleness, default=0))
        for s in staleness:
            M.STALENESS.observe(s)
        M.TRAINED_TOKENS.inc(stats["loss_tokens"])

    await pusher.close()
    buffer.close()
    _log(f"done: {cfg.train.total_steps} steps, final version {version}")
    return 0


def _empty_stats() -> dict:
    """A step whose every group was dropped by the consume-time guard: nothing to train on."""
    nan = float("nan")
    return {"reward_mean": nan, "num_samples": 0, "step_s": 0.0, "loss": nan, "grad_norm": nan,
            "clipfrac": nan, "approx_kl": nan, "behav_w_max": nan, "loss_tokens": 0, "skipped": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m areal_like.learner.main")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--metrics-port", type=int, default=None)
    a = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(run(a.run_dir, a.metrics_port))


if __name__ == "__main__":
    sys.exit(main())
