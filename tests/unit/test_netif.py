from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pscontract import netif
from pscontract.netif import Iface, NetifError

IFACES = [Iface("lo", "127.0.0.1", 8), Iface("eth0", "10.1.2.3", 24), Iface("ib0", "10.200.5.6", 16),
          Iface("eth1", "192.168.7.8", 24)]


@pytest.mark.parametrize("spec, address", [
    ("eth0", "10.1.2.3"),        # exact name
    ("eth", "10.1.2.3"),         # prefix: first match in kernel order, as ps-lite
    ("ib", "10.200.5.6"),
    ("10.200.0.0/16", "10.200.5.6"),  # CIDR, whatever the name
    ("192.168.7.0/24", "192.168.7.8"),
    ("10.1.2.9/24", "10.1.2.3"),   # host bits are ignored
    ("lo", "127.0.0.1"),
])
def test_match(spec: str, address: str) -> None:
    assert netif.match(spec, IFACES).address == address


@pytest.mark.parametrize("spec, message", [
    ("wlan0", "DMLC_INTERFACE=wlan0 matches no interface with an IPv4 address (interfaces: lo 127.0.0.1/8, "
              "eth0 10.1.2.3/24, ib0 10.200.5.6/16, eth1 192.168.7.8/24)"),
    ("172.16.0.0/12", "no IPv4 address in 172.16.0.0/12"),
    ("10.0.0.0/99", "is not a valid IPv4 CIDR"),
    ("", "DMLC_INTERFACE is empty"),
])
def test_no_match_names_the_interfaces(spec: str, message: str) -> None:
    with pytest.raises(NetifError) as e:
        netif.match(spec, IFACES)
    assert message in str(e.value)


def test_real_interfaces_include_loopback() -> None:
    ifaces = netif.interfaces()
    assert ("lo", "127.0.0.1", 8) in [tuple(i) for i in ifaces]
    assert netif.interface_address("lo") == "127.0.0.1"
    assert netif.interface_address("127.0.0.0/8") == "127.0.0.1"


def test_resolve_and_route() -> None:
    assert netif.resolve_ipv4("127.0.0.1") == "127.0.0.1"
    assert netif.resolve_ipv4("localhost").startswith("127.")
    assert netif.route_source("127.0.0.1") == "127.0.0.1"
    with pytest.raises(NetifError, match="cannot resolve host"):
        netif.resolve_ipv4("no-such-host.invalid")


def test_runs_standalone_for_remote_hosts(tmp_path) -> None:
    # the ssh backend sends this file to hosts where nothing is installed
    import shutil
    copy = tmp_path / "netif.py"
    shutil.copy(netif.__file__, copy)
    out = subprocess.run([sys.executable, "-S", str(copy), "lo"], capture_output=True, text=True, cwd=tmp_path)
    doc = json.loads(out.stdout)
    assert doc["address"] == "127.0.0.1" and doc["interface"] == "lo"
    out = subprocess.run([sys.executable, "-S", str(copy), "nope0"], capture_output=True, text=True)
    assert "matches no interface" in json.loads(out.stdout)["error"]
