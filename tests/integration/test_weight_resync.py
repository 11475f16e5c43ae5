"""A restarted generation server is re-synced before it serves a rollout (issue 11, "every role supervised").

Real processes on loopback: embedded servers, a real redis-server, the learner's rank-0 `Coordinator`
with its real pushers. A server is SIGKILLed and restarted with --start-paused on the same port (as
the launcher does), the restart is counted in `restarts:server`, and the Coordinator re-forms the
weight group and pushes the current weights again — from fetch while it waits for data, before the
next push, after a push that failed because the server was dead, and after one it died in."""

from __future__ import annotations

import asyncio
import os
import signal
import types

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_like import metrics as M
from areal_like.api.config import (BufferConfig, ExperimentConfig, ModelConfig, ServerConfig, WeightSyncConfig)
from areal_like.api.run_files import Endpoints
from areal_like.learner.main import Coordinator
from areal_like.weights import DiskWeightPusher, WeightPushError

from conftest import EngineServer, free_port
from test_weight_sync import local_logprobs, perturbed

pytestmark = pytest.mark.integration

ADMIN = "admin-key"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # rank 0 lives in this test process
PROMPT = [5, 9, 13, 17]


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


# The servers' side of a weight group times out before the learner's (weights.timeout_s=40 below; `launcher
# run` gives its servers weights.timeout_s): when server 0 dies in the middle of a gloo push (step 4), server
# 1 may already wait inside a broadcast the trainer never starts — gloo cannot interrupt it — and is free for
# the re-sync's group after this, while the re-formed group's first broadcast still waits for it.
SERVER_TIMEOUT = ("--weight-sync-timeout-s", "20")


@pytest.fixture
def restarted(tmp_path):
    """`restart(srv)`: SIGKILL `srv` (by PID) and start a new server on its port with --start-paused."""
    started: list[EngineServer] = []

    def restart(srv: EngineServer, model_dir: str, wait: bool = True) -> EngineServer:
        kill(srv)
        new = EngineServer(model_dir, tmp_path, "--admin-api-key", ADMIN, "--start-paused", *SERVER_TIMEOUT,
                           port=srv.port)
        started.append(new)
        return new.wait_ready() if wait else new

    yield restart
    for s in started:
        s.stop()


def kill(srv: EngineServer) -> None:
    srv.proc.kill()
    srv.proc.wait(timeout=15)
    srv.stop()  # closes its log


async def get(url: str, path: str) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path, headers=ADMIN_H, timeout=aiohttp.ClientTimeout(total=30)) as r:
            assert r.status == 200, await r.text()
            return await r.json(content_type=None)


async def sample(url: str, seed: int = 7, n: int = 16):
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, "sampling_seed": seed}}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/generate", json=body, headers=ADMIN_H, timeout=aiohttp.ClientTimeout(total=120)) as r:
            assert r.status == 200, await r.text()
            res = await r.json()
    lps = torch.tensor([t[0] for t in res["meta_info"]["output_token_logprobs"]])
    return res["output_ids"], lps, res["meta_info"]["weight_version"]


async def assert_serves(servers, model, version: int) -> None:
    """Every server reports `version` and generates with `model`'s weights (same output everywhere)."""
    outs = []
    for srv in servers:
        info = await get(srv.url, "/get_model_info")
        assert info["weight_version"] == str(version), (srv.url, info)
        assert (await get(srv.url, "/server_info"))["paused"] is False
        out, lps, v = await sample(srv.url)
        assert v == str(version)
        assert (lps - local_logprobs(model, PROMPT, out)).abs().mean() <= 1e-4
        outs.append(out)
    assert all(o == outs[0] for o in outs)


def make_coordinator(tmp_path, monkeypatch, redis_server, stream, model_dir, urls, mode="distributed"):
    monkeypatch.setenv("AREAL_LIKE_REDIS_URL", redis_server.url)
    cfg = ExperimentConfig(model=ModelConfig(path=model_dir), server=ServerConfig(admin_api_key=ADMIN),
                           buffer=BufferConfig(stream=stream, block_ms=100),
                           weights=WeightSyncConfig(mode=mode, timeout_s=40, bucket_mb=0.05))
    return Coordinator(cfg, Endpoints(servers=urls), str(tmp_path), 0, weight_port=free_port(), metrics_port=None)


def resyncs() -> float:
    return M.WEIGHT_RESYNCS._value.get()


async def test_restarted_server_is_resynced_distributed(engine_servers, tiny_model_dir, base_model, redis_server,
                                                        redis_stream, restarted, tmp_path, monkeypatch):
    servers = engine_servers(tiny_model_dir, 2, "--admin-api-key", ADMIN, *SERVER_TIMEOUT)
    coord = make_coordinator(tmp_path, monkeypatch, redis_server, redis_stream, tiny_model_dir,
                             [s.url for s in servers])
    buf = coord.buffer
    m1, m2, m3, m4 = (perturbed(base_model, seed=s) for s in (1, 2, 3, 4))
    n0 = resyncs()
    await coord.start(None, 0, types.SimpleNamespace(spec="d1p1t1"), list(base_model.state_dict().items()))
    try:
        await coord.push(list(m1.state_dict().items()), 1)
        await assert_serves(servers, m1, 1)
        assert resyncs() == n0

        # 1. server 1 dies and comes back paused with model.path's weights; its requests are held
        servers[1] = restarted(servers[1], tiny_model_dir)
        assert (await get(servers[1].url, "/get_model_info"))["weight_version"] == "0"
        assert (await get(servers[1].url, "/server_info"))["paused"] is True
        held = asyncio.ensure_future(sample(servers[1].url))
        await asyncio.sleep(0.5)
        assert not held.done()
        assert buf.run.count_restart("server") == 1  # the launcher, once the server answers /health
        # fetch waits for data (none comes) and re-syncs meanwhile; it returns when told to stop
        assert await coord.fetch(1, lambda: coord.seen_restarts >= 1) is None
        assert coord.pusher.group_name == "weight_update_group_0_r1" and resyncs() == n0 + 1
        out, lps, v = await asyncio.wait_for(held, 60)  # the held request ran with the pushed weights
        assert v == "1" and (lps - local_logprobs(m1, PROMPT, out)).abs().mean() <= 1e-4
        await assert_serves(servers, m1, 1)

        # 2. a push while server 1 is dead fails, re-syncs once it is back, and lands everywhere
        kill(servers[1])
        push = asyncio.ensure_future(coord.push(list(m2.state_dict().items()), 2))
        await asyncio.sleep(1.0)
        assert not push.done()  # waiting for the dead server
        servers[1] = restarted(servers[1], tiny_model_dir, wait=False)
        res = await asyncio.wait_for(push, 90)
        assert res.push_s > 0 and resyncs() == n0 + 2
        assert coord.pusher.group_name == "weight_update_group_0_r2"
        await assert_serves(servers, m2, 2)

        # 3. the launcher counts that restart only now: the next push re-forms the group first (harmless)
        buf.run.count_restart("server")
        await coord.push(list(m3.state_dict().items()), 3)
        assert coord.seen_restarts == 2 and resyncs() == n0 + 3
        await assert_serves(servers, m3, 3)

        # 4. server 0 dies in the middle of a push (small buckets: the 4th bucket is on the wire)
        coord.pusher.bucket_bytes = 2048
        collective = coord.pusher._with_collective
        calls = []

        async def kill_at_bucket_4(http, coll, **kw):
            calls.append(1)
            if len(calls) == 4:
                asyncio.get_running_loop().call_later(0.003, os.kill, servers[0].proc.pid, signal.SIGKILL)
            return await collective(http, coll, **kw)

        coord.pusher._with_collective = kill_at_bucket_4
        push = asyncio.ensure_future(coord.push(list(m4.state_dict().items()), 4))
        while servers[0].proc.poll() is None:
            await asyncio.sleep(0.005)
        coord.pusher._with_collective = collective
        assert not push.done() and len(calls) >= 4
        servers[0] = restarted(servers[0], tiny_model_dir, wait=False)
        await asyncio.wait_for(push, 90)
        assert coord.pusher.group_name == "weight_update_group_0_r4" and resyncs() == n0 + 4
        await assert_serves(servers, m4, 4)
    finally:
        await coord.close(False, 4, 4, saved=False)


async def test_restarted_server_is_resynced_disk(engine_servers, tiny_model_dir, base_model, redis_server,
                                                 redis_stream, restarted, tmp_path, monkeypatch):
    (srv,) = engine_servers(tiny_model_dir, 1, "--admin-api-key", ADMIN)
    coord = make_coordinator(tmp_path, monkeypatch, redis_server, redis_stream, tiny_model_dir, [srv.url], "disk")
    m1 = perturbed(base_model, seed=11)
    await coord.start(None, 0, types.SimpleNamespace(spec="d1p1t1"), list(base_model.state_dict().items()))
    try:
        await coord.push(list(m1.state_dict().items()), 1)
        srv = restarted(srv, tiny_model_dir)
        coord.buffer.run.count_restart("server")
        assert await coord.fetch(1, lambda: coord.seen_restarts >= 1) is None
        await assert_serves([srv], m1, 1)
    finally:
        await coord.close(False, 1, 1, saved=False)


async def test_wait_servers_names_the_servers_that_never_answered(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    pusher = DiskWeightPusher([dead], out_dir=str(tmp_path / "w"), timeout_s=1)
    await pusher.init()
    try:
        with pytest.raises(WeightPushError, match=r"did not answer /health within 1s: " + dead.replace(".", r"\.")):
            await pusher.reform()
    finally:
        await pusher.close()
