"""Across hosts without help (launcher/spec/network.py, pscontract.netif.carrier_*): a torch job's
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME per host and where they come from, and a service address on
loopback while processes run elsewhere refused at once."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import pscontract as pc
from launcher import backends
from launcher.errors import ConfigError
from launcher.node import task
from launcher.run import addresses
from launcher.spec import network
from launcher.spec.job import Host, JobSpec
from pscontract import netif
from pscontract.netif import Iface, NetifError

IFACES = [Iface("lo", "127.0.0.1", 8), Iface("eth0", "10.1.2.3", 24), Iface("ib0", "10.200.5.6", 16)]
H1, H2 = Host("h1", slots=2), Host("h2", slots=2)


def torch_spec(**kw) -> JobSpec:
    base = dict(command=("python", "ddp.py"), num_workers=4, num_servers=0, launcher="ssh", tracker="torch",
                hosts=(H1, H2))
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


# --- the node's rule: which interface ----------------------------------------------------------------


def test_the_carrier_is_dmlc_interface_else_the_interface_of_the_nodes_address() -> None:
    assert netif.carrier_spec("10.200.0.0/16", "10.1.2.3") == "10.200.0.0/16"  # DMLC_INTERFACE wins
    assert netif.carrier_spec(None, "10.1.2.3") == "10.1.2.3/32"
    assert netif.carrier_spec("", " 10.1.2.3 ") == "10.1.2.3/32"
    assert netif.carrier_spec(None, "127.0.0.1") is None  # every rank on this machine: gloo's own choice
    assert netif.carrier_spec(None, "h1") is None and netif.carrier_spec(None, None) is None
    assert netif.carrier_name(None, "10.200.5.6", IFACES) == "ib0"
    assert netif.carrier_name(None, "10.1.2.3", IFACES) == "eth0"
    assert netif.carrier_name("ib", "10.1.2.3", IFACES) == "ib0"
    assert netif.carrier_name(None, "10.9.9.9", IFACES) is None  # (a NAT in between: nothing carries it)
    with pytest.raises(NetifError, match="matches no interface"):
        netif.carrier_name("wlan0", "10.1.2.3", IFACES)  # a wrong DMLC_INTERFACE stays an error


def test_a_batch_nodes_torch_worker_gets_the_interface_that_carries_its_address() -> None:
    here = [i for i in netif.interfaces() if not i.address.startswith("127.")]
    env = {pc.MASTER_ADDR: "127.0.0.1", pc.NODE_HOST: "127.0.0.1"}
    assert task.torch_sockets(env) == {}  # (loopback: all here)
    assert task.torch_sockets({**env, pc.INTERFACE: "lo"}) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}
    assert task.torch_sockets({pc.NODE_HOST: "127.0.0.1", pc.INTERFACE: "lo"}) == {}  # not a torch job
    if not here:
        pytest.skip("this machine has no interface but loopback")
    env = {pc.MASTER_ADDR: "10.0.0.1", pc.NODE_HOST: here[0].address}
    assert task.torch_sockets(env) == {"GLOO_SOCKET_IFNAME": here[0].name, "NCCL_SOCKET_IFNAME": "=" + here[0].name}
    assert task.torch_sockets({**env, "GLOO_SOCKET_IFNAME": "eth9"}) == {"NCCL_SOCKET_IFNAME": "=" + here[0].name}


# --- where the values come from: the dry run's lines, a run's log line -----------------------------------


def test_the_dry_run_says_per_ssh_host_which_interface_and_why() -> None:
    lines = network.socket_lines(torch_spec(), [("h1", "10.0.0.1"), ("h2", "10.0.0.2")], all_here=False)
    assert lines == [
        "GLOO_SOCKET_IFNAME=<the interface of 10.0.0.1>, NCCL_SOCKET_IFNAME==<the interface of 10.0.0.1> (host h1: "
        "the interface of 10.0.0.1, the address ssh reaches it on, which the other hosts reach; found there before "
        "the start)",
        "GLOO_SOCKET_IFNAME=<the interface of 10.0.0.2>, NCCL_SOCKET_IFNAME==<the interface of 10.0.0.2> (host h2: "
        "the interface of 10.0.0.2, the address ssh reaches it on, which the other hosts reach; found there before "
        "the start)"]
    named = network.socket_lines(torch_spec(), [("h1", "h1")], all_here=False)
    assert named[0].startswith("GLOO_SOCKET_IFNAME=<the interface of h1's address>")


def test_the_dry_run_names_dmlc_interface_and_the_users_own_values() -> None:
    spec = torch_spec(env=(("GLOO_SOCKET_IFNAME", "eth1"),), environ=(("DMLC_INTERFACE", "10.1.0.0/16"),))
    assert network.socket_lines(spec, [("h1", "10.0.0.1")], all_here=False) == [
        "GLOO_SOCKET_IFNAME=eth1 (from --env); pslaunch leaves it as set",
        "NCCL_SOCKET_IFNAME==<the interface DMLC_INTERFACE=10.1.0.0/16 selects> (host h1: the interface "
        "DMLC_INTERFACE=10.1.0.0/16 selects there, found there before the start)"]
    both = torch_spec(environ=(("GLOO_SOCKET_IFNAME", "ib0"), ("NCCL_SOCKET_IFNAME", "=ib0")),
                      env_worker=(("NCCL_SOCKET_IFNAME", "ib1"),))
    assert network.socket_lines(both, [("h1", "10.0.0.1")], all_here=False) == [
        "GLOO_SOCKET_IFNAME=ib0 (from this shell's environment); pslaunch leaves it as set",
        "NCCL_SOCKET_IFNAME=ib1 (from --env-worker); pslaunch leaves it as set"]


def test_the_dry_run_of_other_placements() -> None:
    assert network.socket_lines(torch_spec(launcher="local", hosts=()), None, all_here=True) == [
        "GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: not set (every process runs on this machine; gloo and NCCL pick "
        "their own)"]
    assert network.socket_lines(torch_spec(launcher="slurm", hosts=()), None, all_here=False) == [
        "GLOO_SOCKET_IFNAME=<the interface of DMLC_NODE_HOST>, NCCL_SOCKET_IFNAME==<the interface of DMLC_NODE_HOST> "
        "(each node: the interface of its address that routes to MASTER_ADDR, the one the other nodes reach; found "
        "there at the start; not set where that is loopback)"]
    assert network.socket_lines(torch_spec(tracker="ps", num_servers=1), [("h1", "10.0.0.1")], all_here=False) == []


def test_a_run_logs_each_hosts_values_and_why() -> None:
    extra = {"GLOO_SOCKET_IFNAME": "veth1", "NCCL_SOCKET_IFNAME": "=veth1"}
    assert network.socket_text(extra, "veth1", "10.0.0.2") == (
        "GLOO_SOCKET_IFNAME=veth1, NCCL_SOCKET_IFNAME==veth1 (the interface of 10.0.0.2, the address the other "
        "hosts reach)")
    assert network.socket_text(extra, "veth1", "10.0.0.2", "10.0.0.0/8").endswith(
        "(the interface DMLC_INTERFACE=10.0.0.0/8 selects there)")


def test_the_ssh_dry_run_shows_the_lines_host_by_host(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("10.77.0.1 slots=2\n10.77.0.2 slots=2\n")
    r = subprocess.run([sys.executable, "-m", "launcher", "--dry-run", "--launcher", "ssh", "-H", str(hosts), "-n",
                        "4", "--tracker", "torch", "python", "ddp.py"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if x.startswith("GLOO_SOCKET_IFNAME")]
    assert lines == [f"GLOO_SOCKET_IFNAME=<the interface of {a}>, NCCL_SOCKET_IFNAME==<the interface of {a}> (host "
                     f"{a}: the interface of {a}, the address ssh reaches it on, which the other hosts reach; found "
                     "there before the start)" for a in ("10.77.0.1", "10.77.0.2")], r.stdout


# --- loopback while processes run elsewhere ------------------------------------------------------


def test_loopback_with_other_hosts_is_refused_with_the_fix() -> None:
    why = network.loopback_refusal(torch_spec(environ=(("DMLC_INTERFACE", "lo"),)), "127.0.0.1", "DMLC_INTERFACE=lo",
                                   ["10.0.0.1", "10.0.0.2", "10.0.0.3"])
    assert why == ("DMLC_INTERFACE=lo puts the torch store (MASTER_ADDR) on 127.0.0.1, a loopback address, which "
                   "processes on 10.0.0.1 (and 2 more hosts) cannot reach: set DMLC_INTERFACE to a network the "
                   "hosts share (a name, or a CIDR such as 10.1.0.0/16), or leave DMLC_INTERFACE out: pslaunch then "
                   "takes this host's address on the route to the hosts")
    ps = JobSpec(command=("x",), num_workers=2, num_servers=1, launcher="slurm", host_ip="127.0.0.1")
    assert network.loopback_refusal(ps, "127.0.0.1", "--host-ip 127.0.0.1", ["the Slurm nodes"], routed=False) == (
        "--host-ip 127.0.0.1 puts the scheduler (DMLC_PS_ROOT_URI) on 127.0.0.1, a loopback address, which "
        "processes on the Slurm nodes cannot reach: give --host-ip an address of this host that they reach, or set "
        "DMLC_INTERFACE (a name, or a CIDR such as 10.1.0.0/16)")
    rabit = torch_spec(tracker="rabit")
    assert "the rabit tracker (DMLC_TRACKER_URI)" in (network.loopback_refusal(rabit, "127.0.0.1", "x", ["h"]) or "")


def test_loopback_is_fine_where_everything_is_here() -> None:
    spec = torch_spec()
    assert network.loopback_refusal(spec, "127.0.0.1", "DMLC_INTERFACE=lo", []) is None  # all here
    assert network.loopback_refusal(spec, "10.0.0.9", "DMLC_INTERFACE=eth0", ["h1"]) is None


def test_other_machines_are_the_hosts_that_are_not_this_one() -> None:
    assert addresses.other_machines(["localhost", "127.0.0.2", "10.5.5.5", "10.6.6.6", "10.5.5.5"],
                                    local={"10.6.6.6"}) == ["10.5.5.5"]
    assert addresses.other_machines(["no-such-host.invalid"], local=set()) == ["no-such-host.invalid"]


def test_a_batch_systems_job_needs_the_address_its_nodes_reach_before_any_connection() -> None:
    slurm, ssh = backends.get("slurm"), backends.get("ssh")
    with pytest.raises(ConfigError, match="^--launcher slurm cannot tell which address of this host its nodes reach"):
        addresses.check_address_given(torch_spec(launcher="slurm", hosts=()), slurm)
    addresses.check_address_given(torch_spec(launcher="slurm", hosts=(), host_ip="10.77.0.9"), slurm)
    addresses.check_address_given(torch_spec(launcher="slurm", hosts=(), environ=(("DMLC_INTERFACE", "lo"),)), slurm)
    addresses.check_address_given(torch_spec(hosts=(Host("10.77.0.1"),)), ssh)  # the route to the hosts tells


def test_check_loopback_before_any_connection() -> None:
    ssh, slurm, local = backends.get("ssh"), backends.get("slurm"), backends.get("local")
    lo = (("DMLC_INTERFACE", "lo"),)
    with pytest.raises(ConfigError, match="which processes on 10.77.0.1 .and 1 more host. cannot reach"):
        addresses.check_loopback(torch_spec(hosts=(Host("10.77.0.1"), Host("10.77.0.2")), environ=lo), ssh)
    addresses.check_loopback(torch_spec(hosts=(Host("localhost"),), environ=lo), ssh)  # ssh to this machine
    addresses.check_loopback(torch_spec(launcher="local", hosts=(), environ=lo), local)
    with pytest.raises(ConfigError, match="processes on the Slurm nodes cannot reach"):
        addresses.check_loopback(torch_spec(launcher="slurm", hosts=(), environ=lo), slurm)
    with pytest.raises(ConfigError, match="^--host-ip 127.0.0.1 puts the torch store"):
        addresses.check_loopback(torch_spec(hosts=(Host("10.77.0.1"),), host_ip="127.0.0.1"), ssh)
    # a literal --host-ip is the user's word where a batch system places the processes
    addresses.check_loopback(torch_spec(launcher="slurm", hosts=(), host_ip="127.0.0.1"), slurm)
    addresses.check_loopback(torch_spec(launcher="sge", hosts=(), environ=lo), backends.get("sge"))
    addresses.check_loopback(torch_spec(hosts=(Host("10.77.0.1"),)), ssh)  # without either: the route decides


@pytest.mark.timeout(60)
def test_dmlc_interface_lo_with_ssh_hosts_is_one_line_at_once(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("10.77.0.1 slots=2\n10.77.0.2 slots=2\n")  # (nothing answers there: no connection is tried)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "launcher", "--launcher", "ssh", "-H", str(hosts), "-n", "4",
                        "--tracker", "torch", "python", "ddp.py"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "DMLC_INTERFACE": "lo"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("pslaunch: error: DMLC_INTERFACE=lo puts the torch store (MASTER_ADDR) on 127.0.0.1, "
                               "a loopback address, which processes on 10.77.0.1 (and 1 more host) cannot reach: ")
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert time.monotonic() - t0 < 20
