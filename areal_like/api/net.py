"""Small network helpers shared by every role (no torch, no asyncio)."""

from __future__ import annotations

import random
import socket
from collections.abc import Collection

# Ports `free_port` draws from: [PORT_FLOOR, the kernel's first ephemeral port).
PORT_FLOOR = 10000
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports() -> tuple[int, int] | None:
    """The kernel's ephemeral port range (Linux), None where it cannot be read."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            low, high = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return low, high


def free_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A TCP port free on `host` now, for a process that binds it later (a role's HTTP or metrics
    port, a process group's store), and not one of `avoid` (those handed out already and not yet
    bound: the launcher's). Another listener may still take it before the caller binds: callers fail
    naming the port.

    Drawn at random *below* the kernel's ephemeral range: the OS hands ports of that range to every
    outgoing connection (and to bind(0)), so such a port could be taken between the pick and the
    bind by any client of this very run — a Redis or HTTP connection's local end — as a learner's
    metrics port once was (EADDRINUSE, in CI). Where the range leaves fewer than 1000 ports above
    PORT_FLOOR, or cannot be read, the OS picks (bind to port 0)."""
    family, stype, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    eph = ephemeral_ports()
    if eph is not None and eph[0] - PORT_FLOOR >= 1000:
        pick = random.SystemRandom()
        for _ in range(100):
            port = pick.randrange(PORT_FLOOR, eph[0])
            if port in avoid:
                continue
            with socket.socket(family, stype, proto) as sock:
                try:
                    sock.bind((addr[0], port, *addr[2:]))
                except OSError:  # in use (listening, connected or in TIME_WAIT): another draw
                    continue
                return port
    for _ in range(100):
        with socket.socket(family, stype, proto) as sock:
            sock.bind(addr)
            port = sock.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError(f"no free TCP port on {host} outside the {len(avoid)} already handed out")
