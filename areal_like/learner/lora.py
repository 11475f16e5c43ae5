"""LoRA on the learner's actor (`model.lora_rank` > 0): `LoraConverter`, a model converter
(learner/converters.py) that puts peft's LoRA layers in at the model builder's convert step, so every
parallel strategy after it (pipeline split, TP, activation checkpointing, FSDP2) applies to the adapted
model, and that declares everything LoRA changes downstream — the builder, the parallelizer, the
sharded model and the checkpointer call its hooks without naming it.

    convert      peft's `inject_adapter_in_model` on the meta-device model — each targeted
                 `nn.Linear` becomes a `lora.Linear` holding the frozen `base_layer` and the adapter
                 `lora_A` [r, in], `lora_B` [out, r] (requires_grad: the only trainable parameters,
                 in the master dtype where FSDP's shards are the master). No LoRA math is written
                 here: peft's forward adds lora_B(lora_A(dropout(x))) · alpha/r to the base output.
                 `check` refuses a reference model and lm_head under FSDP's vocabulary split.
    names        peft's module names (`q_proj.base_layer.weight`, `q_proj.lora_A.default.weight`)
                 are not what checkpoints hold: `canonical_name` drops `.base_layer` and the adapter
                 name `.default`, so the base reads its HF checkpoint names and the adapter is
                 `….q_proj.lora_A.weight` — peft's saved names less its `base_model.model.` prefix
                 (`weights/adapter.py` writes and reads the adapter directory). The trainable-key
                 filter is `is_lora_name`: the adapter is the trainable subset, the base frozen
                 (stored in the compute dtype).
    values       `files` → `ModelFiles`: the base from `model.path`'s safetensors, the adapter from
                 `model.lora_path` or a fresh init — lora_A Kaiming-uniform (peft's init) from a
                 generator seeded by `train.seed` and the tensor's name, lora_B zeros — made as a
                 full tensor and then sharded like any checkpoint tensor, so every layout (and the
                 one-process learner) starts from the same adapter.
    TP           `tensor_parallel_plan`: the base of a column-parallel projection and its lora_B
                 column-parallel (lora_A replicated: its input is); the base of a row-parallel one
                 and its lora_A row-parallel (lora_B replicated: its input is the reduced A·x).
    reference    `frozen_base` → `adapters_disabled`: the base model itself (peft's
                 `enable_adapters(False)`) — with LoRA and a KL term the trainer builds no reference copy.
    dropout      `training` → `dropout_active`: peft's `lora_dropout` modules train only inside the
                 learner's differentiated forward (the model is otherwise in eval mode: no dropout).
    state        its own format: a checkpoint holds the adapter alone as peft writes it
                 (adapter_config.json + adapter_model.safetensors, the fp32 master; the frozen base
                 is model.path, never copied), recorded in meta.json under "lora" (its
                 adapter_config), and a checkpoint and a run refuse each other when one has an
                 adapter and the other not, or the ranks differ; `train.export_hf` writes a peft
                 adapter dir in `model.dtype`, `train.export_merged` the whole model with the adapter
                 merged in (`MergedWeights`); a push sends the adapter with its config
                 (`weights.adapter.AdapterWeights`): the servers keep their base.

What this module does not do: no optimizer (ShardedModel holds the adapter's), no transport.
"""

from __future__ import annotations

import contextlib
import copy
import math
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from areal_like.learner.converters import BuildContext, ModelConverter, parameters_on_meta
from areal_like.weights.adapter import LORA_MARKERS, base_layer_name, is_lora_name

ADAPTER = "default"  # peft's adapter name inside the learner's model (one adapter)


class LoraSettings:
    """`model.lora_*` checked: rank, alpha, target modules, dropout, an adapter to start from."""

    def __init__(self, rank: int, alpha: float, target_modules: str | list[str], dropout: float = 0.0,
                 path: str | None = None) -> None:
        from areal_like.api.config import check_lora_numbers, lora_target_modules

        if rank < 1:
            raise ValueError(f"model.lora_rank={rank}: LoRA needs a rank ≥ 1 (e.g. 8), or 0 for full fine-tuning")
        check_lora_numbers(alpha, dropout)
        modules = lora_target_modules(target_modules)
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.target_modules = modules
        self.dropout = float(dropout)
        self.path = path

    @classmethod
    def from_model_config(cls, model_cfg) -> "LoraSettings | None":
        """None when `model.lora_rank` is 0 (full fine-tuning)."""
        if model_cfg.lora_rank == 0:
            return None
        return cls(model_cfg.lora_rank, model_cfg.lora_alpha, model_cfg.target_modules, model_cfg.lora_dropout,
                   model_cfg.lora_path)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self):
        from peft import LoraConfig

        # explicit names (not "all-linear", which peft resolves against a PreTrainedModel's own
        # output layer): the same list reaches the servers' adapter config
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=list(self.target_modules),
                          lora_dropout=self.dropout, bias="none", task_type="CAUSAL_LM")


def canonical_name(name: str) -> str:
    """The name checkpoints know a parameter by: peft's `.base_layer` and adapter name dropped
    (`…q_proj.base_layer.weight` → `…q_proj.weight`, `…q_proj.lora_A.default.weight` → `…q_proj.lora_A.weight`)."""
    name = base_layer_name(name)
    for m in LORA_MARKERS:
        name = name.replace(f"{m}{ADAPTER}.", m)
    return name


def init_adapter_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A fresh adapter tensor, the same for every layout: lora_A as peft initialises it (Kaiming
    uniform, a = √5: U(−1/√in, 1/√in)) from a generator seeded by `seed` and the name; lora_B zeros
    (so a fresh adapter leaves the base model's outputs unchanged)."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=√5) on a Linear [r, in]
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


class ModelFiles(Mapping):
    """The full tensors a LoRA model is materialized from, by canonical name: the base's from its
    safetensors (`weights.disk.SafetensorsDir`, read one at a time), the adapter's from
    `model.lora_path`'s adapter file, or fresh (`init_adapter_tensor`)."""

    def __init__(self, base: Mapping[str, torch.Tensor], shapes: Mapping[str, tuple[int, ...]], *, seed: int,
                 adapter: Mapping[str, torch.Tensor] | None = None) -> None:
        self.base = base
        self.shapes = dict(shapes)  # adapter tensor name → shape
        self.seed = seed
        self.adapter = adapter

    def __contains__(self, name: object) -> bool:
        return name in self.shapes or name in self.base

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.shapes:
            if self.adapter is not None:
                return self.adapter[name]
            return init_adapter_tensor(name, self.shapes[name], self.seed)
        return self.base[name]

    def __iter__(self) -> Iterator[str]:
        yield from self.shapes
        yield from self.base.keys()  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.shapes) + len(list(self.base.keys()))  # type: ignore[attr-defined]


class LoraConverter(ModelConverter):
    """The LoRA converter of one run's actor (see the module docstring): `settings`, the base model's
    path (`base_model`: the adapter config's `base_model_name_or_path`), `seed` for a fresh adapter."""

    own_format = True
    has_frozen_base = True
    record_key = "lora"
    trainable_keys = staticmethod(is_lora_name)

    def __init__(self, settings: LoraSettings, *, base_model: str, seed: int = 0) -> None:
        self.settings = settings
        self.base_model = base_model
        self.seed = seed

    # ---- build ------------------------------------------------------------------------------------
    def check(self, build: BuildContext) -> None:
        if not build.trainable:
            raise ValueError(f"LoRA is for trainable models, not the {build.role}")
        fsdp = build.dp_sharding != "none"
        if "lm_head" in self.settings.target_modules and fsdp and build.dp > 1 and not build.param_offload:
            raise ValueError("model.target_modules names lm_head, but under FSDP (train.dp_sharding="
                             f"{build.dp_sharding}, d{build.dp}) the LM head is split by vocabulary rows, which an "
                             "adapter cannot wrap: drop lm_head, or set train.dp_sharding=none")

    def convert(self, hf_model: nn.Module, build: BuildContext) -> nn.Module:
        """peft's LoRA layers on the meta-device model, the adapter's parameters in the trainable dtype
        (the master dtype where FSDP's shards are the master), everything else frozen."""
        from peft import inject_adapter_in_model

        settings, adapter_dtype = self.settings, build.trainable_dtype
        with parameters_on_meta():
            hf_model = inject_adapter_in_model(settings.peft_config(), hf_model, adapter_name=ADAPTER)
        found = [n for n, _ in hf_model.named_parameters() if is_lora_name(n)]
        if not found:
            raise ValueError(f"model.target_modules={list(settings.target_modules)} matched no linear layer of "
                             f"{type(hf_model).__name__}")
        for layer in _lora_layers(hf_model):  # peft keeps adapters in fp32 under a 16-bit base: set it
            for linear in (*layer.lora_A.values(), *layer.lora_B.values()):
                w = linear.weight
                if w.dtype != adapter_dtype:
                    linear.weight = nn.Parameter(w.to(adapter_dtype), requires_grad=True)
        return hf_model

    def canonical_name(self, name: str) -> str:
        return canonical_name(name)

    def files(self, base: Mapping[str, torch.Tensor], meta: Sequence[tuple]) -> Mapping[str, torch.Tensor]:
        """The base from its files, the adapter from `model.lora_path` (checked against the settings) or fresh."""
        from areal_like.weights.adapter import read_adapter

        shapes = {n: tuple(shape) for n, shape, *_ in meta if is_lora_name(n)}
        path = self.settings.path
        return ModelFiles(base, shapes, seed=self.seed, adapter=read_adapter(path, self.settings) if path else None)

    def tensor_parallel_plan(self, plan: dict, module_names: list[str]) -> dict:
        """Megatron's split of a projection that carries an adapter: a column-parallel one splits its base
        and lora_B by output rows (lora_A sees the replicated input, its output is replicated); a
        row-parallel one its base and lora_A by input columns (A·x is summed over tp like the base's
        output; lora_B runs replicated). A plain projection keeps its style."""
        from torch.distributed.tensor.parallel import ColwiseParallel

        present = set(module_names)
        out: dict = {}
        for name, style in plan.items():
            if f"{name}.base_layer" not in present:
                out[name] = style
                continue
            out[f"{name}.base_layer"] = style
            out[f"{name}.{'lora_B' if isinstance(style, ColwiseParallel) else 'lora_A'}.{ADAPTER}"] = copy.copy(style)
        return out

    # ---- running ----------------------------------------------------------------------------------
    def training(self, module: nn.Module):
        return dropout_active(module, self.settings.dropout)

    def frozen_base(self, module: nn.Module):
        return adapters_disabled(module)

    def describe(self, model, *, base_is_reference: bool) -> str:
        """What `model.lora_*` made of the actor."""
        lo = self.settings
        n_train = sum(p.numel() for p in model.opt_params)
        return (f"rank {lo.rank}, alpha {lo.alpha:g} (scale {lo.scaling:g}) on {','.join(lo.target_modules)}; "
                f"this rank trains {n_train} adapter parameters, the base frozen"
                + (f"; started from {lo.path}" if lo.path else "")
                + ("; the KL reference is the base with the adapter disabled (no reference copy)"
                   if base_is_reference else ""))

    # ---- state: the adapter as a peft directory -----------------------------------------------------
    def record(self) -> dict[str, Any]:
        """peft's adapter_config.json of this run's adapter (meta.json's "lora")."""
        from areal_like.weights.adapter import adapter_config

        return adapter_config(self.settings, self.base_model)

    def check_resume(self, saved: Any, path: str) -> None:
        if not saved:
            raise ValueError(f"checkpoint {path} holds a full model but this run trains LoRA: resume with "
                             f"model.lora_rank=0, or start a new run (train.resume_mode=disable)")
        if int(saved["r"]) != self.settings.rank:
            raise ValueError(f"checkpoint {path} holds a rank-{saved['r']} adapter, this run model.lora_rank="
                             f"{self.settings.rank}: resume with model.lora_rank={saved['r']}")

    @classmethod
    def foreign_checkpoint(cls, saved: Any, path: str) -> str:
        return (f"checkpoint {path} holds a LoRA adapter but this run fine-tunes the full model: resume with "
                f"model.lora_rank={saved['r']}, or start a new run (train.resume_mode=disable)")

    def save(self, model, out_dir: str, *, write: bool) -> None:
        """The adapter alone (the master, fp32) as a peft adapter dir; the base stays model.path."""
        from areal_like.weights.adapter import write_adapter_dir

        write_adapter_dir(model.weights(keys=is_lora_name), out_dir, self.record(), write=write)

    def load(self, model, path: str) -> None:
        from areal_like.weights.adapter import read_adapter_tensors

        model.load_full(read_adapter_tensors(path, "checkpoint"), path, keys=is_lora_name)

    def export(self, model, out_dir: str, *, dtype: torch.dtype, write: bool) -> None:
        """A peft adapter dir in `dtype` (`PeftModel.from_pretrained(base, out_dir)` loads it)."""
        from areal_like.weights.adapter import write_adapter_dir

        write_adapter_dir(model.weights(keys=is_lora_name), out_dir, self.record(), dtype=dtype, write=write)

    def weight_source(self, model, announce: Callable[[str], None] | None):
        """The adapter's tensors only, with its peft config: the servers keep their base and load the adapter."""
        from areal_like.weights.adapter import AdapterWeights

        return AdapterWeights(model.weights(announce, keys=is_lora_name), self.record())

    def plain_weights(self, model):
        return MergedWeights(model, self.settings.scaling)


def _lora_layers(module: nn.Module) -> list[nn.Module]:
    from peft.tuners.lora import LoraLayer

    return [m for m in module.modules() if isinstance(m, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(module: nn.Module):
    """The base model: every LoRA layer of `module` skips its adapter (peft's `enable_adapters(False)`).

    peft's toggle also clears the adapter's `requires_grad`; that flag is put back at once: FSDP2
    reads it when it first runs a forward (its mixed-precision and reduce dtypes are set for the
    trainable parameters then), and this pass — the KL reference's — may be that first forward."""
    layers = _lora_layers(module)
    flags = [(p, p.requires_grad) for m in layers for d in (m.lora_A, m.lora_B) for p in d.parameters()]
    for m in layers:
        m.enable_adapters(False)
    for p, rg in flags:
        p.requires_grad_(rg)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, rg in flags:
            p.requires_grad_(rg)


@contextlib.contextmanager
def dropout_active(module: nn.Module, p: float):
    """peft's `lora_dropout` modules in train mode (the rest of the model stays in eval mode)."""
    if p <= 0:
        yield
        return
    drops = [d for m in _lora_layers(module) for d in m.lora_dropout.values()]
    for d in drops:
        d.train()
    try:
        yield
    finally:
        for d in drops:
            d.eval()


class MergedWeights:
    """A `WeightSource` of the model with its adapter merged in — every base tensor by its HF name,
    a LoRA'd projection's weight as W + (alpha/r)·B·A (peft's merge), no adapter tensors: what
    `train.export_merged` writes, loadable as a plain HF model. Collective like `GatheredWeights`
    (every rank iterates the same `open`; rank 0 gets the tensors)."""

    def __init__(self, model, scaling: float) -> None:
        self.model = model
        self.scaling = scaling
        names = {n: i for i, (n, *_) in enumerate(model.state_meta)}
        self.base = [i for i, (n, *_) in enumerate(model.state_meta) if not is_lora_name(n)]
        self.parts: dict[int, tuple[int, int]] = {}  # base weight index → (lora_A, lora_B) indices
        for i in self.base:
            n = model.state_meta[i][0]
            if n.endswith(".weight"):
                stem = n.removesuffix(".weight")
                a, b = names.get(f"{stem}.lora_A.weight"), names.get(f"{stem}.lora_B.weight")
                if a is not None and b is not None:
                    self.parts[i] = (a, b)
        self.meta = [model.state_meta[i][:3] for i in self.base]
        self.device = model.device
        self.gathers = model.needs_gather()

    def open(self, indices):
        src = self.model.weights()
        for k in indices:
            i = self.base[k]
            name, w = next(src.open([i]))
            if i in self.parts:
                (_, a), (_, b) = list(src.open(list(self.parts[i])))
                if w is not None:
                    w = (w.float() + self.scaling * (b.float() @ a.float())).to(w.dtype)
                del a, b
            yield name, w
