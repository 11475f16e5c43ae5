"""PROTOCOL.md conformance of the embedded server, part 2: streaming, stop strings, min_new_tokens,
input/top logprobs, penalties, pause modes, abort, loads/server_info, the key matrix and the 400s.
(test_engine_server.py covers the basic reply shape, batching, pause abort/retract and the client.)"""

import asyncio
import json
import re

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_like.learner.logprobs import token_logprobs_from_logits

pytestmark = pytest.mark.integration

API, ADMIN = "user-key", "admin-key"
USER_H = {"Authorization": f"Bearer {API}"}
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
GREEDY = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(engine_servers, tiny_model_dir):
    (srv,) = engine_servers(tiny_model_dir, 1, "--api-key", API, "--admin-api-key", ADMIN, "--max-context-len", "256")
    return srv


@pytest.fixture(scope="module")
def local_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def call(method, url, path, body=None, headers=USER_H, timeout=60):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, json=body, headers=headers,
                             timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.json(content_type=None)


async def gen(url, body, headers=USER_H):
    st, r = await call("POST", url, "/generate", body, headers)
    assert st == 200, r
    return r


async def stream(url, body, headers=USER_H):
    """All SSE events of a streaming /generate, [DONE] as the string 'DONE'."""
    events = []
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/generate", json={**body, "stream": True}, headers=headers,
                          timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append("DONE" if data == "[DONE]" else json.loads(data))
    return events


async def wait_running(url, n=1, timeout=20.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if (await call("GET", url, "/v1/loads"))[1]["num_running_reqs"] >= n:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("request never started running")


async def test_stream_cumulative_events_then_done(server):
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "sampling_params": {**GREEDY, "max_new_tokens": 12}}
    full = await gen(server.url, body)
    events = await stream(server.url, body)
    assert events[-1] == "DONE" and len(events) >= 3
    evs = events[:-1]
    assert all(e["meta_info"]["finish_reason"] is None for e in evs[:-1])
    assert evs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    lens = [len(e["output_ids"]) for e in evs]
    assert lens == sorted(lens) and lens[-1] == 12
    for e in evs:  # cumulative: every event is a prefix of the final output, logprobs aligned
        k = len(e["output_ids"])
        assert e["output_ids"] == full["output_ids"][:k] and len(e["meta_info"]["output_token_logprobs"]) == k
    assert evs[-1]["text"] == full["text"]


async def test_stream_n_samples_carry_index_and_stream_interval(server):
    body = {"input_ids": [5, 6], "rid": "sn", "sampling_params": {"max_new_tokens": 9, "n": 2, "ignore_eos": True,
                                                                  "sampling_seed": 3, "stream_interval": 4}}
    events = await stream(server.url, body)
    assert events[-1] == "DONE"
    finals = [e for e in events[:-1] if e["meta_info"]["finish_reason"] is not None]
    assert sorted(e["index"] for e in finals) == [0, 1]
    assert {e["meta_info"]["id"] for e in finals} == {"sn_0", "sn_1"}
    partial = [len(e["output_ids"]) for e in events[:-1] if e["meta_info"]["finish_reason"] is None]
    assert all(n % 4 == 0 for n in partial)  # one event per stream_interval tokens


async def test_stream_abort_ends_with_abort_event(server):
    body = {"input_ids": [5], "rid": "sab", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    task = asyncio.ensure_future(stream(server.url, body))
    await wait_running(server.url)
    await call("POST", server.url, "/abort_request", {"rid": "sab"}, ADMIN_H)
    events = await task
    assert events[-1] == "DONE" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"


async def test_stop_strings_trim_unless_no_stop_trim(server, tok):
    free = await gen(server.url, {"input_ids": [8, 9], "sampling_params": GREEDY})
    text = free["text"]
    stop = text[6:8]
    k = text.index(stop)  # the earliest occurrence is where generation stops
    r = await gen(server.url, {"input_ids": [8, 9], "sampling_params": {**GREEDY, "stop": stop}})
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert r["text"] == text[:k]
    # ids keep the tokens of the stop string
    assert tok.decode(r["output_ids"], skip_special_tokens=True) == text[:k + len(stop)]
    r2 = await gen(server.url, {"input_ids": [8, 9], "sampling_params": {**GREEDY, "stop": ["@@", stop],
                                                                         "no_stop_trim": True}})
    assert r2["text"] == text[:k + len(stop)] and r2["meta_info"]["finish_reason"]["matched"] == stop
    # a stop string is not matched before min_new_tokens
    r3 = await gen(server.url, {"input_ids": [8, 9], "sampling_params": {**GREEDY, "stop": stop,
                                                                         "min_new_tokens": k + len(stop) + 1}})
    assert len(r3["output_ids"]) > k + len(stop)


async def test_min_new_tokens_masks_eos_and_stop_ids(server):
    free = await gen(server.url, {"input_ids": [3, 4], "sampling_params": GREEDY})
    first = free["output_ids"][0]
    r = await gen(server.url, {"input_ids": [3, 4], "sampling_params": {**GREEDY, "stop_token_ids": [first],
                                                                        "min_new_tokens": 5}})
    assert first not in r["output_ids"][:4]
    fr = r["meta_info"]["finish_reason"]
    assert fr["type"] == "length" or (fr == {"type": "stop", "matched": first} and len(r["output_ids"]) >= 5)


async def test_input_logprobs_from_start_and_top_logprobs(server, local_model):
    prompt = [10, 11, 12, 13, 14]
    r = await gen(server.url, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                               "top_logprobs_num": 3, "return_text_in_logprobs": True,
                               "sampling_params": {"max_new_tokens": 6, "temperature": 0.5, "ignore_eos": True}})
    m = r["meta_info"]
    inp, out = m["input_token_logprobs"], m["output_token_logprobs"]
    assert inp[0][0] is None and inp[0][1] == prompt[0] and [t[1] for t in inp] == prompt
    assert all(isinstance(t[2], str) and t[2] for t in inp + out)  # return_text_in_logprobs
    with torch.no_grad():
        logits = local_model(input_ids=torch.tensor([prompt])).logits
    ref = token_logprobs_from_logits(logits[:, :-1], torch.tensor([prompt[1:]]), 1.0)[0]  # NOT temperature-scaled
    assert (torch.tensor([t[0] for t in inp[1:]]) - ref).abs().max() < 1e-4
    # top logprobs: k triples per token, descending, for output and input (first input entry None)
    tops = m["output_top_logprobs"]
    assert len(tops) == 6 and all(len(t) == 3 for t in tops)
    for (lp, tid, _), top in zip(out, tops):
        vals = [x[0] for x in top]
        assert vals == sorted(vals, reverse=True) and lp <= vals[0] + 1e-6
        if tid in [x[1] for x in top]:
            assert abs(dict((x[1], x[0]) for x in top)[tid] - lp) < 1e-5
    itop = m["input_top_logprobs"]
    assert itop[0] is None and len(itop) == len(prompt) and all(len(t) == 3 for t in itop[1:])
    # logprob_start_len cuts the input list
    r2 = await gen(server.url, {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 2,
                                "sampling_params": {"max_new_tokens": 1}})
    inp2 = r2["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in inp2] == prompt[2:] and abs(inp2[0][0] - float(ref[1])) < 1e-4
    assert "input_top_logprobs" not in r2["meta_info"] and "output_top_logprobs" not in r2["meta_info"]


async def test_a_teachers_batched_scoring_is_the_models_logprobs_from_each_start(server, local_model):
    """On-policy distillation's request (issue 43 item 4, `GenerationClient.score`): a batch of sequences, each
    with its own `logprob_start_len` (SGLang's list form) and no new token → each sequence's logprobs of its
    tokens from its start, the model's own (not temperature-scaled)."""
    from areal_like.engine.client import GenerationClient

    seqs, starts = [[10, 11, 12, 13, 14], [20, 21, 22], [5, 6, 7, 8]], [2, 1, 3]
    async with GenerationClient([server.url], api_key=API) as client:
        got = await client.score(seqs, starts, key="g")
    for ids, st, lps in zip(seqs, starts, got):
        with torch.no_grad():
            logits = local_model(input_ids=torch.tensor([ids])).logits
        ref = token_logprobs_from_logits(logits[:, :-1], torch.tensor([ids[1:]]), 1.0)[0][st - 1:]
        assert len(lps) == len(ids) - st and (torch.tensor(lps) - ref).abs().max() < 1e-4
    bad = await call("POST", server.url, "/generate", {"input_ids": seqs, "return_logprob": True,
                                                      "logprob_start_len": [1, 1],
                                                      "sampling_params": {"max_new_tokens": 0}})
    assert bad[0] == 400 and "'logprob_start_len' list has 2 entries for 3 prompts" in json.dumps(bad[1])


async def test_penalties_change_greedy_output(server):
    base = await gen(server.url, {"input_ids": [5, 6], "sampling_params": {**GREEDY, "max_new_tokens": 30}})
    ids = base["output_ids"]
    assert len(set(ids)) < len(ids)  # the random tiny model repeats itself
    r = await gen(server.url, {"input_ids": [5, 6], "sampling_params": {**GREEDY, "max_new_tokens": 30,
                                                                        "presence_penalty": 2.0,
                                                                        "frequency_penalty": 2.0}})
    assert r["output_ids"] != ids
    r = await gen(server.url, {"input_ids": [5, 6], "sampling_params": {**GREEDY, "max_new_tokens": 30,
                                                                        "repetition_penalty": 2.0}})
    assert r["output_ids"] != ids


async def test_n_samples_share_the_prompt_prefill(server):
    r = await gen(server.url, {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "n": 4,
                                                                              "sampling_seed": 11}})
    assert len(r) == 4 and sorted(x["meta_info"]["cached_tokens"] for x in r) == [0, 4, 4, 4]
    again = await gen(server.url, {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 8, "n": 4,
                                                                                  "sampling_seed": 11}})
    assert [x["output_ids"] for x in again] == [x["output_ids"] for x in r]  # per-sample seeds are reproducible


async def test_pause_in_place_keeps_rows_and_flush_refuses_while_busy(server):
    url = server.url
    body = {"input_ids": [5, 6], "rid": "inplace", "sampling_params": {"max_new_tokens": 150, "ignore_eos": True}}
    task = asyncio.ensure_future(gen(url, body))
    await wait_running(url)
    assert (await call("POST", url, "/pause_generation", {"mode": "in_place"}, ADMIN_H))[0] == 200
    _, loads = await call("GET", url, "/v1/loads")
    assert loads["num_running_reqs"] == 1 and loads["paused"] is True
    st, r = await call("POST", url, "/flush_cache", {}, ADMIN_H)
    assert st == 400 and "error" in r
    assert not task.done()
    assert (await call("POST", url, "/continue_generation", {}, ADMIN_H))[0] == 200
    r = await asyncio.wait_for(task, 60)
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 150}
    st, r = await call("POST", url, "/pause_generation", {"mode": "sideways"}, ADMIN_H)
    assert st == 400


async def test_abort_all_and_loads_and_server_info(server):
    url = server.url
    tasks = [asyncio.ensure_future(gen(url, {"input_ids": [5 + i], "sampling_params": {"max_new_tokens": 200,
                                                                                       "ignore_eos": True}}))
             for i in range(3)]
    await wait_running(url, 3)
    _, loads = await call("GET", url, "/v1/loads")
    assert loads["num_running_reqs"] == 3 and {"num_waiting_reqs", "loads", "timestamp"} <= set(loads)
    # SGLang's ADMIN_OPTIONAL level: with both keys set, the api key is not enough (issue 24)
    assert (await call("POST", url, "/abort_request", {"abort_all": True}))[0] == 401
    st, r = await call("POST", url, "/abort_request", {"abort_all": True}, ADMIN_H)
    assert st == 200 and r["num_aborted"] == 3
    for t in tasks:
        assert (await t)["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await call("POST", url, "/abort_request", {}, ADMIN_H))[0] == 400
    st, info = await call("GET", url, "/server_info")
    assert st == 200 and info["context_length"] == 256 and info["max_running_requests"] == 64
    assert "api_key" not in info and "admin_api_key" not in info and "version" in info
    r = await gen(url, {"input_ids": [5], "sampling_params": {"max_new_tokens": 0}})
    assert r["output_ids"] == [] and r["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


async def test_key_matrix(server, tmp_path):
    url = server.url
    for path in ("/health", "/health_generate", "/metrics"):  # open
        async with aiohttp.ClientSession() as s:
            async with s.get(url + path) as r:
                assert r.status == 200, path
    gen_body = {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}
    assert (await call("POST", url, "/generate", gen_body, headers={}))[0] == 401
    assert (await call("POST", url, "/generate", gen_body, headers={"Authorization": "Bearer nope"}))[0] == 401
    assert (await call("POST", url, "/generate", gen_body, ADMIN_H))[0] == 200  # admin key also serves
    for path, body in (("/pause_generation", {}), ("/continue_generation", {}), ("/flush_cache", {}),
                       ("/update_weights_from_disk", {"model_path": str(tmp_path)}),
                       ("/init_weights_update_group", {}), ("/update_weights_from_distributed", {}),
                       ("/destroy_weights_update_group", {})):
        st, r = await call("POST", url, path, body, USER_H)
        assert st == 401 and r == {"error": {"message": "Unauthorized"}}, path
    for path in ("/model_info", "/server_info", "/v1/loads"):
        assert (await call("GET", url, path, headers={}))[0] == 401
        assert (await call("GET", url, path, headers=USER_H))[0] == 200


async def test_more_400s(server):
    url = server.url
    task = asyncio.ensure_future(gen(url, {"input_ids": [5], "rid": "busy",
                                           "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}))
    await wait_running(url)
    cases = [
        ({"input_ids": [[1], [2]], "rid": ["same", "same"]}, "Duplicate request ID"),
        ({"input_ids": [1], "rid": "busy_0"}, None),  # a different rid is fine…
        ({"input_ids": [1], "rid": "busy"}, "Duplicate request ID"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "n": 2}, "rid": "busy"}, None),  # busy_0/busy_1
        ({"input_ids": [1] * 256}, "context length"),
        ({"input_ids": [1] * 200, "sampling_params": {"max_new_tokens": 57}}, "context length"),
        ({"input_ids": [1], "sampling_params": {"temprature": 1.0}}, "unknown sampling_params"),
        ({"input_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"input_ids": [1], "sampling_params": {"stop": [1]}}, "stop"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [10 ** 6]}}, "stop_token_ids"),
        ({"input_ids": [1], "sampling_params": {"min_p": 2}}, "min_p"),
        ({"text": 5}, "text"),
    ]
    for body, msg in cases:
        st, r = await call("POST", url, "/generate", body)
        if msg is None:
            assert st == 200, (body, r)
        else:
            assert st == 400 and msg in r["error"]["message"], (body, r)
    await call("POST", url, "/abort_request", {"rid": "busy"}, ADMIN_H)
    await task


async def test_stream_client_disconnect_aborts_the_request(server):
    async def aborts():
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/metrics") as r:
                pat = r'^areal_like_generate_requests_total{finish_reason="abort"} (\S+)$'
                m = re.search(pat, await r.text(), re.M)
        return float(m.group(1)) if m else 0.0

    before = await aborts()
    body = {"input_ids": [5], "stream": True, "sampling_params": {"max_new_tokens": 250, "ignore_eos": True}}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.url + "/generate", json=body, headers=USER_H) as r:
            await r.content.readline()  # the first event arrived: the request runs
    # the connection is closed: the server notices on its next write and aborts the request
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while (await call("GET", server.url, "/v1/loads"))[1]["num_running_reqs"] and loop.time() < deadline:
        await asyncio.sleep(0.02)
    assert await aborts() == before + 1  # aborted, not run to its length
