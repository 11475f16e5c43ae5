"""Model converters: the convert step of the model-building seam (`learner/model.py`) and everything a
conversion changes downstream of it, declared by the converter itself (torchtitan's idea: a model
converter owns its key filter, state-dict transform and save format; the builder, the parallelizer,
the sharded model and the checkpointer call it without knowing what it is).

A `ModelConverter` declares (`convert` is required; the rest default to "changes nothing", and the
own-format hooks are called only where `own_format` is set):

    check / convert       refuse a build it cannot apply to; rewrite the meta-device model (before any
                          parallelism, so every strategy after it applies to the converted model)
    canonical_name        the state-dict transform: the name checkpoints and pushes know a parameter by
    trainable_keys        the trainable-key filter: which parameters train (None: all of them); the
                          rest is frozen and stored in the compute dtype, and "the trainable subset"
                          of the state is what a converter with its own format saves and pushes
    fresh / files         the source of its new tensors at materialize: init functions run on each
                          local shard (`fresh`), or a mapping of full tensors over the model's files
                          (`files`), sharded like any checkpoint tensor
    tensor_parallel_plan  a rewrite of a decoder layer's TP plan for the modules it wrapped
    training              a context around the differentiated forward (train-only modules)
    describe              one line for the start-up log
    frozen_base           where `has_frozen_base`: a context in which the model computes with its
                          frozen base alone (the initial weights: a KL reference without a second copy)
    own_format            its checkpoints, exports and pushes carry its own files instead of the full
                          model: `save` / `load` / `export` / `weight_source`, a merged export
                          (`plain_weights`: the model as its unconverted architecture)
    record_key            the meta.json key its checkpoints are recorded under (`record`): every kind
                          with one (registered in `RECORDED` when its class is defined: the trainer
                          imports them all) is written in every checkpoint — its record, or null where
                          the run does not apply it — so a checkpoint and a run refuse each other both
                          ways (`check_resume`, `foreign_checkpoint`)

A model's converters are composed by a `Conversion` (the one object the seam passes around:
`ShardedModel.conversion`). Converters here: `ValueHead` (the critic); learner/lora.py's adapter;
learner/moe.py's `FusedExperts` (a MoE model's per-expert files read into transformers' fused experts).
`parameters_on_meta` (load and convert build on the meta device) lives here, below both.

What this module does not do: no building, no parallelism, no I/O of its own (converters bring theirs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

Init = Callable[[torch.Tensor], Any]  # runs on a local tensor (a shard) in place

# record_key → converter kind: every kind whose checkpoints are recorded (filled as the kinds are defined)
RECORDED: dict[str, type["ModelConverter"]] = {}


@contextlib.contextmanager
def parameters_on_meta():
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


@dataclass(frozen=True)
class BuildContext:
    """What a converter may need to know of the model being built (`learner.model.build_model`)."""

    role: str  # actor | critic | reference
    trainable: bool
    dp: int
    dp_sharding: str  # the effective one: none where dp = 1
    param_offload: bool
    compute_dtype: torch.dtype
    master_dtype: torch.dtype
    tp: int = 1

    @property
    def trainable_dtype(self) -> torch.dtype:
        """The dtype trainable parameters are stored in: the master's where FSDP's shards are the master."""
        return self.master_dtype if self.dp_sharding != "none" and self.trainable else self.compute_dtype


class ModelConverter:
    """One model-to-model rewrite at the convert step and what follows from it (module docstring).
    `model` below is the built `ShardedModel`; `module` its pipeline-stage module."""

    own_format: ClassVar[bool] = False
    has_frozen_base: ClassVar[bool] = False
    record_key: ClassVar[str | None] = None
    # the trainable-key filter over canonical names; None: every parameter trains
    trainable_keys: Callable[[str], bool] | None = None

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        if cls.record_key is not None:
            RECORDED[cls.record_key] = cls

    # ---- build ------------------------------------------------------------------------------------
    def check(self, build: BuildContext) -> None:
        """Refuse (ValueError naming the setting) a build this converter cannot apply to."""

    def convert(self, hf_model: nn.Module, build: BuildContext) -> nn.Module:
        raise NotImplementedError

    def canonical_name(self, name: str) -> str:
        return name

    def fresh(self) -> dict[str, Init]:
        """{canonical name: init} of new tensors not read from the model's files (initialised on each shard)."""
        return {}

    def files(self, base: Mapping[str, torch.Tensor], meta: Sequence[tuple]) -> Mapping[str, torch.Tensor]:
        """The full tensors the model is materialized from: `base` (its safetensors) plus this converter's
        new tensors, by canonical name; `meta` the whole model's (name, shape, dtype, stage)."""
        return base

    def tensor_parallel_plan(self, plan: dict, module_names: list[str]) -> dict:
        """A decoder layer's TP plan ({submodule: ParallelStyle}) rewritten for the modules it wrapped."""
        return plan

    # ---- running ----------------------------------------------------------------------------------
    def training(self, module: nn.Module):
        """A context around the differentiated forward of `module`."""
        return contextlib.nullcontext()

    def frozen_base(self, module: nn.Module):
        """A context in which `module` computes with its frozen base alone (where `has_frozen_base`)."""
        raise NotImplementedError

    def describe(self, model, *, base_is_reference: bool) -> str:
        """One line for the start-up log ("": nothing to say)."""
        return ""

    # ---- state: own format (`own_format`) ----------------------------------------------------------
    def record(self) -> Any:
        """What the checkpoint's meta.json holds under `record_key` (JSON)."""
        return None

    def check_resume(self, saved: Any, path: str) -> None:
        """Refuse a checkpoint whose record (`saved`: meta.json's value under `record_key`, None when it has
        none) this run cannot resume."""

    @classmethod
    def foreign_checkpoint(cls, saved: Any, path: str) -> str:
        """The message refusing a checkpoint recorded by this kind in a run that does not apply it."""
        return f"checkpoint {path} was written with the {cls.record_key} converter, which this run does not apply"

    def save(self, model, out_dir: str, *, write: bool) -> None:
        """The model's checkpoint files in its own format (collective; rank `write` writes)."""
        raise NotImplementedError

    def load(self, model, path: str) -> None:
        """Read `save`'s files of checkpoint `path` into the model (collective)."""
        raise NotImplementedError

    def export(self, model, out_dir: str, *, dtype: torch.dtype, write: bool) -> None:
        """The model's export in its own format (collective; rank `write` writes)."""
        raise NotImplementedError

    def weight_source(self, model, announce: Callable[[str], None] | None):
        """What a push reads (a `WeightSource`)."""
        raise NotImplementedError

    def plain_weights(self, model):
        """A `WeightSource` of the model as its unconverted architecture (a merged export); None: the state as is."""
        return None


class ValueHead(ModelConverter):
    """The critic: the actor's architecture with `lm_head` replaced by a zero-initialised (hidden → 1)
    value head, so V starts at 0 everywhere and every parallel strategy applies unchanged. The head is
    not read from the LM checkpoint (its lm_head is [vocab, hidden]): it is initialised to zeros."""

    def convert(self, hf_model: nn.Module, build: BuildContext) -> nn.Module:
        w = hf_model.get_input_embeddings().weight
        hf_model.lm_head = nn.Linear(hf_model.config.hidden_size, 1, bias=False).to(device=w.device, dtype=w.dtype)
        hf_model.config.tie_word_embeddings = False  # the value head is its own tensor
        return hf_model

    def fresh(self) -> dict[str, Init]:
        return {"lm_head.weight": nn.init.zeros_}


class Conversion:
    """The converters applied to one model, in order, composed into the hooks the seam calls. At most
    one of them has its own state format; without one the model's state is the full model's."""

    def __init__(self, converters: Sequence[ModelConverter] = ()) -> None:
        self.converters = tuple(converters)
        owners = [c for c in self.converters if c.own_format]
        if len(owners) > 1:
            raise ValueError(f"converters {[type(c).__name__ for c in owners]} each bring their own state "
                             "format: a model takes one of them")
        self.format: ModelConverter | None = owners[0] if owners else None
        keys = [c.trainable_keys for c in self.converters if c.trainable_keys is not None]
        # the trainable subset: what every converter's filter lets through; None: every parameter trains
        self.trainable_keys: Callable[[str], bool] | None = (
            None if not keys else keys[0] if len(keys) == 1 else (lambda name: all(k(name) for k in keys)))

    def __iter__(self) -> Iterator[ModelConverter]:
        return iter(self.converters)

    def canonical_name(self, name: str) -> str:
        for c in self.converters:
            name = c.canonical_name(name)
        return name

    def fresh(self) -> dict[str, Init]:
        out: dict[str, Init] = {}
        for c in self.converters:
            out.update(c.fresh())
        return out

    def files(self, base: Mapping[str, torch.Tensor], meta: Sequence[tuple]) -> Mapping[str, torch.Tensor]:
        for c in self.converters:
            base = c.files(base, meta)
        return base

    def tensor_parallel_plan(self, plan: dict, module_names: list[str]) -> dict:
        for c in self.converters:
            plan = c.tensor_parallel_plan(plan, module_names)
        return plan

    @contextlib.contextmanager
    def training(self, module: nn.Module):
        with contextlib.ExitStack() as stack:
            for c in self.converters:
                stack.enter_context(c.training(module))
            yield

    @property
    def has_frozen_base(self) -> bool:
        """Whether the model can compute as its frozen base (`frozen_base`)."""
        return any(c.has_frozen_base for c in self.converters)

    @contextlib.contextmanager
    def frozen_base(self, module: nn.Module):
        """`module` computing as its frozen base: every converter that has one leaves it alone."""
        with contextlib.ExitStack() as stack:
            for c in self.converters:
                if c.has_frozen_base:
                    stack.enter_context(c.frozen_base(module))
            yield

    def describe(self, model, *, base_is_reference: bool) -> str:
        return "; ".join(d for c in self.converters if (d := c.describe(model, base_is_reference=base_is_reference)))

    # ---- state ------------------------------------------------------------------------------------
    def records(self) -> dict[str, Any]:
        """meta.json's entries: every recorded kind's key, with this model's record or null."""
        mine = {c.record_key: c.record() for c in self.converters if c.record_key is not None}
        return {key: mine.get(key) for key in RECORDED}

    def check_resume(self, meta: Mapping[str, Any], path: str) -> None:
        """Each recorded kind: the run's converter judges the checkpoint's record; a record of a kind
        the run does not apply refuses the checkpoint."""
        for key, kind in RECORDED.items():
            mine = next((c for c in self.converters if c.record_key == key), None)
            saved = meta.get(key)
            if mine is not None:
                mine.check_resume(saved, path)
            elif saved:
                raise ValueError(kind.foreign_checkpoint(saved, path))

    def save(self, model, out_dir: str, *, write: bool) -> bool:
        """The model's checkpoint files in its converter's format; False: none has one (write the full model)."""
        if self.format is None:
            return False
        self.format.save(model, out_dir, write=write)
        return True

    def load(self, model, path: str) -> bool:
        if self.format is None:
            return False
        self.format.load(model, path)
        return True

    def export(self, model, out_dir: str, *, dtype: torch.dtype, write: bool) -> bool:
        if self.format is None:
            return False
        self.format.export(model, out_dir, dtype=dtype, write=write)
        return True

    def weight_source(self, model, announce: Callable[[str], None] | None = None):
        """What a push reads: the format converter's source, else the model's full state."""
        if self.format is None:
            return model.weights(announce)
        return self.format.weight_source(model, announce)

    def plain_weights(self, model):
        """The model as its unconverted architecture (a merged export); without a converter that merges,
        the full state."""
        for c in self.converters:
            src = c.plain_weights(model)
            if src is not None:
                return src
        return model.weights()
