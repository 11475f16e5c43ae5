"""Placement invariants: devices used at most once, TP groups inside a node, full coordinate grids."""

from __future__ import annotations

import itertools

import pytest

from allocation import (
    AllocationError,
    Placement,
    nodes_needed,
    parse_allocation,
    place,
    rank_of,
    resolve_cluster,
)

# (allocation, nodes, devices per node)
CASES = [
    ("sglang.d16p1m1+d8p2m1", 4, 8),
    ("sglang.d4p1m1 + d2p2m1", 1, 8),
    ("sglang.d64p1m1 + d32p2m1", 16, 8),
    ("sglang.d8m8p1 + d4p4m4", 16, 8),
    ("d32p1m4", 16, 8),
    ("sglang.d8p1t1+d8p1t1", 2, 8),
    ("sglang:d4t2+fsdp:d8", 2, 8),
    ("sglang:d3t2+megatron:d2t4", 3, 8),
    ("megatron:d2p2t4e4", 2, 8),
    ("megatron:d2p2t2c2", 4, 4),
    ("sglang:d4p2t2+megatron:(attn:d2p2t2c2|ffn:d2p2t2e2)", 4, 8),
    ("sglang[rollout]:d2+fsdp[actor]:d4|fsdp[critic]:d2t2", 1, 8),
    ("sglang[rollout]:d2+fsdp[actor]:d4+fsdp[critic]:d2t2+sglang[judge]:t2", 2, 8),
    ("fsdp[actor]:d4+sglang[rollout]:d2t2", 1, 8),
    ("sglang[rollout]:d4|fsdp[actor]:d4+sglang[teacher]:d2t2", 2, 4),
    ("sglang:d2t2|megatron:d2t2", 1, 4),
    ("sglang:d2t4|fsdp:d8", 2, 4),
    ("sglang:d2t16+megatron:d4t2", 5, 8),
    ("embedded.d1p1t1+d1p1t1", None, None),
    ("sglang:d5", 2, 3),
]


def _pool_slots(plan: Placement) -> list[list[frozenset]]:
    """Per pool (``+``), the set of devices of each of its components."""
    alloc = plan.allocation
    out = []
    for group in alloc.groups:
        sets = []
        for spec in group:
            c = plan.component(spec.name)
            if hasattr(c, "servers"):
                slots = [slot for s in c.servers for slot in s.slots]
            else:
                slots = [(r.node, r.device) for r in c.ranks]
            assert len(slots) == len(set(slots)) == spec.world_size  # a component uses a device once
            sets.append(frozenset(slots))
        out.append(sets)
    return out


def _check_invariants(plan: Placement) -> None:
    alloc = plan.allocation
    g = plan.devices_per_node
    in_cluster = {(n, d) for n in range(plan.nodes) for d in range(g)}
    pools = _pool_slots(plan)
    for sets in pools:
        # every slot exists in the cluster; the components of a pool share its devices
        assert all(s <= in_cluster for s in sets)
        assert all(s == sets[0] for s in sets)
    # pools are disjoint and laid out in the order written
    firsts = [s[0] for s in pools]
    for a, b in zip(firsts, firsts[1:]):
        assert not a & b
        assert max(n * g + d for n, d in a) < min(n * g + d for n, d in b)
    if alloc.generation is not None and alloc.training is not None:
        gen_slots = {slot for s in plan.servers for slot in s.slots}
        train_slots = {(r.node, r.device) for r in plan.ranks}
        assert (gen_slots == train_slots) == alloc.colocated
        assert bool(gen_slots & train_slots) == alloc.colocated
    assert len(plan.used_devices) == alloc.total_devices
    # generation: one server per dp replica of p*t devices, inside one node unless larger than one
    gen = alloc.generation
    if gen is not None:
        assert [s.index for s in plan.servers] == list(range(gen.dp))
        for s in plan.servers:
            assert len(s.slots) == gen.server_size
            if gen.server_size <= g:
                assert len(set(s.nodes)) == 1
            else:
                assert s.slots[0][1] == 0  # starts on a node boundary, takes whole nodes
    # training: the full grid, Megatron ordering, TP groups inside one node
    for comp in plan.training:
        t = comp.spec
        coords = {(r.dp_rank, r.pp_rank, r.cp_rank, r.tp_rank) for r in comp.ranks}
        grid = set(itertools.product(range(t.dp), range(t.pp), range(t.cp), range(t.tp)))
        assert coords == grid
        assert [r.rank for r in comp.ranks] == list(range(t.world_size))
        for r in comp.ranks:
            assert rank_of(t, r.dp_rank, r.pp_rank, r.cp_rank, r.tp_rank) == r.rank
        if t.tp <= g:
            groups: dict[tuple[int, int, int], set[int]] = {}
            for r in comp.ranks:
                groups.setdefault((r.dp_rank, r.pp_rank, r.cp_rank), set()).add(r.node)
            assert all(len(nodes) == 1 for nodes in groups.values())


@pytest.mark.parametrize(("text", "nodes", "gpn"), CASES)
def test_placement_invariants(text: str, nodes: int | None, gpn: int | None) -> None:
    plan = place(parse_allocation(text), nodes=nodes, devices_per_node=gpn)
    _check_invariants(plan)


def test_done_when_example() -> None:
    plan = place("sglang.d16p1m1+d8p2m1", nodes=4, devices_per_node=8)
    assert len(plan.servers) == 16
    assert all(len(s.devices) == 1 for s in plan.servers)
    assert len(plan.ranks) == 16
    assert {(r.dp_rank, r.pp_rank) for r in plan.ranks} == {(d, p) for d in range(8) for p in range(2)}
    assert [s.slots[0] for s in plan.servers] == [(n, d) for n in (0, 1) for d in range(8)]
    assert {r.node for r in plan.ranks} == {2, 3}
    _check_invariants(plan)


def test_megatron_rank_order_tp_fastest_then_dp_then_pp() -> None:
    plan = place("megatron:d2p2t2", nodes=1, devices_per_node=8)
    coords = [(r.pp_rank, r.dp_rank, r.tp_rank) for r in plan.ranks]
    assert coords == sorted(coords)
    assert [(r.node, r.device) for r in plan.ranks] == [(0, d) for d in range(8)]


def test_server_does_not_straddle_nodes() -> None:
    plan = place("sglang:d3t3", nodes=3, devices_per_node=4)
    assert [s.slots for s in plan.servers] == [
        ((0, 0), (0, 1), (0, 2)),
        ((1, 0), (1, 1), (1, 2)),
        ((2, 0), (2, 1), (2, 2)),
    ]


def test_large_server_takes_whole_nodes() -> None:
    plan = place("sglang:d2t12", nodes=4, devices_per_node=8)
    assert plan.servers[0].nodes == (0,) * 8 + (1,) * 4
    assert plan.servers[1].slots[0] == (2, 0)


def test_colocated_components_share_devices() -> None:
    plan = place("sglang:d2t2|fsdp[actor]:d4|fsdp[critic]:d2t2", nodes=1, devices_per_node=4)
    server_slots = {slot for s in plan.servers for slot in s.slots}
    for comp in plan.training:
        assert {(r.node, r.device) for r in comp.ranks} == server_slots
    assert [c.spec.name for c in plan.training] == ["actor", "critic"]


def test_too_few_devices() -> None:
    with pytest.raises(AllocationError) as info:
        place("sglang.d16p1m1+d8p2m1", nodes=2, devices_per_node=8)
    err = info.value
    assert err.column == 0
    assert "needs 32 devices but 2 nodes × 8 = 16: pass --nodes 4" in err.hint


def test_fragmentation_needs_more_nodes() -> None:
    # 3 servers of 3 devices fit 9 ≤ 2×8 devices by count, but a server may not straddle nodes
    with pytest.raises(AllocationError) as info:
        place("sglang:d3t3", nodes=1, devices_per_node=8)
    assert "pass --nodes 2" in info.value.hint
    assert nodes_needed(parse_allocation("sglang:d3t3"), 8) == 2
    assert nodes_needed(parse_allocation("sglang:d3t3"), 4) == 3


def test_bad_cluster_sizes() -> None:
    for nodes, gpn, word in [(0, 8, "--nodes"), (2, 0, "--devices-per-node"), (-1, None, "--nodes")]:
        with pytest.raises(AllocationError) as info:
            place("sglang:d2", nodes=nodes, devices_per_node=gpn)
        assert word in info.value.hint


def test_huge_plans_are_refused_cleanly() -> None:
    with pytest.raises(AllocationError):
        place("sglang:d999999t999999")


def test_resolve_cluster_defaults() -> None:
    alloc = parse_allocation("sglang.d16p1m1+d8p2m1")
    assert resolve_cluster(alloc, None, None) == (1, 32)
    assert resolve_cluster(alloc, None, 8) == (4, 8)
    assert resolve_cluster(alloc, None, 5) == (7, 5)
    assert resolve_cluster(alloc, 4, None) == (4, 8)
    assert resolve_cluster(alloc, 3, 16) == (3, 16)


def test_to_dict_schema() -> None:
    d = place("sglang:d2t2+megatron:d2p2", nodes=1, devices_per_node=8).to_dict()
    assert d["kind"] == "decoupled" and d["total_devices"] == 8
    assert d["generation"]["servers"][1] == {"index": 1, "node": 0, "devices": [2, 3], "nodes": [0, 0]}
    assert d["training"]["ranks"][3] == {
        "rank": 3,
        "node": 0,
        "device": 7,
        "dp_rank": 1,
        "pp_rank": 1,
        "tp_rank": 0,
        "cp_rank": 0,
    }
    assert [(c["pool"], c["role"], c["kind"], c["name"]) for c in d["components"]] == [
        (0, "rollout", "generation", "rollout"), (1, "actor", "training", "actor")]


def test_every_component_gets_its_own_pool_or_shares_one() -> None:
    text = "sglang[rollout]:d2t2+fsdp[actor]:d4|fsdp[critic]:d4+sglang[judge]:d1t2+sglang[teacher]:d2"
    plan = place(text, nodes=2, devices_per_node=8)
    _check_invariants(plan)
    d = plan.to_dict()
    assert d["total_devices"] == 4 + 4 + 2 + 2
    comps = {c["name"]: c for c in d["components"]}
    assert [(c["pool"], c["role"]) for c in d["components"]] == [
        (0, "rollout"), (1, "actor"), (1, "critic"), (2, "judge"), (3, "teacher")]
    assert [s["devices"] for s in comps["rollout"]["servers"]] == [[0, 1], [2, 3]]
    assert [r["device"] for r in comps["critic"]["ranks"]] == [r["device"] for r in comps["actor"]["ranks"]] == [4, 5, 6, 7]
    assert [s["devices"] for s in comps["judge"]["servers"]] == [[0, 1]] and comps["judge"]["servers"][0]["node"] == 1
    assert [s["devices"] for s in comps["teacher"]["servers"]] == [[2], [3]]
    assert d["generation"]["name"] == "rollout" and d["training"]["name"] == "actor"

