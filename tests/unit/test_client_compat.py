"""The rollout client against replies shaped like older SGLang releases (PROTOCOL.md, "Differences
between SGLang releases"), served by a scripted aiohttp app on loopback inside the test."""

import pytest
from aiohttp import web

from areal_like.engine.client import GenerationClient, parse_reply


def reply_04x(ids, version, finish):
    """SGLang 0.4.x: no `output_ids`; ids only inside the logprob triples."""
    meta = {"id": "r", "finish_reason": finish, "prompt_tokens": 3, "completion_tokens": len(ids),
            "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(ids)]}
    if version is not None:
        meta["weight_version"] = version
    return {"text": "", "meta_info": meta}


@pytest.fixture
async def scripted():
    """`scripted(replies)` → (url, received bodies): /generate answers the replies in order."""
    runners = []

    async def start(replies):
        bodies = []

        async def generate(request):
            bodies.append(await request.json())
            return web.json_response(replies[len(bodies) - 1])

        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}", bodies

    yield start
    for r in runners:
        await r.cleanup()


def test_parse_reply_takes_ids_from_logprobs_on_04x():
    ids, lps, meta = parse_reply(reply_04x([9, 8], "1", {"type": "length", "length": 2}))
    assert ids == [9, 8] and lps == [-0.5, -1.5] and meta["weight_version"] == "1"
    ids, _, _ = parse_reply({"output_ids": [4], "meta_info": {"output_token_logprobs": [[-1.0, 4, None]]}})
    assert ids == [4]


async def test_abort_before_prefill_and_partial_abort_are_resubmitted(scripted):
    url, bodies = await scripted([
        reply_04x([], "3", {"type": "abort", "message": "Abort before prefill"}),  # 0.4.x: no tokens
        reply_04x([11, 12], "3", {"type": "abort", "message": "Abort in running batch"}),
        [reply_04x([13, 14], "4", {"type": "length", "length": 2})],  # a list reply: take the first
    ])
    async with GenerationClient([url]) as client:
        res = await client.generate([1, 2, 3], max_new_tokens=4)
    assert res.output_ids == [11, 12, 13, 14] and res.output_versions == [3, 3, 4, 4]
    assert res.num_interruptions == 2 and res.finish_reason == "length"
    assert [b["input_ids"] for b in bodies] == [[1, 2, 3], [1, 2, 3], [1, 2, 3, 11, 12]]
    assert [b["sampling_params"]["max_new_tokens"] for b in bodies] == [4, 4, 2]
    assert len({b["rid"] for b in bodies}) == 1


async def test_reply_without_weight_version(scripted):
    """0.4.x replies carry no weight_version: tokens get the version the caller set for that server."""
    url, _ = await scripted([reply_04x([5], None, {"type": "length", "length": 1}),
                             reply_04x([6], None, {"type": "length", "length": 1})])
    async with GenerationClient([url]) as client:
        res = await client.generate([1], max_new_tokens=1)
        assert res.output_versions == [0]
        client.fallback_version[url] = 7
        res = await client.generate([1], max_new_tokens=1)
    assert res.output_versions == [7]
