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


WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def reach_host(bind_host: str) -> str:
    """The address a client on the same machine reaches a listener bound to `bind_host` at: the bind
    address itself, or loopback for a wildcard bind (0.0.0.0, ::). A URL built from it probes the
    address actually served (issue 40: a server bound to a non-loopback address never answered the
    health check sent to 127.0.0.1)."""
    return WILDCARDS.get(bind_host, bind_host)


def url_host(addr: str) -> str:
    """`addr` as the host part of a URL: an IPv6 address in brackets."""
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr


NODE_ADDRESS_ENV = "AREAL_LIKE_BIND_HOST"
"""The address the node of a role is reached at, set by the launcher under `--backend ray` (the node's
Ray address): its listeners (/metrics) bind it and its gloo groups use the interface that holds it."""


def interface_addresses() -> dict[str, list[str]]:
    """This machine's interfaces and their addresses (Linux: IPv4 through SIOCGIFADDR, IPv6 from
    /proc/net/if_inet6); no external command needed."""
    import fcntl
    import ipaddress
    import struct

    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                res = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:  # no IPv4 address
                continue
            out.setdefault(name, []).append(socket.inet_ntoa(res[20:24]))
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    out.setdefault(parts[5], []).append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    except OSError:
        pass
    return out


def interface_of(address: str) -> str | None:
    """The name of this machine's interface that holds `address` (an IP or a host name), None if none does."""
    import ipaddress

    try:
        want = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        try:
            want = ipaddress.ip_address(socket.gethostbyname(address))
        except OSError:
            return None
    for name, addrs in interface_addresses().items():
        if any(ipaddress.ip_address(a) == want for a in addrs):
            return name
    if want.is_loopback:  # 127.0.0.2 … live on lo without being listed
        return "lo"
    return None


def gloo_interface(env: dict[str, str] | None = None) -> str | None:
    """GLOO_SOCKET_IFNAME for this role (issue 40 item 4): the one set (launcher.gloo_socket_ifname, or the
    user's), else the interface holding the node's address ($AREAL_LIKE_BIND_HOST, set under Ray) — never
    gloo's own choice, the address of the host name, which Debian/Ubuntu's /etc/hosts and host-network pods
    map to 127.0.1.1 (a group across nodes would then bind loopback). None where neither is set (a local run:
    the launcher sets `lo`). Raises naming launcher.gloo_socket_ifname when no interface holds the address."""
    import os

    env = os.environ if env is None else env
    if env.get("GLOO_SOCKET_IFNAME"):
        return env["GLOO_SOCKET_IFNAME"]
    addr = env.get(NODE_ADDRESS_ENV)
    if not addr:
        return None
    name = interface_of(addr)
    if name is None:
        have = ", ".join(f"{n} {'/'.join(a)}" for n, a in interface_addresses().items()) or "none"
        raise RuntimeError(f"this node is reached at {addr} ({NODE_ADDRESS_ENV}), but none of its interfaces holds "
                           f"that address (it has: {have}): set launcher.gloo_socket_ifname to the interface the "
                           "nodes reach each other through (e.g. eth0)")
    return name


def apply_gloo_interface() -> str | None:
    """`gloo_interface()` put into this process's environment before any gloo group is created."""
    import os

    name = gloo_interface()
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
    return name
