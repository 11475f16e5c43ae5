"""`ShardedModel`: one model of the learner on this rank, after `learner/model.py` built it.

It owns what a parallel layout changes about a model — this rank's pipeline stage (TP-sharded, and
dp-sharded under `train.dp_sharding=full|grad_op`), the optimizer and its state, the gradient
reduction over dp, the global gradient norm and clipping, the full state dict gathered from the
shards (pushes, checkpoints, exports) and loading one back. The `Trainer` keeps the RL step only.

Data parallel, two ways (`dp_sharding`, resolved by `model.build_model`):

    none           every dp rank holds the whole stage; after the last micro-batch the gradients
                   are SUM-all-reduced over dp (`DataParallelReducer`). With a 16-bit compute dtype
                   and an fp32 `train.master_dtype` the optimizer owns fp32 master copies, each
                   backward's 16-bit gradient moved into the master's fp32 `.grad` at once (a
                   post-accumulate-grad hook); `step` copies the masters back (Megatron's layout).
    full | grad_op FSDP2 (`fully_shard`, parallelize.py step 4): parameters, gradients and AdamW
                   state are dim-0 shards over dp (DTensors; 2-D with TP). The shards *are* the
                   master — held in `train.master_dtype` — and FSDP's mixed-precision policy casts
                   them to `model.dtype` at each all-gather and reduce-scatters gradients in the
                   master dtype, SUM (divide factor 1: the loss is already divided by the global
                   loss-token count). No separate master, no hook, no reducer.

Learner state per parameter under bf16 compute and an fp32 master: 2 + 4 + 4 + 8 = 18 bytes with
`none` (bf16 parameter, fp32 gradient, fp32 master, AdamW m and v), 16/dp with `full` (fp32 shard,
its gradient, m and v) plus the all-gathered bf16 parameters of the layer running.

Every method that moves tensors is collective over the pool: call it on every rank, in the same
order. Full-model names, shapes and stages (`full_meta`, recorded before the pipeline split) keep
push order (what `save_pretrained` writes), whatever the layout. Names are the model's canonical
ones (its `Conversion`'s `canonical_name`, learner/converters.py); a part of the state — e.g. the
trainable subset a converter's key filter names — is read and loaded through a `keys` filter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from areal_like.learner.converters import Conversion
from areal_like.learner.parallel.layout import ParallelLayout
from areal_like.learner.parallel.parallelize import (
    DataParallelReducer,
    PipelineStageModule,
    is_expert_parallel,
    local_tensor,
    stage_layer_ids,
    tp_partial_grad,
)

DP_SHARDING = ("full", "grad_op", "none")

FullMeta = list[tuple[str, tuple[int, ...], torch.dtype, int]]  # (HF name, shape, dtype, pipeline stage)


def full_meta_of(hf_model: nn.Module, pp: int, canonical_name: Callable[[str], str] = lambda n: n) -> FullMeta:
    """Names (`canonical_name`'s: the converters'), shapes, dtypes and pipeline stages of every parameter
    and persistent buffer of the whole (unsplit) model, in `named_parameters` order then buffers — what
    the push sends."""
    persistent = set(hf_model.state_dict().keys())
    full = [(canonical_name(n), p) for n, p in hf_model.named_parameters()]
    full += [(canonical_name(n), b) for n, b in hf_model.named_buffers() if n in persistent]
    layers = hf_model.config.num_hidden_layers

    def stage_of(name: str) -> int:
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            return next(s for s in range(pp) if i in stage_layer_ids(layers, pp, s))
        if name.startswith("model.embed_tokens."):
            return 0
        if name.startswith(("model.norm.", "lm_head.")):
            return pp - 1
        if pp == 1:
            return 0
        raise ValueError(f"cannot place parameter {name!r} on a pipeline stage: use p1 for this model")

    return [(n, tuple(t.shape), t.dtype, stage_of(n)) for n, t in full]


def _sharded_dims(t: torch.Tensor) -> str:
    """Mesh dims a DTensor is split over ("dp", "tp", "dp+tp"), "" for a replicated/plain tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor):
        return ""
    names = t.device_mesh.mesh_dim_names or ()
    # FSDP's dp split of a TP shard is a _StridedShard, which is not `is_shard()`
    return "+".join(sorted(n for n, pl in zip(names, t.placements) if pl.is_shard() or isinstance(pl, _StridedShard)))


def _own_part(full: Mapping[str, torch.Tensor], name: str, t: torch.Tensor) -> torch.Tensor | None:
    """This rank's block of tensor `name` read alone from a file source that can read row ranges
    (`SafetensorsDir.read_rows`): for a DTensor sharded with plain Shard/Replicate placements, the rows
    of its block along dim 0 (one contiguous read), then the block's columns of those — a rank of d×t
    reads ~1/d of each FSDP-sharded tensor instead of all of it. None: read the full tensor (a dict
    source, a plain tensor, other placements)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    read_rows = getattr(full, "read_rows", None)
    if read_rows is None or not isinstance(t, DTensor) or t.ndim == 0:
        return None
    if not all(type(p) in (Shard, Replicate) for p in t.placements) or list(full.shape(name)) != list(t.shape):
        return None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    block = read_rows(name, offset[0], offset[0] + shape[0])
    for d in range(1, len(shape)):
        if shape[d] != t.shape[d]:
            block = block.narrow(d, offset[d], shape[d])
    # a layout whose local tensor is not that block (padding, strided sharding): the full read
    return block if tuple(block.shape) == tuple(t.to_local().shape) else None


def load_full_into(local: list[tuple[str, torch.Tensor]], full: Mapping[str, torch.Tensor], where: str, *,
                   tied: bool, masters: Mapping[str, torch.Tensor] | None = None,
                   fresh: Mapping[str, Callable[[torch.Tensor], Any]] | None = None) -> None:
    """Copy each full tensor `full[name]` (a dict, or a lazily read `SafetensorsDir`: one tensor in
    memory at a time) into this rank's part of the local tensor of that name — a DTensor's shard
    (TP, FSDP), a plain tensor whole — and into its master copy if it has one. Names in `fresh` are
    not read: their init function runs on the local tensor instead (a converter's new tensor, e.g.
    the critic's zero value head). A tied `lm_head.weight` loads through the embedding."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    masters = masters or {}
    fresh = fresh or {}
    with torch.no_grad():
        for name, t in local:
            if name in fresh:
                fresh[name](local_tensor(t))
                continue
            if name not in full:
                if tied and name == "lm_head.weight":
                    continue  # tied to model.embed_tokens.weight, loaded through it
                raise KeyError(f"{where} lacks {name}")
            part = _own_part(full, name, t)
            if part is not None:  # this rank's block alone, read from the file (issue 40 item 8)
                for dst in (t, masters.get(name)):
                    if dst is not None:
                        (dst.to_local() if isinstance(dst, DTensor) else dst).copy_(part)
                del part
                continue
            src = full[name]
            for dst in (t, masters.get(name)):  # the master from the file, not from t
                if dst is None:
                    continue
                if isinstance(dst, DTensor):
                    shard = distribute_tensor(src.to(dst.dtype), dst.device_mesh, dst.placements, src_data_rank=None)
                    dst.to_local().copy_(shard.to_local())
                    del shard
                else:
                    dst.copy_(src)
            del src


class ShardedModel:
    """One model of the trainer on this rank: its pipeline stage (TP- and, with `dp_sharding`
    full/grad_op, dp-sharded); optimizer if trainable. See the module docstring. `conversion`: the
    converters the model was built with (its names, trainable subset and state format)."""

    def __init__(self, stage_module: PipelineStageModule, full_meta: FullMeta, param_names: set[str],
                 layout: ParallelLayout, *, trainable: bool, out_dim: int | None, train_cfg, compute_dtype: torch.dtype,
                 master_dtype: torch.dtype, dp_sharding: str, role: str, device: torch.device | None = None,
                 param_offload: bool = False, optimizer_offload: bool = False,
                 conversion: Conversion | None = None) -> None:
        self.layout = layout
        self.conversion = conversion or Conversion()
        canonical_name = self.conversion.canonical_name
        self.device = device or torch.device("cpu")  # where compute and collectives run
        self.optimizer_offload = optimizer_offload
        self.param_offload = param_offload  # FSDP keeps the shards in host memory (parallelize.apply_fsdp)
        self.role = role
        self.stage_module = stage_module
        self.config = stage_module.hf.config
        self.out_dim = out_dim
        self.dp_sharding = dp_sharding
        self.fsdp = dp_sharding != "none"
        self.compute_dtype = compute_dtype
        self.tied = bool(getattr(self.config, "tie_word_embeddings", False))
        self.full_meta = full_meta
        # A separate master copy exists only without FSDP (FSDP's shards are the master).
        self.master_dtype = master_dtype if trainable and master_dtype != compute_dtype and not self.fsdp else None
        # The dtypes as `state_tensors` holds them (the master's for parameters): what gathers carry.
        # `param_names`: the whole model's parameters (other stages' too), buffers excluded.
        self.param_names = param_names
        self.state_meta = [(n, shape, self.master_dtype if self.master_dtype is not None and dt.is_floating_point
                            and n in param_names else dt, st) for n, shape, dt, st in full_meta]
        # A language model's last stage outputs hidden states; its head (`lm_head`) runs in the loss,
        # in token chunks (train.logits_chunk_tokens). A critic's (hidden → 1) value head stays in the stage.
        self.stage_module.return_hidden = out_dim is None
        self.head = stage_module.hf.lm_head if layout.is_last_stage else None
        persistent = {n for n, *_ in full_meta}
        self.local = [(canonical_name(n.removeprefix("hf.")), p) for n, p in stage_module.named_parameters()]
        self.local += [(canonical_name(n.removeprefix("hf.")), b) for n, b in stage_module.named_buffers()
                       if canonical_name(n.removeprefix("hf.")) in persistent]
        self.optimizer = None
        self.reducer: DataParallelReducer | None = None
        self.expert_reducer: DataParallelReducer | None = None
        self.tp_partial: list[nn.Parameter] = []
        self.params: list[nn.Parameter] = []
        self.master: list[nn.Parameter] = []  # the optimizer's parameters when master_dtype is set
        self.master_by_name: dict[str, nn.Parameter] = {}
        self.opt_params: list[nn.Parameter] = []
        self.opt_names: list[str] = []  # HF names of `opt_params`, in order
        if trainable:
            named = [(n, p) for n, p in self.local if isinstance(p, nn.Parameter) and p.requires_grad]
            self.params = [p for _, p in named]
            self.opt_names = [n for n, _ in named]
            if self.master_dtype is not None:
                self.master = [nn.Parameter(p.detach().to(self.master_dtype).clone()) for p in self.params]
                self.master_by_name = {n: m for (n, _), m in zip(named, self.master)}
                for p, m in zip(self.params, self.master):
                    p.register_post_accumulate_grad_hook(lambda p, m=m: self._grad_to_master(p, m))
            self.opt_params = self.master or self.params
            # expert-parallel experts (ep-mesh DTensors; FSDP leaves them out): SUM over the edp ranks alone
            experts = [p for p in self.opt_params if is_expert_parallel(p)]
            if not self.fsdp:
                self.reducer = DataParallelReducer([p for p in self.opt_params if not is_expert_parallel(p)], layout)
            if experts:
                self.expert_reducer = DataParallelReducer(experts, layout, group=layout.edp_group,
                                                          size=layout.dp * layout.tp // layout.ep)
            if layout.tp > 1:  # gradients that are each tp rank's share (parallelize.TP_PARTIAL_GRAD)
                self.tp_partial = [p for n, p in zip(self.opt_names, self.opt_params) if tp_partial_grad(n)]
            betas = tuple(float(b) for b in train_cfg.adam_betas)
            if len(betas) != 2:
                raise ValueError(f"train.adam_betas must have 2 entries, got {train_cfg.adam_betas}")
            # foreach=False: DTensor and plain-tensor parameters share one param group.
            self.optimizer = torch.optim.AdamW(self.opt_params, lr=train_cfg.lr, betas=betas,  # type: ignore[arg-type]
                                               eps=train_cfg.adam_eps, weight_decay=train_cfg.weight_decay,
                                               foreach=False)
        else:
            for _, p in self.local:
                p.requires_grad_(False)
        self.optimizer_steps = 0
        self.asleep: set[str] = set()  # what `sleep()` moved to host memory ("optimizer", "params") until `wake()`

    # ---- gradients and the optimizer step ----------------------------------------------------------
    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
            for p in self.params if self.master else ():
                p.grad = None

    @staticmethod
    def _grad_to_master(p: torch.Tensor, m: torch.Tensor) -> None:
        """Move a 16-bit gradient into the master's `.grad`: accumulated over micro-batches in the
        master dtype (as Megatron's main_grad), the 16-bit one freed as soon as backward made it."""
        if p.grad is None:
            return
        if m.grad is None:
            m.grad = p.grad.to(m.dtype)
        else:
            m.grad.add_(p.grad)
        p.grad = None

    def reduce_grads(self) -> None:
        """Gradients onto the optimizer's parameters, reduced over dp, in the master dtype. FSDP
        reduce-scattered them in backward already; without it: to the master (a gradient set some
        other way than backward), then the dp SUM all-reduce. Expert-parallel experts: SUM over edp.
        Replicated parameters that saw a tp rank's heads only (Qwen3's q/k norms): SUM over tp."""
        if not self.fsdp:
            for p, m in zip(self.params, self.master):
                self._grad_to_master(p, m)
        for p in self.tp_partial:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(local_tensor(p.grad), group=self.layout.tp_group)
        if not self.fsdp:
            assert self.reducer is not None
            self.reducer.all_reduce_grads()
        if self.expert_reducer is not None:
            self.expert_reducer.all_reduce_grads()

    @property
    def lockstep(self) -> bool:
        """Whether every dp rank must run as many forwards as the others (FSDP's gathers, expert parallel's
        all-to-alls pair up across them): the trainer pads a rank's micro-batches with fillers."""
        return self.fsdp or self.layout.ep > 1

    def _optimizer_state_to(self, device: torch.device) -> None:
        """Move the AdamW state (m, v; DTensor shards included) to `device` (optimizer offload)."""
        assert self.optimizer is not None
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and v.device != device and k != "step":
                    st[k] = v.to(device, non_blocking=device.type == "cpu")

    def step(self) -> None:
        """AdamW on the optimizer's parameters, then master → model (cast to the compute dtype).
        With `optimizer_offload` the AdamW state comes from host memory for the step and goes back."""
        assert self.optimizer is not None
        if self.optimizer_offload:
            self._optimizer_state_to(self.device)
        self.optimizer.step()
        if self.optimizer_offload:
            self._optimizer_state_to(torch.device("cpu"))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the copies finished before reuse
        self.optimizer_steps += 1
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                local_tensor(p).copy_(local_tensor(m))

    # ---- co-located mode: sleep between training phases -------------------------------------------
    def sleep(self, *, keep_params: bool = False) -> None:
        """Free the gradients; on a CUDA rank move the AdamW state and (unless `keep_params`) the
        parameters — FSDP's shards, unless its CPU offload keeps them on the host already — and the
        separate master to host memory: what verl's hybrid engine offloads while the co-located servers
        generate. `keep_params`: before the weight handoff, which reads them. On CPU nothing moves."""
        self.zero_grad()
        if self.device.type != "cuda":
            return
        host = torch.device("cpu")
        if self.optimizer is not None and not self.optimizer_offload and "optimizer" not in self.asleep:
            self._optimizer_state_to(host)
            self.asleep.add("optimizer")
        if not keep_params and "params" not in self.asleep:
            if not self.param_offload:
                self.stage_module.to(host)  # FSDP2 re-registers its sharded parameters after `_apply`
            for m in self.master:
                m.data = m.data.to(host)
            self.asleep.add("params")
        torch.cuda.current_stream(self.device).synchronize()

    def wake(self) -> None:
        """Undo `sleep`: what it moved goes back to the device."""
        if "params" in self.asleep:
            if not self.param_offload:
                self.stage_module.to(self.device)
            for m in self.master:
                m.data = m.data.to(self.device)
        if "optimizer" in self.asleep:
            self._optimizer_state_to(self.device)
        self.asleep.clear()

    def reshard(self) -> None:
        """Free the all-gathered parameters FSDP kept after a forward without backward (the root's,
        which FSDP never reshards after forward); no-op without FSDP."""
        if self.fsdp:
            self.stage_module.reshard()  # type: ignore[operator]

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's tensors by HF name, parameters as the optimizer holds them (the fp32 master
        where there is one; FSDP's shards): what pushes, checkpoints and exports read."""
        return {n: self.master_by_name.get(n, t) for n, t in self.local}

    def grad_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's gradients of the optimizer's parameters by HF name (after `reduce_grads`: reduced)."""
        return {n: self.master_by_name.get(n, p).grad for n, p in self.local  # type: ignore[misc]
                if isinstance(p, nn.Parameter) and self.master_by_name.get(n, p).grad is not None}

    def grad_norm_and_clip(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the full gradient (as `clip_grad_norm_` of one process), then clip.

        Σ‖g‖² of each gradient's local part, summed over the mesh dims it is split over (dp for
        FSDP shards, tp for TP shards, both for 2-D) and counted once where replicated — then Σ over
        pp stages. Without FSDP dp ranks hold identical gradients after the all-reduce: no dp sum.
        """
        L = self.layout
        dev = self.device  # the sums are reduced on the device groups (offloaded gradients are on the host)
        sq = {k: torch.zeros((), device=dev) for k in ("", "dp", "tp", "dp+tp", "ep")}
        for p in self.opt_params:
            if p.grad is not None:
                sq[_sharded_dims(p.grad)] += local_tensor(p.grad).float().pow(2).sum().to(dev)
        if L.dp > 1 and self.fsdp:
            both = torch.stack([sq["dp+tp"], sq["dp"]])
            dist.all_reduce(both, group=L.dp_group)
            sq["dp+tp"], sq["dp"] = both[0], both[1]
        if L.tp > 1:
            both = torch.stack([sq["dp+tp"], sq["tp"]])
            dist.all_reduce(both, group=L.tp_group)
            sq["dp+tp"], sq["tp"] = both[0], both[1]
        if L.ep > 1:  # expert-parallel experts: each ep rank holds its experts' (identical over edp)
            dist.all_reduce(sq["ep"], group=L.ep_group)
        total = sq[""] + sq["dp"] + sq["tp"] + sq["dp+tp"] + sq["ep"]
        if L.pp > 1:
            dist.all_reduce(total, group=L.pp_group)
        norm = total.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # the formula of clip_grad_norm_
        coef_on = {dev: coef}
        for p in self.opt_params:
            if p.grad is not None:
                g = local_tensor(p.grad)
                g.mul_(coef_on.setdefault(g.device, coef.to(g.device)))
        return norm

    # ---- full tensors ------------------------------------------------------------------------------
    def gather_one(self, i: int, local: dict[str, torch.Tensor] | None = None,
                   dtype: torch.dtype | None = None, *, everywhere: bool = False) -> torch.Tensor | None:
        """The full (unsharded) tensor `state_meta[i]` on rank 0, None elsewhere; `local` None = the
        state (`state_tensors`: the master where there is one). Collective over the ranks that hold
        a part of it: its stage's ranks all-gather the DTensor over the dims it is split on (tp, dp
        with FSDP); a later stage's (dp 0, tp 0) rank sends it to rank 0 over the pool's world group.
        Every rank calls it with the same `i`s in the same order (a rank that holds no part returns
        at once), which pairs the collectives up. `dtype` (a push: the servers' dtype): a floating-point
        tensor is cast shard by shard *before* the gather and the stage transfer — half the bytes of an
        fp32 master for bf16 servers, and the same values as casting the gathered tensor (elementwise).
        `everywhere`: every rank of the pool gets the full tensor (a per-GPU handoff, where each rank hands
        its own copy to the server on its GPU): its stage's ranks from the all-gather, the other stages'
        by a broadcast from the stage's sending rank over the pool."""
        from torch.distributed.tensor import DTensor

        L = self.layout
        name, shape, held, stage = self.state_meta[i]
        want = dtype if dtype is not None and held.is_floating_point else None  # None: as held
        if stage != L.pp_rank and L.rank != 0 and not everywhere:
            return None
        full = None
        if stage == L.pp_rank:
            local = self.state_tensors() if local is None else local
            t = local[name].detach()
            cast = want is not None and t.dtype != want
            if isinstance(t, DTensor) and (t.to_local().device != self.device or cast):
                # an offloaded shard is gathered on the device; a push's cast happens to the shard
                t = DTensor.from_local(t.to_local().to(self.device, want or t.dtype), t.device_mesh, t.placements,
                                       run_check=False, shape=t.shape, stride=t.stride())
            elif cast:
                t = t.to(want)
            full = (t.full_tensor() if isinstance(t, DTensor) else t).contiguous()
            del t
        if everywhere:
            if L.pp > 1:
                if full is None:
                    full = torch.empty(shape, dtype=want or held, device=self.device)
                dist.broadcast(full, src=L.stage_rank(stage), group=L.world_group)
            return full
        if stage == 0:
            return full if L.rank == 0 else None
        if L.rank == 0:  # a later stage's tensor: from that stage's sending rank
            full = torch.empty(shape, dtype=want or held, device=self.device)
            dist.recv(full, src=L.stage_rank(stage), group=L.world_group)
            return full
        if L.rank == L.stage_rank(stage):
            assert full is not None
            dist.send(full, dst=0, group=L.world_group)
        return None

    def gather_full(self, local: dict[str, torch.Tensor] | None = None, *, params_only: bool = False
                    ) -> list[tuple[str, torch.Tensor]]:
        """Every full tensor on rank 0 ([] elsewhere), `full_meta` order; `local` None = the state,
        else e.g. the gradients (with `params_only`: no buffers). Holds the whole model on rank 0:
        for tests and small models; pushes, exports and checkpoints stream `weights()`. Collective."""
        local = self.state_tensors() if local is None else local
        out = []
        trains = self.conversion.trainable_keys
        for i, (name, *_) in enumerate(self.state_meta):
            if params_only and (name not in self.param_names or (trains is not None and not trains(name))):
                continue  # (gradients: a frozen rest, outside the converters' trainable subset, has none)
            t = self.gather_one(i, local)
            if t is not None:
                out.append((name, t))
        return out

    def needs_gather(self) -> bool:
        """Whether rank 0 lacks part of the model (pipeline stages, TP or FSDP shards): the same on every rank."""
        from torch.distributed.tensor import DTensor

        return self.layout.pp > 1 or any(isinstance(t, DTensor) for _, t in self.local)

    def weights(self, announce: Callable[[str], None] | None = None, *,
                keys: Callable[[str], bool] | None = None) -> GatheredWeights:
        """A `WeightSource` of the full state (`weights.source`): what a push or an export reads.
        `keys`: the tensors whose names it accepts only (e.g. a converter's trainable subset)."""
        only = None if keys is None else [i for i, (n, *_) in enumerate(self.state_meta) if keys(n)]
        return GatheredWeights(self, announce, only=only)

    def load_full(self, full: Mapping[str, torch.Tensor], where: str, *,
                  keys: Callable[[str], bool] | None = None) -> None:
        """Copy full (unsharded) tensors into this rank's shard of every local tensor (and the master);
        `keys`: the local tensors whose names it accepts only (`full` holds no others)."""
        local = self.local if keys is None else [(n, t) for n, t in self.local if keys(n)]
        load_full_into(local, full, where, tied=self.tied, masters=self.master_by_name)

    # ---- optimizer state by name (sharded checkpoints: torch.distributed.checkpoint) ------------------
    _ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")

    def optimizer_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """This rank's AdamW state keyed `<prefix>.<HF name>.<exp_avg|exp_avg_sq|step>`: DTensor shards
        (FSDP over dp, TP) or plain tensors (replicated). The keys and the global shapes do not depend
        on the layout, so a DCP checkpoint of them loads into any other layout. {} before the first step."""
        assert self.optimizer is not None
        out: dict[str, torch.Tensor] = {}
        for n, p in zip(self.opt_names, self.opt_params):
            st = self.optimizer.state.get(p)
            if st:
                out.update({f"{prefix}.{n}.{k}": st[k] for k in self._ADAM_KEYS})
        return out

    def empty_optimizer_tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """What `optimizer_tensors` would hold here, zeroed, to load a checkpoint into (each moment
        with its parameter's dtype, device and placements; the step a 0-d float32 on the host)."""
        out: dict[str, torch.Tensor] = {}
        for n, p in zip(self.opt_names, self.opt_params):
            out[f"{prefix}.{n}.exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format).detach()
            out[f"{prefix}.{n}.exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format).detach()
            out[f"{prefix}.{n}.step"] = torch.zeros((), dtype=torch.float32)
        return out

    def set_optimizer_tensors(self, loaded: dict[str, torch.Tensor], prefix: str) -> None:
        """Install `empty_optimizer_tensors` after a checkpoint filled them."""
        assert self.optimizer is not None
        for n, p in zip(self.opt_names, self.opt_params):
            self.optimizer.state[p] = {k: loaded[f"{prefix}.{n}.{k}"] for k in self._ADAM_KEYS}
        if self.optimizer_offload:
            self._optimizer_state_to(torch.device("cpu"))

    def load_optimizer_state(self, osd: dict[str, Any]) -> None:
        """A per-rank `optimizer.state_dict()` of checkpoint formats 2-3 (DTensor state as local shards),
        same layout only; format 4 goes through `set_optimizer_tensors`."""
        from torch.distributed.tensor import DTensor

        assert self.optimizer is not None
        self.optimizer.load_state_dict(osd)  # casts floating state to the parameters' (master) dtype and device
        for p in self.opt_params:  # local shards back to DTensors like their parameter
            if isinstance(p, DTensor):
                st = self.optimizer.state.get(p, {})
                for k, v in list(st.items()):
                    if torch.is_tensor(v) and not isinstance(v, DTensor) and v.dim() > 0:
                        # shape/stride given: FSDP's dim-0 shards may be uneven (the last rank's shorter)
                        st[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                                   shape=p.shape, stride=p.stride())
        if self.optimizer_offload:
            self._optimizer_state_to(torch.device("cpu"))


def dtype_word(dtype: torch.dtype | None) -> str:
    """A gather command's dtype field: "bfloat16", or "-" for as held (`parse_dtype_word` reads it back)."""
    return "-" if dtype is None else str(dtype).removeprefix("torch.")


def parse_dtype_word(word: str) -> torch.dtype | None:
    return None if word == "-" else getattr(torch, word)


class GatheredWeights:
    """A `weights.source.WeightSource` over a `ShardedModel`'s full state, gathered tensor by tensor.

    Two ways to read it. Collective (`announce` None): every rank iterates the same `open(indices)`
    (an HF export, a checkpoint); rank 0 gets the tensors, the others None. Led (`announce` set, a
    push): only rank 0 iterates; before each bucket's gathers it announces the bucket to the
    followers (`ParallelLayout.leader_command`), which read the same bucket collectively (an `open`
    without announcements, its tensors dropped) from their `leader_ready` wait. Either way rank 0
    holds one full tensor at a time beyond its shard."""

    def __init__(self, model: ShardedModel, announce: Callable[[str], None] | None = None,
                 only: list[int] | None = None, wire_dtype: torch.dtype | None = None) -> None:
        self.model = model
        # the dtype floating-point tensors are gathered in (a pusher sets it to the servers' dtype before it
        # opens a bucket: the shards are cast before the all-gather and the stage transfer); None = as held
        self.wire_dtype = wire_dtype
        self.announce = announce
        # `only`: a subset of the state (indices of `state_meta`, e.g. a converter's trainable subset); `open` takes
        # indices into it, announced to the followers as state indices
        self.index = list(range(len(model.state_meta))) if only is None else list(only)
        self.meta = [model.state_meta[i][:3] for i in self.index]
        self.device = model.device
        self.gathers = model.needs_gather()

    def open(self, indices: Sequence[int]) -> Iterator[tuple[str, torch.Tensor | None]]:
        m = self.model
        indices = [self.index[i] for i in indices]
        dt = self.wire_dtype
        if self.gathers and self.announce is not None:
            self.announce(f"gather {m.role} {dtype_word(dt)} {','.join(map(str, indices))}")
        if m.device.type == "cuda":
            torch.cuda.set_device(m.device)  # a push fills its buckets on a worker thread
        local = m.state_tensors()
        for i in indices:
            yield m.state_meta[i][0], m.gather_one(i, local, dt)

    # ---- per-GPU handoff (co-located SGLang: issue 40 item 3) ----------------------------------------
    @property
    def ranks(self) -> int:
        """The pool's ranks: each holds a GPU a per-GPU handoff reads from."""
        return self.model.layout.world_size

    def open_everywhere(self, indices: Sequence[int]) -> Iterator[tuple[str, torch.Tensor]]:
        """`open`, but every rank gets every full tensor (`gather_one(everywhere=True)`); collective, no
        announcement: rank 0 calls it from `hand_off`, the followers from `serve_command`."""
        m = self.model
        if m.device.type == "cuda":
            torch.cuda.set_device(m.device)
        local = m.state_tensors()
        for i in (self.index[j] for j in indices):
            yield m.state_meta[i][0], m.gather_one(i, local, self.wire_dtype, everywhere=True)

    def hand_off(self, indices: Sequence[int], pack: Callable[[Iterator, list], str]) -> list[str]:
        """Rank 0: every rank packs bucket `indices` from its own full copy of the tensors — `pack(tensors,
        metas)` → a payload (weights/ipc.py: CUDA-IPC handles of a buffer on that rank's GPU) — rank 0's
        `pack` here, the followers' from their `leader_ready` wait (announced `handoff` command); returns
        the payloads in rank order. The followers hold their buffer until the next bucket or `end_hand_off`
        (rank 0 announces a bucket only after every server loaded the one before)."""
        m = self.model
        state = [self.index[i] for i in indices]
        if self.announce is not None:
            self.announce(f"handoff {m.role} {dtype_word(self.wire_dtype)} {','.join(map(str, state))}")
        mine = pack(self.open_everywhere(indices), [self.meta[i] for i in indices])
        return gather_payloads(m.layout, mine)

    def end_hand_off(self) -> None:
        """Rank 0, after the last bucket's replies: the followers drop their last buffer."""
        if self.announce is not None:
            self.announce(f"handoff {self.model.role} end")


def gather_payloads(layout, payload: str) -> list[str]:
    """Every rank's `payload` on rank 0, in rank order ([] elsewhere): gathered over the pool's host (gloo)
    world group, under its timeout."""
    if layout.world_size == 1:
        return [payload]
    out: list = [None] * layout.world_size if layout.rank == 0 else None
    dist.gather_object(payload, out, dst=0, group=layout.host_world_group)
    return out if layout.rank == 0 else []
