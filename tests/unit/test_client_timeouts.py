"""A generation request that times out is sent again — the request, not its group — to another server
when there is one, with the tokens already held, a bounded number of times; the final error names every
server it timed out on. Real aiohttp servers on loopback that stall (never answer) when told to."""

import asyncio

import pytest
from aiohttp import web

from areal_like.engine.client import GenerationClient, GenerationTimeout

TIMEOUT_S = 0.5  # the client's request timeout; a stalled attempt never answers at all


class Server:
    """/generate on 127.0.0.1: stalls on the attempts whose index is in `stall` (0-based, per server),
    answers `abort` with `partial` tokens on those in `abort`, else finishes with `length`."""

    def __init__(self, version: int, stall=(), abort=(), partial=3):
        self.version, self.stall, self.abort, self.partial = version, set(stall), set(abort), partial
        self.bodies: list[dict] = []
        self.url = ""

    async def generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        i = len(self.bodies)
        self.bodies.append(body)
        if i in self.stall:
            await asyncio.Event().wait()  # until the client drops the connection (cancels this handler)
        k = body["sampling_params"]["max_new_tokens"]
        n, reason = (min(self.partial, k), "abort") if i in self.abort else (k, "length")
        return web.json_response({"output_ids": [self.version] * n, "meta_info": {
            "output_token_logprobs": [[-0.5, self.version, None]] * n, "weight_version": str(self.version),
            "finish_reason": {"type": reason}}})

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def client(*servers, retries=2):
    return GenerationClient([s.url for s in servers], request_timeout_s=TIMEOUT_S, health_interval_s=0,
                            max_timeout_retries=retries)


async def test_a_stalled_request_is_sent_again_to_another_server():
    async with Server(3, stall={0}) as slow, Server(5) as ok:
        async with client(slow, ok) as c:
            res = await c.generate([1, 2, 3], max_new_tokens=10, key="g", rid="r")
    # a fresh client routes the first request to the first of two idle servers: `slow`; it ends on `ok`
    assert res.finish_reason == "length" and len(res.output_ids) == 10
    assert res.num_timeouts == 1 and res.server == ok.url and res.output_versions == [5] * 10
    assert [b["rid"] for b in slow.bodies] == ["r"] and [b["rid"] for b in ok.bodies] == ["r.t1"]


async def test_the_retry_keeps_the_tokens_already_held():
    # slow: first attempt is interrupted (a weight-update abort, 3 tokens kept), the resubmission stalls
    async with Server(3, abort={0}, stall={1}) as slow, Server(5) as ok:
        async with client(slow, ok) as c:
            res = await c.generate([1, 2, 3], max_new_tokens=10, key="g", rid="r")
    assert res.num_interruptions == 1 and res.num_timeouts == 1
    assert res.output_versions == [3] * 3 + [5] * 7 and res.server == ok.url
    (again,) = ok.bodies
    assert again["input_ids"] == [1, 2, 3, 3, 3, 3] and again["sampling_params"]["max_new_tokens"] == 7


async def test_a_request_that_keeps_timing_out_fails_naming_the_server():
    async with Server(3, stall={0, 1, 2, 3}) as slow:
        async with client(slow, retries=2) as c:
            with pytest.raises(GenerationTimeout, match=rf"rid=r: timed out 3 times .* on {slow.url}, {slow.url}, "
                                                        rf"{slow.url}; last: POST {slow.url}/generate timed out"):
                await c.generate([1, 2, 3], max_new_tokens=4, key="g", rid="r")
    assert [b["rid"] for b in slow.bodies] == ["r", "r.t1", "r.t2"]  # retried twice, then given up


async def test_no_retries_configured_fails_at_the_first_timeout():
    async with Server(3, stall={0}) as slow, Server(5) as ok:
        async with client(slow, ok, retries=0) as c:
            with pytest.raises(GenerationTimeout, match="timed out 1 times"):
                await c.generate([1, 2, 3], max_new_tokens=4, server=slow.url, rid="r")
    assert ok.bodies == []
