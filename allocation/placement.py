"""Place a parsed `Allocation` on a cluster of ``nodes × devices_per_node`` devices.

What it decides:

* **Order.** The pools (``+``) in the order written, each on devices of its own; the components of
  a pool (``|``) share one list of devices: every component of the pool maps its ranks, or
  servers, onto that same list in order.
* **Generation servers.** Server ``i`` gets ``p×t`` consecutive devices on one node; a server that
  would straddle a node boundary starts on the next node instead (the skipped devices stay idle).
  Only a server larger than a node (``p×t > devices_per_node``) spans nodes, and then it starts on
  a node boundary and takes whole nodes.
* **Learner ranks.** Megatron order, tensor fastest, then context, then data, then pipeline::

      rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

  Rank ``r`` runs on the ``r``-th device of its group, devices being handed out in blocks of
  ``lcm`` of the group's tensor sizes (and its server size, when colocated with generation); a
  block never straddles nodes unless it is larger than a node. So every tensor-parallel group sits
  inside one node whenever ``tp ≤ devices_per_node`` (and the group's sizes are powers of two, the
  usual case).
* **Capacity.** A plan needing more nodes than given raises `AllocationError` with a hint such as
  ``needs 32 devices but 2 nodes × 8 = 16: pass --nodes 4``.

Devices are identified by ``(node, local device index)``. Nothing is started here; this module is
pure and imports neither torch nor redis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from allocation.errors import AllocationError
from allocation.parser import parse_allocation
from allocation.spec import Allocation, GenerationSpec, TrainingSpec

DEFAULT_DEVICES_PER_NODE = 8
MAX_PLACED_DEVICES = 1 << 20
"""Larger plans are refused (placement lists every device)."""


@dataclass(frozen=True)
class ServerPlacement:
    """One generation server: its index (its data-parallel rank) and its devices."""

    index: int
    slots: tuple[tuple[int, int], ...]
    """``(node, local device)`` per device, in tensor/pipeline order."""

    @property
    def node(self) -> int:
        """The (first) node the server runs on."""
        return self.slots[0][0]

    @property
    def devices(self) -> tuple[int, ...]:
        """Local device ids, parallel to `nodes`."""
        return tuple(d for _, d in self.slots)

    @property
    def nodes(self) -> tuple[int, ...]:
        """The node of each device (all equal unless the server is larger than a node)."""
        return tuple(n for n, _ in self.slots)


@dataclass(frozen=True)
class RankPlacement:
    """One learner rank: where it runs and its coordinates in the DP×PP×CP×TP grid."""

    component: str
    rank: int
    node: int
    device: int
    dp_rank: int
    pp_rank: int
    cp_rank: int
    tp_rank: int


@dataclass(frozen=True)
class ComponentPlacement:
    """All ranks of one training component (actor, critic, ...)."""

    spec: TrainingSpec
    ranks: tuple[RankPlacement, ...]


@dataclass(frozen=True)
class GenerationPlacement:
    """All servers of one generation component (rollout, judge, teacher, ...)."""

    spec: GenerationSpec
    servers: tuple[ServerPlacement, ...]


@dataclass(frozen=True)
class Placement:
    """Where every server and learner rank of an allocation runs."""

    allocation: Allocation
    nodes: int
    devices_per_node: int
    generation: tuple[GenerationPlacement, ...]
    training: tuple[ComponentPlacement, ...]

    @property
    def servers(self) -> tuple[ServerPlacement, ...]:
        """The rollout servers (`Allocation.generation`), or () without them."""
        gen = self.allocation.generation
        return next((g.servers for g in self.generation if gen is not None and g.spec.name == gen.name), ())

    @property
    def ranks(self) -> tuple[RankPlacement, ...]:
        """Ranks of the actor (`Allocation.training`), or () without it."""
        actor = self.allocation.training
        return next((c.ranks for c in self.training if actor is not None and c.spec.name == actor.name), ())

    def component(self, name: str) -> GenerationPlacement | ComponentPlacement:
        """The placement of the component called `name`."""
        for c in (*self.generation, *self.training):
            if c.spec.name == name:
                return c
        raise KeyError(f"no component named {name!r} in {self.allocation}")

    @property
    def used_devices(self) -> frozenset[tuple[int, int]]:
        used = {slot for g in self.generation for s in g.servers for slot in s.slots}
        used.update((r.node, r.device) for c in self.training for r in c.ranks)
        return frozenset(used)

    @property
    def cluster_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape printed by ``launcher plan --json``: ``generation`` (the rollout servers) and
        ``training`` (the actor), and ``components``: every component in order with its role and pool."""
        alloc = self.allocation
        gens = {g.spec.name: _generation_dict(g) for g in self.generation}  # names are distinct (the parser's rule)
        trains = {c.spec.name: _component_dict(c) for c in self.training}
        components = []
        for pool, group in enumerate(alloc.groups):
            for spec in group:
                d = gens.get(spec.name) or trains[spec.name]
                components.append({"pool": pool, "role": spec.role,
                                   "kind": "generation" if isinstance(spec, GenerationSpec) else "training", **d})
        return {
            "allocation": str(alloc),
            "total_devices": alloc.total_devices,
            "kind": alloc.kind,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "generation": gens[alloc.generation.name] if alloc.generation is not None else None,
            "training": trains[alloc.training.name] if alloc.training is not None else None,
            "components": components,
        }


def _generation_dict(g: GenerationPlacement) -> dict[str, Any]:
    s = g.spec
    return {
        "backend": s.backend,
        "name": s.name,
        "dp": s.dp,
        "tp": s.tp,
        "pp": s.pp,
        "server_size": s.server_size,
        "world_size": s.world_size,
        "servers": [
            {"index": v.index, "node": v.node, "devices": list(v.devices), "nodes": list(v.nodes)} for v in g.servers
        ],
    }


def _component_dict(c: ComponentPlacement) -> dict[str, Any]:
    t = c.spec
    ffn = None
    if t.ffn is not None:
        ffn = {"dp": t.ffn.dp, "pp": t.ffn.pp, "tp": t.ffn.tp, "ep": t.ffn.ep}
    return {
        "backend": t.backend,
        "name": t.name,
        "dp": t.dp,
        "pp": t.pp,
        "tp": t.tp,
        "cp": t.cp,
        "ep": t.ep,
        "world_size": t.world_size,
        "ffn": ffn,
        "ranks": [
            {
                "rank": r.rank,
                "node": r.node,
                "device": r.device,
                "dp_rank": r.dp_rank,
                "pp_rank": r.pp_rank,
                "tp_rank": r.tp_rank,
                "cp_rank": r.cp_rank,
            }
            for r in c.ranks
        ],
    }


class _Cursor:
    """Hands out blocks of consecutive global device indexes on an unbounded row of nodes."""

    def __init__(self, devices_per_node: int) -> None:
        self.g = devices_per_node
        self.pos = 0

    def take(self, size: int) -> list[int]:
        offset = self.pos % self.g
        if size <= self.g:
            if offset + size > self.g:
                self.pos += self.g - offset
            block = list(range(self.pos, self.pos + size))
            self.pos += size
        else:
            if offset:
                self.pos += self.g - offset
            block = list(range(self.pos, self.pos + size))
            self.pos += math.ceil(size / self.g) * self.g
        return block

    def take_group(self, world: int, block: int) -> list[int]:
        out: list[int] = []
        for _ in range(world // block):
            out.extend(self.take(block))
        return out


def _block_size(sizes: list[int]) -> int:
    block = 1
    for s in sizes:
        block = math.lcm(block, s)
    return block


def _layout(alloc: Allocation, devices_per_node: int) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Global device indexes: per generation component its servers', per training component its ranks'
    (rank order); both in the order of `Allocation.generation_components` / `training_components`."""
    if alloc.total_devices > MAX_PLACED_DEVICES:
        raise AllocationError(
            f"the plan needs {alloc.total_devices} devices; placement handles at most {MAX_PLACED_DEVICES}",
            alloc.source or str(alloc),
            0,
            "use smaller d, p, t or c sizes",
        )
    cursor = _Cursor(devices_per_node)
    servers: dict[str, list[list[int]]] = {}
    ranks: dict[str, list[int]] = {}
    for group in alloc.groups:
        if len(group) == 1 and isinstance(group[0], GenerationSpec):  # servers on their own: one by one
            gen = group[0]
            servers[gen.name] = [cursor.take(gen.server_size) for _ in range(gen.num_servers)]
            continue
        sizes: list[int] = []
        for c in group:
            if isinstance(c, GenerationSpec):
                sizes.append(c.server_size)
            else:
                sizes.extend([c.tp] + ([c.ffn.tp] if c.ffn is not None else []))
        shared = cursor.take_group(Allocation.group_devices(group), _block_size(sizes))
        for c in group:
            if isinstance(c, GenerationSpec):
                servers[c.name] = [shared[i * c.server_size : (i + 1) * c.server_size] for i in range(c.num_servers)]
            else:
                ranks[c.name] = shared[: c.world_size]
    return ([servers[g.name] for g in alloc.generation_components],
            [ranks[t.name] for t in alloc.training_components])


def nodes_needed(alloc: Allocation, devices_per_node: int) -> int:
    """Smallest node count on which `place` succeeds with ``devices_per_node`` devices per node."""
    if devices_per_node < 1:
        raise AllocationError(
            f"devices per node must be at least 1, got {devices_per_node}",
            alloc.source or str(alloc),
            0,
            "pass --devices-per-node 1 or more",
        )
    servers, training = _layout(alloc, devices_per_node)
    highest = max((d for group in (*(s for gs in servers for s in gs), *training) for d in group), default=-1)
    return max(1, highest // devices_per_node + 1)


def resolve_cluster(alloc: Allocation, nodes: int | None, devices_per_node: int | None) -> tuple[int, int]:
    """Fill in a missing node count or node size the way ``launcher plan`` does.

    Neither given: one node with exactly the devices needed. Only ``devices_per_node``: as many
    nodes as the plan needs. Only ``nodes``: 8 devices per node.
    """
    if nodes is None and devices_per_node is None:
        return 1, alloc.total_devices
    if nodes is None:
        assert devices_per_node is not None
        return nodes_needed(alloc, devices_per_node), devices_per_node
    return nodes, devices_per_node if devices_per_node is not None else DEFAULT_DEVICES_PER_NODE


def _coordinates(spec: TrainingSpec, rank: int) -> tuple[int, int, int, int]:
    """(dp_rank, pp_rank, cp_rank, tp_rank) of a rank: tp fastest, then cp, dp, pp."""
    tp_rank = rank % spec.tp
    cp_rank = (rank // spec.tp) % spec.cp
    dp_rank = (rank // (spec.tp * spec.cp)) % spec.dp
    pp_rank = rank // (spec.tp * spec.cp * spec.dp)
    return dp_rank, pp_rank, cp_rank, tp_rank


def rank_of(spec: TrainingSpec, dp_rank: int, pp_rank: int, cp_rank: int, tp_rank: int) -> int:
    """Inverse of the coordinates: ``((pp_rank*dp + dp_rank)*cp + cp_rank)*tp + tp_rank``."""
    return ((pp_rank * spec.dp + dp_rank) * spec.cp + cp_rank) * spec.tp + tp_rank


def place(
    alloc: Allocation | str,
    nodes: int | None = None,
    devices_per_node: int | None = None,
) -> Placement:
    """Assign every generation server and learner rank its node and devices.

    ``alloc`` may be a string (parsed first). Missing cluster sizes are filled in by
    `resolve_cluster`. Raises `AllocationError` if the allocation does not fit.
    """
    if isinstance(alloc, str):
        alloc = parse_allocation(alloc)
    source = alloc.source or str(alloc)
    nodes, g = resolve_cluster(alloc, nodes, devices_per_node)
    if g < 1:
        raise AllocationError(
            f"devices per node must be at least 1, got {g}", source, 0, "pass --devices-per-node 1 or more"
        )
    if nodes < 1:
        raise AllocationError(f"node count must be at least 1, got {nodes}", source, 0, "pass --nodes 1 or more")
    need = nodes_needed(alloc, g)
    total = alloc.total_devices
    if total > nodes * g:
        raise AllocationError(
            f"the plan needs {total} devices but the cluster has {nodes * g}",
            source,
            0,
            f"needs {total} devices but {nodes} nodes × {g} = {nodes * g}: pass --nodes {need}",
        )
    if need > nodes:
        raise AllocationError(
            f"the plan needs {need} nodes of {g} devices but the cluster has {nodes}",
            source,
            0,
            f"servers and tensor-parallel groups stay inside one node, so {total} devices need "
            f"{need} nodes × {g}: pass --nodes {need}",
        )
    server_idx, training_idx = _layout(alloc, g)
    gens = tuple(
        GenerationPlacement(spec, tuple(ServerPlacement(i, tuple((d // g, d % g) for d in devs))
                                        for i, devs in enumerate(idx)))
        for spec, idx in zip(alloc.generation_components, server_idx)
    )
    comps: list[ComponentPlacement] = []
    for spec, devs in zip(alloc.training_components, training_idx):
        ranks = []
        for r, d in enumerate(devs):
            dp_rank, pp_rank, cp_rank, tp_rank = _coordinates(spec, r)
            ranks.append(RankPlacement(spec.name, r, d // g, d % g, dp_rank, pp_rank, cp_rank, tp_rank))
        comps.append(ComponentPlacement(spec, tuple(ranks)))
    return Placement(alloc, nodes, g, gens, tuple(comps))


