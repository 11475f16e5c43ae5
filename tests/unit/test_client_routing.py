"""Rollout client health and routing: the UP/DOWN state machine and routing as pure logic (no I/O),
then failover against scripted aiohttp apps on loopback (PROTOCOL.md reply shapes)."""

import asyncio
import logging
import socket

import pytest
from aiohttp import web

from areal_like.engine.client import GenerationClient, GenerationResult, ServerDownError

A, B, C = "http://a", "http://b", "http://c"


def dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


# ---------------------------------------------------------------- pure routing / state
def test_routing_skips_down_servers_and_reroutes_sticky_keys():
    c = GenerationClient([A, B + "/", C])
    c.inflight.update({A: 0, B: 5, C: 9})
    assert c.pick_server(key="g") == A
    c.mark_down(A, "connection refused")
    assert c.pick_server() == B  # least loaded among the UP ones
    assert c.pick_server(key="g") == B  # sticky key re-routed…
    c.mark_up(A)
    assert c.pick_server(key="g") == B  # …and stays on its new server when A is back
    assert c.pick_server(key="h") == A
    c.mark_down(A, "x")
    c.mark_down(B, "y")
    assert {c.pick_server(key=k) for k in ("g", "h", "i")} == {C}


def test_ties_round_robin_over_up_servers_only():
    c = GenerationClient([A, B, C])
    c.mark_down(B, "gone")
    assert {c.pick_server() for _ in range(6)} == {A, C}


def test_no_server_up_names_every_server_and_its_last_error():
    c = GenerationClient([A, B])
    c.mark_down(A, "POST http://a/generate: connection failed 5 times: refused")
    c.mark_down(B, "GET http://b/health timed out after 5s")
    with pytest.raises(ServerDownError) as e:
        c.pick_server(key="g")
    msg = str(e.value)
    assert "http://a" in msg and "connection failed 5 times" in msg
    assert "http://b" in msg and "timed out after 5s" in msg


def test_server_states_and_transitions_logged_once(caplog):
    c = GenerationClient([A, B])
    st = c.server_states()
    assert set(st) == {A, B} and st[A]["up"] is True and st[A]["last_error"] is None and st[A]["inflight"] == 0
    since0 = st[A]["since"]
    c.inflight[A] = 2
    with caplog.at_level(logging.WARNING, logger="areal_like.engine.client"):
        for _ in range(3):
            c.mark_down(A, "refused")
        c.mark_up(A)
        c.mark_up(A)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("DOWN" in m for m in lines) == 1 and sum("UP again" in m for m in lines) == 1
    st = c.server_states()[A]
    assert st["up"] is True and st["inflight"] == 2 and st["last_error"] == "refused" and st["since"] >= since0


def test_result_has_failover_count_defaulting_to_zero():
    r = GenerationResult([1], [0.0], [0], "length", A)  # older positional constructors still work
    assert r.num_failovers == 0


# ---------------------------------------------------------------- scripted servers on loopback
def reply(ids, version, finish):
    return {"output_ids": ids, "meta_info": {"id": "r", "finish_reason": finish, "weight_version": version,
                                             "output_token_logprobs": [[-0.5, t, None] for t in ids]}}


@pytest.fixture
async def app_factory():
    runners = []

    async def start(handler, port=0, health=None):
        bodies = []

        async def generate(request):
            bodies.append(await request.json())
            return await handler(request, len(bodies) - 1)

        async def healthy(request):
            return web.json_response({})

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health or healthy)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}", bodies, runner

    yield start
    for r in runners:
        await r.cleanup()


async def test_failover_keeps_tokens_and_versions(app_factory):
    """A serves 2 tokens (then a pause aborts), then dies; B continues with prompt + those tokens."""
    async def a_handler(request, i):
        if i == 0:
            return web.json_response(reply([11, 12], "3", {"type": "abort", "message": "paused"}))
        request.transport.close()  # the server dies mid-request
        return web.Response()

    async def b_handler(request, i):
        return web.json_response(reply([13, 14], "4", {"type": "length", "length": 2}))

    url_a, bodies_a, _ = await app_factory(a_handler)
    url_b, bodies_b, _ = await app_factory(b_handler)
    async with GenerationClient([url_a, url_b], max_connection_retries=1, retry_backoff_s=0.01,
                                health_interval_s=None) as client:
        assert client.pick_server("k") == url_a
        res = await client.generate([1, 2, 3], max_new_tokens=4, key="k", rid="r1")
        assert client.server_states()[url_a]["up"] is False and url_a in client.server_states()[url_a]["last_error"]
        assert client.pick_server("k") == url_b  # the group's key moved with it
        assert client.inflight == {url_a: 0, url_b: 0}
    assert res.output_ids == [11, 12, 13, 14] and res.output_versions == [3, 3, 4, 4]
    assert res.output_logprobs == [-0.5] * 4 and res.finish_reason == "length"
    assert res.num_interruptions == 1 and res.num_failovers == 1 and res.server == url_b
    assert bodies_b == [{"input_ids": [1, 2, 3, 11, 12], "return_logprob": True, "rid": "r1.f1",
                         "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1}}]


async def test_pinned_request_does_not_fail_over_and_names_the_server():
    url = dead_url()
    async with GenerationClient([url], max_connection_retries=2, retry_backoff_s=0.01) as c:
        with pytest.raises(ServerDownError) as e:
            await c.generate([1, 2], max_new_tokens=2, server=url)
        assert url in str(e.value) and "connection failed 3 times" in str(e.value) and "/generate" in str(e.value)
        assert c.inflight[url] == 0 and c.server_states()[url]["up"] is False


async def test_waits_for_a_server_to_come_back(app_factory):
    """No server is up: generate waits (down_wait_s) until the probe sees one answer /health again."""
    url = dead_url()
    port = int(url.rsplit(":", 1)[1])

    async def ok(request, i):
        return web.json_response(reply([7], "0", {"type": "length", "length": 1}))

    async with GenerationClient([url], max_connection_retries=1, retry_backoff_s=0.01, health_interval_s=0.05,
                                down_wait_s=30) as c:
        gen = asyncio.ensure_future(c.generate([1], max_new_tokens=1))
        for _ in range(2000):  # until the connection failure marked it down
            if not c.server_states()[url]["up"]:
                break
            await asyncio.sleep(0.01)
        assert not c.server_states()[url]["up"] and not gen.done()
        await app_factory(ok, port=port)  # the server is back on its port
        res = await asyncio.wait_for(gen, 30)
        assert res.output_ids == [7] and res.num_failovers == 1 and c.server_states()[url]["up"]


async def test_all_down_fails_after_the_wait_naming_every_server():
    urls = [dead_url(), dead_url()]
    async with GenerationClient(urls, max_connection_retries=1, retry_backoff_s=0.01, health_interval_s=0.05,
                                down_wait_s=0.3) as c:
        with pytest.raises(ServerDownError) as e:
            await c.generate([1, 2], max_new_tokens=2, rid="lost-1")
        msg = str(e.value)
        assert all(u in msg for u in urls) and "lost-1" in msg and "no generation server came back" in msg
        assert "cannot connect" in msg or "connection failed" in msg
        assert c.inflight == {u: 0 for u in urls}
    assert c._probe_task is None  # close() stopped the probe


async def test_probe_marks_a_silent_server_down_and_in_flight_requests_fail_over(app_factory):
    """A hung server (accepts, never answers, /health too) is found by the probe; its in-flight
    request is cancelled there and finishes on the other server."""
    hang = asyncio.Event()

    async def a_handler(request, i):
        await hang.wait()
        return web.json_response({})

    async def a_health(request):
        await hang.wait()
        return web.json_response({})

    async def b_handler(request, i):
        return web.json_response(reply([5, 6], "0", {"type": "length", "length": 2}))

    url_a, _, _ = await app_factory(a_handler, health=a_health)
    url_b, _, _ = await app_factory(b_handler)
    try:
        async with GenerationClient([url_a, url_b], health_interval_s=0.05, health_timeout_s=0.2,
                                    health_failures_to_down=2) as c:
            res = await asyncio.wait_for(c.generate([1], max_new_tokens=2, key="g", rid="h1"), 30)
            assert res.server == url_b and res.num_failovers == 1 and res.output_ids == [5, 6]
            st = c.server_states()[url_a]
            assert st["up"] is False and url_a in st["last_error"] and "/health" in st["last_error"]
    finally:
        hang.set()
