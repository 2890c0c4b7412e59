"""How a job's processes on several hosts reach each other: the pure rules, in one place.

* The job's service (the ps scheduler, a tracker, the torch store) listens on the launching
  host at the address :mod:`launcher.run.addresses` works out; when that address is on
  loopback while processes run on other machines, nobody there can reach it:
  :func:`loopback_refusal` says so in one line before anything starts, instead of a
  ``--start-timeout`` later.
* A torch job's gloo and NCCL bind, on each host, the interface of the address the other hosts
  reach that host on (``GLOO_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``; the node side's rule is
  :func:`pscontract.netif.carrier_spec`): the one ``DMLC_INTERFACE`` selects, else the one that
  carries the address ssh reached the host on (or, on a batch system's node, the address that
  routes to the store). Without them gloo binds what the host's name resolves to, often
  127.0.1.1, and the other ranks get "Connection refused, remote=127.0.0.1". A value the user
  set (``--env``, ``--env-worker`` or this shell's environment, which is forwarded) is left alone.
  :func:`socket_lines` is what a dry run says about them, :func:`socket_text` what a run logs.
"""

from __future__ import annotations

import ipaddress
from typing import Mapping, Optional, Sequence

import pscontract as pc

from .job import JobSpec

#: the variables that name the interface gloo and NCCL bind
SOCKET_NAMES = (pc.GLOO_SOCKET_IFNAME, pc.NCCL_SOCKET_IFNAME)


def is_loopback(address: Optional[str]) -> bool:
    """True for an IP address on loopback (127.0.0.0/8, ::1); False for anything else, a name included."""
    try:
        return ipaddress.ip_address((address or "").strip()).is_loopback
    except ValueError:
        return False


def user_socket_settings(spec: JobSpec) -> dict[str, str]:
    """The socket variables the user set, each with where from (``--env`` and ``--env-worker`` win
    over this shell's environment): ``{"GLOO_SOCKET_IFNAME": "eth1 (from --env)"}``."""
    found: dict[str, str] = {}
    for layer, source in ((spec.environ_dict(), "this shell's environment"), (dict(spec.env), "--env"),
                          (dict(spec.env_worker), "--env-worker")):
        for name in SOCKET_NAMES:
            value = (layer.get(name) or "").strip()
            if value:
                found[name] = f"{value} (from {source})"
    return found


def service_name(spec: JobSpec) -> str:
    """What the job's processes connect to on the launching host, and the variable that names it
    (every job has one: ``-s 0`` is a rabit job, with its tracker)."""
    if spec.tracker == "torch":
        return f"the torch store ({pc.MASTER_ADDR})"
    if spec.collective:
        return f"the {spec.tracker} tracker ({pc.TRACKER_URI})"
    return f"the scheduler ({pc.ROOT_URI})"


def loopback_refusal(spec: JobSpec, address: Optional[str], source: str, elsewhere: Sequence[str],
                     routed: bool = True) -> Optional[str]:
    """Why the job cannot run, or None: its service's ``address`` (chosen by ``source``, such as
    ``DMLC_INTERFACE=lo``) is on loopback while processes run on ``elsewhere`` (other machines:
    their names, or one phrase such as ``the Slurm nodes``). A loopback address reaches only
    the machine it is on: on the others, every process would wait ``--start-timeout`` for a
    connection that cannot come. ``routed``: without ``DMLC_INTERFACE`` and ``--host-ip`` the
    launcher takes the route to the hosts (a hostfile's hosts; not a batch system's nodes)."""
    if not elsewhere or not is_loopback(address):
        return None
    where = elsewhere[0] + (f" (and {len(elsewhere) - 1} more host{'s' if len(elsewhere) > 2 else ''})"
                            if len(elsewhere) > 1 else "")
    fix = ("set DMLC_INTERFACE to a network the hosts share (a name, or a CIDR such as 10.1.0.0/16)"
           if source.startswith("DMLC_INTERFACE") else "give --host-ip an address of this host that they reach, or "
           "set DMLC_INTERFACE (a name, or a CIDR such as 10.1.0.0/16)")
    if routed:
        fix += f", or leave {source.split('=')[0].split(' ')[0]} out: pslaunch then takes this host's address " \
               "on the route to the hosts"
    return (f"{source} puts {service_name(spec)} on {address}, a loopback address, which processes on {where} "
            f"cannot reach: {fix}")


def socket_text(extra: Mapping[str, str], interface: Optional[str], address: Optional[str],
                dmlc_interface: str = "") -> str:
    """One host's socket variables as a run logs them: ``GLOO_SOCKET_IFNAME=eth0,
    NCCL_SOCKET_IFNAME==eth0 (the interface of 10.0.0.2, the address the other hosts reach)``."""
    names = ", ".join(f"{k}={v}" for k, v in extra.items())
    return f"{names} ({_why(interface or '?', address, dmlc_interface)})"


def _why(interface: str, address: Optional[str], dmlc_interface: str) -> str:
    if dmlc_interface:
        return f"the interface DMLC_INTERFACE={dmlc_interface} selects there"
    return f"the interface of {address}, the address the other hosts reach"


def socket_lines(spec: JobSpec, hosts: Optional[Sequence[tuple[str, str]]], all_here: bool) -> list[str]:
    """What a dry run says about ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` of a torch job:
    one line per host (``hosts``: each host's name and the address the launcher reaches it on,
    when the launcher decides; None when each node works it out), each saying where the value
    comes from. Nothing for another job."""
    if spec.tracker != "torch":
        return []
    user = user_socket_settings(spec)
    out = [f"{name}={how}; pslaunch leaves it as set" for name, how in user.items()]
    left = [name for name in SOCKET_NAMES if name not in user]
    if not left:
        return out
    names = ", ".join(left)
    iface = spec.interface
    if all_here and not iface:
        return out + [f"{names}: not set (every process runs on this machine; gloo and NCCL pick their own)"]
    if iface:
        what, why = f"the interface DMLC_INTERFACE={iface} selects", "there, found there before the start"
        where = [f"host {h}" for h, _ in hosts] if hosts is not None else ["each node"]
        return out + [f"{_values(left, what)} ({w}: {what} {why})" for w in where]
    if hosts is None:
        return out + [f"{_values(left, 'the interface of DMLC_NODE_HOST')} (each node: the interface of its address "
                      f"that routes to {pc.MASTER_ADDR}, the one the other nodes reach; found there at the start; "
                      "not set where that is loopback)"]
    return out + [f"{_values(left, f'the interface of {_address(address)}')} (host {host}: the interface of "
                  f"{_address(address)}, the address ssh reaches it on, which the other hosts reach; found there "
                  "before the start)" for host, address in hosts]


def _address(name: str) -> str:
    """An address as it is, a host name as ``NAME's address``."""
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        return f"{name}'s address"


def _values(names: Sequence[str], what: str) -> str:
    """``GLOO_SOCKET_IFNAME=<what>, NCCL_SOCKET_IFNAME==<what>`` (NCCL's ``=``: that interface exactly)."""
    return ", ".join(f"{n}={'=' if n == pc.NCCL_SOCKET_IFNAME else ''}<{what}>" for n in names)
