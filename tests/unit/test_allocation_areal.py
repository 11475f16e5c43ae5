"""The allocation parser agrees with AReaL 1.0.4's on every string of its recorded table.

`tests/assets/allocation/areal_1_0_4.json` holds what AReaL 1.0.4's own parser (`_AllocationMode.from_str`)
returned for 300 strings: the forms of its docs, examples and tests, and systematic variations of named
components, colocation groups, order, names, whitespace and dimensions. For each string we must agree
on accepting or rejecting it; for an accepted one on every component in order (backend, dp, pp, tp,
cp, ep, world size, the name where one is written, which components share a pool) and on the total
devices; for a rejected one with a named component, on the reason.

The strings where we differ are listed below with the reason, and the test fails if the list is not
exactly the set of disagreements (a new one, or one that went away).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from allocation import AllocationError, TrainingSpec, parse_allocation

TABLE = json.loads((Path(__file__).parents[1] / "assets" / "allocation" / "areal_1_0_4.json").read_text())["rows"]

# We accept, AReaL 1.0.4 refuses: the earlier generations of the grammar, which this project keeps
# (dotted `sglang.d4+d4`, `m` for tensor, a bare-dimensions training part meaning megatron, leading zeros).
KEPT_FORMS = {
    "d4t2", "sglang:d1+d1", "sglang:d8+d8", "sglang:d2p1t2+d2p1t1c2", "vllm:d4p1t2+d4p1t1c2", "vllm:d32+d16",
    "sglang.d4+fsdp.d4", "d1", "d2p2t1", "sglang:d4+d4", "sglang.d16p1m1+d8p2m1", "sglang.d4p1m1+d4p1m1",
    "sglang.d2+fsdp.d4", "sglang:d16p1m1+d8p2m1", "vllm.d4+d4", "d4p1m1", "sglang:d4+fsdp:d4p1m1",
    "sglang:d4+d2p2", "sglang:d4+d2p2t1c2", "sglang:d4+d2p2e2", "fsdp.d4", "sglang:d01", "fsdp:m2",
}
# We accept, AReaL refuses: a name on an attn/ffn hybrid layout. AReaL's grammar has no place for it, so
# there a MoE actor could never be one of 3+ components (which must all be named).
NAMED_HYBRID = {"megatron[actor]:(attn:d4p2t2c2|ffn:d2p2t4e2)", "sglang[r]:d2+megatron[actor]:(attn:d2t2|ffn:e4)"}
# AReaL accepts, we refuse with a hint (each is a likely typo, or a string AReaL itself cannot run):
REFUSED = {
    # two unnamed components of one kind: AReaL parses them, then cannot tell which is the rollout or
    # the actor ("Ambiguous allocation type"); ours says so at once (their default names collide)
    "sglang:d2+sglang:d2", "vllm:d2+sglang:d2", "fsdp:d4+fsdp:d4", "fsdp:d4+megatron:d2p2",
    # a dimension given twice: AReaL keeps the last silently
    "sglang:d4d2", "fsdp:d4d2", "sglang:d4t2t4",
    # spaces inside a dimension list
    "sglang:d 2+fsdp:d4", "sglang:d2 t2+fsdp:d4",
    # an unbalanced parenthesis around a hybrid layout
    "megatron:(attn:d4p2t2c2|ffn:d2p2t4e2", "megatron:attn:d4p2t2c2|ffn:d2p2t4e2)",
    # an attn/ffn hybrid on fsdp, which has no expert parallelism
    "fsdp:(attn:d4|ffn:d4)",
}
# AReaL's error (first words) -> what our message or hint says for the same reason
REASONS = {
    "When using 3+ components, all must have names": "all must have names",
    "Duplicate component name": "duplicate component name",
    "Components in colocation group must have names": "colocation group must have names",
    "Colocated components must have matching world sizes": "matching world sizes",
    "FSDP backend only supports": "fsdp has no",
}


def _ours(text: str):
    try:
        return parse_allocation(text)
    except AllocationError as e:
        return e


def test_the_table_covers_the_named_forms() -> None:
    named = [r for r in TABLE if "[" in r["string"]]
    assert len(TABLE) == 300 and len(named) >= 90
    assert any(r["string"] == "sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d4" and r["accepted"] for r in TABLE)
    assert any("judge" in r["string"] and r["accepted"] for r in TABLE)


def test_accepts_and_rejects_what_areal_does_except_the_listed_forms() -> None:
    differ = {r["string"] for r in TABLE if (not isinstance(_ours(r["string"]), AllocationError)) != r["accepted"]}
    assert differ == KEPT_FORMS | NAMED_HYBRID | REFUSED
    for s in KEPT_FORMS | NAMED_HYBRID:
        assert not isinstance(_ours(s), AllocationError)


@pytest.mark.parametrize("row", [r for r in TABLE if r["accepted"] and r["string"] not in REFUSED],
                         ids=lambda r: r["string"])
def test_components_pools_and_devices_match(row) -> None:
    alloc = _ours(row["string"])
    assert not isinstance(alloc, AllocationError), alloc
    assert alloc.total_devices == row["total_devices"]
    ours = alloc.components
    assert len(ours) == len(row["components"])
    for spec, theirs in zip(ours, row["components"]):
        cp = getattr(spec, "cp", 1)
        ep = getattr(spec, "ep", 1)
        assert (spec.backend, spec.dp, spec.pp, spec.tp, cp, spec.world_size) == (
            theirs["backend"], theirs["dp"], theirs["pp"], theirs["tp"], theirs["cp"], theirs["world_size"])
        if isinstance(spec, TrainingSpec) and not spec.is_hybrid:
            assert ep == theirs["ep"]
        if theirs["name"] is not None:
            assert spec.name == theirs["name"]
        # a member colocated with an earlier one shares its pool; a separated one starts a pool
        first_of_pool = any(g[0] is spec for g in alloc.groups)
        assert first_of_pool == (not theirs["colocated"])


@pytest.mark.parametrize("row", [r for r in TABLE if not r["accepted"] and "[" in r["string"]
                                 and any(r["error"].split(": ", 1)[1].startswith(k) for k in REASONS)],
                         ids=lambda r: r["string"])
def test_named_strings_are_refused_for_areals_reason(row) -> None:
    err = _ours(row["string"])
    assert isinstance(err, AllocationError)
    want = next(v for k, v in REASONS.items() if row["error"].split(": ", 1)[1].startswith(k))
    assert want in (err.message + " " + err.hint).lower(), (str(err), row["error"])
