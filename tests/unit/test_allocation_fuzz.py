"""Fuzz the parser: for any str, only AllocationError escapes; valid results round-trip and place."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocation import Allocation, AllocationError, parse_allocation, place

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_TOKENS = [
    "sglang", "embedded", "vllm", "megatron", "fsdp", "foo", ".", ":", "+", " + ", "|", " | ",
    "[", "]", "actor", "critic", "(", ")", "attn:", "ffn:", "d", "p", "t", "m", "c", "e", "x",
    "0", "1", "2", "4", "8", "16", "99999999", " ", "\t", "é", "²", "-",
]  # fmt: skip


def _check(text: str) -> None:
    try:
        alloc = parse_allocation(text)
    except AllocationError as err:
        assert 0 <= err.column <= len(text)
        assert err.hint
        str(err)
        return
    assert parse_allocation(str(alloc)) == alloc
    assert alloc.kind in ("decoupled", "train_only", "generation_only", "colocated")
    if alloc.total_devices <= 4096:
        try:
            plan = place(alloc, devices_per_node=8)
        except AllocationError:
            raise AssertionError(f"a parsed allocation failed to place: {text!r}") from None
        assert len(plan.used_devices) == alloc.total_devices


@FUZZ
@given(st.text(max_size=60))
def test_random_text(text: str) -> None:
    _check(text)


@FUZZ
@given(st.lists(st.sampled_from(_TOKENS), max_size=14).map("".join))
def test_near_valid_token_soup(text: str) -> None:
    _check(text)


_dim = st.tuples(st.sampled_from("dptmce"), st.integers(0, 9)).map(lambda lt: f"{lt[0]}{lt[1]}")
_dims = st.lists(_dim, min_size=1, max_size=4).map("".join)
_backend = st.sampled_from(["sglang", "embedded", "vllm", "megatron", "fsdp"])
_name = st.sampled_from(["", "[actor]", "[critic]", "[rollout]", "[x]"])
_sep = st.sampled_from([".", ":"])
_hybrid = st.tuples(_dims, _dims).map(lambda ad: f"(attn:{ad[0]}|ffn:{ad[1]})")
_component = st.one_of(
    _dims,
    st.tuples(_backend, _name, _sep, st.one_of(_dims, _hybrid)).map("".join),
)
_group = st.lists(_component, min_size=1, max_size=3).map("|".join)


@FUZZ
@given(st.lists(_group, min_size=1, max_size=3).map(" + ".join))
def test_structured_near_valid(text: str) -> None:
    _check(text)


@FUZZ
@given(st.lists(_group, min_size=1, max_size=2).map("+".join), st.integers(0, 40), st.sampled_from("+|:.()[]0dx "))
def test_mutated_valid_looking(text: str, pos: int, ch: str) -> None:
    pos = min(pos, len(text))
    _check(text[:pos] + ch + text[pos:])
    _check(text[:pos] + text[pos + 1 :])


@FUZZ
@given(
    st.integers(1, 8), st.integers(1, 4), st.integers(1, 4),  # generation d p t
    st.integers(1, 8), st.integers(1, 4), st.integers(1, 4), st.integers(1, 2),  # training d p t c
)
def test_generated_valid_round_trip(gd: int, gp: int, gt: int, td: int, tp: int, tt: int, tc: int) -> None:
    text = f"sglang.d{gd}p{gp}m{gt}+d{td}p{tp}m{tt}c{tc}"
    alloc = parse_allocation(text)
    assert isinstance(alloc, Allocation)
    assert alloc.total_devices == gd * gp * gt + td * tp * tt * tc
    assert parse_allocation(str(alloc)) == alloc
    _check(text)
