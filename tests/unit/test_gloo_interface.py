"""Issue 40 item 4: gloo's interface on a cluster node is the one holding the address the node is reached
at (the launcher hands every Ray role its node's address), never gloo's default — the address of the host
name, 127.0.1.1 on Debian/Ubuntu — and a node where no interface holds it is an error naming the key.
Read against this machine's real interfaces."""

import os
import shutil
import subprocess
import sys

import pytest

from areal_like.api.net import NODE_ADDRESS_ENV, gloo_interface, interface_addresses, interface_of


def _ip_addr() -> dict[str, set[str]]:
    """iproute2's view of this machine's addresses, to check ours against."""
    out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    seen: dict[str, set[str]] = {}
    for line in out.splitlines():
        f = line.split()
        seen.setdefault(f[1].split("@")[0], set()).add(f[3].split("/")[0])
    return seen


def test_interfaces_match_iproute2():
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed here: nothing to compare the interface list with")
    ours = {name: set(addrs) for name, addrs in interface_addresses().items()}
    assert ours == _ip_addr()


def test_every_address_of_this_machine_maps_to_its_interface():
    for name, addrs in interface_addresses().items():
        for a in addrs:
            assert interface_of(a) == name, (a, name)
    assert interface_of("127.0.0.1") == "lo" and interface_of("127.0.1.1") == "lo"


def test_the_node_address_picks_the_interface_not_the_host_name():
    non_lo = [(n, a) for n, addrs in interface_addresses().items() if n != "lo" for a in addrs
              if not a.startswith("fe80")]
    for name, addr in non_lo:
        assert gloo_interface({NODE_ADDRESS_ENV: addr}) == name
    assert gloo_interface({NODE_ADDRESS_ENV: "127.0.0.1"}) == "lo"
    # the user's (or launcher.gloo_socket_ifname's) choice wins; a local run sets neither address nor name
    assert gloo_interface({NODE_ADDRESS_ENV: "127.0.0.1", "GLOO_SOCKET_IFNAME": "eth7"}) == "eth7"
    assert gloo_interface({}) is None


def test_an_address_no_interface_holds_names_the_key():
    with pytest.raises(RuntimeError, match=r"198\.51\.100\.7.*launcher\.gloo_socket_ifname"):
        gloo_interface({NODE_ADDRESS_ENV: "198.51.100.7"})  # TEST-NET-2: on no interface here


def test_a_role_process_sets_it_before_its_groups_exist():
    """What the learner and the embedded server run first (their `main`): the process environment gets it."""
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env[NODE_ADDRESS_ENV] = "127.0.0.1"
    code = "import os; from areal_like.api.net import apply_gloo_interface as a; a(); print(os.environ['GLOO_SOCKET_IFNAME'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "lo"
