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
split whole decoder layers. Tensor parallel inside the experts is not implemented (refused, naming t1).

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
    (`ExpertFiles`); refuse tensor parallel (the experts' TP split is not implemented)."""

    def check(self, build: BuildContext) -> None:
        if build.tp > 1:
            raise ValueError(f"a mixture-of-experts model with tensor parallel t{build.tp}: the experts' TP split is "
                             "not implemented; use t1 on the training side (d and p shard a MoE model)")

    def convert(self, hf_model: nn.Module, build: BuildContext) -> nn.Module:
        return hf_model

    def files(self, base: Mapping[str, torch.Tensor], meta: Sequence[tuple]) -> Mapping[str, torch.Tensor]:
        fused = {m[0]: m[1] for m in meta if _FUSED_NAME.match(m[0])}
        return ExpertFiles(base, fused) if fused else base

    def describe(self, model, *, base_is_reference: bool) -> str:
        return ""


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
        router.replay_agree = (torch.sort(chosen, -1).values == torch.sort(own, -1).values).all(-1)
        return logits, scores.to(logits.dtype) if cast else scores, chosen

    return forward


class RouterReplay:
    """The routers of one model (a pipeline stage) patched for replay; `replaying(routes)` sets, for one
    forward over a (B, T) batch, each layer's expert ids from `routes` ((B, T, layers × top-k), −1 = none)."""

    def __init__(self, module: nn.Module, config) -> None:
        self.routers = find_routers(module)
        self.layers, self.top_k = routing_shape(config) if self.routers else (0, 0)
        for _, r in self.routers:
            if not hasattr(r, "replay_ids"):
                r.forward = _replayed_forward(r, r.forward)
                r.replay_ids = None

    def set(self, routes_BTW: torch.Tensor | None) -> None:
        for layer, r in self.routers:
            r.replay_agree = None
            r.replay_ids = None if routes_BTW is None else routes_BTW.reshape(
                -1, self.layers, self.top_k)[:, layer, :].contiguous()

    def recorded(self) -> torch.Tensor:
        """(tokens, layers × top-k) expert ids the routers chose themselves in the last forward (dense layers 0)."""
        first = self.routers[0][1].last_ids
        out = torch.zeros(first.shape[0], self.layers, self.top_k, dtype=torch.long, device=first.device)
        for layer, r in self.routers:
            out[:, layer, :] = r.last_ids
        return out.reshape(first.shape[0], -1)

    def agreement(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(routed positions × layers whose replayed experts are the learner's own top-k set, routed positions ×
        layers replayed) of the last forward, as device scalars (summed into the step's stats, no host sync);
        None when nothing was replayed."""
        same = total = None
        for _, r in self.routers:
            agree, ids = getattr(r, "replay_agree", None), r.replay_ids
            if agree is None or ids is None:
                continue
            counted = (ids >= 0).all(-1)
            s, t = (agree & counted).sum(), counted.sum()
            same, total = (s, t) if same is None else (same + s, total + t)
        if same is None:
            return None
        return same.float(), total.float()
