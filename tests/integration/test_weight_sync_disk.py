"""`weights.mode=disk`: DiskWeightPusher → a real embedded server via /update_weights_from_disk.

After a push the server reports the pushed version and its logprobs equal a local recomputation
with the pushed weights; only the newest two version dirs stay; a checkpoint the server cannot load
leaves it serving its previous weights (not paused) and the error names the server. The pushes
write several safetensors shards with an index, as a real model's are written."""

import json
import os
from types import SimpleNamespace

import aiohttp
import pytest
import torch

from areal_like.api.config import ExperimentConfig
from areal_like.api.run_files import Endpoints
from areal_like.learner.logprobs import token_logprobs_from_logits
from areal_like.weights import DiskWeightPusher, WeightPusher, WeightPushError, make_weight_pusher
from _weights import base_model, perturbed  # noqa: F401 (base_model: a fixture)

pytestmark = pytest.mark.integration

ADMIN = "admin-key"
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def server(engine_servers, tiny_model_dir):
    return engine_servers(tiny_model_dir, 1, "--admin-api-key", ADMIN)[0]




def local_logprobs(model, prompt, out) -> torch.Tensor:
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    return token_logprobs_from_logits(logits[:, len(prompt) - 1:-1], ids[:, len(prompt):], 1.0)[0]


async def call(method, url, path, body=None):
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url + path, json=body, headers=ADMIN_H,
                             timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.json(content_type=None)


async def sample(url, prompt, n=16):
    st, r = await call("POST", url, "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": {
        "max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3}})
    assert st == 200, r
    return r["output_ids"], torch.tensor([t[0] for t in r["meta_info"]["output_token_logprobs"]]), \
        r["meta_info"]["weight_version"]


async def test_disk_push_lands_and_keeps_two_dirs(server, base_model, tiny_model_dir, tmp_path):
    prompt = [4, 8, 15, 16]
    out_dir = tmp_path / "weights_disk"
    # files of at most 64 kB: the tiny model is written (and loaded) as several shards + index, as a real one
    async with DiskWeightPusher([server.url], out_dir=str(out_dir), model_path=tiny_model_dir, timeout_s=60,
                                admin_api_key=ADMIN, shard_bytes=64_000) as pusher:
        for version in (1, 2, 3):
            new = perturbed(base_model, seed=100 + version)
            named = list(new.state_dict().items())  # tied embeddings share storage: the writer copes
            t = await pusher.update(named, version=version)
            assert 0 < t.pause_window_s <= t.push_s
            _, info = await call("GET", server.url, "/model_info")
            assert info["weight_version"] == str(version)
            out, lps, v = await sample(server.url, prompt)
            assert v == str(version)
            assert (lps - local_logprobs(new, prompt, out)).abs().mean() <= 1e-4
            assert (lps - local_logprobs(base_model, prompt, out)).abs().mean() > 1e-3  # really new weights
        # a complete HF dir: config and tokenizer files next to the weights; only the newest two kept
        assert sorted(os.listdir(out_dir)) == ["v00000002", "v00000003"]
        files = set(os.listdir(out_dir / "v00000003"))
        assert {"config.json", "model.safetensors.index.json"} <= files, files
        assert len([f for f in files if f.startswith("model-") and f.endswith(".safetensors")]) > 1, files
        assert any(f.startswith("tokenizer") for f in files), files
        assert json.loads((out_dir / "v00000003" / "config.json").read_text()) == \
            json.loads(open(os.path.join(tiny_model_dir, "config.json")).read())

        # A checkpoint the server cannot load (wrong shapes): it rolls back, keeps serving v3, not paused.
        bad = [(n, torch.zeros(2, 2)) for n, _ in base_model.state_dict().items()]
        with pytest.raises(WeightPushError, match=server.url.replace(".", r"\.") + ".*update_weights_from_disk"):
            await pusher.update(bad, version=4)
        _, info = await call("GET", server.url, "/model_info")
        assert info["weight_version"] == "3"
        _, _, v = await sample(server.url, prompt)  # answers: generation was continued
        assert v == "3"


def test_factory_picks_the_pusher_by_mode(tmp_path):
    ep = Endpoints(servers=["http://127.0.0.1:1"], weight_backend="gloo", server_devices=[2])
    cfg = ExperimentConfig()
    p = make_weight_pusher(cfg, ep, model_path="m", run_dir=str(tmp_path), weight_port=1234, incarnation=3)
    assert isinstance(p, WeightPusher)
    assert (p.master_port, p.group_name, p.world_size, p.backend) == (1234, "weight_update_group_3", 3, "gloo")
    assert p.bucket_bytes == int(cfg.weights.bucket_mb * 2**20)
    cfg.weights.mode = "disk"
    d = make_weight_pusher(cfg, ep, model_path="m", run_dir=str(tmp_path), weight_port=1234, incarnation=3)
    assert isinstance(d, DiskWeightPusher)
    assert d.out_dir == str(tmp_path / "weights_disk") and d.model_path == "m"
    assert d.shard_bytes == int(cfg.weights.bucket_mb * 2**20)  # weights.bucket_mb sizes its files too
    with pytest.raises(ValueError, match="weights.mode"):
        make_weight_pusher(SimpleNamespace(weights=SimpleNamespace(mode="nfs")), ep, model_path="m",
                           run_dir=str(tmp_path), weight_port=1, incarnation=0)
