"""Typed, immutable description of an allocation: which backends run, with which parallelism.

`Allocation` is the value every allocation string parses into (see `allocation.parser` for the
grammar). It knows its kind, how many devices it needs, and how to print itself as a canonical
modern string (``str(alloc)``) that parses back to an equal value.

Kinds (``Allocation.kind``):
    ``generation_only``  only generation servers (``sglang:d4``).
    ``train_only``       only learner components (``megatron:d8p2``, ``fsdp[actor]:d4|fsdp[critic]:d4``).
    ``decoupled``        generation and training on separate devices (``sglang:d4+fsdp:d8``);
                         the devices needed are the sum of both sides.
    ``colocated``        generation and training share the same devices (``sglang:d4|fsdp:d4``);
                         the devices needed are the common world size.
Colocated *training* components (``fsdp[actor]:d4|fsdp[critic]:d4``) always share one set of
devices, whatever the kind; they do not make the whole allocation "colocated" unless a generation
component is in the same ``|`` group.

This module does not parse strings and does not place anything on devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from allocation.errors import AllocationError

GENERATION_BACKENDS: tuple[str, ...] = ("sglang", "embedded", "vllm")
"""Generation backends the parser accepts."""
RUNNABLE_GENERATION_BACKENDS: tuple[str, ...] = ("sglang", "embedded")
"""Generation backends areal_like can actually launch (vllm is parse-only)."""
TRAINING_BACKENDS: tuple[str, ...] = ("megatron", "fsdp")
"""Training backends. A legacy string without a training backend means ``megatron``."""

DEFAULT_GENERATION_NAME = "rollout"
DEFAULT_TRAINING_NAME = "actor"

Kind = Literal["generation_only", "train_only", "decoupled", "colocated"]


def _dims_str(dp: int, pp: int = 1, tp: int = 1, cp: int = 1, ep: int = 1) -> str:
    """Canonical dimension string: order d p t c e, sizes of 1 left out (but never empty)."""
    parts = [f"{k}{v}" for k, v in (("d", dp), ("p", pp), ("t", tp), ("c", cp), ("e", ep)) if v != 1]
    return "".join(parts) or "d1"


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of one parallel layout: data, pipeline, tensor, context, expert."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def attn_world_size(self) -> int:
        """Devices of an attention (dense) layout: d×p×t×c (e adds no devices)."""
        return self.dp * self.pp * self.tp * self.cp

    @property
    def ffn_world_size(self) -> int:
        """Devices of an ffn (expert) layout in an attn/ffn hybrid: d×p×t×e."""
        return self.dp * self.pp * self.tp * self.ep

    def __str__(self) -> str:
        return _dims_str(self.dp, self.pp, self.tp, self.cp, self.ep)


@dataclass(frozen=True)
class GenerationSpec:
    """The generation side: ``dp`` servers, each using ``pp × tp`` devices."""

    backend: str
    name: str = DEFAULT_GENERATION_NAME
    dp: int = 1
    pp: int = 1
    tp: int = 1
    column: int = field(default=0, compare=False, repr=False)
    """Where this component starts in the source string (for error messages; not part of the value)."""

    @property
    def server_size(self) -> int:
        """Devices used by one server: p×t."""
        return self.pp * self.tp

    @property
    def num_servers(self) -> int:
        return self.dp

    @property
    def world_size(self) -> int:
        """Devices used by all servers: d×p×t."""
        return self.dp * self.pp * self.tp

    @property
    def runnable(self) -> bool:
        return self.backend in RUNNABLE_GENERATION_BACKENDS

    def __str__(self) -> str:
        name = "" if self.name == DEFAULT_GENERATION_NAME else f"[{self.name}]"
        return f"{self.backend}{name}:{_dims_str(self.dp, self.pp, self.tp)}"


@dataclass(frozen=True)
class TrainingSpec:
    """One learner component (actor, critic, ...) laid out as DP × PP × TP (× CP, EP).

    ``attn`` is the dense layout; ``ffn`` is set only for an attention/ffn hybrid
    (``megatron:(attn:...|ffn:...)``), in which case both layouts have the same world size and
    pipeline size. The flat properties (``dp``, ``pp``, ``tp``, ``cp``) describe ``attn``;
    ``ep`` is the ffn's expert size for a hybrid, else ``attn.ep``.
    """

    backend: str
    attn: ParallelDims
    name: str = DEFAULT_TRAINING_NAME
    ffn: ParallelDims | None = None
    column: int = field(default=0, compare=False, repr=False)

    @property
    def dp(self) -> int:
        return self.attn.dp

    @property
    def pp(self) -> int:
        return self.attn.pp

    @property
    def tp(self) -> int:
        return self.attn.tp

    @property
    def cp(self) -> int:
        return self.attn.cp

    @property
    def ep(self) -> int:
        return self.ffn.ep if self.ffn is not None else self.attn.ep

    @property
    def is_hybrid(self) -> bool:
        return self.ffn is not None

    @property
    def world_size(self) -> int:
        """Devices used: d×p×t×c of the (attention) layout; expert parallelism adds none."""
        return self.attn.attn_world_size

    def __str__(self) -> str:
        name = "" if self.name == DEFAULT_TRAINING_NAME else f"[{self.name}]"
        if self.ffn is not None:
            return f"{self.backend}{name}:(attn:{self.attn}|ffn:{self.ffn})"
        return f"{self.backend}{name}:{self.attn}"


@dataclass(frozen=True)
class Allocation:
    """A parsed allocation string. Build one with `allocation.parse_allocation`.

    ``generation`` is None or the one generation component; ``training_components`` holds every
    learner component (all of them share one set of devices); ``training`` is the first of them.
    ``colocated`` is True when generation shares its devices with training.
    """

    generation: GenerationSpec | None
    training_components: tuple[TrainingSpec, ...] = ()
    colocated: bool = False
    source: str = field(default="", compare=False, repr=False)
    """The string this was parsed from (for error messages; not part of the value)."""

    @property
    def training(self) -> TrainingSpec | None:
        return self.training_components[0] if self.training_components else None

    @property
    def kind(self) -> Kind:
        if self.training is None:
            return "generation_only"
        if self.generation is None:
            return "train_only"
        return "colocated" if self.colocated else "decoupled"

    @property
    def generation_devices(self) -> int:
        return self.generation.world_size if self.generation is not None else 0

    @property
    def training_devices(self) -> int:
        return self.training.world_size if self.training is not None else 0

    @property
    def total_devices(self) -> int:
        """Devices the allocation needs: generation + training, or their shared size if colocated."""
        if self.colocated:
            return max(self.generation_devices, self.training_devices)
        return self.generation_devices + self.training_devices

    def require_runnable(self) -> None:
        """Raise `AllocationError` if a component is parse-only here (vllm)."""
        gen = self.generation
        if gen is not None and not gen.runnable:
            source = self.source or str(self)
            column = gen.column if self.source else 0
            runnable = " or ".join(RUNNABLE_GENERATION_BACKENDS)
            raise AllocationError(
                f"generation backend {gen.backend!r} can be planned but not run by areal_like",
                source,
                column,
                f"use {runnable} instead, e.g. {str(self).replace(gen.backend, 'sglang', 1)!r}",
            )

    def __str__(self) -> str:
        train = "|".join(str(t) for t in self.training_components)
        if self.generation is None:
            return train
        if not train:
            return str(self.generation)
        return f"{self.generation}{'|' if self.colocated else '+'}{train}"
