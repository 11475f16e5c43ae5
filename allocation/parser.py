"""Parse AReaL allocation strings (all three generations) into an `Allocation`.

Accepted forms (whitespace is allowed at the ends and around ``+``, ``|`` and inside ``( )``):

* legacy dotted, ``m`` = tensor parallel, dimensions in any order:
  ``sglang.d16p1m1+d8p2m1``, ``sglang.d8m8p1 + d4p4m4``, training-only ``d32p1m4``;
* dotted with ``t`` = tensor parallel, missing dimensions = 1: ``sglang.d4p1t1+d4p1t1``,
  ``sglang.d4+d4``, ``embedded.d1p1t1+d1p1t1``;
* modern colon form: ``sglang:d4t2+fsdp:d8``, ``megatron:d2p2t4e4``,
  ``sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)``,
  named and colocated components ``sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4``.

Grammar::

    allocation := group ('+' group)?           left of '+': the generation server; right: training
    group      := component ('|' component)*   components of one group share the same devices
    component  := backend ('[' name ']')? ('.' | ':') (dims | hybrid)  |  dims
    hybrid     := '(' 'attn' ':' dims '|' 'ffn' ':' dims ')'          (either order, megatron only)
    dims       := (letter size)+   letter in d p t m c e, size a positive integer, each letter once

Semantics (AReaL's): ``d`` data parallel (= number of generation servers), ``p`` pipeline,
``t`` or ``m`` tensor (the same dimension, so only one of them), ``c`` context, ``e`` expert.
Missing dimensions are 1. A generation part may not use ``c`` or ``e``. Devices are d×p×t for
generation and d×p×t×c for training; ``e`` adds no devices (it must divide d×t×c). In an
attn/ffn hybrid the attention world d×p×t×c must equal the ffn world d×p×t×e, and both use the
same ``p``. ``fsdp`` has neither ``p`` nor ``e`` (use ``megatron`` for those). Dimensions without a
backend (the legacy training part) mean our Megatron-style learner: backend ``megatron``.

Components in one ``|`` group share devices, so they must have equal world sizes; there is at most
one generation component; a generation component colocated with training makes the allocation
kind ``colocated``. Unnamed components are called ``rollout`` (generation) and ``actor``
(training); names must be distinct (``fsdp[actor]:d4|fsdp[critic]:d4``).

Every failure is an `AllocationError` with a column and a hint; nothing else escapes
`parse_allocation` for any ``str`` input. This module does not place anything on devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from allocation.errors import AllocationError
from allocation.spec import (
    DEFAULT_GENERATION_NAME,
    DEFAULT_TRAINING_NAME,
    GENERATION_BACKENDS,
    TRAINING_BACKENDS,
    Allocation,
    GenerationSpec,
    ParallelDims,
    TrainingSpec,
)

_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyz")
_DIGITS = frozenset("0123456789")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
_DIM_LETTERS = {"d": "dp", "p": "pp", "t": "tp", "m": "tp", "c": "cp", "e": "ep"}
_DIM_WORDS = {"dp": "data", "pp": "pipeline", "tp": "tensor", "cp": "context", "ep": "expert"}
_MAX_DIGITS = 6  # sizes up to 999999; keeps int() away from huge inputs
_BACKENDS_HINT = (
    f"known backends: {', '.join(GENERATION_BACKENDS)} (generation); "
    f"{', '.join(TRAINING_BACKENDS)} (training)"
)
_DIMS_HINT = "dimensions are d (data), p (pipeline), t or m (tensor), c (context), e (expert)"
_EXAMPLE = "e.g. 'sglang:d4t2+fsdp:d8' or 'sglang.d4p1m1+d2p2m1'"


@dataclass(frozen=True)
class _Dims:
    """Parsed dimension sizes plus the column of each letter (for later semantic errors)."""

    sizes: dict[str, int]
    columns: dict[str, int]
    letters: dict[str, str]  # canonical key -> letter as written ('m' or 't' for tp)
    start: int

    def get(self, key: str) -> int:
        return self.sizes.get(key, 1)

    def text(self, key: str) -> str:
        return f"{self.letters[key]}{self.sizes[key]}"


@dataclass(frozen=True)
class _Component:
    backend: str  # "" for a bare (legacy training) dims component
    name: str | None
    start: int
    name_column: int
    dims: _Dims | None
    hybrid: tuple[_Dims, _Dims] | None  # (attn, ffn)

    @property
    def is_generation(self) -> bool:
        return self.backend in GENERATION_BACKENDS


class _Parser:
    def __init__(self, source: str) -> None:
        self.s = source
        self.i = 0

    # ---- low-level helpers -------------------------------------------------------------
    def fail(self, message: str, column: int, hint: str) -> AllocationError:
        return AllocationError(message, self.s, column, hint)

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def at_end(self) -> bool:
        return self.i >= len(self.s)

    def skip_ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def read_letters(self) -> str:
        start = self.i
        while self.i < len(self.s) and self.s[self.i] in _LETTERS:
            self.i += 1
        return self.s[start : self.i]

    def describe(self, column: int) -> str:
        return "the end" if column >= len(self.s) else repr(self.s[column])

    # ---- grammar ---------------------------------------------------------------------
    def parse(self) -> Allocation:
        self.skip_ws()
        if self.at_end():
            raise self.fail("empty allocation", self.i, f"write an allocation, {_EXAMPLE}")
        groups: list[list[_Component]] = [self.parse_group()]
        plus_columns: list[int] = []
        while True:
            self.skip_ws()
            if self.peek() != "+":
                break
            plus = self.i
            plus_columns.append(plus)
            self.i += 1
            self.skip_ws()
            if self.at_end():
                raise self.fail(
                    "dangling '+' with nothing after it",
                    plus,
                    "remove the trailing '+' or add the training part after it, e.g. '+fsdp:d8'",
                )
            if self.peek() in "+|":
                raise self.fail(
                    f"expected a component after '+', found {self.describe(self.i)}",
                    self.i,
                    "remove the extra separator",
                )
            groups.append(self.parse_group())
        self.skip_ws()
        if not self.at_end():
            ch = self.peek()
            if ch in _LETTERS and self.s[self.i - 1].isspace():
                hint = "spaces are allowed only around '+' and '|': write dimensions together, like d4p1t2"
            elif ch in ")]":
                hint = "remove the unmatched bracket"
            else:
                hint = "remove it"
            raise self.fail(f"unexpected {self.describe(self.i)}", self.i, hint + f"; {_EXAMPLE}")
        return self.assemble(groups, plus_columns)

    def parse_group(self) -> list[_Component]:
        comps = [self.parse_component()]
        while True:
            save = self.i
            self.skip_ws()
            if self.peek() != "|":
                self.i = save
                return comps
            bar = self.i
            self.i += 1
            self.skip_ws()
            if self.at_end() or self.peek() in "+|":
                raise self.fail(
                    "dangling '|' with no component after it",
                    bar,
                    "remove the '|' or add a colocated component after it, e.g. '|fsdp[critic]:d4'",
                )
            comps.append(self.parse_component())

    def parse_component(self) -> _Component:
        start = self.i
        ch = self.peek()
        if ch == "":
            raise self.fail("expected a component, found the end", start, _EXAMPLE)
        if ch not in _LETTERS:
            if ch in "+|":
                raise self.fail(
                    f"{ch!r} with nothing before it", start, f"remove the leading {ch!r}; {_EXAMPLE}"
                )
            raise self.fail(
                f"expected a backend or dimensions, found {self.describe(start)}",
                start,
                f"start with a backend or dimensions, {_EXAMPLE}",
            )
        word = self.read_letters()
        nxt = self.peek()
        if nxt not in (".", ":", "["):
            if len(word) == 1:
                if word not in _DIM_LETTERS:
                    raise self.fail(f"unknown dimension {word!r}", start, _DIMS_HINT)
                self.i = start  # bare dimensions: the legacy training part
                dims = self.parse_dims()
                return _Component("", None, start, start, dims, None)
            if word in GENERATION_BACKENDS or word in TRAINING_BACKENDS:
                raise self.fail(
                    f"expected ':' after backend {word!r}, found {self.describe(self.i)}",
                    self.i,
                    f"write {word}:d4 (backend, colon, dimensions)",
                )
            raise self.fail(
                f"unknown backend {word!r}", start, f"{_BACKENDS_HINT}; dimensions need a size, e.g. d4p2"
            )
        if word not in GENERATION_BACKENDS and word not in TRAINING_BACKENDS:
            raise self.fail(f"unknown backend {word!r}", start, _BACKENDS_HINT)
        name: str | None = None
        name_column = start
        if nxt == "[":
            self.i += 1
            name_column = self.i
            while self.i < len(self.s) and self.s[self.i] in _NAME_CHARS:
                self.i += 1
            name = self.s[name_column : self.i]
            if self.peek() != "]":
                raise self.fail(
                    f"bad component name, found {self.describe(self.i)}",
                    self.i,
                    "a name is letters, digits, '_' or '-' closed by ']', e.g. fsdp[critic]:d4",
                )
            if not name:
                raise self.fail("empty component name", name_column, "write a name inside [ ], e.g. fsdp[critic]:d4")
            self.i += 1
            if self.peek() not in (".", ":"):
                raise self.fail(
                    f"expected ':' after {word}[{name}], found {self.describe(self.i)}",
                    self.i,
                    f"write {word}[{name}]:d4",
                )
        self.i += 1  # '.' or ':'
        if self.peek() == "(":
            hybrid_column = self.i
            if word != "megatron":
                raise self.fail(
                    f"attention/ffn hybrid layout is not available for {word!r}",
                    hybrid_column,
                    "only megatron takes (attn:...|ffn:...), e.g. megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)",
                )
            attn, ffn = self.parse_hybrid()
            return _Component(word, name, start, name_column, None, (attn, ffn))
        dims = self.parse_dims()
        return _Component(word, name, start, name_column, dims, None)

    def parse_hybrid(self) -> tuple[_Dims, _Dims]:
        open_col = self.i
        self.i += 1
        self.skip_ws()
        parts: dict[str, _Dims] = {}
        while True:
            label_col = self.i
            label = self.read_letters()
            if label not in ("attn", "ffn"):
                raise self.fail(
                    f"expected 'attn:' or 'ffn:' inside ( ), found {self.describe(label_col)}",
                    label_col,
                    "write (attn:d2p2t2c2|ffn:d2p2t2e2)",
                )
            if label in parts:
                raise self.fail(f"{label!r} given twice", label_col, "give one attn: and one ffn: layout")
            if self.peek() != ":":
                raise self.fail(
                    f"expected ':' after {label!r}, found {self.describe(self.i)}", self.i, f"write {label}:d2p2t2"
                )
            self.i += 1
            parts[label] = self.parse_dims()
            self.skip_ws()
            ch = self.peek()
            if ch == ")":
                self.i += 1
                break
            if ch == "|":
                self.i += 1
                self.skip_ws()
                continue
            if ch == "":
                raise self.fail("unclosed '('", open_col, "close the hybrid layout with ')'")
            raise self.fail(
                f"expected '|' or ')' in the hybrid layout, found {self.describe(self.i)}",
                self.i,
                "write (attn:d2p2t2c2|ffn:d2p2t2e2)",
            )
        for label in ("attn", "ffn"):
            if label not in parts:
                raise self.fail(
                    f"hybrid layout without {label!r}",
                    open_col,
                    "give both layouts: (attn:d2p2t2c2|ffn:d2p2t2e2)",
                )
        return parts["attn"], parts["ffn"]

    def parse_dims(self) -> _Dims:
        start = self.i
        sizes: dict[str, int] = {}
        columns: dict[str, int] = {}
        letters: dict[str, str] = {}
        if self.peek() not in _LETTERS:
            raise self.fail(
                f"expected dimensions, found {self.describe(self.i)}",
                self.i,
                "write dimensions like d4p1t2 (d data, p pipeline, t tensor, c context, e expert)",
            )
        while self.peek() != "" and self.peek() in _LETTERS:
            col = self.i
            letter = self.peek()
            if letter not in _DIM_LETTERS:
                raise self.fail(
                    f"unknown dimension {letter!r}",
                    col,
                    _DIMS_HINT,
                )
            self.i += 1
            digits_start = self.i
            while self.i < len(self.s) and self.s[self.i] in _DIGITS:
                self.i += 1
            digits = self.s[digits_start : self.i]
            if not digits:
                raise self.fail(
                    f"dimension {letter!r} has no size", digits_start, f"write a size after it, e.g. {letter}2"
                )
            if len(digits.lstrip("0")) > _MAX_DIGITS:
                raise self.fail(
                    f"dimension {letter}{digits} is too large", col, f"sizes go up to {10**_MAX_DIGITS - 1}"
                )
            value = int(digits)
            key = _DIM_LETTERS[letter]
            if value == 0:
                raise self.fail(
                    f"dimension {letter!r} is zero", col, f"sizes start at 1: write {letter}1 or leave {letter!r} out"
                )
            if key in sizes:
                alias = letters[key] != letter
                hint = (
                    "'t' and 'm' both mean tensor parallel: keep only one"
                    if alias
                    else f"give {letter!r} once ({_DIM_WORDS[key]} parallel size)"
                )
                raise self.fail(f"repeated dimension {letter!r}", col, hint)
            sizes[key] = value
            columns[key] = col
            letters[key] = letter
        return _Dims(sizes, columns, letters, start)

    # ---- semantic checks -------------------------------------------------------------
    def generation_spec(self, comp: _Component) -> GenerationSpec:
        if comp.dims is None:  # hybrid on a generation backend is rejected while parsing
            raise self.fail("generation backends take plain dimensions", comp.start, "write e.g. sglang:d4t2")
        dims = comp.dims
        for key in ("cp", "ep"):
            if key in dims.sizes:
                raise self.fail(
                    f"{_DIM_WORDS[key]} parallelism ({dims.letters[key]!r}) on the generation part",
                    dims.columns[key],
                    f"context (c) and expert (e) apply to training only: remove {dims.text(key)!r}",
                )
        return GenerationSpec(
            backend=comp.backend,
            name=comp.name or DEFAULT_GENERATION_NAME,
            dp=dims.get("dp"),
            pp=dims.get("pp"),
            tp=dims.get("tp"),
            column=comp.start,
        )

    def training_spec(self, comp: _Component) -> TrainingSpec:
        backend = comp.backend or "megatron"
        name = comp.name or DEFAULT_TRAINING_NAME
        if comp.hybrid is not None:
            attn_d, ffn_d = comp.hybrid
            if "ep" in attn_d.sizes:
                raise self.fail(
                    "expert parallelism in the attn layout",
                    attn_d.columns["ep"],
                    f"put e in the ffn layout: remove {attn_d.text('ep')!r} from attn",
                )
            if "cp" in ffn_d.sizes:
                raise self.fail(
                    "context parallelism in the ffn layout",
                    ffn_d.columns["cp"],
                    f"put c in the attn layout: remove {ffn_d.text('cp')!r} from ffn",
                )
            attn = ParallelDims(attn_d.get("dp"), attn_d.get("pp"), attn_d.get("tp"), attn_d.get("cp"), 1)
            ffn = ParallelDims(ffn_d.get("dp"), ffn_d.get("pp"), ffn_d.get("tp"), 1, ffn_d.get("ep"))
            if attn.pp != ffn.pp:
                raise self.fail(
                    f"attn pipeline size {attn.pp} differs from ffn pipeline size {ffn.pp}",
                    ffn_d.columns.get("pp", ffn_d.start),
                    f"use the same p in both layouts, e.g. p{attn.pp} in ffn",
                )
            if attn.attn_world_size != ffn.ffn_world_size:
                raise self.fail(
                    f"attn world size d×p×t×c = {attn.attn_world_size} differs from "
                    f"ffn world size d×p×t×e = {ffn.ffn_world_size}",
                    ffn_d.start,
                    "make the attention and ffn world sizes equal (change d, t or e in ffn)",
                )
            return TrainingSpec(backend, attn, name, ffn, column=comp.start)
        dims = comp.dims
        if dims is None:
            raise self.fail("missing dimensions", comp.start, "write e.g. fsdp:d8")
        attn = ParallelDims(dims.get("dp"), dims.get("pp"), dims.get("tp"), dims.get("cp"), dims.get("ep"))
        if backend == "fsdp":
            for key in ("pp", "ep"):
                if key in dims.sizes and dims.sizes[key] > 1:
                    raise self.fail(
                        f"fsdp has no {_DIM_WORDS[key]} parallelism",
                        dims.columns[key],
                        f"use megatron for {dims.letters[key]!r} (e.g. megatron:{attn}) or remove {dims.text(key)!r}",
                    )
        dense = attn.dp * attn.tp * attn.cp
        if attn.ep > 1 and dense % attn.ep != 0:
            raise self.fail(
                f"expert parallel size {attn.ep} does not divide d×t×c = {dense}",
                dims.columns["ep"],
                f"choose e dividing {dense}, or use an attn/ffn hybrid layout",
            )
        return TrainingSpec(backend, attn, name, None, column=comp.start)

    def assemble(self, groups: list[list[_Component]], plus_columns: list[int]) -> Allocation:
        if len(groups) > 2:
            raise self.fail(
                "more than one '+'",
                plus_columns[1],
                "an allocation is 'generation+training'; use '|' for components sharing devices",
            )
        gens = [c for g in groups for c in g if c.is_generation]
        if len(gens) > 1:
            raise self.fail(
                "more than one generation component",
                gens[1].start,
                "use a single generation component; d sets the number of servers",
            )
        if len(groups) == 2:
            left, right = groups
            for comp in left:
                if not comp.is_generation:
                    raise self.fail(
                        "the part left of '+' must be the generation servers",
                        comp.start,
                        "put a generation backend first, e.g. 'sglang:d4+fsdp:d8', or drop the '+'",
                    )
            for comp in right:
                if comp.is_generation:
                    raise self.fail(
                        "a generation component right of '+'",
                        comp.start,
                        "put the generation component left of '+' and training on the right",
                    )
        generation = self.generation_spec(gens[0]) if gens else None
        training_comps = [c for g in groups for c in g if not c.is_generation]
        training = [self.training_spec(c) for c in training_comps]

        # names must be distinct
        seen: dict[str, int] = {}
        named: list[tuple[str, _Component]] = []
        if generation is not None:
            named.append((generation.name, gens[0]))
        named.extend((t.name, c) for t, c in zip(training, training_comps))
        for nm, comp in named:
            if nm in seen:
                raise self.fail(
                    f"duplicate component name {nm!r}",
                    comp.name_column,
                    "give each component a distinct name, e.g. 'fsdp[actor]:d4|fsdp[critic]:d4'",
                )
            seen[nm] = comp.start

        # components sharing devices must have equal world sizes
        colocated = len(groups) == 1 and generation is not None and bool(training)
        shared: list[tuple[str, int, int]] = []  # (label, world size, column)
        if colocated and generation is not None:
            shared.append((f"{generation.backend}[{generation.name}]", generation.world_size, generation.column))
        shared.extend((f"{t.backend}[{t.name}]", t.world_size, t.column) for t in training)
        if shared:
            first_label, first_world, _ = shared[0]
            for label, world, column in shared[1:]:
                if world != first_world:
                    raise self.fail(
                        f"colocated components share devices but {label} uses {world} and "
                        f"{first_label} uses {first_world}",
                        column,
                        f"give both the same world size ({first_world} devices), or separate them with '+'",
                    )
        return Allocation(generation, tuple(training), colocated, source=self.s)


def parse_allocation(text: str) -> Allocation:
    """Parse an allocation string; raise `AllocationError` (and nothing else) when it is invalid."""
    if not isinstance(text, str):
        raise AllocationError(
            f"allocation must be a string, not {type(text).__name__}", "", 0, f"pass a string, {_EXAMPLE}"
        )
    return _Parser(text).parse()
