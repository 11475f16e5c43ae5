"""Parsing allocation strings: valid forms of all three generations, errors with column and hint."""

from __future__ import annotations

import subprocess
import sys

import pytest

from allocation import Allocation, AllocationError, ParallelDims, parse_allocation

# (string, kind, total devices, canonical string)
VALID = [
    # legacy dotted, m = tensor, any order, spaces around '+'
    ("sglang.d16p1m1+d8p2m1", "decoupled", 32, "sglang:d16+megatron:d8p2"),
    ("sglang.d4p1m1 + d2p2m1", "decoupled", 8, "sglang:d4+megatron:d2p2"),
    ("sglang.d16p1m1 + d8p2m1", "decoupled", 32, "sglang:d16+megatron:d8p2"),
    ("sglang.d64p1m1 + d32p2m1", "decoupled", 128, "sglang:d64+megatron:d32p2"),
    ("sglang.d8m8p1 + d4p4m4", "decoupled", 128, "sglang:d8t8+megatron:d4p4t4"),
    ("d32p1m4", "train_only", 128, "megatron:d32t4"),
    ("m4p1d32", "train_only", 128, "megatron:d32t4"),
    # dotted with t, missing dims = 1
    ("sglang.d8p1t1+d8p1t1", "decoupled", 16, "sglang:d8+megatron:d8"),
    ("sglang.d4p1t1+d4p1t1", "decoupled", 8, "sglang:d4+megatron:d4"),
    ("sglang.d4+d4", "decoupled", 8, "sglang:d4+megatron:d4"),
    ("embedded.d1p1t1+d1p1t1", "decoupled", 2, "embedded:d1+megatron:d1"),
    ("sglang.d2p1t1", "generation_only", 2, "sglang:d2"),
    ("vllm.d4+d4", "decoupled", 8, "vllm:d4+megatron:d4"),
    # modern colon form
    ("sglang:d4t2+fsdp:d8", "decoupled", 16, "sglang:d4t2+fsdp:d8"),
    ("sglang:d4", "generation_only", 4, "sglang:d4"),
    ("megatron:d2p2t4e4", "train_only", 16, "megatron:d2p2t4e4"),
    ("fsdp:d8c2", "train_only", 16, "fsdp:d8c2"),
    (
        "sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)",
        "decoupled",
        32,
        "sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)",
    ),
    ("megatron:( ffn:d1p2t2e2 | attn:d2p2t2 )", "train_only", 8, "megatron:(attn:d2p2t2|ffn:p2t2e2)"),
    ("sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4", "decoupled", 6,
     "sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4"),
    # named components (AReaL's): 3+ joined by '+' all named, any order, judge/teacher pools, archon
    ("sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d4", "decoupled", 10,
     "sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d4"),
    ("sglang[rollout]:d2 + sglang[judge]:d1t2 + fsdp[actor]:d4", "decoupled", 8,
     "sglang[rollout]:d2+sglang[judge]:t2+fsdp[actor]:d4"),
    ("fsdp[actor]:d4+sglang[rollout]:d2", "decoupled", 6, "fsdp:d4+sglang:d2"),
    ("sglang [ rollout ] : d2+fsdp[actor]:d4", "decoupled", 6, "sglang:d2+fsdp:d4"),
    ("megatron:attn:d2t2|ffn:e4|fsdp[c]:d4", "train_only", 4, "megatron:(attn:d2t2|ffn:e4)|fsdp[c]:d4"),
    ("archon[actor]:d2p2e2", "train_only", 4, "archon:d2p2e2"),
    ("fsdp[actor]:d4|fsdp[critic]:d2t2", "train_only", 4, "fsdp:d4|fsdp[critic]:d2t2"),
    ("sglang:d4|fsdp:d4", "colocated", 4, "sglang:d4|fsdp[actor]:d4"),
    ("sglang[gen]:d2t2 | megatron[policy]:d2t2", "colocated", 4, "sglang[gen]:d2t2|megatron[policy]:d2t2"),
    ("  embedded:d1  ", "generation_only", 1, "embedded:d1"),
    ("megatron:p1", "train_only", 1, "megatron:d1"),
]


@pytest.mark.parametrize(("text", "kind", "total", "canonical"), VALID)
def test_valid(text: str, kind: str, total: int, canonical: str) -> None:
    alloc = parse_allocation(text)
    assert alloc.kind == kind
    assert alloc.total_devices == total
    assert str(alloc) == canonical
    again = parse_allocation(str(alloc))
    assert again == alloc
    assert str(again) == canonical
    assert parse_allocation(text) == alloc


def test_legacy_and_modern_forms_are_equal() -> None:
    assert parse_allocation("sglang.d4p1m2+d2p2m1") == parse_allocation("sglang:d4t2+megatron:d2p2")
    assert parse_allocation("sglang.d4p1t2+d2p2t1") == parse_allocation("sglang.d4m2 + p2d2")
    assert parse_allocation("sglang:d4") != parse_allocation("embedded:d4")


def test_typed_fields_decoupled() -> None:
    alloc = parse_allocation("sglang.d8m8p1 + d4p4m4")
    gen, train = alloc.generation, alloc.training
    assert gen is not None and train is not None
    assert (gen.backend, gen.name, gen.dp, gen.pp, gen.tp) == ("sglang", "rollout", 8, 1, 8)
    assert (gen.server_size, gen.world_size) == (8, 64)
    assert (train.backend, train.name, train.dp, train.pp, train.tp, train.cp, train.ep) == (
        "megatron",
        "actor",
        4,
        4,
        4,
        1,
        1,
    )
    assert train.world_size == 64
    assert alloc.training_components == (train,)


def test_typed_fields_hybrid_keeps_both_layouts() -> None:
    alloc = parse_allocation("sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)")
    t = alloc.training
    assert t is not None and t.is_hybrid
    assert t.attn == ParallelDims(dp=2, pp=2, tp=2, cp=2, ep=1)
    assert t.ffn == ParallelDims(dp=2, pp=2, tp=2, cp=1, ep=2)
    assert (t.dp, t.pp, t.tp, t.cp, t.ep, t.world_size) == (2, 2, 2, 2, 2, 16)
    assert alloc.generation is not None and alloc.generation.world_size == 16


def test_expert_dims_add_no_devices() -> None:
    t = parse_allocation("megatron:d2p2t4e4").training
    assert t is not None and (t.ep, t.world_size) == (4, 16)


def test_colocated_components() -> None:
    alloc = parse_allocation("sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4")
    assert [t.name for t in alloc.training_components] == ["actor", "critic"]
    assert alloc.training is not None and alloc.training.name == "actor"
    assert not alloc.colocated
    co = parse_allocation("sglang:d2t2|fsdp:d4")
    assert co.colocated and co.kind == "colocated" and co.total_devices == 4


def test_generation_only_and_train_only() -> None:
    assert parse_allocation("sglang:d4").training is None
    assert parse_allocation("d32p1m4").generation is None


def test_vllm_parses_but_is_not_runnable() -> None:
    alloc = parse_allocation("sglang.d2+d2")
    alloc.require_runnable()
    vllm = parse_allocation("  vllm:d4t2+fsdp:d8")
    assert vllm.generation is not None and vllm.generation.backend == "vllm"
    with pytest.raises(AllocationError) as info:
        vllm.require_runnable()
    assert info.value.column == 2
    assert "sglang" in info.value.hint


# (string, column, a word of the hint or message)
INVALID = [
    ("", 0, "write an allocation"),
    ("   ", 3, "write an allocation"),
    ("foo:d4", 0, "known backends"),
    ("sglang:d4+torch:d4", 10, "known backends"),
    ("sglang:x4", 7, "dimensions are"),
    ("sglang.d4q1", 9, "dimensions are"),
    ("sglang:d0", 7, "sizes start at 1"),
    ("sglang.d4+d2p0", 12, "sizes start at 1"),
    ("sglang:d4d2", 9, "once"),
    ("sglang:d4t2m2", 11, "both mean tensor"),
    ("d4p1m1p2", 6, "once"),
    ("sglang:d4+", 9, "trailing '+'"),
    ("sglang:d4 + ", 10, "trailing '+'"),
    ("+fsdp:d4", 0, "leading"),
    ("sglang:d4++fsdp:d4", 10, "extra separator"),
    ("fsdp:d4|", 7, "remove the '|'"),
    ("sglang:d4c2+fsdp:d4", 9, "training only"),
    ("sglang:d4e2", 9, "training only"),
    ("fsdp[a]:d4|fsdp[a]:d4", 16, "distinct name"),
    ("fsdp:d4|fsdp:d4", 8, "distinct name"),
    ("fsdp[a]:d4|fsdp[b]:d8", 11, "same world size"),
    ("sglang:d2|fsdp:d4", 10, "matching world sizes"),
    ("megatron:(attn:d2p2t2c2|ffn:d2p2t2e4)", 28, "world sizes equal"),
    ("megatron:(attn:d2p2|ffn:d4e1)", 24, "same p"),
    ("megatron:(attn:d2e2|ffn:d2e2)", 17, "ffn layout"),
    ("megatron:(attn:d2|ffn:c2e1)", 22, "attn layout"),
    ("megatron:(attn:d2)", 9, "both layouts"),
    ("megatron:(attn:d2|attn:d2)", 18, "one attn"),
    ("megatron:(attn:d2|ffn:d2", 9, "close"),
    ("fsdp:(attn:d2|ffn:d2)", 5, "only megatron"),
    ("sglang:(attn:d2|ffn:d2)", 7, "only megatron"),
    ("fsdp:d4p2", 7, "use megatron"),
    ("megatron:d2e4", 11, "choose e"),
    ("sglang", 6, "sglang:d4"),
    ("sglang:", 7, "dimensions like"),
    ("sglang:d", 8, "size after"),
    ("sglang[]:d4", 7, "name inside"),
    ("sglang[a b]:d4", 9, "letters, digits"),
    ("sglang[roll-out]:d4", 11, "letters, digits or '_'"),
    ("sglang[1r]:d4", 7, "a letter or '_'"),
    ("fsdp[a]:d4|fsdp:d4", 11, "colocation group must have names"),
    ("sglang[r]:d2+fsdp[a]:d4+fsdp:d4", 24, "all must have names"),
    ("sglang:d2+fsdp:d4+sglang[judge]:d1", 0, "all must have names"),
    ("sglang[x]:d2+fsdp[x]:d4", 18, "duplicate component name 'x'"),
    ("sglang[r]:d2|fsdp[a]:d4", 13, "matching world sizes"),
    ("sglang[ok]d4", 10, "sglang[ok]:d4"),
    ("d4+fsdp:d4", 3, "default name of an unnamed fsdp"),
    ("sglang:d4+sglang:d4", 10, "sglang[judge]"),
    ("sglang:d4|vllm:d4", 10, "distinct name"),
    ("sglang:d2+fsdp:d2+fsdp:d2", 0, "all must have names"),
    ("sglang:d4 t2", 10, "spaces are allowed only"),
    ("sglang:d4)", 9, "unmatched"),
    ("sglang:d1234567", 7, "sizes go up to"),
    ("SGLANG:d4", 0, "start with a backend"),
    ("9", 0, "start with a backend"),
    ("sgl:d4", 0, "known backends"),
    ("dp4", 0, "need a size"),
]


@pytest.mark.parametrize(("text", "column", "word"), INVALID)
def test_invalid(text: str, column: int, word: str) -> None:
    with pytest.raises(AllocationError) as info:
        parse_allocation(text)
    err = info.value
    assert err.column == column, str(err)
    assert word in err.hint or word in err.message, str(err)
    assert err.source == text


def test_error_str_shows_caret_under_column() -> None:
    with pytest.raises(AllocationError) as info:
        parse_allocation("sglang.d16p1m1+d8p0m1")
    lines = str(info.value).splitlines()
    assert lines[1] == "  sglang.d16p1m1+d8p0m1"
    assert lines[2] == "  " + " " * 17 + "^"
    assert lines[3].startswith("hint: ")
    assert isinstance(info.value, ValueError)


def test_non_str_input_is_an_allocation_error() -> None:
    with pytest.raises(AllocationError):
        parse_allocation(None)  # type: ignore[arg-type]


def test_allocation_imports_neither_torch_nor_redis() -> None:
    code = (
        "import sys, allocation, allocation.placement, launcher.plan\n"
        "bad = [m for m in ('torch', 'redis') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
