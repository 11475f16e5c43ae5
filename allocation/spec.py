"""Typed, immutable description of an allocation: which backends run, with which parallelism.

`Allocation` is the value every allocation string parses into (see `allocation.parser` for the
grammar). It knows its kind, how many devices it needs, and how to print itself as a canonical
modern string (``str(alloc)``) that parses back to an equal value.

Pools and roles: components separated by ``+`` get devices of their own, those joined by ``|`` share
one pool (equal world sizes). Every component has a name (written ``backend[name]:dims``; unnamed ones are
``rollout`` for generation and ``actor`` for training) and a role (`role_of`): ``rollout``, ``actor``,
``critic``, ``ref``, ``judge`` or ``teacher``. A run's rollout servers are ``Allocation.generation`` and
its actor ``Allocation.training``; the other components (a critic pool, a judge's or a teacher's servers)
are in ``Allocation.components``.

Kinds (``Allocation.kind``):
    ``generation_only``  only generation servers (``sglang:d4``).
    ``train_only``       only learner components (``megatron:d8p2``, ``fsdp[actor]:d4|fsdp[critic]:d4``).
    ``decoupled``        the rollout servers and the actor on separate devices (``sglang:d4+fsdp:d8``).
    ``colocated``        the rollout servers share the actor's devices (``sglang:d4|fsdp[actor]:d4``).
The devices needed are the sum over the pools (``Allocation.total_devices``), as AReaL counts them.

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
TRAINING_BACKENDS: tuple[str, ...] = ("megatron", "fsdp", "archon")
"""Training backends the parser accepts. A legacy string without a training backend means ``megatron``."""
RUNNABLE_TRAINING_BACKENDS: tuple[str, ...] = ("megatron", "fsdp")
"""Training backends areal_like's learner runs (archon is parse-only)."""
EXPERT_BACKENDS: tuple[str, ...] = ("megatron", "archon")
"""Training backends with pipeline and expert parallelism and the attn/ffn hybrid layout."""

DEFAULT_GENERATION_NAME = "rollout"
DEFAULT_TRAINING_NAME = "actor"

ROLES: tuple[str, ...] = ("rollout", "actor", "critic", "ref", "judge", "teacher")
"""A component named one of these has that role; any other name takes its backend's role: ``rollout`` for a
generation backend (``sglang[gen]``, ``sglang[rollout2]``), ``actor`` for a training one."""


def role_of(name: str, generation: bool) -> str:
    """The role of a component called `name` (see `ROLES`)."""
    if name in ROLES:
        return name
    return DEFAULT_GENERATION_NAME if generation else DEFAULT_TRAINING_NAME

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

    @property
    def role(self) -> str:
        return role_of(self.name, generation=True)

    def text(self, named: bool = False) -> str:
        """``backend[name]:dims``; the name only when `named` or not the default."""
        name = f"[{self.name}]" if named or self.name != DEFAULT_GENERATION_NAME else ""
        return f"{self.backend}{name}:{_dims_str(self.dp, self.pp, self.tp)}"

    def __str__(self) -> str:
        return self.text()


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

    @property
    def runnable(self) -> bool:
        return self.backend in RUNNABLE_TRAINING_BACKENDS

    @property
    def role(self) -> str:
        return role_of(self.name, generation=False)

    def text(self, named: bool = False) -> str:
        """``backend[name]:dims`` (or ``:(attn:…|ffn:…)``); the name only when `named` or not the default."""
        name = f"[{self.name}]" if named or self.name != DEFAULT_TRAINING_NAME else ""
        if self.ffn is not None:
            return f"{self.backend}{name}:(attn:{self.attn}|ffn:{self.ffn})"
        return f"{self.backend}{name}:{self.attn}"

    def __str__(self) -> str:
        return self.text()


Component = GenerationSpec | TrainingSpec
"""One parsed component: a generation pool (servers) or a learner pool (ranks)."""


@dataclass(frozen=True)
class Allocation:
    """A parsed allocation string. Build one with `allocation.parse_allocation`.

    ``groups`` are the device pools in the order written (``+`` separates them); the components of one
    group (``|``) share that group's devices and have equal world sizes. Each component has a name and a
    role (`role_of`). The run's two main components are ``generation`` (the rollout servers) and
    ``training`` (the actor); ``colocated`` is True when they share a group.
    """

    groups: tuple[tuple[Component, ...], ...] = ()
    source: str = field(default="", compare=False, repr=False)
    """The string this was parsed from (for error messages; not part of the value)."""

    @property
    def components(self) -> tuple[Component, ...]:
        """Every component, in the order written."""
        return tuple(c for g in self.groups for c in g)

    @property
    def generation(self) -> GenerationSpec | None:
        """The rollout servers: the first generation component whose role is ``rollout``."""
        return next((c for c in self.components if isinstance(c, GenerationSpec) and c.role == "rollout"), None)

    @property
    def generation_components(self) -> tuple[GenerationSpec, ...]:
        """Every generation component (rollout, judge, teacher, ...), in order."""
        return tuple(c for c in self.components if isinstance(c, GenerationSpec))

    @property
    def training_components(self) -> tuple[TrainingSpec, ...]:
        """Every learner component (actor, critic, ...), in order."""
        return tuple(c for c in self.components if isinstance(c, TrainingSpec))

    @property
    def training(self) -> TrainingSpec | None:
        """The actor: the first learner component whose role is ``actor``."""
        return next((c for c in self.training_components if c.role == "actor"), None)

    @property
    def colocated(self) -> bool:
        """The rollout servers share their devices with the actor."""
        gen, train = self.generation, self.training
        return gen is not None and train is not None and self.group_of(gen) == self.group_of(train)

    def group_of(self, comp: Component) -> int:
        """Index of the device pool `comp` belongs to."""
        for i, g in enumerate(self.groups):
            if any(c.name == comp.name for c in g):  # names are distinct (the parser's rule)
                return i
        raise ValueError(f"{comp} is not a component of {self}")

    @property
    def kind(self) -> Kind:
        if not self.training_components:
            return "generation_only"
        if not self.generation_components:
            return "train_only"
        return "colocated" if self.colocated else "decoupled"

    @property
    def generation_devices(self) -> int:
        return self.generation.world_size if self.generation is not None else 0

    @property
    def training_devices(self) -> int:
        return self.training.world_size if self.training is not None else 0

    @staticmethod
    def group_devices(group: tuple[Component, ...]) -> int:
        """Devices of one pool: its components' common world size."""
        return group[0].world_size if group else 0

    @property
    def total_devices(self) -> int:
        """Devices the allocation needs: the sum over its pools (components sharing a pool count once)."""
        return sum(self.group_devices(g) for g in self.groups)

    def require_runnable(self) -> None:
        """Raise `AllocationError` if a component is parse-only here (vllm, archon)."""
        source = self.source or str(self)
        for comp in self.components:
            if comp.runnable:
                continue
            column = comp.column if self.source else 0
            if isinstance(comp, GenerationSpec):
                runnable = " or ".join(RUNNABLE_GENERATION_BACKENDS)
                example = str(self).replace(comp.backend, "sglang", 1)
            else:
                runnable = " or ".join(RUNNABLE_TRAINING_BACKENDS)
                example = str(self).replace(comp.backend, "megatron", 1)
            kind = "generation" if isinstance(comp, GenerationSpec) else "training"
            raise AllocationError(
                f"{kind} backend {comp.backend!r} can be planned but not run by areal_like",
                source,
                column,
                f"use {runnable} instead, e.g. {example!r}",
            )

    def __str__(self) -> str:
        """Canonical modern string, valid in AReaL's grammar too: names are written where it needs them
        (with 3+ components every one; a colocated member after the first) or where not the default."""
        every = len(self.components) >= 3
        return "+".join("|".join(c.text(named=every or i > 0) for i, c in enumerate(g)) for g in self.groups)
