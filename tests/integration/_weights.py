"""Shared by the weight-sync tests: the tiny model in fp32 and perturbed copies of it (new weights to push)."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def perturbed(model, seed: int, scale: float = 0.05):
    """A copy of `model` with every weight moved by N(0, scale²) noise."""
    g = torch.Generator().manual_seed(seed)
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return m
