"""`ParallelLayout`: the one object that owns the learner pool's DP × PP × TP layout.

It checks dp·pp·tp(·cp) = world size, creates every sub-group (each with a timeout) and the
DeviceMesh, and is the only place the rest of the learner gets ranks and groups from.

Rank order is Megatron's: tensor parallel fastest, then data parallel, then pipeline —

    global_rank = pp_rank · (dp·tp) + dp_rank · tp + tp_rank          mesh dims ("pp", "dp", "tp")

so the ranks of one TP group are neighbours (one node, fastest links) and pipeline stages are the
outermost split. Expert parallel (`e`, a MoE model) adds no ranks: as Megatron's (with expert
tensor parallel 1), it splits a stage's dp × tp ranks, in rank order (tp fastest), into edp × ep
(dp_rank · tp + tp_rank = edp_rank · ep + ep_rank). A MoE layer's experts are split over the ep
ranks (`ep_group`, the 1-D `ep_mesh`; tokens travel to their experts by all-to-all, learner/moe.py;
with t > 1 each tp rank sends its share of the tokens) and replicated over the edp ranks holding
the same experts (`edp_group`: their gradients' SUM). Context parallel (cp) is parsed by the allocation but not
implemented: cp > 1 is rejected here with the setting to change.

Two families of groups (issue 23): the *device* groups (`world_group`, `dp_group`, `pp_group`,
`tp_group`, the mesh) move device tensors — gradients, activations, weights — on the device's backend
(NCCL on CUDA, which takes CUDA tensors only); the *host* groups (`host_world_group`,
`host_dp_group`) are gloo groups beside them for every collective of CPU tensors: the step's groups
as msgpack bytes, dp sums of host-side statistics (advantage moments, KL sums), barriers.
`group_for(tensor, dim)` picks by the tensor's device. On CPU both families are gloo, built the same
way (tests pass `device_backend="cuda:gloo"` — a backend map with no CPU half, refusing CPU tensors
as NCCL does — to prove no CPU tensor goes to a device group).

Followers never wait for rank 0's data inside a collective (a collective's timeout would fire while
rank 0 waits minutes for its first batch or a validation): `leader_ready(what)` parks them on a key
of the pool's store (hosted by rank 0) in short re-armed waits with no overall limit; rank 0's death
closes the store, which the followers notice at once and report naming rank 0.

What this module does not do: it never touches a model or data; `parallelize.py` applies the layout.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

DIM_NAMES = ("pp", "dp", "tp")
# Backend of the device groups per device type. NCCL moves CUDA tensors only: a CPU tensor on an
# NCCL group fails with "No backend type associated with device type cpu".
DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
HOST_BACKEND = "gloo"  # the host groups: collectives of CPU tensors
LEADER_POLL_S = 10.0  # a follower's re-armed wait for rank 0, at most (≤ the collective timeout)
LEADER_LOG_EVERY_S = 60.0  # how often a waiting follower says so in its log


def pool_backend(device_type: str) -> str:
    """The default process group's backend string: gloo for CPU tensors plus the device's backend
    for device tensors ("cpu:gloo,cuda:nccl" on CUDA; torch dispatches by the tensor's device), so
    even a CPU collective on the default group (torch internals) has a backend on GPU."""
    if device_type not in DEVICE_BACKENDS:
        raise ValueError(f"learner device type {device_type!r} not supported: use one of {sorted(DEVICE_BACKENDS)}")
    if device_type == "cpu":
        return HOST_BACKEND
    return f"cpu:{HOST_BACKEND},{device_type}:{DEVICE_BACKENDS[device_type]}"


@dataclass(frozen=True)
class LayoutSpec:
    """Sizes only (pure; no process group): from an allocation's training side or by hand."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: a split of a stage's dp × tp ranks (adds none)

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
        return cls.from_component(tr)

    @classmethod
    def from_component(cls, tr) -> "LayoutSpec":
        """An allocation's `TrainingSpec` → its layout. An attn/ffn hybrid (`megatron:(attn:…|ffn:…)`) is
        refused: the learner runs one layout for the whole model, experts split over dp by `e`."""
        if tr.ffn is not None:
            raise ValueError(f"allocation component {tr.text()!r}: attn/ffn hybrid layouts are not implemented in "
                             f"the learner; write one layout with e splitting the experts over d, e.g. "
                             f"{tr.backend}:d{tr.ffn.dp * tr.ffn.ep}p{tr.pp}t{tr.ffn.tp}e{tr.ffn.ep}")
        return cls(dp=tr.dp, pp=tr.pp, tp=tr.tp, cp=tr.cp, ep=tr.ep)

    @classmethod
    def from_string(cls, text: str) -> "LayoutSpec":
        """"d2p2t1", "d2", "t2" (missing sizes are 1), or a whole allocation string ("a.d1+d2p1t1")."""
        import re

        m = re.fullmatch(r"(?:d(\d+))?(?:p(\d+))?(?:t(\d+))?(?:c(\d+))?(?:e(\d+))?", text.strip())
        if m is None or not text.strip():
            return cls.from_allocation(text)
        d, p, t, c, e = (int(x) if x else 1 for x in m.groups())
        return cls(dp=d, pp=p, tp=t, cp=c, ep=e)

    def __str__(self) -> str:
        return (f"d{self.dp}p{self.pp}t{self.tp}" + (f"c{self.cp}" if self.cp > 1 else "")
                + (f"e{self.ep}" if self.ep > 1 else ""))

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

    def __init__(self, spec: LayoutSpec, *, timeout_s: float = 300.0, device_type: str = "cpu",
                 device_backend: str | None = None) -> None:
        """`device_backend`: the device groups' backend (default: DEVICE_BACKENDS[device_type]); the
        host groups are always gloo."""
        if spec.cp != 1:
            raise ValueError(f"context parallel (cp={spec.cp}) is not implemented in the learner: "
                             "use c1 in the allocation's training side (e.g. d2p1t1)")
        for name in ("dp", "pp", "tp", "ep"):
            if getattr(spec, name) < 1:
                raise ValueError(f"layout {name} must be ≥ 1, got {getattr(spec, name)}")
        if (spec.dp * spec.tp) % spec.ep:
            raise ValueError(f"expert parallel e{spec.ep} does not divide d×t = {spec.dp * spec.tp}: the experts are "
                             f"split over a pipeline stage's d×t ranks; use an e dividing {spec.dp * spec.tp} in the "
                             f"allocation's training side (e.g. d{spec.dp}t{spec.tp}e{spec.dp * spec.tp})")
        self.spec = spec
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device_type = device_type
        self.device_backend = device_backend or DEVICE_BACKENDS.get(device_type)
        self._leader_seq = 0  # messages from rank 0 so far (leader_ready, leader_command; the same count on every rank)
        # A follower's handler of rank 0's `leader_command`s (run inside its leader_ready wait).
        self.on_command: Callable[[str], None] | None = None
        self.distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if self.distributed else 1
        if spec.world_size != world:
            raise ValueError(
                f"layout {spec} needs dp·pp·tp = {spec.world_size} ranks but the process group has {world}: "
                f"change the training side of the allocation (e.g. d{world}p1t1) or start {spec.world_size} ranks"
            )
        self.rank = dist.get_rank() if self.distributed else 0
        self.pp_rank, self.dp_rank, self.tp_rank = spec.coords(self.rank)
        # expert parallel: dp_rank · tp + tp_rank = edp_rank · ep + ep_rank; the experts are split over the ep
        # ranks (`ep_group`, `ep_mesh`) and replicated over the edp ranks holding the same ones (`edp_group`)
        self.edp_rank, self.ep_rank = divmod(self.dp_rank * spec.tp + self.tp_rank, spec.ep)
        self.mesh = self.ep_mesh = None
        self.pp_group = self.dp_group = self.tp_group = self.world_group = None
        self.ep_group = self.edp_group = None
        self.host_world_group = self.host_dp_group = None
        if self.distributed:
            self._build_groups()

    # ---- groups ------------------------------------------------------------------------------
    def _build_groups(self) -> None:
        from torch.distributed.device_mesh import DeviceMesh

        s = self.spec
        grid = torch.arange(s.world_size).reshape(s.pp, s.dp, s.tp)  # (pp, dp, tp): the rank order
        mine: dict[str, dist.ProcessGroup] = {}
        dev = self.device_backend
        if dev is None:
            raise ValueError(f"a learner pool on device type {self.device_type!r} is not supported: use one of "
                             f"{sorted(DEVICE_BACKENDS)} (or a single rank, d1p1t1)")
        # Every rank calls new_group for every group of every dim, in the same order (a collective).
        for dim, name in enumerate(DIM_NAMES):
            lines = grid.movedim(dim, -1).reshape(-1, grid.shape[dim])
            for line in lines.tolist():
                g = dist.new_group(line, timeout=self.timeout, backend=dev)
                if self.rank in line:
                    mine[name] = g
        self.pp_group, self.dp_group, self.tp_group = mine["pp"], mine["dp"], mine["tp"]
        ep_ranks: list[int] = []
        if s.ep > 1:  # each stage's dp × tp ranks (tp fastest) split into edp × ep (an ep group: neighbours)
            blocks = grid.reshape(s.pp, -1, s.ep)  # (pp, edp, ep)
            for name, lines in (("ep", blocks.reshape(-1, s.ep)),
                                ("edp", blocks.transpose(1, 2).reshape(-1, blocks.shape[1]))):
                for line in lines.tolist():
                    g = dist.new_group(line, timeout=self.timeout, backend=dev)
                    if self.rank in line:
                        mine[name] = g
                        ep_ranks = line if name == "ep" else ep_ranks
            self.ep_group, self.edp_group = mine["ep"], mine["edp"]
        # The whole pool with this layout's timeout (the default group's is the launcher's choice).
        self.world_group = dist.new_group(list(range(s.world_size)), timeout=self.timeout, backend=dev)
        # The host groups beside them (gloo): CPU tensors never go to a device group.
        for line in grid.movedim(1, -1).reshape(-1, s.dp).tolist():
            g = dist.new_group(line, timeout=self.timeout, backend=HOST_BACKEND)
            if self.rank in line:
                self.host_dp_group = g
        self.host_world_group = dist.new_group(list(range(s.world_size)), timeout=self.timeout,
                                               backend=HOST_BACKEND)
        self.mesh = DeviceMesh.from_group(
            [self.pp_group, self.dp_group, self.tp_group], self.device_type, mesh=grid, mesh_dim_names=DIM_NAMES
        )
        if s.ep > 1:
            self.ep_mesh = DeviceMesh.from_group(self.ep_group, self.device_type, mesh=ep_ranks, mesh_dim_names=("ep",))

    def group_for(self, t: torch.Tensor, name: str) -> dist.ProcessGroup:
        """The group of dim `name` ("dp" or "world") for a collective of `t`: the host (gloo) group
        for a CPU tensor, the device group otherwise."""
        host = {"dp": self.host_dp_group, "world": self.host_world_group}
        dev = {"dp": self.dp_group, "world": self.world_group}
        if name not in host:
            raise ValueError(f"no host group for dim {name!r}: use 'dp' or 'world'")
        return host[name] if t.device.type == "cpu" else dev[name]

    def barrier(self) -> None:
        """Every rank of the pool (on the host world group, under its timeout); no-op in one process."""
        if self.distributed and self.world_size > 1:
            dist.barrier(group=self.host_world_group)

    def leader_ready(self, what: str) -> None:
        """Rank 0 says it has reached the collective that follows its leader-only work (reading the
        buffer, a validation, a push); the other ranks wait here for that, outside any collective.

        Every rank calls it at the same points (same sequence). A follower waits on a key of the
        pool's store in bounded waits of LEADER_POLL_S, re-armed with no overall limit: rank 0 has
        its own timeouts on what it waits for, and a collective timeout must not cut a long first
        batch short. The store is hosted by rank 0, so rank 0 dying ends the wait at once with an
        error naming it (no silent hang).

        While it waits, a follower runs the commands rank 0 sends with `leader_command` (in order,
        through `on_command`): a weight push gathers each bucket from the shards that way."""
        if not self.distributed or self.world_size == 1:
            return
        if self.rank == 0:
            self._post(b"ready:" + what.encode())
            return
        while True:
            msg = self._next_message(what)
            if not msg.startswith(b"cmd:"):
                return
            if self.on_command is None:
                raise RuntimeError(f"learner rank {self.rank}: rank 0 sent a command ({msg[4:80]!r}) but this "
                                   "rank has no handler (ParallelLayout.on_command)")
            self.on_command(msg[4:].decode())

    def leader_command(self, cmd: str) -> None:
        """Rank 0 only: the followers, waiting in `leader_ready`, run `on_command(cmd)` next (a command
        that is collective with rank 0 — rank 0 enters the same collectives right after)."""
        if not self.distributed or self.world_size == 1:
            return
        if self.rank != 0:
            raise RuntimeError("leader_command is rank 0's (the followers receive it in leader_ready)")
        self._post(b"cmd:" + cmd.encode())

    def _post(self, msg: bytes) -> None:
        # The default group's store: the pool's TCPStore (init_pool_from_env makes rank 0 host it).
        store = dist.distributed_c10d._get_default_store()
        self._leader_seq += 1
        store.set(f"areal_like/leader/{self._leader_seq}", msg)

    def _next_message(self, what: str) -> bytes:
        """A follower's next message from rank 0, waited for without an overall limit (see leader_ready)."""
        store = dist.distributed_c10d._get_default_store()
        self._leader_seq += 1
        key = f"areal_like/leader/{self._leader_seq}"
        t0 = last_log = time.monotonic()
        poll = datetime.timedelta(seconds=min(LEADER_POLL_S, self.timeout.total_seconds()))

        def leader_gone(e: Exception) -> RuntimeError:
            return RuntimeError(
                f"learner rank {self.rank}: rank 0 (the pool's leader, host of its store) is gone while this rank "
                f"waited for it to {what} ({time.monotonic() - t0:.0f} s): {e}. See rank 0's log (learner rank "
                "0's exit status and traceback) for why it stopped")

        while True:
            try:
                store.wait([key], poll)
                break
            except dist.DistNetworkError as e:
                raise leader_gone(e) from e
            except dist.DistStoreError:
                # One bounded wait over. A round trip proves rank 0's store still answers (a vanished
                # host fails it within the store's timeout instead of leaving us waiting forever).
                try:
                    if store.check([key]):
                        break
                except dist.DistError as e:
                    raise leader_gone(e) from e
                now = time.monotonic()
                if now - last_log >= LEADER_LOG_EVERY_S:
                    print(f"[learner] rank {self.rank}: waiting {now - t0:.0f} s for rank 0 to {what}", flush=True)
                    last_log = now
        try:
            msg = store.get(key)
        except dist.DistError as e:
            raise leader_gone(e) from e
        # The last follower through removes the key (the store lives as long as the pool).
        if store.add(f"{key}/passed", 1) == self.world_size - 1:
            store.delete_key(key)
            store.delete_key(f"{key}/passed")
        return msg

    def submesh(self, name: str):
        """The 1-D DeviceMesh of dim `name` ("pp", "dp", "tp", "ep") containing this rank."""
        if self.mesh is None:
            raise RuntimeError("no device mesh in a single-process layout")
        if name == "ep":
            if self.ep_mesh is None:
                raise RuntimeError("no ep mesh: the layout has e1")
            return self.ep_mesh
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
    def ep(self) -> int:
        return self.spec.ep

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
                f"tp={self.tp_rank}" + (f", ep={self.ep_rank})" if self.ep > 1 else ")"))
