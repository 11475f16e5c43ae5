"""Parse AReaL allocation strings (all three generations) into an `Allocation`.

Accepted forms (whitespace is allowed at the ends and around ``+``, ``|`` and inside ``( )``):

* legacy dotted, ``m`` = tensor parallel, dimensions in any order:
  ``sglang.d16p1m1+d8p2m1``, ``sglang.d8m8p1 + d4p4m4``, training-only ``d32p1m4``;
* dotted with ``t`` = tensor parallel, missing dimensions = 1: ``sglang.d4p1t1+d4p1t1``,
  ``sglang.d4+d4``, ``embedded.d1p1t1+d1p1t1``;
* modern colon form: ``sglang:d4t2+fsdp:d8``, ``megatron:d2p2t4e4``,
  ``sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)``,
  named and colocated components ``sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4``.

Grammar (AReaL 1.0.4's for the modern form, plus the older ones above)::

    allocation := group ('+' group)*            each group: devices of its own, in the order written
    group      := component ('|' component)*   components of one group share its devices
    component  := backend ('[' name ']')? ('.' | ':') (dims | hybrid)  |  dims
    hybrid     := '(' 'attn' ':' dims '|' 'ffn' ':' dims ')'   (either order; or without '( )', attn first)
    dims       := (letter size)+   letter in d p t m c e, size a positive integer, each letter once
    name       := [A-Za-z_][A-Za-z0-9_]*

Whitespace is allowed at the ends, around ``+``, ``|`` and ``:``, inside ``[ ]`` and ``( )``.

Semantics (AReaL's): ``d`` data parallel (= number of generation servers), ``p`` pipeline,
``t`` or ``m`` tensor (the same dimension, so only one of them), ``c`` context, ``e`` expert.
Missing dimensions are 1. A generation component may not use ``c`` or ``e``. Devices are d×p×t for
generation and d×p×t×c for training; ``e`` adds no devices (it must divide d×t×c). In an
attn/ffn hybrid the attention world d×p×t×c must equal the ffn world d×p×t×e, and both use the
same ``p``. ``fsdp`` has neither ``p`` nor ``e`` (use ``megatron`` for those). Dimensions without a
backend (the legacy training part) mean our Megatron-style learner: backend ``megatron``.

Names (AReaL's rules): components in one ``|`` group have equal world sizes and every one after the
first is named; with 3 or more components joined by ``+`` every one is named; names are distinct.
A string without any name keeps the older rules: unnamed components are called ``rollout``
(generation) and ``actor`` (training), so ``sglang:d4|fsdp:d4`` is the rollout colocated with the
actor and ``sglang:d2+sglang:d2`` is refused (two components called ``rollout``). The order of the
groups is free (``fsdp[actor]:d4+sglang[rollout]:d2``); a name gives the component its role
(`allocation.spec.role_of`).

Every failure is an `AllocationError` with a column and a hint; nothing else escapes
`parse_allocation` for any ``str`` input. This module does not place anything on devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from allocation.errors import AllocationError
from allocation.spec import (
    DEFAULT_GENERATION_NAME,
    DEFAULT_TRAINING_NAME,
    EXPERT_BACKENDS,
    GENERATION_BACKENDS,
    TRAINING_BACKENDS,
    Allocation,
    GenerationSpec,
    ParallelDims,
    TrainingSpec,
)

_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyz")
_DIGITS = frozenset("0123456789")
_NAME_HINT = "a name is a letter or '_' followed by letters, digits or '_' (AReaL's rule), e.g. fsdp[critic]:d4"
_NAME_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_NAME_CHARS = _NAME_START | _DIGITS
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
        if len(word) > 1 and nxt.isspace():  # AReaL allows spaces between a backend and '[' or ':'
            save = self.i
            self.skip_ws()
            nxt = self.peek()
            if nxt not in ("[", ":"):
                self.i, nxt = save, self.peek()
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
            self.skip_ws()
            name_column = self.i
            if self.peek() != "" and self.peek() not in _NAME_START and self.peek() != "]":
                raise self.fail(f"bad component name, found {self.describe(self.i)}", self.i, _NAME_HINT)
            while self.i < len(self.s) and self.s[self.i] in _NAME_CHARS:
                self.i += 1
            name = self.s[name_column : self.i]
            self.skip_ws()
            if self.peek() != "]":
                raise self.fail(f"bad component name, found {self.describe(self.i)}", self.i,
                                "close the name with ']'; " + _NAME_HINT)
            if not name:
                raise self.fail("empty component name", name_column, "write a name inside [ ], e.g. fsdp[critic]:d4")
            self.i += 1
            self.skip_ws()
            if self.peek() not in (".", ":"):
                raise self.fail(
                    f"expected ':' after {word}[{name}], found {self.describe(self.i)}",
                    self.i,
                    f"write {word}[{name}]:d4",
                )
        self.i += 1  # '.' or ':'
        self.skip_ws()
        if self.peek() == "(" or self.starts_bare_hybrid():
            hybrid_column = self.i
            if word not in EXPERT_BACKENDS:
                raise self.fail(
                    f"attention/ffn hybrid layout is not available for {word!r}",
                    hybrid_column,
                    f"only {' and '.join(EXPERT_BACKENDS)} take (attn:...|ffn:...), "
                    "e.g. megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)",
                )
            attn, ffn = self.parse_hybrid()
            return _Component(word, name, start, name_column, None, (attn, ffn))
        dims = self.parse_dims()
        return _Component(word, name, start, name_column, dims, None)

    def starts_bare_hybrid(self) -> bool:
        """At ``attn:`` without a '(' (AReaL's parentheses are optional: ``megatron:attn:d2t2|ffn:e4``)."""
        if not self.s.startswith("attn", self.i):
            return False
        k = self.i + 4
        while k < len(self.s) and self.s[k].isspace():
            k += 1
        return k < len(self.s) and self.s[k] == ":"

    def parse_hybrid(self) -> tuple[_Dims, _Dims]:
        """``(attn:dims|ffn:dims)`` (either order), or without parentheses ``attn:dims|ffn:dims``."""
        open_col = self.i
        paren = self.peek() == "("
        if paren:
            self.i += 1
            self.skip_ws()
        parts: dict[str, _Dims] = {}
        while True:
            label_col = self.i
            label = self.read_letters()
            if label not in ("attn", "ffn") or (not paren and label != ("attn" if not parts else "ffn")):
                want = "'attn:' or 'ffn:' inside ( )" if paren else ("'attn:'" if not parts else "'ffn:' after '|'")
                raise self.fail(
                    f"expected {want}, found {self.describe(label_col)}",
                    label_col,
                    "write (attn:d2p2t2c2|ffn:d2p2t2e2)",
                )
            if label in parts:
                raise self.fail(f"{label!r} given twice", label_col, "give one attn: and one ffn: layout")
            self.skip_ws()
            if self.peek() != ":":
                raise self.fail(
                    f"expected ':' after {label!r}, found {self.describe(self.i)}", self.i, f"write {label}:d2p2t2"
                )
            self.i += 1
            self.skip_ws()
            parts[label] = self.parse_dims()
            if not paren and label == "ffn":
                break
            self.skip_ws()
            ch = self.peek()
            if ch == ")" and paren:
                self.i += 1
                break
            if ch == "|":
                self.i += 1
                self.skip_ws()
                continue
            if ch == "" and paren:
                raise self.fail("unclosed '('", open_col, "close the hybrid layout with ')'")
            raise self.fail(
                f"expected {'| or )' if paren else '|ffn:'} in the hybrid layout, found {self.describe(self.i)}",
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
        """Names, pools and world sizes, by AReaL's rules (module docstring)."""
        specs = [[self.generation_spec(c) if c.is_generation else self.training_spec(c) for c in g] for g in groups]
        comps = [c for g in groups for c in g]
        explicit = any(c.name is not None for c in comps)
        # a colocated member after the first is named (a string without any name keeps the old
        # unnamed `sglang:d4|fsdp:d4`: its members are told apart by their default names)
        if explicit:
            for g in groups:
                for c in g[1:]:
                    if c.name is None:
                        raise self.fail(
                            "components in a colocation group must have names",
                            c.start,
                            f"name every component after the first of a '|' group, e.g. "
                            f"'{c.backend or 'megatron'}[critic]:...'",
                        )
        # with 3+ components joined by '+', every one is named
        unnamed = [c for c in comps if c.name is None]
        if len(groups) > 1 and len(comps) >= 3 and unnamed:
            raise self.fail(
                f"with 3 or more components all must have names; {len(unnamed)} unnamed",
                unnamed[0].start,
                "name each one, e.g. 'sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d4'",
            )
        seen: set[str] = set()
        for comp, spec in zip(comps, (s for g in specs for s in g)):
            if spec.name in seen:
                written = "" if comp.name is not None else f" (the default name of an unnamed {comp.backend or 'megatron'} component)"
                raise self.fail(
                    f"duplicate component name {spec.name!r}{written}",
                    comp.name_column,
                    "give each component a distinct name, e.g. 'sglang[rollout]:d2+sglang[judge]:d1' or "
                    "'fsdp[actor]:d4|fsdp[critic]:d4'",
                )
            seen.add(spec.name)
        # components sharing devices have equal world sizes
        for g in specs:
            for spec in g[1:]:
                if spec.world_size != g[0].world_size:
                    raise self.fail(
                        f"colocated components must have matching world sizes: {spec.backend}[{spec.name}] uses "
                        f"{spec.world_size} devices and {g[0].backend}[{g[0].name}] {g[0].world_size}",
                        spec.column,
                        f"give both the same world size ({g[0].world_size} devices), or separate them with '+'",
                    )
        return Allocation(tuple(tuple(g) for g in specs), source=self.s)


def parse_allocation(text: str) -> Allocation:
    """Parse an allocation string; raise `AllocationError` (and nothing else) when it is invalid."""
    if not isinstance(text, str):
        raise AllocationError(
            f"allocation must be a string, not {type(text).__name__}", "", 0, f"pass a string, {_EXAMPLE}"
        )
    return _Parser(text).parse()
