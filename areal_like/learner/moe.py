"""Mixture-of-experts models in the learner (issue 44): transformers' MoE classes as they are.

transformers 5 keeps a MoE layer's experts fused — `<layer>.mlp.experts.gate_up_proj` [E, 2·I, H] (each
expert's gate rows, then its up rows) and `<layer>.mlp.experts.down_proj` [E, H, I] — and the router as
`<layer>.mlp.gate.weight` [E, H]; Qwen3-MoE, Qwen2-MoE (plus its shared expert), OLMoE, DeepSeek-V3 and
Mixtral all share that layout. Their checkpoints (what `save_pretrained` writes and what SGLang reads) keep
one tensor per expert instead: `<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight`.

`FusedExperts` is the converter (learner/converters.py) that joins the two: the learner's own names are the
fused ones (its checkpoints, the embedded engine's pushes — the engine runs the same transformers class),
and a model directory in the per-expert format is read through `ExpertFiles`, which stacks an expert range
on demand (an FSDP rank that holds experts [a, b) reads those experts' tensors alone). Every parallel
strategy sees plain parameters: FSDP2 shards the fused tensors along the expert dimension, pipeline stages
split whole decoder layers, tensor parallel splits attention and leaves each MoE layer's router whole on every
tp rank and every expert unsplit (no TP inside an expert).

Expert parallel (`apply_expert_parallel`, `e` in the allocation): the fused tensors become DTensors sharded
along the expert dim over the layout's ep mesh, and the experts' forward sends each token's assignments to the
ranks holding those experts and back by all-to-all (`_ep_forward`); FSDP leaves them out, and their gradients
are SUMmed over the edp ranks (parallel/sharded_model.py). `PerExpertWeights` is the push's view for SGLang
servers, which load one tensor per expert.

Routing (`find_routers`, `RouterReplay`): each MoE layer's router (`<layer>.mlp.gate`, transformers'
`*TopKRouter`: softmax over the experts in fp32, top-k, optionally renormalised) returns (logits, scores,
indices). Rollout routing replay (R3, `train.routing_replay=rollout`) runs the learner's forward with the
indices the server chose for each position instead of the router's own top-k: the scores are the router's
own softmax probabilities gathered at the replayed experts (renormalised as the router does), so the
router's weights still get gradients — through the replayed experts' scores — as Megatron's router replay
and verl's R3 do; only the discrete choice is taken from the server. A position without a recorded route
(the last token, which the server sampled but never ran; padding) keeps the router's own choice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from areal_like.learner.converters import BuildContext, ModelConverter

FUSED = ("gate_up_proj", "down_proj")
_FUSED_NAME = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")
# Mixtral's checkpoints name the same tensors w1 (gate), w3 (up), w2 (down) under block_sparse_moe
_MIXTRAL = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def is_moe(model: nn.Module) -> bool:
    """Whether `model` has transformers' fused experts (a MoE model)."""
    return any(_FUSED_NAME.match(n) for n, _ in model.named_parameters())


def expert_count(shape: Sequence[int]) -> int:
    return int(shape[0])


class ExpertFiles(Mapping):
    """A model's files (a `SafetensorsDir`, or any mapping of full tensors) with the fused experts' names
    readable: a name the files hold is read as is; a fused name missing from them is stacked from the
    per-expert tensors (HF's checkpoint format). `read_rows` of a fused name reads that range of experts only."""

    def __init__(self, base: Mapping[str, torch.Tensor], fused: Mapping[str, Sequence[int]]) -> None:
        self.base = base
        self.fused = {n: list(s) for n, s in fused.items() if n not in base}  # what must be stacked

    def _expert_name(self, prefix: str, e: int, proj: str) -> str:
        name = f"{prefix}.{e}.{proj}.weight"
        if name in self.base:
            return name
        mixtral = f"{prefix.replace('.mlp.experts', '.block_sparse_moe.experts')}.{e}.{_MIXTRAL[proj]}.weight"
        if mixtral in self.base:
            return mixtral
        raise KeyError(f"{name} (the per-expert tensors of {prefix}: neither the fused tensor nor expert {e}'s "
                       "is in the model's files)")

    def _stack(self, name: str, start: int, stop: int) -> torch.Tensor:
        m = _FUSED_NAME.match(name)
        prefix, kind = m["prefix"], m["kind"]
        if kind == "down_proj":
            return torch.stack([self.base[self._expert_name(prefix, e, "down_proj")] for e in range(start, stop)])
        return torch.stack([torch.cat([self.base[self._expert_name(prefix, e, "gate_proj")],
                                       self.base[self._expert_name(prefix, e, "up_proj")]], dim=0)
                            for e in range(start, stop)])

    def __contains__(self, name: object) -> bool:
        return name in self.fused or name in self.base

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.fused:
            return self._stack(name, 0, expert_count(self.fused[name]))
        return self.base[name]

    def __iter__(self):
        return iter([*self.fused, *(k for k in self.base.keys() if k not in self.fused)])

    def __len__(self) -> int:
        return len(list(iter(self)))

    def keys(self):
        return list(iter(self))

    def shape(self, name: str) -> list[int]:
        if name in self.fused:
            return list(self.fused[name])
        return list(self.base.shape(name)) if hasattr(self.base, "shape") else list(self.base[name].shape)

    @property
    def read_rows(self):
        if not hasattr(self.base, "read_rows"):
            return None  # `_own_part` then reads full tensors

        def read_rows(name: str, start: int, stop: int) -> torch.Tensor:
            if name in self.fused:
                return self._stack(name, start, stop)
            return self.base.read_rows(name, start, stop)

        return read_rows


class FusedExperts(ModelConverter):
    """A MoE model (transformers' fused experts): read per-expert checkpoints into the fused parameters
    (`ExpertFiles`); under tensor parallel, attention (and dense and shared-expert MLPs) are split over
    t while each MoE layer's router stays whole on every t rank and no expert is split (with `e` the experts
    spread over the t ranks too: `apply_expert_parallel`)."""

    def convert(self, hf_model: nn.Module, build: BuildContext) -> nn.Module:
        return hf_model

    def tensor_parallel_plan(self, plan: dict, module_names: list[str]) -> dict:
        """A MoE layer's `mlp` is the router and the experts (no `mlp.gate_proj`…): its dense entries go;
        Qwen2-MoE's shared expert is a dense MLP, split as one (column-parallel in, row-parallel out)."""
        names = set(module_names)
        out = {n: style for n, style in plan.items() if n in names}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"mlp.shared_expert.{proj}"
            if name in names:
                out[name] = plan.get(f"mlp.{proj}") or _dense_style(proj)
        return out

    def files(self, base: Mapping[str, torch.Tensor], meta: Sequence[tuple]) -> Mapping[str, torch.Tensor]:
        fused = {m[0]: m[1] for m in meta if _FUSED_NAME.match(m[0])}
        return ExpertFiles(base, fused) if fused else base

    def describe(self, model, *, base_is_reference: bool) -> str:
        return ""


def _dense_style(proj: str):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return RowwiseParallel() if proj == "down_proj" else ColwiseParallel()


# ---- expert parallel (`e` in the allocation) -------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` of rows with uneven splits; its backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        torch.distributed.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        torch.distributed.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _tp_gather_rows(x: torch.Tensor, rows: int, total: int, group, tp: int) -> torch.Tensor:
    """Every tp rank's `x` (its first `rows` rows of a `rows`-padded share) stacked in rank order, trimmed to
    `total` rows (uneven shares: the last ranks' are shorter)."""
    pad = x.new_zeros((rows, *x.shape[1:]))
    pad[: x.shape[0]] = x
    parts = [torch.empty_like(pad) for _ in range(tp)]
    torch.distributed.all_gather(parts, pad.contiguous(), group=group)
    return torch.cat(parts)[:total]


class _ScatterToTP(torch.autograd.Function):
    """Forward: this tp rank's share [start, stop) of rows replicated over tp. Backward: the shares' gradients
    gathered from every tp rank (the full gradient of the replicated input, the same on each)."""

    @staticmethod
    def forward(ctx, x, start: int, stop: int, share: int, group, tp: int):
        ctx.args = (x.shape[0], share, group, tp)
        return x[start:stop]

    @staticmethod
    def backward(ctx, grad):
        total, share, group, tp = ctx.args
        return _tp_gather_rows(grad, share, total, group, tp), None, None, None, None, None


class _GatherFromTP(torch.autograd.Function):
    """Forward: every tp rank's rows (`share` at most each) stacked, trimmed to `total`. Backward: this rank's
    rows of the gradient (downstream of here is replicated over tp: every rank holds the same gradient)."""

    @staticmethod
    def forward(ctx, x, start: int, share: int, total: int, group, tp: int):
        ctx.rows = (start, start + x.shape[0])
        return _tp_gather_rows(x, share, total, group, tp)

    @staticmethod
    def backward(ctx, grad):
        start, stop = ctx.rows
        return grad[start:stop], None, None, None, None, None


def expert_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every fused-experts module (`<…>.mlp.experts` with `gate_up_proj`) in `module`."""
    return [(n, m) for n, m in module.named_modules()
            if n.endswith(".experts") and isinstance(getattr(m, "gate_up_proj", None), nn.Parameter)]


def apply_expert_parallel(stage: nn.Module, layout) -> None:
    """Split each MoE layer's fused experts over the ep ranks (in place, on meta, before FSDP): `gate_up_proj`
    and `down_proj` become DTensors on the ep mesh sharded along the expert dim (ep rank r holds experts
    [r·E/ep, (r+1)·E/ep)), and the experts' forward dispatches each token's top-k assignments to the ranks
    holding those experts and combines the results back (`_ep_forward`). No-op for e1."""
    if layout.ep == 1:
        return
    from torch.distributed.tensor import Shard, distribute_tensor

    found = expert_modules(stage)
    if not found:
        raise ValueError(f"expert parallel e{layout.ep} on a model without experts (a dense model): use e1 in the "
                         "allocation's training side")
    mesh = layout.submesh("ep")
    for name, m in found:
        E = m.gate_up_proj.shape[0]
        if E % layout.ep:
            raise ValueError(f"expert parallel e{layout.ep} does not divide {name}'s {E} experts: use an e dividing {E}")
        for attr in FUSED:
            p = getattr(m, attr)
            setattr(m, attr, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None),
                                          requires_grad=p.requires_grad))
        m.forward = _ep_forward(m, layout, E)


def _ep_forward(experts: nn.Module, layout, num_experts: int):
    """The experts' forward under expert parallel — same signature and result as transformers' (hidden (N, H),
    top-k expert ids (N, k), their weights (N, k)) → (N, H). Dispatch: each (token, expert) assignment goes,
    sorted by expert, to the ep rank holding that expert (an all-to-all of the per-expert counts — from which the
    receiver knows each row's expert — then one of the rows); each rank runs its experts on what it received; combine: the outputs go back the same
    way (all-to-all) and each token sums its k outputs times their weights (the routing weights stay on the
    token's own rank: the router's gradient never crosses ranks). With t > 1 the tokens (replicated over tp) are
    shared out: each tp rank dispatches its 1/tp of them and the outputs are gathered back over tp before the
    weighted sum (Megatron's token split for expert tensor parallel 1), so no expert computes a token twice.
    Every ep rank must call it for every forward (the trainer keeps dp ranks in lockstep). Gradients:
    `_AllToAll`'s backward, the tp share's scatter/gather pair; the expert weights' through `to_local` (a
    DTensor gradient on the ep mesh)."""
    import torch.nn.functional as F

    group, ep = layout.ep_group, layout.ep
    per_rank = num_experts // ep
    first = layout.ep_rank * per_rank
    tp, tp_group, tp_rank = layout.tp, layout.tp_group, layout.tp_rank

    def forward(hidden_states, top_k_index, top_k_weights):
        total = hidden_states.shape[0]
        if tp > 1:  # the tokens are replicated over tp: each tp rank dispatches its share [start, stop) of them
            share = -(-total // tp)
            start, stop = min(tp_rank * share, total), min((tp_rank + 1) * share, total)
            hidden = _ScatterToTP.apply(hidden_states, start, stop, share, tp_group, tp)
            y = dispatch_compute(hidden, top_k_index[start:stop])
            y = _GatherFromTP.apply(y, start * top_k_index.shape[1], share * top_k_index.shape[1],
                                    total * top_k_index.shape[1], tp_group, tp)
        else:
            y = dispatch_compute(hidden_states, top_k_index)
        # each token's k outputs × its routing weights, on every rank holding the token (the router's gradient
        # stays where the router ran)
        w = top_k_weights.reshape(-1, 1).to(hidden_states.dtype)
        return (y * w).reshape(total, top_k_index.shape[1], -1).sum(dim=1)

    def dispatch_compute(hidden_states, top_k_index):
        """(N·k, H): each (token, slot) assignment's expert output, computed on the rank holding the expert."""
        N, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        # assignments sorted by expert (so by destination rank: each holds a contiguous range of experts); an id
        # of num_experts (transformers' "no expert") sorts last and is not sent
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
        # one all-to-all of the per-expert counts: what each source sends to each of this rank's experts
        recv_counts = torch.empty_like(per_expert)
        torch.distributed.all_to_all_single(recv_counts, per_expert, group=group)
        recv_counts = recv_counts.reshape(ep, per_rank)  # (source rank, local expert)
        in_splits = per_expert.reshape(ep, per_rank).sum(1).tolist()
        out_splits = recv_counts.sum(1).tolist()
        sent = order[: sum(in_splits)]
        x = _AllToAll.apply(hidden_states[sent // k], out_splits, in_splits, group)
        # the received rows come by source, each source's by expert: their local expert ids follow from the counts
        local = torch.repeat_interleave(torch.arange(per_rank, device=flat.device).repeat(ep), recv_counts.reshape(-1))
        w1 = experts.gate_up_proj.to_local().to(x.dtype)  # (E/ep, 2I, H); a wider master is cast as FSDP's mp does
        w2 = experts.down_proj.to_local().to(x.dtype)  # (E/ep, H, I)
        by_expert = torch.argsort(local, stable=True)
        counts = recv_counts.sum(0).tolist()
        outs = []
        for j, rows in enumerate(torch.split(by_expert, counts)):
            if counts[j]:
                gate, up = F.linear(x[rows], w1[j]).chunk(2, dim=-1)
                outs.append(F.linear(experts.act_fn(gate) * up, w2[j]))
        if not outs:  # nothing came here: an empty result still in the graph (every rank's backward runs both
            # all-to-alls, or the others would wait for this one)
            outs = [x.new_zeros((0, hidden_states.shape[-1])) + 0 * (x[:0].sum() + w1[:0].sum() + w2[:0].sum())]
        # back to the received order (by_expert's inverse, as a scatter)
        y = torch.cat(outs)
        y = y.new_empty(y.shape).index_copy(0, by_expert, y)
        back = _AllToAll.apply(y, in_splits, out_splits, group)  # (valid assignments, H), in `sent` order
        y_assign = hidden_states.new_zeros((N * k, hidden_states.shape[-1]))
        return y_assign.index_copy(0, sent, back.to(hidden_states.dtype))

    return forward


# ---- routing ----------------------------------------------------------------------------------------------
def find_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(decoder layer index, router module) of every MoE layer of `model` (an HF causal LM, or a pipeline
    stage holding some of its layers): transformers' `*TopKRouter` at `<…>.layers.<i>.mlp.gate`."""
    out = []
    for name, m in model.named_modules():
        parts = name.split(".")
        if type(m).__name__.endswith(("TopKRouter", "TopkRouter")) and len(parts) >= 3 and parts[-2:] == ["mlp", "gate"]:
            i = parts.index("layers") if "layers" in parts else -1
            if i >= 0 and parts[i + 1].isdigit():
                out.append((int(parts[i + 1]), m))
    return sorted(out, key=lambda x: x[0])


def routing_shape(config) -> tuple[int, int]:
    """(layers, top-k) of a MoE config: one route row per position is layers × top-k expert ids (SGLang's
    (token, layer, top_k), every decoder layer; a dense layer's ids are 0)."""
    return int(config.num_hidden_layers), int(config.num_experts_per_tok)


def _replayed_forward(router: nn.Module, original):
    """`router.forward` that uses `router.replay_ids` ((tokens, top-k) expert ids, −1 = the router's own choice)
    when set, else runs as written."""
    import torch.nn.functional as F

    cast = hasattr(router, "norm_topk_prob")  # the Qwen/OLMoE routers cast their scores to the logits' dtype
    norm = getattr(router, "norm_topk_prob", True)  # Mixtral's always renormalises

    def forward(hidden_states):
        ids = getattr(router, "replay_ids", None)
        if ids is None:  # the router's own choice, kept for a recording pass (train.routing_replay=behaviour)
            out = original(hidden_states)
            router.last_ids = out[2]
            return out
        h = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(h, router.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        if ids.shape != own.shape:
            raise ValueError(f"routing replay: {tuple(ids.shape)} replayed expert ids for {tuple(own.shape)} routed "
                             "positions × top-k (the trajectory's routes do not fit this model)")
        chosen = torch.where(ids >= 0, ids, own)
        scores = probs.gather(-1, chosen)
        if norm:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        with torch.no_grad():  # (positions whose replayed experts are the router's own top-k set, positions replayed)
            agree = (torch.sort(chosen, -1).values == torch.sort(own, -1).values).all(-1)
            counted = (ids >= 0).all(-1)
            router.replay_counts = ((agree & counted).sum().float(), counted.sum().float())
        return logits, scores.to(logits.dtype) if cast else scores, chosen

    return forward


class RouterReplay:
    """The routers of one model (a pipeline stage: its layers' routers alone) patched for replay. The stage runs
    each decoder layer through `run_layer` when a forward has routes ((B, T, layers × top-k) expert ids, −1 =
    none): that layer's router takes its ids for exactly that call — under activation checkpointing the
    recomputation in backward calls it again with the same routes, and a pipeline schedule's micro-batches each
    carry their own. `count` adds a layer's agreement of the training forward to the step's (`take_stats`)."""

    def __init__(self, module: nn.Module, config) -> None:
        self.routers = find_routers(module)
        self.by_layer = dict(self.routers)
        self.layers, self.top_k = routing_shape(config) if hasattr(config, "num_experts_per_tok") else (0, 0)
        self.stats: tuple[torch.Tensor, torch.Tensor] | None = None  # (agreeing, replayed) positions × layers
        for _, r in self.routers:
            if not hasattr(r, "replay_ids"):
                r.forward = _replayed_forward(r, r.forward)
                r.replay_ids = None

    def run_layer(self, layer_idx: int, layer: nn.Module, routes_BTW: torch.Tensor, h, *args, **kwargs):
        """`layer(h, …)` with its router replaying `routes_BTW`'s ids for that layer (none for a dense layer)."""
        r = self.by_layer.get(layer_idx)
        if r is None:
            return layer(h, *args, **kwargs)
        r.replay_ids = routes_BTW.reshape(-1, self.layers, self.top_k)[:, layer_idx, :].contiguous()
        try:
            return layer(h, *args, **kwargs)
        finally:
            r.replay_ids = None

    def count(self, layer_idx: int) -> None:
        """Add the agreement of layer `layer_idx`'s last replayed forward to the step's (device scalars, no sync)."""
        r = self.by_layer.get(layer_idx)
        got = getattr(r, "replay_counts", None) if r is not None else None
        if got is None:
            return
        r.replay_counts = None
        self.stats = got if self.stats is None else (self.stats[0] + got[0], self.stats[1] + got[1])

    def take_stats(self) -> tuple[float, float]:
        """(agreeing, replayed) positions × layers of this stage's training forwards since the last call."""
        st, self.stats = self.stats, None
        return (0.0, 0.0) if st is None else (float(st[0]), float(st[1]))

    def recorded(self, positions: int, device) -> torch.Tensor:
        """(positions, layers × top-k) expert ids this stage's routers chose themselves in the last forward (the
        other stages' layers and dense layers 0: a sum over the pipeline stages joins them)."""
        out = torch.zeros(positions, self.layers, self.top_k, dtype=torch.long, device=device)
        for layer, r in self.routers:
            out[:, layer, :] = r.last_ids
        return out.reshape(positions, -1)


# ---- the push to SGLang servers: per-expert tensors ---------------------------------------------------------
class PerExpertWeights:
    """A `WeightSource` (weights/source.py) over `src` — the learner's full state, fused experts — with each fused
    tensor split into the per-expert tensors a checkpoint holds and SGLang's `load_weights` reads:
    `<…>.mlp.experts.<e>.{gate,up,down}_proj.weight`; with `mixtral`, Mixtral's
    `<…>.block_sparse_moe.experts.<e>.{w1,w3,w2}.weight` and its router at `<…>.block_sparse_moe.gate.weight`.
    Every other tensor passes through. A fused tensor is gathered once (`src.open`) and its experts' slices
    yielded as views; a bucket that ends inside a fused tensor leaves it held for the next bucket (the pusher
    opens buckets in order), so each fused tensor crosses the pool once per push."""

    def __init__(self, src, *, mixtral: bool = False) -> None:
        self.src = src
        self.device = src.device
        self.gathers = src.gathers
        self.meta: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._parts: list[tuple[int, int | None, str | None]] = []  # (src index, expert, part) per entry of meta
        for i, (name, shape, dtype) in enumerate(src.meta):
            m = _FUSED_NAME.match(name)
            if m is None:
                if mixtral and name.endswith(".mlp.gate.weight"):  # Mixtral's checkpoints keep its router there too
                    name = name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
                self.meta.append((name, tuple(shape), dtype))
                self._parts.append((i, None, None))
                continue
            prefix = m["prefix"].replace(".mlp.experts", ".block_sparse_moe.experts") if mixtral else m["prefix"]
            E, rows, cols = shape
            if m["kind"] == "gate_up_proj":
                projs = [("gate_proj", (rows // 2, cols)), ("up_proj", (rows // 2, cols))]
            else:
                projs = [("down_proj", (rows, cols))]
            for e in range(E):
                for proj, sub in projs:
                    self.meta.append((f"{prefix}.{e}.{_MIXTRAL[proj] if mixtral else proj}.weight", sub, dtype))
                    self._parts.append((i, e, proj))
        self._held: tuple[int, int, torch.Tensor] | None = None  # (src index, last entry yielded, tensor)

    @property
    def wire_dtype(self):
        return getattr(self.src, "wire_dtype", None)

    @wire_dtype.setter
    def wire_dtype(self, dtype) -> None:  # weights/source.py `gather_in`: the servers' dtype, for the gathers
        if hasattr(self.src, "wire_dtype"):
            self.src.wire_dtype = dtype

    def _slice(self, t: torch.Tensor, e: int | None, proj: str | None) -> torch.Tensor:
        if e is None:
            return t
        if proj == "down_proj":
            return t[e]
        half = t.shape[1] // 2
        return t[e, :half] if proj == "gate_proj" else t[e, half:]

    def open(self, indices):
        indices = list(indices)
        held = self._held
        # the fused tensor the last bucket ended inside, kept only for the entry right after it (a new push
        # starts from its first bucket, never there: the held tensor cannot be stale)
        if held is not None and not (indices and indices[0] == held[1] + 1 and self._parts[indices[0]][0] == held[0]):
            held = None
        self._held = None
        needed = list(dict.fromkeys(self._parts[j][0] for j in indices))
        if held is not None:
            needed.remove(held[0])
        last_use = {self._parts[j][0]: k for k, j in enumerate(indices)}
        have: dict[int, torch.Tensor] = {held[0]: held[2]} if held is not None else {}
        it = self.src.open(needed) if needed else iter(())  # (a gathering source announces every open)
        pos = 0  # next of `needed` the source yields
        for k, j in enumerate(indices):
            i, e, proj = self._parts[j]
            while i not in have:
                _, have[needed[pos]] = next(it)
                pos += 1
            t = have[i]
            out = self._slice(t, e, proj) if t is not None else None
            if last_use[i] == k:
                last_of_tensor = j + 1 >= len(self._parts) or self._parts[j + 1][0] != i
                if not last_of_tensor and e is not None:
                    self._held = (i, j, t)  # the rest of this fused tensor comes in the next bucket
                del have[i]
            yield self.meta[j][0], out
        for _ in it:  # (nothing left: every tensor asked for was used)
            pass
