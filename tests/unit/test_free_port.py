"""`free_port` (areal_like/api/net.py): the ports the launcher hands to roles come from below the
kernel's ephemeral range, so no outgoing connection of the run can hold one when its role binds it;
never twice in a run; and a role that still cannot bind its metrics port says which one."""

from __future__ import annotations

import socket

import pytest

from areal_like.api import net


def test_ports_are_free_and_below_the_ephemeral_range():
    eph = net.ephemeral_ports()
    if eph is None:
        pytest.skip(f"no {net._EPHEMERAL_RANGE} on this OS: free_port lets the OS pick")
    ports = {net.free_port() for _ in range(50)}
    assert all(net.PORT_FLOOR <= p < eph[0] for p in ports), sorted(ports)
    assert len(ports) > 40  # drawn at random, not one port handed to every role
    for p in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when handed out


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    """A draw that hits a port in use (here: listening) draws again."""
    if net.ephemeral_ports() is None:
        pytest.skip(f"no {net._EPHEMERAL_RANGE} on this OS: free_port lets the OS pick")
    with socket.socket() as busy, socket.socket() as probe:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
        probe.close()
        draws = iter([taken, taken, free])

        class Draws:  # stands in for random.SystemRandom: these draws, in order
            def randrange(self, lo, hi):
                return next(draws)

        monkeypatch.setattr(net.random, "SystemRandom", Draws)
        assert net.free_port() == free


def test_without_a_readable_range_the_os_picks(monkeypatch):
    monkeypatch.setattr(net, "_EPHEMERAL_RANGE", "/nonexistent/ip_local_port_range")
    assert net.ephemeral_ports() is None
    p = net.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))


def test_the_launcher_never_hands_out_one_port_twice(tmp_path, monkeypatch):
    """Two roles starting together: the second pick must not return the first one's port, which is
    still free (its role has not bound it yet)."""
    from launcher.procs import ProcessTable

    a = net.free_port()
    b = net.free_port(avoid={a})
    draws = iter([a, a, a, b])

    class Draws:
        def randrange(self, lo, hi):
            return next(draws)

    monkeypatch.setattr(net.random, "SystemRandom", Draws)
    monkeypatch.setattr(net, "ephemeral_ports", lambda: (60000, 61000))  # draws used on any OS
    procs = ProcessTable(str(tmp_path))
    assert (procs.free_port("learner"), procs.free_port("rollout0")) == (a, b)


def test_a_role_whose_metrics_port_is_taken_fails_naming_it():
    from areal_like import metrics as M

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve /metrics on 127.0.0.1:{port} .*metrics.prometheus=false"):
            M.serve(port, "127.0.0.1")
