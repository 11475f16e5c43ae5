"""Building the learner's models — actor, critic, reference — in torchtitan's order:

    load         the HF architecture of `model.path` (`critic.path`, `ref.path`) from its config,
                 parameters on the meta device (no memory; buffers real), in the dtype the
                 parameters are *stored* in: the master dtype when FSDP shards a trainable model
                 (its shards are the master), the compute dtype otherwise
    convert      model-to-model rewrites before any parallelism: the caller's `ModelConverter`s
                 (learner/converters.py), composed into the model's `Conversion`; each declares
                 what it changes downstream — names, the trainable subset, the TP plan, the
                 source of its new tensors, its state format — and the steps below ask it
    parallelize  pipeline split → tensor parallel (the plan as the converters rewrite it) →
                 activation checkpointing → data parallel (parallelize.py, in that order), still on meta
    materialize  this rank's part only: storage for its stage's shards on the device (host with
                 parameter offload), filled from the checkpoint's safetensors read tensor by
                 tensor (and the converters' new tensors: `fresh` inits, `files`) — no rank ever
                 holds the whole model, only its shards plus the tensor being read
    wrap         a `ShardedModel` (parallel/sharded_model.py): parameters, optimizer state,
                 gradient reduction, clipping, state dicts, the tensors a push reads; it keeps
                 its `Conversion`, which checkpoints, exports and pushes ask for its state format

`train.dp_sharding` (full = ZeRO-3, the default; grad_op = ZeRO-2; none = replicated) takes effect
where there is something to shard over: a pool with dp > 1. With dp = 1 (or one process) every
mode is the replicated path, and the log says so.

What this module does not do: no RL, no data, no process-group init (the layout is built).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from areal_like.learner.converters import BuildContext, Conversion, ModelConverter, parameters_on_meta
from areal_like.learner.parallel.layout import ParallelLayout
from areal_like.learner.parallel.parallelize import parallelize_model
from areal_like.learner.parallel.sharded_model import DP_SHARDING, ShardedModel, full_meta_of

log = logging.getLogger(__name__)

ROLES = ("actor", "critic", "reference")


def effective_dp_sharding(requested: str, layout: ParallelLayout) -> str:
    """`train.dp_sharding` as it applies to this pool: none where dp = 1 (nothing to shard over)."""
    if requested not in DP_SHARDING:
        raise ValueError(f"train.dp_sharding={requested!r}: use one of {', '.join(DP_SHARDING)}")
    return requested if layout.distributed and layout.dp > 1 else "none"


def load_hf(path: str, *, dtype: torch.dtype) -> nn.Module:
    """Step 1: the HF causal LM architecture of `path` (its config.json), parameters on the meta
    device in `dtype`, eval mode (no dropout: train the sampled policy itself). `materialize` fills it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with parameters_on_meta():
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
                conversion: Conversion | None = None, meta: Sequence[tuple] = ()) -> None:
    """Step 4: storage for this rank's parameters (its shards: `to_empty`, which FSDP2 supports on a
    sharded module) and their values from the safetensors files at `path`, read one tensor at a time
    on the host; buffers keep the values they were built with. The converters name the tensors
    (`canonical_name`) and bring their new ones: `fresh` inits run on the local shards, `files` adds
    full tensors to the files' (`meta`: the whole model's names and shapes)."""
    from areal_like.learner.parallel.sharded_model import load_full_into
    from areal_like.weights.disk import SafetensorsDir

    conversion = conversion or Conversion()
    canonical = conversion.canonical_name

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
    weights = conversion.files(weights, meta)  # the converters' new tensors beside the files'
    local = [(canonical(n.removeprefix("hf.")), p) for n, p in stage.named_parameters()]
    local += [(canonical(n.removeprefix("hf.")), b) for n, b in stage.named_buffers()
              if canonical(n.removeprefix("hf.")) in weights]
    load_full_into(local, weights, where, tied=tied, fresh=conversion.fresh())


def build_model(path: str, role: str, layout: ParallelLayout, *, train_cfg, compute_dtype: torch.dtype,
                master_dtype: torch.dtype, device: torch.device, dp_sharding: str,
                checkpoint_layers: bool = False, converters: Sequence[ModelConverter] = (),
                param_offload: bool = False, optimizer_offload: bool = False) -> ShardedModel:
    """load → convert → parallelize → `ShardedModel`, for `role` (actor | critic | reference).
    Trainable: actor and critic; the reference is frozen (sharded the same way, no optimizer).

    `param_offload`: the model is loaded into host memory and FSDP keeps its shards there (its CPU
    offload policy); `optimizer_offload`: AdamW state in host memory between steps (ShardedModel).

    `converters` (learner/converters.py) rewrite the loaded model in order. Where their trainable-key
    filter leaves a frozen rest, that rest is stored in the compute dtype; the trainable tensors are
    stored in the master dtype where FSDP's shards are the master (`BuildContext.trainable_dtype`)."""
    if role not in ROLES:
        raise ValueError(f"unknown model role {role!r}: one of {ROLES}")
    trainable = role != "reference"
    conversion = Conversion(converters)
    build = BuildContext(role=role, trainable=trainable, dp=layout.dp, dp_sharding=dp_sharding,
                         param_offload=param_offload, compute_dtype=compute_dtype, master_dtype=master_dtype,
                         tp=layout.tp)
    stored = build.trainable_dtype if conversion.trainable_keys is None else compute_dtype
    hf = load_hf(path, dtype=stored)  # 1. load (the architecture, parameters on meta)
    from areal_like.learner.moe import FusedExperts, is_moe

    if is_moe(hf):  # transformers' fused experts, read from per-expert files (learner/moe.py)
        conversion = Conversion((FusedExperts(), *conversion.converters))
    for c in conversion:
        c.check(build)
    for c in conversion:  # 2. convert
        hf = c.convert(hf, build)
    meta = full_meta_of(hf, layout.pp, conversion.canonical_name)
    param_names = {conversion.canonical_name(n) for n, _ in hf.named_parameters()}
    tied = bool(getattr(hf.config, "tie_word_embeddings", False))
    stage = parallelize_model(hf, layout, checkpoint_layers=checkpoint_layers and trainable,  # 3. parallelize
                              dp_sharding=dp_sharding, compute_dtype=compute_dtype,
                              reduce_dtype=master_dtype if trainable else compute_dtype, offload=param_offload,
                              tp_plan=conversion.tensor_parallel_plan)
    # 4. materialize this rank's shards (FSDP's CPU offload keeps them in host memory)
    materialize(stage, path, f"{role} model {path!r}", device=torch.device("cpu") if param_offload else device,
                tied=tied, conversion=conversion, meta=meta)
    return ShardedModel(stage, meta, param_names, layout, trainable=trainable,  # 5. wrap
                        out_dim=1 if role == "critic" else None, train_cfg=train_cfg, compute_dtype=compute_dtype,
                        master_dtype=master_dtype, dp_sharding=dp_sharding, role=role, device=device,
                        param_offload=param_offload, optimizer_offload=optimizer_offload and trainable,
                        conversion=conversion)
