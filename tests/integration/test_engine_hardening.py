"""A hardened embedded server (issue 11, item 4), over real HTTP on loopback.

One request must not take the server down: a huge `n`, a 10 MB body and a client that disconnects
leave /health answering within a second (measured with a generous 2 s bound: a liveness check, not
a benchmark); NaN sampling parameters, boolean token ids and unknown fields are 400s naming the
field; the limits are configurable and answer 400 / 413 / 429 in SGLang's error shape; admin
endpoints refuse callers without the admin key while the weight pusher (with it) works; the
weight-sync TCPStore and every socket the server listens on are bound to loopback only."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import time

import aiohttp
import pytest
import torch

from conftest import free_port

pytestmark = pytest.mark.integration

HEALTH_BOUND_S = 2.0  # "answers within a second", with slack for a shared 2-core CI box
ADMIN = "hardening-admin-key-0123456789"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the pusher's rank 0 lives in this test process


@pytest.fixture(scope="module")
def server(engine_servers, tiny_model_dir):
    """Default limits; a long context so a request runs long enough to be disconnected. The admin key
    comes from the environment, as the launcher passes it (never in argv)."""
    os.environ["AREAL_LIKE_ADMIN_API_KEY"] = ADMIN
    try:
        (srv,) = engine_servers(tiny_model_dir, 1, "--max-context-len", "2048")
    finally:
        del os.environ["AREAL_LIKE_ADMIN_API_KEY"]
    return srv


@pytest.fixture(scope="module")
def small(engine_servers, tiny_model_dir):
    """Tight limits, to reach each of them."""
    (srv,) = engine_servers(tiny_model_dir, 1, "--admin-api-key", ADMIN, "--max-n", "8", "--max-new-tokens-limit",
                            "32", "--max-prompt-len", "16", "--max-queued-tokens", "200",
                            "--max-request-bytes", "4096")
    return srv


async def call(method, url, path, body=None, headers=None, timeout=60, data=None):
    async with aiohttp.ClientSession() as s:
        kw = {"data": data} if data is not None else {"json": body}
        async with s.request(method, url + path, headers=headers or {}, timeout=aiohttp.ClientTimeout(total=timeout),
                             **kw) as r:
            return r.status, await r.json(content_type=None)


async def raw_post(url, path, text: str, timeout=60):
    """POST a body we spell ourselves (NaN and Infinity are what Python's json.dumps writes)."""
    return await call("POST", url, path, data=text.encode(), headers={"Content-Type": "application/json"},
                      timeout=timeout)


async def health_latency(url) -> float:
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health", timeout=aiohttp.ClientTimeout(total=30)) as r:
            await r.read()
            assert r.status == 200
    return time.perf_counter() - t0


async def running(url) -> int:
    return (await call("GET", url, "/v1/loads"))[1]["num_running_reqs"]


async def wait_until(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} not reached within {timeout}s")


async def aborted(url) -> float:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            m = re.search(r'^areal_like_generate_requests_total{finish_reason="abort"} (\S+)$', await r.text(), re.M)
    return float(m.group(1)) if m else 0.0


def long_sp(n=1, tokens=1800):
    return {"max_new_tokens": tokens, "ignore_eos": True, "n": n}


# ---------------------------------------------------------------- one request must not stall /health
async def test_huge_n_is_refused_at_once_and_health_stays_fast(server):
    t0 = time.perf_counter()
    st, r = await call("POST", server.url, "/generate", {"input_ids": [5, 6], "sampling_params": {"n": 100_000}})
    assert st == 400 and set(r) == {"error"} and "sampling_params.n=100000" in r["error"]["message"]
    assert time.perf_counter() - t0 < HEALTH_BOUND_S
    assert await health_latency(server.url) < HEALTH_BOUND_S
    st, r = await call("POST", server.url, "/v1/completions", {"prompt": "ab", "n": 100_000})
    assert st == 400 and "n=100000" in r["error"]["message"] and r["error"]["code"] == 400

    # n at the limit fills the batch (128 samples > 64 rows): /health still answers from the next step
    task = asyncio.ensure_future(call("POST", server.url, "/generate", {
        "input_ids": [5, 6], "rid": "full", "sampling_params": {**long_sp(n=128, tokens=600)}}, timeout=300))
    try:
        await wait_until(lambda: _ge(running(server.url), 64), what="a full batch")
        assert max([await health_latency(server.url) for _ in range(3)]) < HEALTH_BOUND_S
    finally:
        await call("POST", server.url, "/abort_request", {"rid": "full"}, ADMIN_H)
        st, r = await task
    assert st == 200 and len(r) == 128 and {x["meta_info"]["finish_reason"]["type"] for x in r} == {"abort"}


async def _ge(coro, n):
    return (await coro) >= n


async def test_big_bodies_refused_without_blocking(server):
    async def during(coro):
        """(the call's reply, /health latencies measured while it was in flight)"""
        task = asyncio.ensure_future(coro)
        lat = []
        while not task.done() and len(lat) < 3:
            lat.append(await health_latency(server.url))
        return await task, lat + [await health_latency(server.url)]

    ten_mb = '{"text": "' + "a" * (10 << 20) + '"}'
    (st, r), lat = await during(raw_post(server.url, "/generate", ten_mb))
    assert st == 413 and "over the server's limit of 8388608 bytes" in r["error"]["message"]
    assert max(lat) < HEALTH_BOUND_S

    async def chunked():  # no Content-Length: aiohttp stops reading at the limit
        for _ in range(10):
            yield b"a" * (1 << 20)

    st, r = await call("POST", server.url, "/generate", data=chunked())
    assert st == 413 and "limit" in r["error"]["message"]

    # under the byte limit but far longer than any prompt: refused before it is tokenized
    six_mb = "a" * (6 << 20)
    (st, r), lat = await during(call("POST", server.url, "/generate", {"text": six_mb}))
    assert st == 400 and "'text' is 6291456 characters long" in r["error"]["message"]
    assert max(lat) < HEALTH_BOUND_S
    (st, r), lat = await during(call("POST", server.url, "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": six_mb}]}))
    assert st == 400 and "'messages'" in r["error"]["message"] and max(lat) < HEALTH_BOUND_S


@pytest.mark.parametrize("path,stream", [("/generate", False), ("/generate", True),
                                         ("/v1/completions", False), ("/v1/chat/completions", True)])
async def test_disconnected_client_is_aborted_and_its_rows_freed(server, path, stream):
    if path == "/generate":
        body = {"input_ids": [5, 6, 7], "sampling_params": long_sp(n=2), "stream": stream}
    elif path == "/v1/completions":
        body = {"prompt": "abc", "max_tokens": 1800, "ignore_eos": True, "n": 2, "stream": stream}
    else:
        body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 1800, "ignore_eos": True, "n": 2,
                "stream": stream}
    before = await aborted(server.url)

    async def client():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + path, json=body, timeout=aiohttp.ClientTimeout(total=300)) as r:
                assert r.status == 200
                if stream:
                    await r.content.readline()  # the first event arrived
                    await asyncio.sleep(3600)  # … then this client stops reading and goes away
                await r.read()

    task = asyncio.ensure_future(client())
    await wait_until(lambda: _ge(running(server.url), 2), what="the request running")
    task.cancel()  # closes the connection mid-request
    with pytest.raises(asyncio.CancelledError):
        await task
    t0 = time.perf_counter()
    await wait_until(lambda: _eq(running(server.url), 0), timeout=10, what="the rows freed")
    assert time.perf_counter() - t0 < 5.0  # long before 1800 tokens could have been generated
    assert await aborted(server.url) == before + 2
    assert await health_latency(server.url) < HEALTH_BOUND_S
    assert (await call("GET", server.url, "/v1/loads"))[1]["num_waiting_reqs"] == 0


async def _eq(coro, n):
    return (await coro) == n


# ---------------------------------------------------------------- strict validation
async def test_strict_validation_names_the_field(server):
    url = server.url
    native = [
        ('{"input_ids": [5], "sampling_params": {"temperature": NaN}}', "sampling_params.temperature"),
        ('{"input_ids": [5], "sampling_params": {"top_p": Infinity}}', "sampling_params.top_p"),
        ('{"input_ids": [5], "sampling_params": {"repetition_penalty": -Infinity}}', "sampling_params.repetition_penalty"),
        ('{"input_ids": [5, true, 7]}', "'input_ids' must be token ids"),
        ('{"input_ids": [[5], [false]]}', "'input_ids'[1]"),
        ('{"input_ids": [5.0]}', "'input_ids'"),
        ('{"input_ids": [5], "sampling_params": {"stop_token_ids": [true]}}', "sampling_params.stop_token_ids"),
        ('{"input_ids": [5], "sampling_params": {"max_new_tokens": 4.0}}', "sampling_params.max_new_tokens"),
        ('{"input_ids": [5], "sampling_params": {"n": "2"}}', "sampling_params.n"),
        ('{"input_ids": [5], "sampling_params": {"top_k": 1e400}}', "sampling_params.top_k"),
        ('{"input_ids": [5], "sampling_params": {"ignore_eos": "false"}}', "sampling_params.ignore_eos"),
        ('{"input_ids": [5], "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}}', "min_new_tokens"),
        ('{"input_ids": [5], "sampling_params": {"temprature": 1.0}}', "temprature"),
        ('{"input_ids": [5], "temperature": 0.5}', "'temperature'"),
        ('{"input_ids": [5], "bogus": 1, "other": 2}', "unknown fields 'bogus', 'other'"),
        ('{"input_ids": [5], "stream": "yes"}', "'stream'"),
        ('{"input_ids": [5], "return_logprob": [true]}', "'return_logprob'"),
        ('{"input_ids": [5], "rid": 7}', "'rid'"),
        ('{"input_ids": [5], "lora_path": "adapter"}', "LoRA adapter 'adapter' was requested, but LoRA is not enabled"),
        ('{"text": ""}', "'text' is empty"),
    ]
    for body, needle in native:
        st, r = await raw_post(url, "/generate", body)
        assert st == 400 and set(r) == {"error"} and needle in r["error"]["message"], (body, r)
    openai = [
        ("/v1/completions", '{"prompt": "a", "temperature": NaN}', "temperature must be a finite number"),
        ("/v1/completions", '{"prompt": [5, true]}', "'prompt'"),
        ("/v1/completions", '{"prompt": "a", "max_tokens": true}', "max_tokens"),
        ("/v1/completions", '{"prompt": "a", "seed": 1.5}', "seed"),
        ("/v1/completions", '{"prompt": "a", "logprobs": true}', "logprobs"),
        ("/v1/completions", '{"prompt": "a", "foo": 1}', "unknown field 'foo'"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "top_p": NaN}', "top_p"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "stream": 1}', "stream"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 4,'
                                 ' "min_tokens": 9}', "min_tokens"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "prompt": "x"}',
         "unknown field 'prompt'"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a"}], "audio": {"voice": "x"}}',
         "audio"),
    ]
    for path, body, needle in openai:
        st, r = await raw_post(url, path, body)
        assert st == 400 and needle in r["error"]["message"] and r["error"]["type"] == "BadRequestError", (path, body, r)

    # what the rollout client and the evaluator send, SGLang's bookkeeping fields, OpenAI's metadata: accepted
    ok = {"input_ids": [5, 6], "rid": "ok-1", "return_logprob": True, "log_metrics": False, "priority": None,
          "lora_path": None, "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                                                 "stop_token_ids": [2], "sampling_seed": 7, "ignore_eos": True}}
    st, r = await call("POST", url, "/generate", ok)
    assert st == 200 and len(r["output_ids"]) == 3
    st, r = await call("POST", url, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "user": "u",
        "metadata": {"k": "v"}, "store": False, "tool_choice": "none", "parallel_tool_calls": False, "seed": 3})
    assert st == 200 and r["usage"]["completion_tokens"] <= 2


# ---------------------------------------------------------------- configurable limits: 400 / 413 / 429
async def test_limits_answer_400_413_429(small):
    url, H = small.url, ADMIN_H
    cases = [({"input_ids": [5], "sampling_params": {"n": 9}}, "sampling_params.n=9"),
             ({"input_ids": [[5]] * 9}, "holds 9 prompts"),
             ({"input_ids": [[5], [6]], "sampling_params": {"n": 5, "max_new_tokens": 1}}, "10 samples"),
             ({"input_ids": [5], "sampling_params": {"max_new_tokens": 33}}, "limit of 32 (--max-new-tokens-limit)"),
             ({"input_ids": [5] * 17}, "prompt limit of 16 tokens"),
             ({"text": "a" * 400}, "'text' is 400 characters long"),  # > 4 × 16 × the longest token (5)
             ({"input_ids": [5] * 10, "sampling_params": {"n": 8, "max_new_tokens": 30}}, "--max-queued-tokens 200")]
    for body, needle in cases:
        st, r = await call("POST", url, "/generate", body)
        assert st == 400 and needle in r["error"]["message"], (body, r)
    st, r = await call("POST", url, "/generate", data=b'{"input_ids": [' + b"5, " * 2000 + b'5]}')
    assert st == 413 and set(r) == {"error"} and "4096 bytes" in r["error"]["message"]

    # the queue budget: requests held by a pause keep their tokens reserved
    assert (await call("POST", url, "/pause_generation", {"mode": "abort"}, H))[0] == 200
    held = asyncio.ensure_future(call("POST", url, "/generate", {
        "input_ids": [5] * 8, "sampling_params": {"n": 4, "max_new_tokens": 32, "ignore_eos": True}}))  # 160 tokens
    await wait_until(lambda: _waiting(url), what="the held request")
    st, r = await call("POST", url, "/generate", {"input_ids": [5] * 8, "sampling_params": {"n": 2, "max_new_tokens": 32}})
    assert st == 429 and set(r) == {"error"} and "retry later" in r["error"]["message"]
    st, r = await call("POST", url, "/v1/completions", {"prompt": [5] * 8, "max_tokens": 32, "n": 2})
    assert st == 429 and r["error"]["type"] == "RateLimitError" and r["error"]["code"] == 429
    assert (await call("POST", url, "/continue_generation", {}, H))[0] == 200
    st, r = await held
    assert st == 200 and all(len(x["output_ids"]) == 32 for x in r)
    st, r = await call("POST", url, "/generate", {"input_ids": [5] * 8, "sampling_params": {"n": 2, "max_new_tokens": 32}})
    assert st == 200  # the budget came back


async def _waiting(url) -> bool:
    return (await call("GET", url, "/v1/loads"))[1]["num_waiting_reqs"] >= 4


# ---------------------------------------------------------------- admin key, loopback-only sockets
ADMIN_CALLS = [("/pause_generation", {}), ("/continue_generation", {}), ("/flush_cache", {}),
               ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
               ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                               "world_size": 2}),
               ("/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}),
               ("/destroy_weights_update_group", {}), ("/begin_weight_update", {}), ("/end_weight_update", {}),
               ("/abort_request", {"abort_all": True}), ("/abort_request", {"rid": "x"})]


async def test_abort_all_needs_the_admin_key_and_running_requests_finish(server):
    """Issue 24 item 3: a loop of unauthenticated `abort_all` aborted 1,975 requests in 10 s. With an admin
    key set, /abort_request is an admin endpoint (SGLang's ADMIN_OPTIONAL level): without the key it is a
    401 and the running request runs to its length; with it, the abort works."""
    tokens = 400  # long enough to be seen running, short enough to finish
    task = asyncio.ensure_future(call("POST", server.url, "/generate", {
        "input_ids": [5, 6], "rid": "victim", "sampling_params": long_sp(tokens=tokens)}, timeout=300))
    await wait_until(lambda: _ge(running(server.url), 1), what="the victim request running")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for body in ({"abort_all": True}, {"rid": "victim"}):
            st, r = await call("POST", server.url, "/abort_request", body, headers)
            assert st == 401 and r == {"error": {"message": "Unauthorized"}}, (body, headers)
    st, r = await task
    assert st == 200 and r["meta_info"]["finish_reason"]["type"] == "length"
    assert r["meta_info"]["completion_tokens"] == tokens

    task = asyncio.ensure_future(call("POST", server.url, "/generate", {
        "input_ids": [5, 6], "rid": "victim2", "sampling_params": long_sp(tokens=1800)}, timeout=300))
    await wait_until(lambda: _ge(running(server.url), 1), what="the second request running")
    st, r = await call("POST", server.url, "/abort_request", {"abort_all": True}, ADMIN_H)
    assert st == 200 and r["num_aborted"] >= 1
    st, r = await task
    assert st == 200 and r["meta_info"]["finish_reason"]["type"] == "abort"


async def test_admin_endpoints_need_the_key_and_the_pusher_has_it(server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from areal_like.weights import WeightPusher

    with open(f"/proc/{server.proc.pid}/cmdline", "rb") as f:
        assert ADMIN.encode() not in f.read()  # the key came through the environment
    for path, body in ADMIN_CALLS:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            st, r = await call("POST", server.url, path, body, headers)
            assert st == 401 and r == {"error": {"message": "Unauthorized"}}, path
    st, r = await call("GET", server.url, "/server_info")  # no api key: user endpoints stay open
    assert st == 200 and ADMIN not in json.dumps(r)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    port = free_port()
    pusher = WeightPusher([server.url], master_port=port, backend="gloo", timeout_s=60, admin_api_key=ADMIN,
                          bucket_bytes=1 << 20)
    await pusher.init()
    try:
        # the TCPStore (rank 0, this process) listens on the master address only
        assert {ip for ip, _ in listening(port=port)} == {"127.0.0.1"}
        await pusher.update(list(model.state_dict().items()), version=3)
        st, info = await call("GET", server.url, "/model_info")
        assert st == 200 and info["weight_version"] == "3"
        # every socket the server listens on (HTTP, gloo) is on loopback too
        server_socks = listening(pid=server.proc.pid)
        assert server_socks and all(_loopback(ip) for ip, _ in server_socks), server_socks
    finally:
        await pusher.close()


def _loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1") or ip.startswith("::ffff:127.")


def listening(port: int | None = None, pid: int | None = None) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets in LISTEN state, by port or owned by `pid`."""
    inodes = None
    if pid is not None:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(int(link[8:-1]))
    out = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(path) as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            cols = row.split()
            (addr_hex, port_hex), state, inode = cols[1].split(":"), cols[3], int(cols[9])
            if state != "0A" or (port is not None and int(port_hex, 16) != port) or \
                    (inodes is not None and inode not in inodes):
                continue
            raw = bytes.fromhex(addr_hex)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # little-endian 32-bit words
            out.append((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return out
