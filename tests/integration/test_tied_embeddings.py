"""A model with tied input/output embeddings (Qwen2.5-0.5B…3B, Qwen3-0.6B…4B) keeps them tied in
the learner, with the checkpoint's values, whatever the layout.

The learner builds its models on the meta device and gives them storage afterwards (`to_empty`),
which hands every module its own new Parameter — so a tied `lm_head` came out as a second,
never-loaded tensor (uninitialised memory as the head, twice the state). Checked here on a tiny tied
model: in one process the learner's logits equal HF's own `from_pretrained` model's, and the head *is*
the embedding; on two gloo ranks with `train.dp_sharding=none` (replicated) and `full` (FSDP, the
vocabulary split over dp) the head is the embedding's Parameter and the gathered weights equal the file;
after a train step they are still one tensor."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

from areal_like.api.config import TrainConfig
from areal_like.data.tiny_model import build_tiny_model
from areal_like.learner.parallel.spawn import leave_pool, synthetic_groups
from areal_like.learner.trainer import Trainer

from conftest import RANK_START, free_port

pytestmark = pytest.mark.integration


def _embedding_in_file(model_dir: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))["model.embed_tokens.weight"]


def _rank_main(rank: int, world: int, port: int, model_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        for sharding in ("none", "full"):
            ln = Trainer(model_dir, TrainConfig(dp_sharding=sharding, lr=1e-2, warmup_steps=0), "d2", temperature=1.0)
            hf = ln.actor.stage_module.hf
            assert hf.lm_head.weight is hf.model.embed_tokens.weight, sharding
            state = dict(ln.full_state())
            if rank == 0:
                assert "lm_head.weight" not in state
                torch.testing.assert_close(state["model.embed_tokens.weight"], _embedding_in_file(model_dir))
            ln.train_step(synthetic_groups(1, vocab=32), version=0)
            assert hf.lm_head.weight is hf.model.embed_tokens.weight, f"{sharding}: untied by a step"
            del ln
        leave_pool()  # not a plain return: a rank may abort in the interpreter's finalization (exit_rank)
    finally:  # on a failure (leave_pool does not return)
        dist.destroy_process_group()


def test_tied_embeddings_stay_tied_and_loaded(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = build_tiny_model(str(tmp_path / "m"), tie_word_embeddings=True)
    ln = Trainer(model_dir, TrainConfig(), temperature=1.0)
    hf = ln.actor.stage_module.hf
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, ref(input_ids=ids).logits)
    mp.start_processes(_rank_main, args=(2, free_port(), model_dir), nprocs=2, join=True, start_method=RANK_START)
