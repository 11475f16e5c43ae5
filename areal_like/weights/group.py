"""A separate torch.distributed process group for weight sync (not the default group).

The trainer (rank 0) and every generation server's device join one group over a TCPStore that
rank 0 hosts. Neither side may touch its default group: a learner already has one (its SPMD ranks)
and a server must not join it. So, as SGLang and verl do, the group is built directly with
`_new_process_group_helper` over our own store, which leaves the default group alone.

Collectives here always carry a timeout and their errors say which group and which peer.
"""

from __future__ import annotations

import datetime
import logging
import socket

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

log = logging.getLogger(__name__)


class WeightGroup:
    """Handle of one weight-sync group: the process group and what names it in errors."""

    def __init__(self, pg, *, group_name: str, rank: int, world_size: int, master: str, backend: str,
                 timeout_s: float, store):
        self.pg = pg
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.master = master
        self.backend = backend
        self.timeout_s = timeout_s
        self._store = store  # keep the TCPStore (rank 0: the server) alive as long as the group

    def describe(self) -> str:
        return (f"group {self.group_name!r} ({self.backend}, rank {self.rank} of {self.world_size}, "
                f"store {self.master})")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, what: str = "") -> None:
        """Broadcast `tensor` in place from group rank `src`; raises naming the group and peer."""
        try:
            work = self.pg.broadcast([tensor], _bcast_opts(src))
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:
            peer = "the trainer (rank 0)" if src == 0 else f"rank {src}"
            raise RuntimeError(f"broadcast{' of ' + what if what else ''} from {peer} failed or timed out after "
                               f"{self.timeout_s:.0f}s in {self.describe()}: {e}") from e

    def abort(self) -> bool:
        """End the group's in-flight collectives now (NCCL: ncclCommAbort, so a broadcast whose peer
        answered early or died returns with an error instead of at the timeout, and the learner goes on
        to re-form the group). Gloo's abort does not interrupt a collective under way: there it ends at
        the group's timeout. Returns whether an abort was issued."""
        if self.pg is None or self.backend != "nccl":
            return False
        try:
            self.pg.abort()
        except Exception as e:  # noqa: BLE001 — best effort: the collective still ends at its timeout
            log.warning("aborting %s: %s", self.describe(), e)
            return False
        return True

    def destroy(self) -> None:
        try:
            dist.destroy_process_group(self.pg)
        except Exception as e:  # a broken group may refuse; forget it anyway
            log.warning("destroying %s: %s", self.describe(), e)
            _world.pg_group_ranks.pop(self.pg, None)
        self.pg = None
        self._store = None


def _bcast_opts(src: int):
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return opts


def bound_listen_fd(host: str, port: int) -> int:
    """A listening TCP socket bound to `host`:`port`, handed over as a file descriptor: the
    TCPStore takes ownership (and closes it with the store)."""
    family, stype, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, stype, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


def init_weight_group(*, master_address: str, master_port: int, world_size: int, rank: int,
                      group_name: str = "weight_update_group", backend: str = "gloo",
                      timeout_s: float = 300.0) -> WeightGroup:
    """Create (join) the weight-sync group. Blocks until all `world_size` ranks have joined.

    Rank 0 hosts the TCPStore at master_address:master_port, bound to that address alone (the
    launcher uses 127.0.0.1, so the store is not reachable from other hosts). For gloo on loopback set
    GLOO_SOCKET_IFNAME=lo in the environment (gloo picks its interface from it).
    """
    master = f"{master_address}:{master_port}"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        # Rank 0's store listens on master_address only (TCPStore alone would bind every interface).
        fd = bound_listen_fd(master_address, master_port) if rank == 0 else None
        store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout,
                              wait_for_workers=False, master_listen_fd=fd, use_libuv=True)
    except Exception as e:
        role = "host" if rank == 0 else "reach"
        raise RuntimeError(f"rank {rank} of group {group_name!r} could not {role} the TCP store at {master} "
                           f"within {timeout_s:.0f}s: {e}") from e
    prefix = PrefixStore(group_name, store)
    try:
        pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), prefix,
                                          group_name=group_name, timeout=timeout)
    except Exception as e:
        raise RuntimeError(f"rank {rank} could not join group {group_name!r} ({backend}, world size {world_size}, "
                           f"store {master}) within {timeout_s:.0f}s — did every rank start? {e}") from e
    # Collectives map global→group ranks through this table; the group is its own world.
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    group = WeightGroup(pg, group_name=group_name, rank=rank, world_size=world_size, master=master,
                        backend=backend, timeout_s=timeout_s, store=store)
    # No collective here: SGLang's `init_weights_update_group` (init_custom_process_group) creates the
    # group and returns, and its first collective is the first bucket's broadcast; an extra "join
    # handshake" broadcast would wait for a peer that never joins it. Joined means, for the trainer:
    # this call returned AND every server answered /init_weights_update_group (a server answers only
    # after its own group creation returned) — `WeightPusher` awaits both. The embedded server's
    # receiver uses this same function, so group formation is the same for both peers.
    return group
