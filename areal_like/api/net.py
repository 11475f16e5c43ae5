"""Small network helpers shared by every role (no torch, no asyncio)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` a moment ago (the OS picks it). Another process may take it before the
    caller binds: callers that bind later retry or fail naming the port."""
    family, stype, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, stype, proto) as sock:
        sock.bind(addr)
        return sock.getsockname()[1]
