"""Weight sources, bucket plans and streamed safetensors shards (weights/source.py, weights/disk.py)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from transformers import AutoModelForCausalLM

from areal_like.data.tiny_model import build_tiny_model
from areal_like.weights.disk import SafetensorsDir, write_safetensors_shards
from areal_like.weights.push import flatten_bucket
from areal_like.weights.source import LocalWeights, fill_bucket, meta_nbytes, plan_buckets

BF16 = torch.bfloat16


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(7, generator=g)), ("flag", torch.tensor([True, False, True])),
            ("b", torch.randn(5, 3, generator=g)), ("c", torch.randn(40, generator=g)),
            ("d", torch.randn(2, generator=g).to(BF16))]


def test_plan_is_bounded_aligned_and_fills_the_same_bytes_as_the_tensors():
    named = _named()
    src = LocalWeights(named)
    plan = plan_buckets(src.meta, 64, BF16)
    assert sorted(i for b in plan for i in b) == list(range(len(named)))  # every tensor once
    for b in plan:
        sizes = [meta_nbytes(src.meta[i], BF16) for i in b]
        assert len(b) == 1 or sum(sizes) <= 64  # a bigger tensor goes alone
        items = [torch.tensor([], dtype=BF16 if src.meta[i][2].is_floating_point else src.meta[i][2]).itemsize
                 for i in b]
        assert items == sorted(items, reverse=True)  # largest element first: every offset aligned
        out = torch.empty(sum(sizes), dtype=torch.uint8)
        got = fill_bucket(src.open(b), [src.meta[i] for i in b], out, BF16)
        assert torch.equal(got, flatten_bucket([named[i] for i in b], dtype=BF16))


def test_streamed_shards_load_with_transformers_and_read_back_lazily(tmp_path):
    model_dir = build_tiny_model(str(tmp_path / "m"), hidden_size=32, intermediate_size=64, num_layers=2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    named = list(model.state_dict().items())
    out = tmp_path / "sharded"
    shutil.copytree(model_dir, out)
    os.remove(out / "model.safetensors")
    n = write_safetensors_shards(named, str(out), dtype=BF16, shard_bytes=8_000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {k for k, _ in named} and index["metadata"]["total_size"] == n
    back = SafetensorsDir(str(out))
    for k, t in named:
        assert back[k].dtype == BF16 and torch.equal(back[k], t.to(BF16)), k
    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)  # HF reads the index
    for k, t in loaded.state_dict().items():
        assert torch.equal(t, dict(named)[k].to(BF16).float()), k
