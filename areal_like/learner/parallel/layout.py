"""`ParallelLayout`: the one object that owns the learner pool's DP × PP × TP layout.

It checks dp·pp·tp(·cp) = world size, creates every sub-group (each with a timeout) and the
DeviceMesh, and is the only place the rest of the learner gets ranks and groups from.

Rank order is Megatron's: tensor parallel fastest, then data parallel, then pipeline —

    global_rank = pp_rank · (dp·tp) + dp_rank · tp + tp_rank          mesh dims ("pp", "dp", "tp")

so the ranks of one TP group are neighbours (one node, fastest links) and pipeline stages are the
outermost split. Context parallel (cp) is parsed by the allocation but not implemented: cp > 1 is
rejected here with the setting to change.

What this module does not do: it never touches a model or data; `parallelize.py` applies the layout.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

DIM_NAMES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class LayoutSpec:
    """Sizes only (pure; no process group): from an allocation's training side or by hand."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.cp

    @classmethod
    def from_allocation(cls, text: str) -> "LayoutSpec":
        """`"embedded.d1p1t1+d2p2t1"` → LayoutSpec(dp=2, pp=2, tp=1) (the training component's dims)."""
        from allocation import parse_allocation

        tr = parse_allocation(text).training  # the first training component (the actor)
        if tr is None:
            raise ValueError(f"allocation {text!r} has no training side: add one, e.g. '+d2p1t1'")
        return cls(dp=tr.dp, pp=tr.pp, tp=tr.tp, cp=getattr(tr, "cp", 1))

    @classmethod
    def from_string(cls, text: str) -> "LayoutSpec":
        """"d2p2t1", "d2", "t2" (missing sizes are 1), or a whole allocation string ("a.d1+d2p1t1")."""
        import re

        m = re.fullmatch(r"(?:d(\d+))?(?:p(\d+))?(?:t(\d+))?(?:c(\d+))?", text.strip())
        if m is None or not text.strip():
            return cls.from_allocation(text)
        d, p, t, c = (int(x) if x else 1 for x in m.groups())
        return cls(dp=d, pp=p, tp=t, cp=c)

    def __str__(self) -> str:
        return f"d{self.dp}p{self.pp}t{self.tp}" + (f"c{self.cp}" if self.cp > 1 else "")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank (see the module docstring's order)."""
        return rank // (self.dp * self.tp), (rank // self.tp) % self.dp, rank % self.tp

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return pp * self.dp * self.tp + dp * self.tp + tp


class ParallelLayout:
    """The learner pool's layout on an initialised default process group.

    Every rank must construct it (it creates sub-groups, a collective call), in the same order
    relative to other group creation. A single process without torch.distributed gets the trivial
    layout (all sizes 1, no groups), so the same learner code runs unchanged in one process.
    """

    def __init__(self, spec: LayoutSpec, *, timeout_s: float = 300.0, device_type: str = "cpu") -> None:
        if spec.cp != 1:
            raise ValueError(f"context parallel (cp={spec.cp}) is not implemented in the learner: "
                             "use c1 in the allocation's training side (e.g. d2p1t1)")
        for name in ("dp", "pp", "tp"):
            if getattr(spec, name) < 1:
                raise ValueError(f"layout {name} must be ≥ 1, got {getattr(spec, name)}")
        self.spec = spec
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device_type = device_type
        self.distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if self.distributed else 1
        if spec.world_size != world:
            raise ValueError(
                f"layout {spec} needs dp·pp·tp = {spec.world_size} ranks but the process group has {world}: "
                f"change the training side of the allocation (e.g. d{world}p1t1) or start {spec.world_size} ranks"
            )
        self.rank = dist.get_rank() if self.distributed else 0
        self.pp_rank, self.dp_rank, self.tp_rank = spec.coords(self.rank)
        self.mesh = None
        self.pp_group = self.dp_group = self.tp_group = self.world_group = None
        if self.distributed:
            self._build_groups()

    # ---- groups ------------------------------------------------------------------------------
    def _build_groups(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        s = self.spec
        grid = torch.arange(s.world_size).reshape(s.pp, s.dp, s.tp)  # (pp, dp, tp): the rank order
        mine: dict[str, dist.ProcessGroup] = {}
        # Every rank calls new_group for every group of every dim, in the same order (a collective).
        for dim, name in enumerate(DIM_NAMES):
            lines = grid.movedim(dim, -1).reshape(-1, grid.shape[dim])
            for line in lines.tolist():
                g = dist.new_group(line, timeout=self.timeout)
                if self.rank in line:
                    mine[name] = g
        self.pp_group, self.dp_group, self.tp_group = mine["pp"], mine["dp"], mine["tp"]
        # The whole pool with this layout's timeout (the default group's is the launcher's choice).
        self.world_group = dist.new_group(list(range(s.world_size)), timeout=self.timeout)
        self.mesh = DeviceMesh.from_group(
            [self.pp_group, self.dp_group, self.tp_group], self.device_type, mesh=grid, mesh_dim_names=DIM_NAMES
        )

    def submesh(self, name: str):
        """The 1-D DeviceMesh of dim `name` ("pp", "dp", "tp") containing this rank."""
        if self.mesh is None:
            raise RuntimeError("no device mesh in a single-process layout")
        return self.mesh[name]

    # ---- sizes and ranks -----------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.spec.dp

    @property
    def pp(self) -> int:
        return self.spec.pp

    @property
    def tp(self) -> int:
        return self.spec.tp

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def global_rank(self, *, pp: int | None = None, dp: int | None = None, tp: int | None = None) -> int:
        """Global rank of the given coordinates (missing ones = this rank's)."""
        return self.spec.rank_of(self.pp_rank if pp is None else pp, self.dp_rank if dp is None else dp,
                                 self.tp_rank if tp is None else tp)

    def stage_rank(self, stage: int) -> int:
        """The global rank that owns stage `stage` for weight gathering: dp 0, tp 0 of that stage."""
        return self.spec.rank_of(stage, 0, 0)

    def pp_group_rank(self, stage: int) -> int:
        """Global rank of pipeline stage `stage` in this rank's pipeline group (same dp, tp)."""
        return self.global_rank(pp=stage)

    def __repr__(self) -> str:
        return (f"ParallelLayout({self.spec}, rank={self.rank}, pp={self.pp_rank}, dp={self.dp_rank}, "
                f"tp={self.tp_rank})")
