"""Issue 44 item 3: what a push to SGLang servers reads of a MoE model (learner/moe.py `PerExpertWeights`): each fused
experts tensor as the per-expert tensors a checkpoint holds, in the order they come, the other tensors as they are —
and each fused tensor read from the learner once per push, whatever the bucket size cuts through it."""

from __future__ import annotations

import pytest
import torch

from areal_like.learner.moe import PerExpertWeights
from areal_like.weights.source import LocalWeights, plan_buckets

E, I, H = 4, 3, 5


class CountingSource(LocalWeights):
    """LocalWeights that records every `open` (a sharded learner's source gathers on each)."""

    def __init__(self, tensors) -> None:
        super().__init__(tensors)
        self.opened: list[list[int]] = []

    def open(self, indices):
        self.opened.append(list(indices))
        yield from super().open(indices)


def _state() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("model.embed_tokens.weight", torch.randn(7, H, generator=g)),
            ("model.layers.0.mlp.experts.gate_up_proj", torch.randn(E, 2 * I, H, generator=g)),
            ("model.layers.0.mlp.experts.down_proj", torch.randn(E, H, I, generator=g)),
            ("model.layers.0.mlp.gate.weight", torch.randn(E, H, generator=g))]


@pytest.mark.parametrize("bucket_bytes", [60, 150, 400, 1 << 20])
def test_each_expert_is_its_own_tensor_and_each_fused_tensor_is_read_once(bucket_bytes):
    state = _state()
    src = CountingSource(state)
    w = PerExpertWeights(src)
    names = [m[0] for m in w.meta]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "model.layers.0.mlp.gate.weight"
    assert len(names) == 2 + 3 * E and "model.layers.0.mlp.experts.2.up_proj.weight" in names
    assert dict((m[0], m[1]) for m in w.meta)["model.layers.0.mlp.experts.1.down_proj.weight"] == (H, I)
    for _ in range(2):  # two pushes: the second reads the (changed) state again, nothing held over
        src.opened.clear()
        got = {}
        for bucket in plan_buckets(w.meta, bucket_bytes):
            got.update((n, t.clone()) for n, t in w.open(bucket))
        assert set(got) == set(names)
        gate_up, down = state[1][1], state[2][1]
        for e in range(E):
            assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], gate_up[e, :I])
            assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.up_proj.weight"], gate_up[e, I:])
            assert torch.equal(got[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], down[e])
        assert torch.equal(got["model.embed_tokens.weight"], state[0][1])
        assert sorted(i for o in src.opened for i in o) == [0, 1, 2, 3]  # each source tensor once
        assert all(o for o in src.opened)  # never an empty open (a sharded source announces each to its ranks)
        for _, t in state:
            t.add_(1.0)


def test_mixtral_names_its_experts_w1_w3_w2_under_block_sparse_moe():
    w = PerExpertWeights(LocalWeights(_state()), mixtral=True)
    names = [m[0] for m in w.meta]
    assert names[1:4] == ["model.layers.0.block_sparse_moe.experts.0.w1.weight",
                          "model.layers.0.block_sparse_moe.experts.0.w3.weight",
                          "model.layers.0.block_sparse_moe.experts.1.w1.weight"]
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    assert names[-1] == "model.layers.0.block_sparse_moe.gate.weight"  # the router, where Mixtral's checkpoints keep it
