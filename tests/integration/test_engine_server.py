"""The embedded generation server over real HTTP on loopback: protocol conformance, batching,
pause/continue, abort, and the rollout client against it. One server for the whole module."""

import asyncio

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_like.engine.client import GenerationClient
from areal_like.learner.logprobs import token_logprobs_from_logits

pytestmark = pytest.mark.integration

API, ADMIN = "user-key", "admin-key"
USER_H = {"Authorization": f"Bearer {API}"}
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
EOS = 2  # the char tokenizer's <eos>


@pytest.fixture(scope="module")
def server(engine_servers, tiny_model_dir):
    (srv,) = engine_servers(tiny_model_dir, 1, "--api-key", API, "--admin-api-key", ADMIN, "--max-context-len", "512")
    return srv


@pytest.fixture(scope="module")
def local_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


async def post(url, path, body, headers=USER_H, timeout=60):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.json(content_type=None)


async def get(url, path, headers=USER_H):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path, headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, await r.text()


async def wait_running(url, n=1, timeout=20.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        _, body = await get(url, "/v1/loads")
        if __import__("json").loads(body)["num_running_reqs"] >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("request never started running")


async def generated_tokens(url) -> float:
    """The server's own count of tokens decoded so far (its Prometheus counter)."""
    _, body = await get(url, "/metrics", headers={})
    line = next(ln for ln in body.splitlines() if ln.startswith("areal_like_generated_tokens_total "))
    return float(line.split()[1])


async def wait_decoding(url, since: float, timeout=20.0):
    """Return once the server decoded a token past `since`: a running request has partial output
    (admission alone does not mean a token yet, and a loaded machine can sit between the two)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if await generated_tokens(url) > since:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the running request never decoded a token")


def long_req(rid, n=400):
    return {"input_ids": [5, 6, 7], "rid": rid, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}


async def test_status_endpoints(server):
    url = server.url
    assert (await get(url, "/health", headers={}))[0] == 200
    assert (await get(url, "/health_generate", headers={}))[0] == 200
    for path in ("/model_info", "/get_model_info"):
        st, body = await get(url, path)
        info = __import__("json").loads(body)
        assert st == 200 and info["weight_version"] == "0" and info["is_generation"] is True
    st, body = await get(url, "/server_info")
    assert st == 200 and API not in body and ADMIN not in body and '"context_length": 512' in body
    assert (await get(url, "/v1/loads"))[0] == 200
    st, text = await get(url, "/metrics", headers={})
    assert st == 200 and "areal_like_generated_tokens_total" in text and "areal_like_server_weight_version" in text


async def test_auth(server):
    assert (await get(server.url, "/model_info", headers={}))[0] == 401
    st, body = await post(server.url, "/pause_generation", {}, headers=USER_H)  # user key is not admin
    assert st == 401 and body == {"error": {"message": "Unauthorized"}}


async def test_generate_reply_shape_and_logprobs(server, local_model):
    prompt = [10, 11, 12, 13]
    st, r = await post(server.url, "/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                                 "sampling_params": {"max_new_tokens": 12, "temperature": 0.8}})
    assert st == 200
    meta = r["meta_info"]
    assert set(meta) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens",
                         "weight_version", "e2e_latency", "output_token_logprobs", "input_token_logprobs"}
    out = r["output_ids"]
    assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == len(out) and isinstance(r["text"], str)
    assert [t[1] for t in meta["output_token_logprobs"]] == out
    assert all(t[2] is None for t in meta["output_token_logprobs"])
    fr = meta["finish_reason"]
    assert fr == {"type": "length", "length": 12} or (fr["type"] == "stop" and fr["matched"] == EOS == out[-1])
    # the server's logprobs follow the one shared definition (temperature-scaled, full vocab)
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = local_model(input_ids=ids).logits
    ref_out = token_logprobs_from_logits(logits[:, len(prompt) - 1:-1], ids[:, len(prompt):], 0.8)[0]
    got = torch.tensor([t[0] for t in meta["output_token_logprobs"]])
    assert (ref_out - got).abs().max() < 1e-4
    ref_in = token_logprobs_from_logits(logits[:, :len(prompt) - 1], ids[:, 1:len(prompt)], 1.0)[0]
    inp = meta["input_token_logprobs"]
    assert inp[0][0] is None and [t[1] for t in inp] == prompt
    assert (torch.tensor([t[0] for t in inp[1:]]) - ref_in).abs().max() < 1e-4


async def test_text_prompt_and_batch_and_n(server, tiny_model_dir):
    from transformers import AutoTokenizer

    n_tok = len(AutoTokenizer.from_pretrained(tiny_model_dir).encode("hi there", add_special_tokens=False))
    st, r = await post(server.url, "/generate", {"text": "hi there", "sampling_params": {"max_new_tokens": 3}})
    assert st == 200 and r["meta_info"]["prompt_tokens"] == n_tok
    st, r = await post(server.url, "/generate", {"input_ids": [[5, 6], [7, 8, 9]], "rid": "bt",
                                                 "sampling_params": {"max_new_tokens": 3}})
    assert st == 200 and isinstance(r, list) and [x["meta_info"]["id"] for x in r] == ["bt_0", "bt_1"]
    assert [x["meta_info"]["prompt_tokens"] for x in r] == [2, 3]
    st, r = await post(server.url, "/generate", {"input_ids": [5, 6], "rid": "nn",
                                                 "sampling_params": {"max_new_tokens": 6, "n": 3, "ignore_eos": True,
                                                                     "sampling_seed": 1}})
    assert st == 200 and isinstance(r, list) and len(r) == 3
    assert [x["meta_info"]["id"] for x in r] == ["nn_0", "nn_1", "nn_2"]
    assert len({tuple(x["output_ids"]) for x in r}) > 1  # each sample draws its own stream


async def test_error_cases(server):
    url = server.url
    cases = [
        {"input_ids": []},
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "bogus": 1}},
        {"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 100}},
        {"input_ids": [1] * 600},
        {"input_ids": [1], "text": "x"},
        {"input_ids": [1], "sampling_params": {"top_p": 0}},
        {"input_ids": [1], "sampling_params": {"regex": "a+"}},
        {"input_ids": [1], "sampling_params": {"frequency_penalty": 3.0}},
        {"input_ids": [1], "top_logprobs_num": -1, "return_logprob": True},
        {"input_ids": [100000]},
    ]
    for body in cases:
        st, r = await post(url, "/generate", body)
        assert st == 400, body
        assert set(r) == {"error"} and isinstance(r["error"]["message"], str) and r["error"]["message"]
    st, r = await post(url, "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 600}})
    assert "context length" in r["error"]["message"]
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/generate", data=b"{nope", headers=USER_H) as resp:
            assert resp.status == 400 and "error" in await resp.json()


async def test_duplicate_rid(server):
    task = asyncio.ensure_future(post(server.url, "/generate", long_req("dup-1")))
    await wait_running(server.url)
    st, r = await post(server.url, "/generate", {"input_ids": [1], "rid": "dup-1"})
    assert st == 400 and "Duplicate request ID" in r["error"]["message"]
    st, _ = await post(server.url, "/abort_request", {"rid": "dup-1"}, headers=ADMIN_H)
    assert st == 200
    st, r = await task
    assert st == 200 and r["meta_info"]["finish_reason"]["type"] == "abort"


async def test_seeded_and_greedy_determinism(server, local_model):
    sp = {"max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 1234, "temperature": 1.0}
    a = (await post(server.url, "/generate", {"input_ids": [3, 4, 5], "sampling_params": sp}))[1]
    b = (await post(server.url, "/generate", {"input_ids": [3, 4, 5], "sampling_params": sp}))[1]
    c = (await post(server.url, "/generate", {"input_ids": [3, 4, 5], "sampling_params": {**sp, "sampling_seed": 99}}))[1]
    assert a["output_ids"] == b["output_ids"] and a["output_ids"] != c["output_ids"]
    g = {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0.0}
    x = (await post(server.url, "/generate", {"input_ids": [3, 4, 5], "sampling_params": g}))[1]
    y = (await post(server.url, "/generate", {"input_ids": [3, 4, 5], "sampling_params": g}))[1]
    assert x["output_ids"] == y["output_ids"]
    ids = [3, 4, 5]
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(local_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert x["output_ids"] == ids[3:]


async def test_stop_token_ids(server):
    g = {"max_new_tokens": 10, "ignore_eos": True, "temperature": 0.0}
    free = (await post(server.url, "/generate", {"input_ids": [3, 4, 5], "sampling_params": g}))[1]["output_ids"]
    stop = free[3]
    r = (await post(server.url, "/generate", {"input_ids": [3, 4, 5],
                                              "sampling_params": {**g, "stop_token_ids": [stop]}}))[1]
    k = free.index(stop)
    assert r["output_ids"] == free[:k + 1]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


async def test_concurrent_requests_are_batched(server):
    bodies = [{"input_ids": [5 + i, 6], "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
              for i in range(8)]
    replies = await asyncio.gather(*(post(server.url, "/generate", b) for b in bodies))
    assert all(st == 200 and len(r["output_ids"]) == 48 for st, r in replies)
    _, body = await get(server.url, "/v1/loads")
    assert __import__("json").loads(body)["max_running_requests_seen"] > 1


async def test_pause_abort_then_continue(server):
    url = server.url
    before = await generated_tokens(url)
    task = asyncio.ensure_future(post(url, "/generate", long_req("long-1")))
    await wait_running(url)
    await wait_decoding(url, before)
    try:
        await _pause_abort_then_continue(url, task)
    finally:  # a failed assertion must not leave the module's server paused for the tests after it
        await post(url, "/continue_generation", {}, headers=ADMIN_H)


async def _pause_abort_then_continue(url, task):
    st, r = await post(url, "/pause_generation", {"mode": "abort"}, headers=ADMIN_H)
    assert st == 200 and r["success"]
    st, r = await task  # returned by the time pause returned: 200 + abort + partial output
    assert task.done() and st == 200
    assert r["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(r["output_ids"]) < 400 and len(r["meta_info"]["output_token_logprobs"]) == len(r["output_ids"])
    # a request sent while paused waits…
    waiting = asyncio.ensure_future(post(url, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 4}}))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    _, loads = await get(url, "/v1/loads")
    assert __import__("json").loads(loads)["num_waiting_reqs"] == 1
    assert (await get(url, "/health", headers={}))[0] == 200  # paused is alive
    # …and completes after continue
    st, _ = await post(url, "/continue_generation", {}, headers=ADMIN_H)
    assert st == 200
    st, r = await asyncio.wait_for(waiting, 30)
    assert st == 200 and r["meta_info"]["finish_reason"]["type"] in ("length", "stop")


async def test_pause_retract_keeps_the_request(server):
    url = server.url
    task = asyncio.ensure_future(post(url, "/generate", long_req("retract-1", n=200)))
    await wait_running(url)
    try:
        assert (await post(url, "/pause_generation", {"mode": "retract"}, headers=ADMIN_H))[0] == 200
        await asyncio.sleep(0.2)
        assert not task.done()
    finally:
        await post(url, "/continue_generation", {}, headers=ADMIN_H)
    st, r = await asyncio.wait_for(task, 60)
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 200} and len(r["output_ids"]) == 200


async def test_abort_by_rid_prefix_and_flush(server):
    url = server.url
    tasks = [asyncio.ensure_future(post(url, "/generate", long_req(f"grp_{i}"))) for i in range(2)]
    other = asyncio.ensure_future(post(url, "/generate", long_req("other", n=60)))
    await wait_running(url, 3)
    st, r = await post(url, "/flush_cache", {}, headers=ADMIN_H)
    assert st == 400 and "error" in r
    st, r = await post(url, "/abort_request", {"rid": "grp"}, headers=ADMIN_H)
    assert st == 200 and r["num_aborted"] == 2
    for t in tasks:
        assert (await t)[1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await other)[1]["meta_info"]["finish_reason"]["type"] == "length"
    st, r = await post(url, "/flush_cache", {}, headers=ADMIN_H)
    assert st == 200 and r["success"]


async def test_client_against_server(server):
    async with GenerationClient([server.url], api_key=API, request_timeout_s=60) as client:
        await client.wait_healthy(30)
        assert await client.health(server.url)
        assert (await client.model_info(server.url))["weight_version"] == "0"
        res = await client.generate([5, 6, 7], max_new_tokens=20, ignore_eos=True, sampling_seed=3, key="g")
        assert res.finish_reason == "length" and len(res.output_ids) == 20 == len(res.output_logprobs)
        assert res.output_versions == [0] * 20 and res.server == server.url and res.num_interruptions == 0
        res2 = await client.generate([5, 6, 7], max_new_tokens=20, ignore_eos=True, sampling_seed=3, key="g")
        assert res2.output_ids == res.output_ids


async def test_flush_while_paused_with_held_requests(server):
    """The weight push flushes once while paused (issue 23): requests that arrived during the pause
    are held, not running (SGLang holds them in its tokenizer), so the flush is accepted."""
    url = server.url
    st, _ = await post(url, "/pause_generation", {"mode": "abort"}, headers=ADMIN_H)
    assert st == 200
    held = asyncio.ensure_future(post(url, "/generate", long_req("held", n=5)))
    await asyncio.sleep(0.2)  # let it arrive (held: the pause keeps it from the scheduler)
    assert not held.done()
    st, r = await post(url, "/flush_cache", {}, headers=ADMIN_H)
    assert st == 200 and r["success"], r
    await post(url, "/continue_generation", {}, headers=ADMIN_H)
    st, r = await asyncio.wait_for(held, 60)
    assert st == 200 and len(r["output_ids"]) == 5
