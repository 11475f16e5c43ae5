"""Apply a `ParallelLayout` to a plain HF causal LM — one function per strategy.

The model file (transformers' Qwen2/Llama) knows nothing of parallelism; everything is applied
here, afterwards, in this fixed order (as torchtitan; `learner/model.py` calls them):

    1. pipeline split   `split_pipeline_stage`  — keep only this stage's layers (HF names kept)
    2. tensor parallel  `apply_tensor_parallel` — DTensor plans on the attention/MLP projections
                        (rewritten by the model's converters for the modules they wrapped: `tp_plan`;
                        a MoE layer's router and experts stay whole on every tp rank)
    2b. expert parallel `apply_expert_parallel` (learner/moe.py) — a MoE model's fused experts split
                        over the ep ranks (`e` in the allocation), tokens dispatched by all-to-all
    3. activation checkpointing `apply_activation_checkpointing` — per decoder layer (opt-in)
    4. data parallel, last, because it must see the final (TP-sharded, stage-local) parameters:
         `train.dp_sharding=full|grad_op`  `apply_fsdp` — FSDP2 `fully_shard` of each decoder layer,
                         then the stage (final norm), over the dp sub-mesh; the embedding and
                         LM head split by vocabulary rows over dp (`vocab_parallel.py`); the
                         expert-parallel experts are left out (replicated over edp, SUM-reduced)
                         (2-D with TP: the tp DTensors are sharded again over dp)
         `train.dp_sharding=none`  `DataParallelReducer` — a bucketed SUM all-reduce of replicated
                         gradients after the last micro-batch (built by `ShardedModel`)

The pipeline split comes first only because it removes modules; TP then parallelises what is
left, exactly as it would the full model.

Both data-parallel paths SUM gradients over dp: the decoupled-PPO loss is already divided by the
*global* loss-token count, so averaging (DDP's and FSDP's default) would be wrong — FSDP gets a
gradient divide factor of 1. No `DistributedDataParallel`: its wrapper renames parameters away from
their HF names and composes poorly with DTensor parameters inside pipeline stages.

What this module does not do: no data, no loss, no optimizer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from areal_like.learner.moe import apply_expert_parallel
from areal_like.learner.parallel.layout import ParallelLayout
from areal_like.learner.parallel.vocab_parallel import apply_vocab_parallel

# A converter's rewrite of a decoder layer's plan ({submodule: ParallelStyle}, the layer's module names)
TPPlanHook = Callable[[dict, list[str]], dict]


# ---- 1. pipeline parallel -----------------------------------------------------------------------
def stage_layer_ids(num_layers: int, pp: int, stage: int) -> list[int]:
    """Contiguous, balanced layer ranges: 5 layers on 2 stages → [0, 1, 2], [3, 4]."""
    if num_layers < pp:
        raise ValueError(f"{num_layers} decoder layers cannot fill {pp} pipeline stages: use p≤{num_layers}")
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


class PipelineStageModule(nn.Module):
    """One pipeline stage of an HF `*ForCausalLM`: (input ids | hidden) → (hidden | logits).

    Wraps the original HF model object with the modules of other stages removed (set to None), so
    `named_parameters()` (with the `hf.` prefix stripped) are still the HF checkpoint names.
    Runs the decoder layers exactly as `Qwen2Model.forward`/`LlamaModel.forward` do: positions
    0..T−1, the same causal-mask helper, the same rotary embedding.
    """

    def __init__(self, hf_model: nn.Module, layer_ids: list[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.hf = hf_model
        self.layer_ids = layer_ids
        self.first = first
        self.last = last
        # Set by the learner: the last stage returns the final-norm hidden states (B, T, H) instead
        # of lm_head's output, so the log-probabilities run the head in token chunks (logprobs.py).
        self.return_hidden = False
        self.checkpoint_layers = False  # step 3: recompute each decoder layer in backward
        # The dtype activations flow in (model.dtype); under FSDP's mixed precision the stored
        # parameters may be wider (the fp32 master shards). Set by the model builder.
        self.compute_dtype = next(hf_model.parameters()).dtype
        # MoE routing replay (train.routing_replay; learner/moe.py RouterReplay), set by the trainer on the actor:
        # a forward given routes runs each layer through it, its router taking that layer's given experts
        self.router_replay = None

    def forward(self, x: torch.Tensor, routes_BTW: torch.Tensor | None = None) -> torch.Tensor:
        """`routes_BTW`: (B, T, layers × top-k) expert ids to replay (−1: the router's own), or None. A pipeline
        schedule passes it as a keyword to every stage, split into micro-batches like the inputs."""
        from transformers.masking_utils import create_causal_mask

        replay = self.router_replay if routes_BTW is not None else None
        if routes_BTW is not None and replay is None:
            raise RuntimeError("routes given to a pipeline stage without routing replay (train.routing_replay=off)")
        inner = self.hf.model
        h_BTH = inner.embed_tokens(x) if self.first else x
        T = h_BTH.shape[1]
        position_ids = torch.arange(T, device=h_BTH.device).unsqueeze(0)
        mask = create_causal_mask(config=inner.config, inputs_embeds=h_BTH, attention_mask=None,
                                  past_key_values=None, position_ids=position_ids)
        position_embeddings = inner.rotary_emb(h_BTH, position_ids)
        recompute = self.checkpoint_layers and torch.is_grad_enabled()
        for i in self.layer_ids:
            # with routes, the layer runs with its router replaying them — in the recomputation too (same call)
            layer = inner.layers[i] if replay is None else functools.partial(replay.run_layer, i, inner.layers[i],
                                                                             routes_BTW)
            if recompute:
                from torch.utils.checkpoint import checkpoint

                h_BTH = checkpoint(layer, h_BTH, attention_mask=mask,
                                   position_embeddings=position_embeddings, position_ids=position_ids,
                                   use_reentrant=False)
            else:
                h_BTH = layer(h_BTH, attention_mask=mask, position_embeddings=position_embeddings,
                              position_ids=position_ids)
            if replay is not None and torch.is_grad_enabled():  # the training forward's agreement (not a recompute)
                replay.count(i)
        if self.last:
            h_BTH = inner.norm(h_BTH)
            return h_BTH if self.return_hidden else self.hf.lm_head(h_BTH)  # (B, T, H) | (B, T, V) logits
        return h_BTH


def split_pipeline_stage(hf_model: nn.Module, layout: ParallelLayout) -> PipelineStageModule:
    """Keep this rank's stage of `hf_model` (in place) and wrap it; pp=1 gives the whole model."""
    if not hasattr(hf_model, "model") or not hasattr(hf_model.model, "layers"):
        raise ValueError(f"pipeline split supports HF *ForCausalLM with .model.layers, got {type(hf_model).__name__}")
    cfg = hf_model.config
    if layout.pp > 1 and getattr(cfg, "tie_word_embeddings", False):
        raise ValueError("pipeline parallel with tied input/output embeddings is not supported: "
                         "use p1 or a model with tie_word_embeddings=false")
    ids = stage_layer_ids(cfg.num_hidden_layers, layout.pp, layout.pp_rank)
    inner = hf_model.model
    for i in range(len(inner.layers)):
        if i not in ids:
            inner.layers[i] = None  # ModuleList slot kept empty so the HF indices (names) stay
    if not layout.is_first_stage:
        inner.embed_tokens = None
    if not layout.is_last_stage:
        inner.norm = None
        hf_model.lm_head = None
    return PipelineStageModule(hf_model, ids, first=layout.is_first_stage, last=layout.is_last_stage)


def build_pipeline_schedule(stage_module: PipelineStageModule, layout: ParallelLayout, *, n_microbatches: int,
                            loss_fn, schedule: str, device: torch.device, microbatch_shape: tuple[int, int],
                            out_dim: int | None = None):
    """A fresh `PipelineStage` + schedule for one step's micro-batch shapes (`out_dim`: width of the
    last stage's output; None = the vocabulary).

    Built per step because a `PipelineStage` infers its send/recv buffer shapes once, and a step's
    padded (B, T) changes with its data. `scale_grads=False`: the loss is already divided by the
    global loss-token count, so the micro-batch gradients must be summed, not averaged.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    # Static shapes given up front (meta tensors): the stage then skips its runtime shape inference,
    # which runs an extra forward on uninitialised buffers (and would call the loss on garbage).
    B, T = microbatch_shape
    cfg = stage_module.hf.config
    dtype = stage_module.compute_dtype  # activations' dtype (FSDP may store wider parameters)
    meta = torch.device("meta")
    x = (torch.empty(B, T, dtype=torch.int64, device=meta) if stage_module.first
         else torch.empty(B, T, cfg.hidden_size, dtype=dtype, device=meta, requires_grad=True))  # ∂L/∂h goes back
    # hidden states (the loss runs the head in chunks), logits, or 1 for a critic's value head
    last_dim = cfg.hidden_size if stage_module.return_hidden else cfg.vocab_size if out_dim is None else out_dim
    y = torch.empty(B, T, last_dim if stage_module.last else cfg.hidden_size, dtype=dtype, device=meta,
                    requires_grad=True)
    stage = PipelineStage(stage_module, layout.pp_rank, layout.pp, device, input_args=x, output_args=y,
                          # gradients have their activations' shapes; stage 0's int64 ids have none
                          input_grads=None if stage_module.first else x,
                          output_grads=None if stage_module.last else y, group=layout.pp_group)
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}.get(schedule)
    if cls is None:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: set train.pp_schedule=1f1b or gpipe")
    return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)


# ---- 2. tensor parallel -------------------------------------------------------------------------
# Megatron's split of a Qwen2/Llama decoder layer: column-parallel in, row-parallel out, so each
# attention block and each MLP needs one all-reduce forward and one backward. Embedding, norms and
# lm_head stay replicated (plain tensors): tiny vocabularies do not need vocab parallelism, and
# replicated logits let the loss run unchanged on every TP rank.
_TP_PLAN_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_TP_PLAN_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


# Replicated over tp but computing on a tp rank's heads only (Qwen3's per-head RMSNorms of q and k): each
# rank's gradient is its heads' share — SUMmed over tp after backward (ShardedModel.reduce_grads).
TP_PARTIAL_GRAD = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


def tp_partial_grad(name: str) -> bool:
    return name.endswith(TP_PARTIAL_GRAD)


def check_tensor_parallel(config, tp: int) -> None:
    """Head counts must split evenly: each TP rank holds heads/tp query and kv_heads/tp KV heads
    (GQA keeps its group ratio per rank)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or kv % tp:
        raise ValueError(f"tensor parallel t{tp} needs num_attention_heads ({heads}) and num_key_value_heads "
                         f"({kv}) divisible by {tp}: use a t that divides {kv}")
    for key in ("intermediate_size", "shared_expert_intermediate_size"):  # dense MLPs, a MoE's shared expert
        size = getattr(config, key, None)
        if size and size % tp:
            raise ValueError(f"tensor parallel t{tp} needs {key} ({size}) divisible by {tp}: use a t that divides it")


def apply_tensor_parallel(stage_module: PipelineStageModule, layout: ParallelLayout,
                          tp_plan: TPPlanHook | None = None) -> None:
    """Shard this stage's decoder layers over the tp sub-mesh (in place); no-op for t1. `tp_plan`: the
    model's converters rewrite each layer's plan for the modules they wrapped
    (`ModelConverter.tensor_parallel_plan`, learner/converters.py)."""
    if layout.tp == 1:
        return
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_tensor_parallel(stage_module.hf.config, layout.tp)
    tp_mesh = layout.submesh("tp")
    for i in stage_module.layer_ids:
        layer = stage_module.hf.model.layers[i]
        plan = {**{n: ColwiseParallel() for n in _TP_PLAN_COLWISE}, **{n: RowwiseParallel() for n in _TP_PLAN_ROWWISE}}
        if tp_plan is not None:
            plan = tp_plan(plan, [n for n, _ in layer.named_modules()])
        parallelize_module(layer, tp_mesh, plan)


# ---- 4. data parallel ---------------------------------------------------------------------------
def expert_parallel_params(module: nn.Module) -> set[nn.Parameter]:
    """The parameters of `module` split over the ep mesh (`apply_expert_parallel`)."""
    return {p for p in module.parameters() if is_expert_parallel(p)}


def is_expert_parallel(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and (t.device_mesh.mesh_dim_names or ()) == ("ep",)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class DataParallelReducer:
    """SUM-all-reduce of all gradients over the dp group, in flattened buckets of `bucket_bytes`.

    `params` are the optimizer's parameters: with a 16-bit `model.dtype` and an fp32 master
    (`train.master_dtype`) these are the fp32 masters, whose `.grad` accumulated the 16-bit model
    gradients of every micro-batch in fp32 (`ShardedModel._grad_to_master`) — so the reduction runs in fp32.

    `train.dp_sharding=none` only (FSDP reduce-scatters in backward instead).
    Called once per optimizer step, after the last micro-batch's backward (no overlap with the
    backward pass — fine for the models this runs on; DDP-style hooks would add overlap). A
    parameter without a gradient on this rank (it got no samples) joins with zeros, so every dp
    rank issues the same collectives in the same order.
    """

    def __init__(self, params: list[nn.Parameter], layout: ParallelLayout, bucket_bytes: int = 25 * 2**20, *,
                 group: dist.ProcessGroup | None = None, size: int | None = None) -> None:
        """`group`/`size`: the group to reduce over (default: dp; the expert-parallel experts': edp)."""
        self.params = params
        self.layout = layout
        self.bucket_bytes = bucket_bytes
        self.group = group if group is not None else layout.dp_group
        self.size = layout.dp if size is None else size

    def all_reduce_grads(self) -> None:
        if self.size == 1 or not self.params:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [local_tensor(p.grad) for p in self.params]
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads + [None]:
            if g is not None and (not bucket or (size + g.numel() * g.element_size() <= self.bucket_bytes
                                                 and g.dtype == bucket[0].dtype)):
                bucket.append(g)
                size += g.numel() * g.element_size()
                continue
            if bucket:
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
                for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    dst.copy_(src)
            if g is not None:
                bucket, size = [g], g.numel() * g.element_size()
            else:
                bucket = []


def apply_fsdp(stage: PipelineStageModule, layout: ParallelLayout, *, mode: str, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype, offload: bool = False) -> None:
    """Step 4 with `train.dp_sharding=full|grad_op`: FSDP2 over the dp sub-mesh, in place.

    Each decoder layer is one FSDP unit (one all-gather in forward, one reduce-scatter in backward);
    the embedding and the LM head are split by vocabulary rows over dp instead (vocab_parallel.py:
    FSDP ignores them; never gathered); the stage itself is the root unit (final norm, a critic's
    value head; with `offload`, the embedding and head too). `full`
    (ZeRO-3) frees each layer's gathered parameters after its forward and gathers them again in
    backward; `grad_op` (ZeRO-2) keeps them until backward. The root is never resharded after
    forward (FSDP's rule), which is what lets the loss run `lm_head` on the hidden states in chunks
    after the stage returned. Mixed precision: the stored shards keep their dtype (the master);
    `param_dtype` is what forward computes in, `reduce_dtype` what gradients are reduced in.
    Gradients are SUMmed (divide factor 1) and a parameter a micro-batch did not use joins the
    reduce-scatter with zeros (a dp rank's micro-batch may hold no loss position).

    `offload` (`train.param_offload`, …): FSDP2's CPU offload policy — the shards and their
    gradients live in host memory (pinned on CUDA), each unit copied to the device for its
    all-gather, and the optimizer steps on the host."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mode not in ("full", "grad_op"):
        raise ValueError(f"train.dp_sharding={mode!r}: use full, grad_op or none")
    mesh = layout.submesh("dp")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    off = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    inner = stage.hf.model
    # The vocabulary rows split over dp instead of an embedding/head gathered for the whole step
    # (vocab_parallel.py). With parameter offload they stay in the root unit, offloaded with it.
    ignored = set() if offload else apply_vocab_parallel(stage, mesh, dtype=param_dtype)
    for i in stage.layer_ids:
        # expert-parallel experts (ep-mesh DTensors) are not FSDP's: split over ep, SUM-reduced over edp
        experts = expert_parallel_params(inner.layers[i])
        ignored |= experts
        fully_shard(inner.layers[i], mesh=mesh, mp_policy=mp, offload_policy=off, reshard_after_forward=mode == "full",
                    ignored_params=experts or None)
    fully_shard(stage, mesh=mesh, mp_policy=mp, offload_policy=off, ignored_params=ignored or None)
    for m in stage.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    stage.set_reduce_scatter_unused_params(True)  # type: ignore[attr-defined]
    stage.compute_dtype = param_dtype


def parallelize_model(hf_model: nn.Module, layout: ParallelLayout, *, checkpoint_layers: bool = False,
                      dp_sharding: str = "none", compute_dtype: torch.dtype | None = None,
                      reduce_dtype: torch.dtype | None = None, offload: bool = False,
                      tp_plan: TPPlanHook | None = None) -> PipelineStageModule:
    """The fixed order: pipeline split → tensor parallel → activation checkpointing → data parallel.

    Returns this rank's stage module. With `dp_sharding` full/grad_op the stage is FSDP-sharded here;
    with `none` the data-parallel reducer is built by `ShardedModel` over the stage's final parameters.
    `tp_plan`: the model's converters' rewrite of each decoder layer's TP plan (`apply_tensor_parallel`).
    """
    stage = split_pipeline_stage(hf_model, layout)  # 1
    apply_tensor_parallel(stage, layout, tp_plan)  # 2
    apply_expert_parallel(stage, layout)  # 2b: a MoE model's experts over the ep ranks (learner/moe.py)
    apply_activation_checkpointing(stage, checkpoint_layers)  # 3
    if dp_sharding != "none":  # 4
        dtype = compute_dtype or stage.compute_dtype
        apply_fsdp(stage, layout, mode=dp_sharding, param_dtype=dtype, reduce_dtype=reduce_dtype or dtype,
                   offload=offload)
    elif offload:
        raise ValueError("parameter offload goes through FSDP: set train.dp_sharding=full with d ≥ 2")
    if offload and layout.ep > 1:
        raise ValueError(f"parameter offload with expert parallel e{layout.ep}: the expert-parallel experts are not "
                         "FSDP's and would stay on the device; set train.param_offload=false (and ref.param_offload, "
                         "critic.param_offload) or use e1")
    return stage


def apply_activation_checkpointing(stage: PipelineStageModule, enabled: bool = True) -> None:
    """Step 3: recompute every decoder layer of this stage in the backward pass (non-reentrant
    `torch.utils.checkpoint`, which works on TP-sharded DTensor layers and inside pipeline stages);
    only the layer inputs are kept. Applied in the stage's own loop, not through HF's
    `gradient_checkpointing_enable`, which only acts in train() mode (the learner runs eval(): no
    dropout) and not on a stage's hand-run layers."""
    stage.checkpoint_layers = bool(enabled)
