"""Validation handshake (buffer/eval_channel.py) and the evaluator (rollout/evaluator.py) for real:
a real redis-server, and a real embedded generation server on loopback serving weight version 3."""

from __future__ import annotations

import asyncio
import time

import pytest

from areal_like.buffer.eval_channel import EvalChannel, EvalError, EvalTimeout
from areal_like.buffer.replay_buffer import ReplayBuffer

pytestmark = pytest.mark.integration


def _pair(url: str, stream: str) -> tuple[EvalChannel, EvalChannel]:
    """(learner side, evaluator side) on separate endpoints, as in two processes."""
    learner = EvalChannel.from_buffer(ReplayBuffer(url, stream=stream, block_ms=100))
    evaluator = EvalChannel.from_buffer(ReplayBuffer(url, stream=stream, block_ms=100), wait_s=0.2, poll_s=0.02)
    return learner, evaluator


async def test_request_collect_and_idempotent_request(redis_server, redis_stream):
    learner, ev = _pair(redis_server.url, redis_stream)
    assert learner.request_key == "{" + redis_stream + "}:eval:request"
    assert await ev.next_request_async(-1) is None  # nothing asked yet
    learner.request(3, 3)
    first = learner.endpoint.client.get(learner.request_key)
    learner.request(3, 3)  # idempotent: the same request, not a second one
    assert learner.endpoint.client.get(learner.request_key) == first
    assert await ev.next_request_async(-1) == (3, 3)

    async def answer() -> None:
        await asyncio.sleep(0.3)  # the learner is already waiting
        await ev.publish_async(3, {"val/all/mean@4": 0.25, "val/version": 3.0})

    t = asyncio.create_task(answer())
    got = await asyncio.to_thread(learner.collect, 3, 10.0)
    await t
    assert got == {"val/all/mean@4": 0.25, "val/version": 3.0}
    assert learner.endpoint.client.get(learner.request_key) is None  # collected: withdrawn
    assert await ev.next_request_async(3) is None  # an answered request never comes back
    with pytest.raises(ValueError, match="version=9"):
        learner.collect(9, 1.0)  # never requested


async def test_collect_times_out_naming_the_evaluator_and_stops_on_request(redis_server, redis_stream):
    learner, ev = _pair(redis_server.url, redis_stream)
    learner.request(5, 10)
    t0 = time.monotonic()
    with pytest.raises(EvalTimeout) as e:
        learner.collect(5, timeout_s=0.4)
    assert 0.4 <= time.monotonic() - t0 < 3
    msg = str(e.value)
    assert "rollout0" in msg and "version 5" in msg and learner.result_key in msg
    assert isinstance(e.value, TimeoutError)
    assert await ev.next_request_async(-1) is None  # a timed-out request is withdrawn

    learner.request(6, 12)
    stops = iter([False, False, True])
    assert learner.collect(6, timeout_s=30, stopping=lambda: next(stops)) is None
    assert learner.endpoint.client.get(learner.request_key) is None


async def test_restarted_learner_gets_a_fresh_evaluation_and_errors_surface(redis_server, redis_stream):
    old, ev = _pair(redis_server.url, redis_stream)
    old.request(4, 4)
    assert await ev.next_request_async(-1) == (4, 4)
    await ev.publish_async(4, {"val/all/mean@4": 0.1})
    # the learner died before collecting; its successor resumes at version 4 and asks again
    new = EvalChannel.from_buffer(ReplayBuffer(redis_server.url, stream=redis_stream, block_ms=100))
    new.request(4, 4)
    assert await ev.next_request_async(4) == (4, 4)  # the old answer is not taken for the new request
    await ev.publish_async(4, {}, error="RuntimeError: every sample failed")
    with pytest.raises(EvalError, match="rollout0.*version 4.*every sample failed"):
        new.collect(4, 5.0)
    with pytest.raises(ValueError):
        await ev.publish_async(7, {})  # no such request taken


async def test_restart_hooks_reassert_what_a_redis_crash_lost(redis_server, redis_stream):
    learner, ev = _pair(redis_server.url, redis_stream)
    learner.request(8, 16)
    r = learner.endpoint.client
    r.delete(learner.request_key)  # what an AOF-everysec crash can lose
    learner.endpoint.run(learner._g_after_restart())  # the hook the endpoint runs on a new run_id
    assert await ev.next_request_async(-1) == (8, 16)
    await ev.publish_async(8, {"val/all/mean@4": 0.5})
    r.delete(ev.result_key)
    await ev.endpoint.arun(ev._g_after_restart())
    assert learner.collect(8, 5.0) == {"val/all/mean@4": 0.5}
    assert learner._g_after_restart in learner.endpoint._hooks  # registered on the shared endpoint


# ---- the Evaluator against a real embedded server ----------------------------------------------------
@pytest.fixture(scope="module")
def served_demo_model(demo_assets, engine_servers):
    model, _ = demo_assets
    (srv,) = engine_servers(model, 1, "--weight-version", "3")
    return model, srv.url


async def test_evaluator_answers_a_request_with_the_weights_the_servers_hold(served_demo_model, redis_server,
                                                                             redis_stream, tmp_path):
    from transformers import AutoTokenizer

    from areal_like.api.config import EvalConfig, GenerationConfig
    from areal_like.data.dataset import PromptDataset
    from areal_like.data.demo_task import ensure_demo_assets
    from areal_like.engine.client import GenerationClient
    from areal_like.reward import RewardFn
    from areal_like.rollout.evaluator import Evaluator

    model, url = served_demo_model
    val = str(tmp_path / "val.parquet")
    ensure_demo_assets(None, None, val_file=val, n_val=10)
    tok = AutoTokenizer.from_pretrained(model)
    dataset = PromptDataset([val], tok, max_prompt_length=64)
    learner, ev_channel = _pair(redis_server.url, redis_stream)
    reward_fn = RewardFn()
    logs: list[str] = []
    async with GenerationClient([url], request_timeout_s=60) as client:
        ev = Evaluator(client, reward_fn, tok, dataset, EvalConfig(n=2, max_prompts=8), GenerationConfig(max_new_tokens=1),
                       ev_channel, seed=1, log=logs.append)
        stop = asyncio.Event()
        task = asyncio.create_task(ev.run(stop))
        try:
            learner.request(3, 7)
            res = await asyncio.to_thread(learner.collect, 3, 60.0)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
        ds = "areal_like/demo"
        for key in (f"val/{ds}/mean@2", f"val/{ds}/pass@2", "val/all/mean@2", "val/all/pass@2"):
            assert 0.0 <= res[key] <= 1.0, (key, res)
        assert res[f"val/{ds}/mean@2"] == res["val/all/mean@2"]  # one data_source
        assert (res["val/version"], res["val/step"], res["val/prompts"]) == (3, 7, 8)
        assert res["val/samples"] == 16 and res["val/failed_samples"] == 0
        assert res["val/generated_tokens"] >= 1
        assert res["val/version_mismatch_tokens"] == 0
        assert res["val/seconds"] > 0
        assert ev.evaluated == 1 and len(logs) == 1 and "version 3" in logs[0]
        # seeds derive from the version: evaluating version 3 again samples the same completions
        again = await ev.evaluate(3, 7)
        assert again["val/all/mean@2"] == res["val/all/mean@2"]
        # the counter sees tokens of another version: the server holds 3, not 2
        other = await ev.evaluate(2, 7)
        assert other["val/version_mismatch_tokens"] == other["val/generated_tokens"] > 0
    await reward_fn.close()


async def test_a_wait_interrupted_by_on_wait_keeps_the_request(redis_server, redis_stream):
    """The learner leaves a validation wait to re-sync a restarted server (on_wait raises) and waits
    again: the request is still there, the evaluator still answers it, the second wait gets it."""
    learner, ev = _pair(redis_server.url, redis_stream)
    learner.request(5, 10)

    class Restarted(Exception):
        pass

    def restarted() -> None:
        raise Restarted

    with pytest.raises(Restarted):
        learner.collect(5, 5.0, on_wait=restarted)
    assert await ev.next_request_async(-1) == (5, 10)  # not withdrawn
    await ev.publish_async(5, {"val/all/mean@4": 0.75})
    assert learner.collect(5, 5.0) == {"val/all/mean@4": 0.75}
