"""Building the learner's models — actor, critic, reference — in torchtitan's order:

    load         the HF checkpoint (`model.path`, `critic.path`, `ref.path`), in the dtype the
                 parameters are *stored* in: the master dtype when FSDP shards a trainable model
                 (its shards are the master), the compute dtype otherwise. Under FSDP into host
                 memory (each rank: the whole model once), moved to the device unit by unit as it
                 is sharded; otherwise straight onto the device
    convert      model-to-model rewrites before any parallelism: the critic's value head
                 (`value_head`); the seam where adapters (LoRA) go
    parallelize  pipeline split → tensor parallel → activation checkpointing → data parallel
                 (parallelize.py, in that order)
    wrap         a `ShardedModel` (parallel/sharded_model.py): parameters, optimizer state,
                 gradient reduction, clipping, state dicts, the tensors a push reads

`train.dp_sharding` (full = ZeRO-3, the default; grad_op = ZeRO-2; none = replicated) takes effect
where there is something to shard over: a pool with dp > 1. With dp = 1 (or one process) every
mode is the replicated path, and the log says so.

What this module does not do: no RL, no data, no process-group init (the layout is built).
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

from areal_like.learner.parallel.layout import ParallelLayout
from areal_like.learner.parallel.parallelize import parallelize_model
from areal_like.learner.parallel.sharded_model import DP_SHARDING, ShardedModel, full_meta_of

log = logging.getLogger(__name__)

ROLES = ("actor", "critic", "reference")

Converter = Callable[[nn.Module], nn.Module]


def value_head(hf_model: nn.Module) -> nn.Module:
    """Convert step of the critic: the same architecture with `lm_head` replaced by a
    zero-initialised (hidden → 1) value head, so V starts at 0 everywhere and every parallel
    strategy applies unchanged."""
    w = hf_model.get_input_embeddings().weight
    head = nn.Linear(hf_model.config.hidden_size, 1, bias=False).to(device=w.device, dtype=w.dtype)
    nn.init.zeros_(head.weight)
    hf_model.lm_head = head
    hf_model.config.tie_word_embeddings = False  # the value head is its own tensor
    return hf_model


def effective_dp_sharding(requested: str, layout: ParallelLayout) -> str:
    """`train.dp_sharding` as it applies to this pool: none where dp = 1 (nothing to shard over)."""
    if requested not in DP_SHARDING:
        raise ValueError(f"train.dp_sharding={requested!r}: use one of {', '.join(DP_SHARDING)}")
    return requested if layout.distributed and layout.dp > 1 else "none"


def load_hf(path: str, *, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Step 1: the HF causal LM at `path`, in `dtype`, on `device`, eval mode (no dropout: train the
    sampled policy itself)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    m.eval()
    return m


def build_model(path: str, role: str, layout: ParallelLayout, *, train_cfg, compute_dtype: torch.dtype,
                master_dtype: torch.dtype, device: torch.device, dp_sharding: str,
                checkpoint_layers: bool = False, converters: tuple[Converter, ...] = (),
                param_offload: bool = False, optimizer_offload: bool = False) -> ShardedModel:
    """load → convert → parallelize → `ShardedModel`, for `role` (actor | critic | reference).
    Trainable: actor and critic; the reference is frozen (sharded the same way, no optimizer).

    `param_offload`: the model is loaded into host memory and FSDP keeps its shards there (its CPU
    offload policy); `optimizer_offload`: AdamW state in host memory between steps (ShardedModel)."""
    if role not in ROLES:
        raise ValueError(f"unknown model role {role!r}: one of {ROLES}")
    trainable = role != "reference"
    fsdp = dp_sharding != "none"
    stored = master_dtype if fsdp and trainable else compute_dtype
    # FSDP: into host memory; each unit's parameters move to the device as `fully_shard` shards them
    # (one layer at a time), so the device never holds the whole unsharded model.
    hf = load_hf(path, dtype=stored, device=torch.device("cpu") if fsdp or param_offload else device)  # 1. load
    for convert in converters:  # 2. convert
        hf = convert(hf)
    meta = full_meta_of(hf, layout.pp)
    param_names = {n for n, _ in hf.named_parameters()}
    stage = parallelize_model(hf, layout, checkpoint_layers=checkpoint_layers and trainable,  # 3. parallelize
                              dp_sharding=dp_sharding, compute_dtype=compute_dtype,
                              reduce_dtype=master_dtype if trainable else compute_dtype, offload=param_offload)
    return ShardedModel(stage, meta, param_names, layout, trainable=trainable,  # 4. wrap
                        out_dim=1 if role == "critic" else None, train_cfg=train_cfg, compute_dtype=compute_dtype,
                        master_dtype=master_dtype, dp_sharding=dp_sharding, role=role, device=device,
                        param_offload=param_offload, optimizer_offload=optimizer_offload and trainable)
