"""`server.dtype` apart from `model.dtype`: an fp32 learner pushes to a bf16 embedded server.

Both pushers cast in the push (the distributed bucket, the disk checkpoint): the server then holds
exactly the learner's weights cast to bf16, the wire/disk carries bf16 bytes (half the fp32 ones),
and the server generates with them."""

import os

import aiohttp
import pytest
import torch
from safetensors.torch import load_file

from areal_like.api.config import ExperimentConfig
from areal_like.api.run_files import Endpoints
from areal_like.weights import DiskWeightPusher, WeightPusher, make_weight_pusher

from conftest import free_port
from _weights import base_model, perturbed  # noqa: F401 (base_model: a fixture)

pytestmark = pytest.mark.integration

ADMIN = "admin-key"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # rank 0 lives in this test process


@pytest.fixture(scope="module")
def server(engine_servers, tiny_model_dir):
    return engine_servers(tiny_model_dir, 1, "--admin-api-key", ADMIN, "--dtype", "bfloat16")[0]




async def call(method, url, path, body=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, json=body, headers=ADMIN_H,
                             timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.json(content_type=None)


async def assert_server_holds_bf16_of(url, named, version):
    """Every parameter the server holds equals the learner's fp32 tensor cast to bf16 (bit-exact,
    read back as floats), not the fp32 values; the server reports `version` and generates."""
    st, info = await call("GET", url, "/server_info")
    assert st == 200 and info["dtype"] == "bfloat16"
    for name, t in named:
        st, got = await call("POST", url, "/get_weights_by_name", {"name": name, "truncate_size": 4})
        assert st == 200, got
        want = t[:4].to(torch.bfloat16).float()
        assert torch.equal(torch.tensor(got, dtype=torch.float32), want), name
        assert not torch.equal(want, t[:4]), f"{name}: bf16 rounding must show (else the test proves nothing)"
    st, r = await call("POST", url, "/generate", {"input_ids": [5, 9, 13], "return_logprob": True, "sampling_params": {
        "max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}})
    assert st == 200 and len(r["output_ids"]) == 12, r
    assert r["meta_info"]["weight_version"] == str(version)
    assert all(torch.isfinite(torch.tensor(lp[0])) for lp in r["meta_info"]["output_token_logprobs"])


async def test_fp32_learner_pushes_bf16_buckets(server, base_model):
    pusher = WeightPusher([server.url], master_port=free_port(), backend="gloo", bucket_bytes=32 << 10,
                          timeout_s=60, admin_api_key=ADMIN, dtype="bfloat16")
    await pusher.init()
    try:
        for version, flattened in ((1, True), (2, False)):  # flattened buckets, then per-tensor broadcasts
            pusher.flattened = flattened
            named = list(perturbed(base_model, seed=version).state_dict().items())
            assert all(t.dtype == torch.float32 for _, t in named)
            res = await pusher.update(named, version=version)
            # the wire carries bf16: 2 bytes per element, half the learner's fp32 bytes
            assert res.bytes == sum(t.numel() * 2 for _, t in named)
            assert res.bytes * 2 == sum(t.numel() * t.element_size() for _, t in named)
            await assert_server_holds_bf16_of(server.url, named, version)
    finally:
        await pusher.close()


async def test_fp32_learner_pushes_bf16_checkpoints_to_disk(server, base_model, tmp_path):
    pusher = DiskWeightPusher([server.url], out_dir=str(tmp_path / "w"), timeout_s=60, admin_api_key=ADMIN,
                              dtype="bfloat16")
    await pusher.init()
    try:
        named = list(perturbed(base_model, seed=7).state_dict().items())
        res = await pusher.update(named, version=3)
        written = load_file(os.path.join(res.path, "model.safetensors"))
        assert {t.dtype for t in written.values()} == {torch.bfloat16}
        assert res.bytes == sum(t.numel() * 2 for t in written.values())
        await assert_server_holds_bf16_of(server.url, named, 3)
    finally:
        await pusher.close()


def test_server_dtype_reaches_both_pushers(tmp_path):
    """`server.dtype=auto` is bf16 where the servers run on GPUs, fp32 on CPU; the factory hands the
    resolved dtype to the pusher `weights.mode` picks."""
    cfg = ExperimentConfig()
    assert cfg.resolved_server_dtype(sglang=False) == "float32"
    assert cfg.resolved_server_dtype(sglang=True) == "bfloat16"
    cfg.server.device = "cuda:0"
    assert cfg.resolved_server_dtype(sglang=False) == "bfloat16"
    cfg.server.device, cfg.server.dtype = "cpu", "bfloat16"
    kw = dict(model_path="m", run_dir=str(tmp_path), weight_port=1234, incarnation=0)
    gloo = Endpoints(servers=["http://127.0.0.1:1"], weight_backend="gloo")
    assert make_weight_pusher(cfg, gloo, **kw).dtype == torch.bfloat16
    cfg.weights.mode = "disk"
    assert make_weight_pusher(cfg, gloo, **kw).dtype == torch.bfloat16
    cfg.server.dtype = "auto"
    assert make_weight_pusher(cfg, gloo, **kw).dtype == torch.float32
    nccl = Endpoints(servers=["http://127.0.0.1:1"], weight_backend="nccl")
    assert make_weight_pusher(cfg, nccl, **kw).dtype == torch.bfloat16
