"""`weights.mode=memory`: the co-located handoff through shared memory (SharedMemoryWeightPusher, learner
side) → two real embedded servers (/update_weights_from_tensor, load_format "areal_like_shm").

The handoff lands exactly the pushed weights; the co-located phase sequence (pause retract → release →
resume weights → update while paused → resume KV → continue) carries a request that was generating
across it, its tokens versioned before/after; the servers refuse what they must not read."""

import asyncio
import base64
import glob
import json
import os

import pytest
import torch

from areal_like.engine.client import GenerationClient
from areal_like.weights import GenerationControl, SharedMemoryWeightPusher
from areal_like.weights.shm import LOAD_FORMAT, SHM_PREFIX, shm_dir

from _weights import base_model, perturbed  # noqa: F401 (base_model: a fixture)
from test_weight_sync import ADMIN, call, generated_tokens, local_logprobs, sample

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def servers(engine_servers, tiny_model_dir):
    return engine_servers(tiny_model_dir, 2, "--admin-api-key", ADMIN)


def new_pusher(servers, owner, **kw) -> SharedMemoryWeightPusher:
    return SharedMemoryWeightPusher([s.url for s in servers], owner=owner, bucket_bytes=kw.pop("bucket_bytes", 32 << 10),
                                    timeout_s=60, admin_api_key=ADMIN, **kw)


async def test_shm_handoff_lands_on_every_server(servers, base_model, tmp_path):
    prompt = [5, 9, 13, 17]
    owner = f"test{os.getpid()}a"
    stale = os.path.join(shm_dir(), f"{SHM_PREFIX}{owner}-1-0")  # what a killed learner of this run left
    open(stale, "wb").close()
    pusher = new_pusher(servers, owner)
    assert isinstance(pusher, GenerationControl)
    await pusher.init()
    assert not os.path.exists(stale)
    try:
        for version in (1, 2):
            new = perturbed(base_model, seed=40 + version)
            named = list(new.state_dict().items())
            t = await pusher.update(named, version=version)  # pause → buckets → flush → continue
            assert t.buckets > 1 and t.bytes == sum(v.numel() * v.element_size() for _, v in named)
            # two segments, alternated per bucket, live for the learner's lifetime
            assert len(glob.glob(os.path.join(shm_dir(), f"{SHM_PREFIX}{owner}-*"))) == 2
            for srv in servers:
                out, lps, v = await sample(srv.url, prompt)
                assert v == str(version)
                assert (lps - local_logprobs(new, prompt, out)).abs().mean() <= 1e-4
                assert (lps - local_logprobs(base_model, prompt, out)).abs().mean() > 1e-3
    finally:
        await pusher.close()
    assert glob.glob(os.path.join(shm_dir(), f"{SHM_PREFIX}{owner}-*")) == []  # close() removes them


async def test_colocated_phase_carries_a_generating_request_across_the_handoff(servers, base_model):
    """What the learner's co-located step does to the servers, with a request decoding when the phase
    starts: it is aborted (its KV freed with the rest) and resubmitted by its client with the tokens so
    far; it waits in the paused server, continues after the handoff under the new weights and finishes —
    tokens before the handoff at the old version, after it at the new one, each with the logprobs of the
    weights that produced it."""
    prompt = [7, 8, 9]
    old, new = perturbed(base_model, seed=50), perturbed(base_model, seed=51)
    pusher = new_pusher(servers, f"test{os.getpid()}b", bucket_bytes=1 << 20)
    await pusher.init()
    try:
        await pusher.update(list(old.state_dict().items()), version=50)
        async with GenerationClient([s.url for s in servers], request_timeout_s=120) as client:
            for attempt in range(5):
                before = await generated_tokens(client.pick_server("g"))
                gen = asyncio.ensure_future(client.generate(prompt, max_new_tokens=300, ignore_eos=True,
                                                            sampling_seed=attempt, key="g"))
                url = client.pick_server("g")
                while await generated_tokens(url) - before < 8 and not gen.done():
                    await asyncio.sleep(0.002)
                await pusher.pause("abort")
                await pusher.release_memory(None)
                for srv in servers:
                    st, info = await call("GET", srv.url, "/server_info")
                    assert info["memory_released"] == ["kv_cache", "weights"] and info["weights_bytes"] == 0
                await pusher.resume_memory(["weights"])
                t = await pusher.update(list(new.state_dict().items()), version=51 + attempt, paused=True)
                st, info = await call("GET", url, "/server_info")
                assert info["paused"] is True and info["weights_undefined"] is False  # still paused: the caller continues
                await pusher.resume_memory(["kv_cache"])
                await pusher.resume()
                res = await gen
                if res.output_versions[0] == 50 and (51 + attempt) in res.output_versions:
                    break
                await pusher.update(list(old.state_dict().items()), version=50)
            v_new = 51 + attempt
            assert len(res.output_ids) == 300 and res.finish_reason == "length" and res.num_interruptions >= 1
            vers = res.output_versions
            k = vers.index(v_new)
            assert 0 < k and set(vers[:k]) == {50} and set(vers[k:]) == {v_new}
            lps = torch.tensor(res.output_logprobs)
            assert (lps[:k] - local_logprobs(old, prompt, res.output_ids)[:k]).abs().mean() <= 1e-4
            assert (lps[k:] - local_logprobs(new, prompt, res.output_ids)[k:]).abs().mean() <= 1e-4
            assert t.pause_window_s <= t.push_s
    finally:
        await pusher.close()


async def test_servers_refuse_what_they_must_not_read(servers, tmp_path):
    url = servers[0].url

    def body(path, tensors, fmt=LOAD_FORMAT):
        desc = base64.b64encode(json.dumps({"path": path, "tensors": tensors}).encode()).decode()
        return {"serialized_named_tensors": [desc], "load_format": fmt}

    # SGLang's own payload (a pickle of CUDA-IPC handles) is never unpickled
    st, r = await call("POST", url, "/update_weights_from_tensor", body("/x", [], fmt=None))
    assert st == 400 and "load_format" in r["error"]["message"] and LOAD_FORMAT in r["error"]["message"]
    # a file outside the shared-memory dir, or not one of ours
    outside = tmp_path / f"{SHM_PREFIX}x"
    outside.write_bytes(b"\0" * 64)
    st, r = await call("POST", url, "/update_weights_from_tensor", body(str(outside), []))
    assert st == 400 and "AREAL_LIKE_SHM_DIR" in r["error"]["message"]
    # a tensor beyond the segment's end
    seg = os.path.join(shm_dir(), f"{SHM_PREFIX}test{os.getpid()}c-1-0")
    with open(seg, "wb") as f:
        f.write(b"\0" * 64)
    try:
        st, r = await call("POST", url, "/update_weights_from_tensor",
                           body(seg, [{"name": "lm_head.weight", "dtype": "float32", "shape": [8, 8], "offset": 0}]))
        assert st == 400 and "outside" in r["error"]["message"]
        st, r = await call("POST", url, "/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"],
                                                                          "load_format": LOAD_FORMAT})
        assert st == 400 and "descriptor" in r["error"]["message"]
    finally:
        os.unlink(seg)
