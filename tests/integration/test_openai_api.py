"""OpenAI-compatible endpoints of the embedded server: raw HTTP shapes, streaming chunks, token ids
and logprobs, errors; then the same through the `openai` package when it is installed."""

import json

import aiohttp
import pytest

pytestmark = pytest.mark.integration

API = "user-key"
H = {"Authorization": f"Bearer {API}"}


@pytest.fixture(scope="module")
def server(engine_servers, tiny_model_dir):
    (srv,) = engine_servers(tiny_model_dir, 1, "--api-key", API, "--served-model-name", "tiny",
                            "--max-context-len", "256")
    return srv


async def post(url, path, body, headers=H):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.json(content_type=None)


async def sse(url, path, body):
    out = []
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json={**body, "stream": True}, headers=H,
                          timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    out.append("DONE" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


async def test_models(server):
    async with aiohttp.ClientSession() as s:
        async with s.get(server.url + "/v1/models", headers=H) as r:
            body = await r.json()
    assert r.status == 200 and body["object"] == "list" and body["data"][0]["id"] == "tiny"
    assert body["data"][0]["max_model_len"] == 256


async def test_completions_shape_logprobs_and_token_ids(server, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    st, r = await post(server.url, "/v1/completions", {
        "model": "tiny", "prompt": "ab", "max_tokens": 7, "temperature": 0.7, "seed": 5, "logprobs": 2,
        "ignore_eos": True, "return_token_ids": True})
    assert st == 200, r
    assert r["object"] == "text_completion" and r["id"].startswith("cmpl-") and r["model"] == "tiny"
    (c,) = r["choices"]
    assert c["index"] == 0 and c["finish_reason"] == "length" and len(c["token_ids"]) == 7
    assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True)
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 7
    assert all(len(t) <= 2 for t in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert r["prompt_token_ids"] == tok.encode("ab", add_special_tokens=False)
    assert r["usage"] == {"prompt_tokens": 2, "completion_tokens": 7, "total_tokens": 9}
    # the same request through the native endpoint draws the same tokens and logprobs
    st, nat = await post(server.url, "/generate", {"input_ids": r["prompt_token_ids"], "return_logprob": True,
                                                   "sampling_params": {"max_new_tokens": 7, "temperature": 0.7,
                                                                       "sampling_seed": 5, "ignore_eos": True}})
    assert nat["output_ids"] == c["token_ids"]
    assert [t[0] for t in nat["meta_info"]["output_token_logprobs"]] == pytest.approx(lp["token_logprobs"], abs=1e-6)


async def test_completions_batch_n_and_stop(server):
    st, r = await post(server.url, "/v1/completions", {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 5, "seed": 1,
                                                       "ignore_eos": True})
    assert st == 200 and [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["choices"][0]["text"] != r["choices"][1]["text"] or r["choices"][0]["text"] == ""
    st, free = await post(server.url, "/v1/completions", {"prompt": "xy", "max_tokens": 20, "temperature": 0,
                                                          "ignore_eos": True})
    text = free["choices"][0]["text"]
    stop = text[5:7]
    st, r = await post(server.url, "/v1/completions", {"prompt": "xy", "max_tokens": 20, "temperature": 0,
                                                       "ignore_eos": True, "stop": [stop]})
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["matched_stop"] == stop and c["text"] == text[:text.index(stop)]


async def test_chat_completion_and_logprobs(server, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}]
    st, r = await post(server.url, "/v1/chat/completions", {
        "model": "tiny", "messages": msgs, "max_tokens": 6, "logprobs": True, "top_logprobs": 3, "seed": 2,
        "return_token_ids": True, "ignore_eos": True})
    assert st == 200, r
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    c = r["choices"][0]
    assert c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str)
    content = c["logprobs"]["content"]
    assert len(content) == 6 == len(c["token_ids"])
    for e, tid in zip(content, c["token_ids"]):
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 3
        assert e["token"] == tok.decode([tid]) and e["logprob"] <= e["top_logprobs"][0]["logprob"] + 1e-6
    prompt = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
                                     tokenize=False, add_generation_prompt=True)
    assert r["prompt_token_ids"] == tok.encode(prompt, add_special_tokens=False)
    st, r = await post(server.url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "logprobs": True,
                                                            "return_tokens_as_token_ids": True})
    assert all(e["token"].startswith("token_id:") for e in r["choices"][0]["logprobs"]["content"])


async def test_streaming_chunks_match_the_full_reply(server):
    body = {"prompt": "hello", "max_tokens": 12, "temperature": 0.9, "seed": 4, "ignore_eos": True, "logprobs": 1,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    st, full = await post(server.url, "/v1/completions", body)
    chunks = await sse(server.url, "/v1/completions", body)
    assert chunks[-1] == "DONE"
    assert chunks[-2]["usage"]["completion_tokens"] == 12 and chunks[-2]["choices"] == []
    parts = chunks[:-2]
    assert all(p["choices"][0]["finish_reason"] is None for p in parts[:-1])
    assert parts[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(p["choices"][0]["text"] for p in parts) == full["choices"][0]["text"]
    assert sum((p["choices"][0]["token_ids"] for p in parts), []) == full["choices"][0]["token_ids"]
    lps = sum((p["choices"][0]["logprobs"]["token_logprobs"] for p in parts), [])
    assert lps == pytest.approx(full["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6)
    # chat: role first, then content deltas
    chat = await sse(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 5, "seed": 1, "ignore_eos": True})
    assert chat[-1] == "DONE" and chat[0]["object"] == "chat.completion.chunk"
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chat[-2]["choices"][0]["finish_reason"] == "length"


async def test_stream_holds_back_a_partial_stop_string(server):
    st, free = await post(server.url, "/v1/completions", {"prompt": "qq", "max_tokens": 20, "temperature": 0,
                                                          "ignore_eos": True})
    text = free["choices"][0]["text"]
    stop = text[8:11]
    chunks = await sse(server.url, "/v1/completions", {"prompt": "qq", "max_tokens": 20, "temperature": 0,
                                                       "ignore_eos": True, "stop": stop})
    streamed = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert streamed == text[:text.index(stop)] and chunks[-2]["choices"][0]["finish_reason"] == "stop"


async def test_openai_errors(server):
    for path, body in (("/v1/completions", {"prompt": "a", "echo": True}),
                       ("/v1/completions", {"prompt": ""}),
                       ("/v1/completions", {"prompt": "a", "max_tokens": 1000}),
                       ("/v1/completions", {"prompt": "a", "logprobs": 50}),
                       ("/v1/chat/completions", {"messages": []}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                 "tools": [{"type": "function"}]})):
        st, r = await post(server.url, path, body)
        assert st == 400, body
        assert r["error"]["code"] == 400 and r["error"]["type"] == "BadRequestError" and r["error"]["message"]
    st, r = await post(server.url, "/v1/completions", {"prompt": "a"}, headers={})
    assert st == 401 and r["error"]["code"] == 401


async def test_openai_package(server):
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API, timeout=60, max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        c = await client.completions.create(model="tiny", prompt="ab", max_tokens=5, logprobs=2, seed=3,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
        assert c.choices[0].finish_reason == "length" and len(c.choices[0].logprobs.token_logprobs) == 5
        assert len(c.choices[0].model_extra["token_ids"]) == 5 and c.usage.completion_tokens == 5
        r = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, logprobs=True, top_logprobs=2, n=2, seed=9,
                                                 extra_body={"ignore_eos": True})
        assert len(r.choices) == 2 and all(len(ch.logprobs.content) == 4 for ch in r.choices)
        assert all(len(e.top_logprobs) == 2 for e in r.choices[0].logprobs.content)
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=6, stream=True, seed=9,
                                                      extra_body={"ignore_eos": True})
        pieces, finish = [], None
        async for chunk in stream:
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        full = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=6, seed=9, extra_body={"ignore_eos": True})
        assert "".join(pieces) == full.choices[0].message.content and finish == "length"
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="tiny", prompt="a", max_tokens=10_000)
    finally:
        await client.close()
