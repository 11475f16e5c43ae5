"""The vocabulary split over dp ranks (`learner/parallel/vocab_parallel.py`) computes what the unsplit
embedding and LM head compute: two gloo ranks, an odd vocabulary (uneven row split), a tied
embedding/head, padding_idx, temperature, an entropy with a gradient, chunks of 3 tokens, and ranks
holding different numbers of tokens — one of them none, as a padding micro-batch does.

Each rank runs the same little model on its own tokens twice: once with the vocab-parallel modules
(rows split over the two ranks), once with a plain `nn.Embedding` / tied `lm_head` holding the whole
matrix (`logprobs.chunked_token_logprobs`, the one-process path). The log-probabilities, entropies and
∂/∂(a layer between embedding and head) must match on each rank; the vocab-parallel gradient of the
rows, gathered, must equal the SUM over ranks of the plain gradients (what the dp reduction gives),
the padding row getting the head's gradient only. fp32 on one thread per rank, 1e-5."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

from areal_like.learner.parallel.spawn import leave_pool
from conftest import RANK_START, free_port

pytestmark = pytest.mark.integration

V, H, PAD = 37, 8, 0


def _case(rank: int, scenario: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (ids (B, T), loss positions (B, T−1)) in `scenario`."""
    g = torch.Generator().manual_seed(100 + rank)
    B, T = (2, 6) if rank == 0 else (1, 4)
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, -1] = PAD  # the padding row is looked up (and must get no gradient)
    pos = torch.rand(B, T - 1, generator=g) > 0.3
    if scenario == "rank1-empty" and rank == 1:
        pos[:] = False
    return ids, pos


def _run(emb, head, mix: torch.nn.Linear, ids, pos):
    from areal_like.learner.logprobs import chunked_token_logprobs

    h = mix(emb(ids))
    lp, ent = chunked_token_logprobs(h[:, :-1], head, ids[:, 1:], 0.9, positions_BT=pos, chunk_tokens=3,
                                     with_entropy=True, entropy_grad=True)
    loss = (lp * 1.3).sum() - 0.7 * ent.sum() + 0.0 * h.sum()  # as the trainer: backward runs without loss tokens
    loss.backward()
    return lp.detach(), ent.detach()


def _rank_main(rank: int, world: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from areal_like.learner.parallel.vocab_parallel import VocabParallelHead, apply_vocab_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        for scenario in ("both", "rank1-empty"):
            torch.manual_seed(0)
            W = torch.randn(V, H)
            mix_w = torch.randn(H, H) / H ** 0.5

            # the plain, whole-matrix model (tied)
            class Plain(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.model = torch.nn.Module()
                    self.model.embed_tokens = torch.nn.Embedding(V, H, padding_idx=PAD)
                    self.lm_head = torch.nn.Linear(H, V, bias=False)
                    self.lm_head.weight = self.model.embed_tokens.weight
                    self.config = type("C", (), {"vocab_size": V})()

            plain = Plain()
            with torch.no_grad():
                plain.model.embed_tokens.weight.copy_(W)
            mix = torch.nn.Linear(H, H, bias=False)
            with torch.no_grad():
                mix.weight.copy_(mix_w)
            ids, pos = _case(rank, scenario)
            lp0, ent0 = _run(plain.model.embed_tokens, plain.lm_head, mix, ids, pos)
            gW = plain.model.embed_tokens.weight.grad.clone()
            dist.all_reduce(gW)  # the dp SUM of the whole-matrix gradients
            gmix = mix.weight.grad.clone()

            # the split model: the same modules after apply_vocab_parallel (stage-like wrapper)
            vp = Plain()
            stage = type("S", (), {"hf": vp})()
            new = apply_vocab_parallel(stage, mesh, dtype=torch.float32)
            assert len(new) == 1, "a tied embedding/head must stay one parameter"
            assert isinstance(vp.lm_head, VocabParallelHead) and vp.lm_head.weight is vp.model.embed_tokens.weight
            (param,) = new
            with torch.no_grad():
                param.to_local().copy_(distribute_tensor(W, mesh, param.placements).to_local())
            assert param.to_local().shape[0] == (19 if rank == 0 else 18)  # torch.chunk's split of 37 rows
            mix.weight.grad = None
            lp1, ent1 = _run(vp.model.embed_tokens, vp.lm_head, mix, ids, pos)
            torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mix.weight.grad, gmix, atol=1e-5, rtol=1e-5)
            full_grad = param.grad.full_tensor()
            torch.testing.assert_close(full_grad, gW, atol=1e-5, rtol=1e-5)
            assert float(lp1.abs().sum()) > 0 or scenario == "rank1-empty" and rank == 1
        leave_pool()  # not a plain return: a rank may abort in the interpreter's finalization (exit_rank)
    finally:  # on a failure (leave_pool does not return)
        dist.destroy_process_group()


def test_vocab_parallel_embedding_and_logprobs_match_the_whole_matrix():
    mp.start_processes(_rank_main, args=(2, free_port()), nprocs=2, join=True, start_method=RANK_START)
