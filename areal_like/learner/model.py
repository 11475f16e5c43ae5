"""Building the learner's models — actor, critic, reference — in torchtitan's order:

    load         the HF architecture of `model.path` (`critic.path`, `ref.path`) from its config,
                 parameters on the meta device (no memory; buffers real), in the dtype the
                 parameters are *stored* in: the master dtype when FSDP shards a trainable model
                 (its shards are the master), the compute dtype otherwise
    convert      model-to-model rewrites before any parallelism: the critic's value head
                 (`value_head`); the actor's LoRA adapters (`learner/lora.py`). A converter's new tensors
                 are listed in `FRESH_ATTR` with their init (the value head: zeros)
    parallelize  pipeline split → tensor parallel → activation checkpointing → data parallel
                 (parallelize.py, in that order), still on meta
    materialize  this rank's part only: storage for its stage's shards on the device (host with
                 parameter offload), filled from the checkpoint's safetensors read tensor by
                 tensor — no rank ever holds the whole model, only its shards plus the tensor
                 being read
    wrap         a `ShardedModel` (parallel/sharded_model.py): parameters, optimizer state,
                 gradient reduction, clipping, state dicts, the tensors a push reads

`train.dp_sharding` (full = ZeRO-3, the default; grad_op = ZeRO-2; none = replicated) takes effect
where there is something to shard over: a pool with dp > 1. With dp = 1 (or one process) every
mode is the replicated path, and the log says so.

What this module does not do: no RL, no data, no process-group init (the layout is built).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
from torch import nn

from areal_like.learner.lora import LoraSettings, ModelFiles, canonical_name, lora_converter
from areal_like.weights.adapter import is_lora_name
from areal_like.learner.parallel.layout import ParallelLayout
from areal_like.learner.parallel.parallelize import parallelize_model
from areal_like.learner.parallel.sharded_model import DP_SHARDING, ShardedModel, full_meta_of

log = logging.getLogger(__name__)

ROLES = ("actor", "critic", "reference")

Converter = Callable[[nn.Module], nn.Module]


FRESH_ATTR = "_areal_fresh_params"  # {HF name: init(local tensor)} of tensors a converter added


def value_head(hf_model: nn.Module) -> nn.Module:
    """Convert step of the critic: the same architecture with `lm_head` replaced by a
    zero-initialised (hidden → 1) value head, so V starts at 0 everywhere and every parallel
    strategy applies unchanged."""
    w = hf_model.get_input_embeddings().weight
    head = nn.Linear(hf_model.config.hidden_size, 1, bias=False).to(device=w.device, dtype=w.dtype)
    hf_model.lm_head = head
    hf_model.config.tie_word_embeddings = False  # the value head is its own tensor
    fresh = dict(getattr(hf_model, FRESH_ATTR, {}))
    fresh["lm_head.weight"] = nn.init.zeros_  # not read from the LM checkpoint: its lm_head is [vocab, hidden]
    setattr(hf_model, FRESH_ATTR, fresh)
    return hf_model


def effective_dp_sharding(requested: str, layout: ParallelLayout) -> str:
    """`train.dp_sharding` as it applies to this pool: none where dp = 1 (nothing to shard over)."""
    if requested not in DP_SHARDING:
        raise ValueError(f"train.dp_sharding={requested!r}: use one of {', '.join(DP_SHARDING)}")
    return requested if layout.distributed and layout.dp > 1 else "none"


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside goes to the meta device (no storage); buffers stay real —
    the non-persistent ones (rotary inv_freq) are computed at construction and not in checkpoints."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def load_hf(path: str, *, dtype: torch.dtype) -> nn.Module:
    """Step 1: the HF causal LM architecture of `path` (its config.json), parameters on the meta
    device in `dtype`, eval mode (no dropout: train the sampled policy itself). `materialize` fills it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with _parameters_on_meta():
        m = AutoModelForCausalLM.from_config(config, dtype=dtype)
    m.eval()
    return m


def _shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) slots of every Parameter registered in more than one place (a tied
    embedding and lm_head), one list per Parameter."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in dict.fromkeys(m for _, m in module.named_modules(remove_duplicate=False)):
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((m, name))
    return [v for v in slots.values() if len(v) > 1]


def materialize(stage: nn.Module, path: str, where: str, *, device: torch.device, tied: bool,
                fresh: dict, lora: LoraSettings | None = None, lora_shapes: dict | None = None, seed: int = 0) -> None:
    """Step 4: storage for this rank's parameters (its shards: `to_empty`, which FSDP2 supports on a
    sharded module) and their values from the safetensors files at `path`, read one tensor at a time
    on the host; buffers keep the values they were built with. With `lora`, the adapter's tensors
    (`lora_shapes`, by canonical name) come from `lora.path` or a fresh init seeded by `seed`."""
    from areal_like.learner.parallel.sharded_model import load_full_into
    from areal_like.weights.adapter import read_adapter
    from areal_like.weights.disk import SafetensorsDir

    try:
        weights = SafetensorsDir(path, "model")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{where}: {e}. The learner reads safetensors weights (one tensor at a time): "
                                "re-save the model with save_pretrained(..., safe_serialization=True)") from e
    buffers = {n: b.detach().clone() for n, b in stage.named_buffers()}
    shared = _shared_parameters(stage)
    stage.to_empty(device=device)
    for slots in shared:  # `to_empty` gives each module its own new Parameter: tie them again
        first = slots[0][0]._parameters[slots[0][1]]
        for module, name in slots[1:]:
            module._parameters[name] = first
    with torch.no_grad():
        for n, b in stage.named_buffers():
            b.copy_(buffers[n])
    if lora is not None:  # the base from `path`, the adapter from model.lora_path or fresh
        weights = ModelFiles(weights, lora_shapes, seed=seed, adapter=read_adapter(lora.path, lora) if lora.path else None)
    local = [(canonical_name(n.removeprefix("hf.")), p) for n, p in stage.named_parameters()]
    local += [(canonical_name(n.removeprefix("hf.")), b) for n, b in stage.named_buffers()
              if canonical_name(n.removeprefix("hf.")) in weights]
    load_full_into(local, weights, where, tied=tied, fresh=fresh)


def build_model(path: str, role: str, layout: ParallelLayout, *, train_cfg, compute_dtype: torch.dtype,
                master_dtype: torch.dtype, device: torch.device, dp_sharding: str,
                checkpoint_layers: bool = False, converters: tuple[Converter, ...] = (),
                param_offload: bool = False, optimizer_offload: bool = False, lora: LoraSettings | None = None,
                seed: int = 0) -> ShardedModel:
    """load → convert → parallelize → `ShardedModel`, for `role` (actor | critic | reference).
    Trainable: actor and critic; the reference is frozen (sharded the same way, no optimizer).

    `param_offload`: the model is loaded into host memory and FSDP keeps its shards there (its CPU
    offload policy); `optimizer_offload`: AdamW state in host memory between steps (ShardedModel).

    `lora` (`model.lora_rank` > 0, the actor): peft's LoRA layers go in at the convert step
    (learner/lora.py); the frozen base is stored in the compute dtype, the adapter — the only
    trainable tensors — in the master dtype where FSDP's shards are the master; `seed` seeds a
    fresh adapter's init."""
    if role not in ROLES:
        raise ValueError(f"unknown model role {role!r}: one of {ROLES}")
    trainable = role != "reference"
    fsdp = dp_sharding != "none"
    stored = master_dtype if fsdp and trainable and lora is None else compute_dtype
    hf = load_hf(path, dtype=stored)  # 1. load (the architecture, parameters on meta)
    if lora is not None:
        if not trainable:
            raise ValueError(f"LoRA is for trainable models, not the {role}")
        if "lm_head" in lora.target_modules and fsdp and layout.dp > 1 and not param_offload:
            raise ValueError("model.target_modules names lm_head, but under FSDP (train.dp_sharding="
                             f"{dp_sharding}, d{layout.dp}) the LM head is split by vocabulary rows, which an "
                             "adapter cannot wrap: drop lm_head, or set train.dp_sharding=none")
        converters = (*converters, lora_converter(lora, adapter_dtype=master_dtype if fsdp else compute_dtype))
    for convert in converters:  # 2. convert
        hf = convert(hf)
    lora_shapes = {canonical_name(n): tuple(p.shape) for n, p in hf.named_parameters() if is_lora_name(n)}
    meta = full_meta_of(hf, layout.pp)
    param_names = {canonical_name(n) for n, _ in hf.named_parameters()}
    tied = bool(getattr(hf.config, "tie_word_embeddings", False))
    fresh = getattr(hf, FRESH_ATTR, {})
    stage = parallelize_model(hf, layout, checkpoint_layers=checkpoint_layers and trainable,  # 3. parallelize
                              dp_sharding=dp_sharding, compute_dtype=compute_dtype,
                              reduce_dtype=master_dtype if trainable else compute_dtype, offload=param_offload)
    # 4. materialize this rank's shards (FSDP's CPU offload keeps them in host memory)
    materialize(stage, path, f"{role} model {path!r}", device=torch.device("cpu") if param_offload else device,
                tied=tied, fresh=fresh, lora=lora, lora_shapes=lora_shapes, seed=seed)
    return ShardedModel(stage, meta, param_names, layout, trainable=trainable,  # 5. wrap
                        out_dim=1 if role == "critic" else None, train_cfg=train_cfg, compute_dtype=compute_dtype,
                        master_dtype=master_dtype, dp_sharding=dp_sharding, role=role, device=device,
                        param_offload=param_offload, optimizer_offload=optimizer_offload and trainable)
