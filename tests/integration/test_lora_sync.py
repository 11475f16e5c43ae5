"""Adapter-only weight sync (`model.lora_rank` > 0) into a real embedded server: after every push the
server generates with the adapter the learner just trained — its logprobs of the tokens it sampled
equal the learner's for the same tokens — over the broadcast (gloo) and the disk transports. The
failure this guards against is the silent one (verl #7495): a push that never reaches the engine,
which then keeps sampling from the base or an old adapter while the learner trains on."""

import pytest
import torch

from areal_like.api.config import TrainConfig
from areal_like.api.net import free_port
from areal_like.api.config import LORA_ADAPTER_NAME
from areal_like.learner.logprobs import token_logprobs_from_logits
from areal_like.learner.lora import LoraSettings, adapters_disabled
from areal_like.learner.parallel.spawn import synthetic_groups
from areal_like.learner.trainer import Trainer
from areal_like.weights import DiskWeightPusher, WeightPusher

from test_engine_server import post

pytestmark = pytest.mark.integration

ADMIN = "admin-key"
TEMP = 0.9
LORA = LoraSettings(4, 8.0, "all-linear")
PROMPTS = [[5, 9, 13, 21, 7], [30, 2, 44]]


@pytest.fixture(scope="module")
def lora_server(engine_servers, tiny_model_dir):
    (srv,) = engine_servers(tiny_model_dir, 1, "--admin-api-key", ADMIN, "--enable-lora", "--max-lora-rank", "4",
                            "--lora-target-modules", "all-linear", "--max-loras-per-batch", "2",
                            "--max-loaded-loras", "2")
    return srv


def learner_logprobs(trainer: Trainer, prompt: list[int], out: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = trainer.actor.head(trainer.actor.stage_module(ids))
    return token_logprobs_from_logits(logits[:, len(prompt) - 1:-1], ids[:, len(prompt):], TEMP)[0]


async def served(url: str, prompt: list[int]) -> tuple[list[int], torch.Tensor, str]:
    body = {"input_ids": prompt, "return_logprob": True, "lora_path": LORA_ADAPTER_NAME,
            "sampling_params": {"max_new_tokens": 6, "temperature": TEMP, "ignore_eos": True}}
    status, r = await post(url, "/generate", body)
    assert status == 200, r
    meta = r["meta_info"]
    toks = [t[1] for t in meta["output_token_logprobs"]]
    return toks, torch.tensor([t[0] for t in meta["output_token_logprobs"]]), meta["weight_version"]


@pytest.mark.parametrize("transport", ["broadcast", "disk"])
async def test_server_generates_with_each_pushed_adapter(transport, lora_server, tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    trainer = Trainer(tiny_model_dir, TrainConfig(lr=3e-2, warmup_steps=0, micro_batch_tokens=256, seed=5), None,
                      temperature=TEMP, lora=LORA)
    if transport == "broadcast":
        pusher = WeightPusher([lora_server.url], master_port=free_port(), backend="gloo", timeout_s=60,
                              admin_api_key=ADMIN, bucket_bytes=16 << 10)  # several buckets of adapter
    else:
        pusher = DiskWeightPusher([lora_server.url], out_dir=str(tmp_path / "adapters"), model_path=tiny_model_dir,
                                  timeout_s=60, admin_api_key=ADMIN)
    adapter_bytes = sum(t.numel() * 4 for n, t in trainer.full_state() if ".lora_" in n)
    full_bytes = sum(t.numel() * 4 for n, t in trainer.full_state())
    await pusher.init()
    try:
        for version in range(4):
            if version:
                trainer.train_step(synthetic_groups(version, vocab=64, n_groups=4, n=4), version=version)
            res = await pusher.update(trainer.weight_source(), version)
            # the adapter alone went over the wire
            assert res.adapter and res.bytes == adapter_bytes < full_bytes / 4, res
            for prompt in PROMPTS:
                toks, lps, wv = await served(lora_server.url, prompt)
                assert wv == str(version)
                torch.testing.assert_close(lps, learner_logprobs(trainer, prompt, toks), atol=1e-4, rtol=0,
                                           msg=lambda m: f"{transport} push of version {version}: {m}")
        # the adapter moved away from the base (a fresh adapter's B = 0), and the server followed it
        toks, lps, _ = await served(lora_server.url, PROMPTS[0])
        with adapters_disabled(trainer.actor.stage_module):
            base = learner_logprobs(trainer, PROMPTS[0], toks)
        assert (lps - base).abs().max() > 1e-3
    finally:
        await pusher.close()
