"""``pslaunch doctor --launcher NAME`` for a backend with checks of its own (a batch system).

The backend's class lists what this host lacks for it (:meth:`Backend.doctor`: client
commands, daemons, a queue, free nodes); this module adds what every such backend needs, an
address of this host that the nodes can reach (the scheduler's), and prints one table with
one line per problem below it. Pure functions of the rows, except :func:`run_preflight`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import pscontract as pc
from pscontract import netif

from ..backends.base import Backend
from . import addresses

Row = tuple[str, bool, str]


def address_row(backend: type[Backend], environ: Mapping[str, str], env: Mapping[str, str],
                host_ip: Optional[str]) -> Optional[Row]:
    """The scheduler's address, for a backend whose nodes are unknown before the job runs."""
    if not backend.needs_scheduler_address:
        return None
    iface = (env.get(pc.INTERFACE) or environ.get(pc.INTERFACE) or "").strip()
    try:
        if iface:
            try:
                here = netif.interface_address(iface)
                return ("address", True, f"DMLC_INTERFACE={iface} is {here} here; each node resolves its own")
            except netif.NetifError as e:
                if addresses.is_literal_host_ip(host_ip):
                    return ("address", True, f"--host-ip {host_ip} (DMLC_INTERFACE={iface}: {e} here; "
                            "the nodes resolve theirs)")
                return ("address", False, f"DMLC_INTERFACE={iface}: {e}; give --host-ip ADDRESS if the nodes' "
                        "interfaces differ from this host's")
        if addresses.is_literal_host_ip(host_ip):
            return ("address", True, f"--host-ip {netif.resolve_ipv4(host_ip or '')}")
        if host_ip in ("ip", "dns"):
            return ("address", True, f"--host-ip {host_ip}: {netif.resolve_ipv4(netif.guess_host_ip(host_ip))}")
    except netif.NetifError as e:
        return ("address", False, str(e))
    return ("address", False, f"--launcher {backend.name} cannot tell which address of this host its nodes reach: "
            "set DMLC_INTERFACE (a name or a CIDR such as 10.1.0.0/16) or --host-ip ADDRESS")


def format_rows(title: str, rows: Sequence[Row]) -> str:
    """The table, then each failed check as one line."""
    width = max((len(r[0]) for r in rows), default=5)
    out = [title, ""]
    out += [f"  {name.ljust(width)}  {'ok  ' if ok else 'FAIL'}  {detail}" for name, ok, detail in rows]
    problems = [(name, detail) for name, ok, detail in rows if not ok]
    out.append("")
    if problems:
        out.append(f"{len(problems)} problem{'s' if len(problems) != 1 else ''}:")
        out += [f"  {name}: {detail}" for name, detail in problems]
    else:
        out.append("everything a job needs is here")
    return "\n".join(out)


def run_preflight(backend: type[Backend], environ: Mapping[str, str], *, env: Mapping[str, str],
                  host_ip: Optional[str], queue: Optional[str], options: Any,
                  job: Optional[Mapping[str, Any]] = None) -> tuple[int, str]:
    """``(exit code, report)``: 0 when every check passes, 1 otherwise. ``job``: the job's own
    command line's values (:meth:`Backend.doctor`)."""
    rows = list(backend.doctor(environ, queue=queue, options=options, job=job) or [])
    row = address_row(backend, environ, env, host_ip)
    if row is not None:
        rows.append(row)
    code = 0 if all(ok for _, ok, _ in rows) else 1
    return code, format_rows(f"pslaunch doctor --launcher {backend.name}:", rows)
