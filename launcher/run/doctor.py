"""``pslaunch doctor -H hosts``: pre-flight checks of every host, in parallel, in one table.

Per host, over the same ssh settings a job would use (``~/.ssh/config``,
``--ssh-*``, strict host keys):

* **ssh**: connection, host key and authentication;
* **python**: the remote ``python3`` (or ``--python``): path and version;
* **imports**: ``import launcher`` and ``import trainer`` in the job's
  working directory (``--sync-dst-dir`` or this directory) with the job's
  forwarded ``PYTHONPATH``;
* **interface**: the address ``DMLC_INTERFACE`` selects there (else the
  address the connection reached), which becomes ``DMLC_NODE_HOST``;
* **port**: that address can bind a free TCP port (as ps-lite nodes do);
* **reach**: the host can connect to the launching host's scheduler address
  (a listener opened here on the first free port of ``--port-range``).

Exit code 0 when every check passes on every host, 1 otherwise, 2 for a
usage error. Problems are listed below the table, one line each.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .. import backends, node
from ..errors import ConfigError, LauncherError
from ..spec import env as jobenv
from ..spec.job import Host, JobSpec
from ..transport.ssh import SSHOptions
from . import addresses

log = logging.getLogger(__name__)

COLUMNS = ("ssh", "python", "imports", "interface", "port", "reach")
MIN_PYTHON = (3, 7)  # launcher/netif.py; the process wrapper itself needs 3.5

# Runs on the host (``python3 -``), after netif.py's source; ARGS is filled in by the launcher.
_REMOTE_CHECKS = r"""
import json as _json, os as _os, socket as _socket, subprocess as _sp, sys as _sys, time as _time
_A = _json.loads(ARGS)
_r = {"python": _sys.executable, "version": "%d.%d.%d" % tuple(_sys.version_info[:3])}
_env = dict(_os.environ)
_env.update(_A["env"])
_imports = {}
try:
    _os.chdir(_os.path.expanduser(_A["cwd"]))  # a relative one is below the login's home
except OSError as _e:
    _imports["cwd"] = "cannot change to %s: %s" % (_A["cwd"], _e.strerror)
else:
    for _m in ("launcher", "trainer"):
        _p = _sp.run([_sys.executable, "-c", "import " + _m], env=_env, stdout=_sp.PIPE, stderr=_sp.PIPE,
                     timeout=60)
        _err = [l for l in _p.stderr.decode("utf-8", "replace").splitlines() if l.strip()]
        _imports[_m] = "ok" if _p.returncode == 0 else (_err[-1] if _err else "exit %d" % _p.returncode)
_r["imports"] = _imports
_addr = _A["peer"]
if _A["iface"]:
    try:
        _i = match(_A["iface"], interfaces())
        _r["interface"] = {"name": _i.name, "address": _i.address}
        _addr = _i.address
    except NetifError as _e:
        _r["interface"] = {"error": str(_e)}
        _addr = None
if _addr:
    _s = _socket.socket()
    try:
        _s.bind((_addr, 0))
        _s.listen(1)
        _r["port"] = {"address": _addr, "port": _s.getsockname()[1]}
    except OSError as _e:
        _r["port"] = {"error": "cannot bind %s: %s" % (_addr, _e.strerror)}
    finally:
        _s.close()
_t0 = _time.monotonic()
try:
    _c = _socket.create_connection((_A["root"], _A["root_port"]), timeout=_A["timeout"])
    _c.close()
    _r["reach"] = {"ms": (_time.monotonic() - _t0) * 1000}
except OSError as _e:
    _r["reach"] = {"error": "%s:%d: %s" % (_A["root"], _A["root_port"], _e.strerror or _e)}
print("PSLAUNCH-DOCTOR " + _json.dumps(_r))
"""


@dataclass
class Row:
    """One host's results: a short cell per column, plus one-line problems."""

    host: Host
    cells: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def fail(self, column: str, cell: str, problem: str) -> None:
        self.cells[column] = f"FAIL {cell}".strip()
        self.problems.append(f"{self.host.name}: {column}: {problem}")

    @property
    def ok(self) -> bool:
        return not self.problems


def remote_script(args: dict[str, Any]) -> bytes:
    """netif.py's functions, then the checks, with ``args`` embedded (pure)."""
    source = node.source("pscontract/netif.py").decode("utf-8")
    source = source.replace('if __name__ == "__main__":', "if False:")
    return (source + f"\nARGS = {json.dumps(json.dumps(args))}\n" + _REMOTE_CHECKS).encode()


def check_host(host: Host, opts: SSHOptions, python: str, cwd: str, iface: str, env: dict[str, str],
               root: tuple[str, int], timeout: float) -> Row:
    """Run every check on one host; never raises."""
    from ..transport.ssh import HostSession, connect, key_type_label, resolve_targets

    row = Row(host)
    t0 = time.monotonic()
    try:
        target = resolve_targets([host], opts)[0]
        transport = connect(target, opts)
    except LauncherError as e:
        row.fail("ssh", "", str(e).split(": ", 1)[-1] if str(e).startswith(host.name) else str(e))
        for c in COLUMNS[1:]:
            row.cells[c] = "-"
        return row
    session = HostSession(target, opts, transport)
    try:
        key = transport.get_remote_server_key()
        row.cells["ssh"] = f"ok {target.user}, {key_type_label(key)} ({(time.monotonic() - t0) * 1000:.0f} ms)"
        args = {"cwd": cwd, "env": env, "iface": iface, "peer": session.peer_address, "root": root[0],
                "root_port": root[1], "timeout": min(timeout, 5.0)}
        r = session.exec(f"{shlex.quote(python)} -", stdin=remote_script(args), timeout=max(30.0, timeout))
        line = next((x for x in r.stdout.decode(errors="replace").splitlines() if x.startswith("PSLAUNCH-DOCTOR ")),
                    None)
        if line is None:
            row.fail("python", python, f"{python} did not run the checks ({r.err_line}); install python3 >= "
                     f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]} there or pass --python PATH")
            for c in COLUMNS[2:]:
                row.cells[c] = "-"
            return row
        _fill(row, json.loads(line.split(" ", 1)[1]), python, cwd)
    except LauncherError as e:
        row.problems.append(f"{host.name}: {e}")
        for c in COLUMNS:
            row.cells.setdefault(c, "-")
    finally:
        session.close()
    return row


def _fill(row: Row, res: dict, python: str, cwd: str) -> None:
    version = tuple(int(x) for x in res["version"].split("."))
    if version < MIN_PYTHON:
        row.fail("python", res["version"], f"{res['python']} is Python {res['version']}; pslaunch needs "
                 f">= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} on every host (pass --python PATH)")
    else:
        row.cells["python"] = f"ok {res['version']} {res['python']}"
    imports = res["imports"]
    if "cwd" in imports:
        row.fail("imports", "cwd", f"{imports['cwd']} (sync first with --sync-dst-dir, or use a shared directory)")
    else:
        bad = {m: why for m, why in imports.items() if why != "ok"}
        if bad:
            row.fail("imports", " ".join(sorted(bad)), "; ".join(f"import {m} in {cwd}: {why}" for m, why in bad.items()))
        else:
            row.cells["imports"] = "ok launcher trainer"
    iface = res.get("interface")
    if iface is None:
        row.cells["interface"] = "ok (unset)"
    elif "error" in iface:
        row.fail("interface", "", iface["error"])
    else:
        row.cells["interface"] = f"ok {iface['name']} {iface['address']}"
    port = res.get("port")
    if port is None:
        row.cells["port"] = "-"
    elif "error" in port:
        row.fail("port", "", port["error"])
    else:
        row.cells["port"] = f"ok {port['port']}"
    reach = res["reach"]
    if "error" in reach:
        row.fail("reach", "", f"cannot connect to the launching host at {reach['error']} (a firewall? the wrong "
                 "network? set DMLC_INTERFACE or --host-ip)")
    else:
        row.cells["reach"] = f"ok {reach['ms']:.0f} ms"


def format_table(rows: Sequence[Row], root: tuple[str, int]) -> str:
    head = ["HOST"] + [c.upper() for c in COLUMNS]
    table = [head] + [[r.host.display] + [r.cells.get(c, "-") for c in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
    problems = [p for r in rows for p in r.problems]
    ok = sum(1 for r in rows if r.ok)
    out.append("")
    out.append(f"{ok} of {len(rows)} host{'s' if len(rows) != 1 else ''} ready; scheduler address "
               f"{root[0]}:{root[1]} (this host)")
    if problems:
        out.append("problems:")
        out.extend(f"  {p}" for p in problems)
    return "\n".join(out)


class _Listener:
    """The launching host's scheduler address, listening while the hosts try to reach it."""

    def __init__(self, address: str, lo: int, hi: int) -> None:
        self.port = addresses.first_free_port(lo, hi)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((address, self.port))
        except OSError as e:
            raise ConfigError(f"cannot listen on {address}:{self.port} here: {e.strerror}") from None
        self.sock.listen(128)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="pslaunch-doctor-listen", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                conn.close()
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.sock.close()


def run_doctor(hosts: Sequence[Host], opts: SSHOptions, *, python: str, cwd: str, env: dict[str, str],
               environ: dict[str, str], host_ip: Optional[str], port_range: tuple[int, int]) -> tuple[int, str]:
    """All checks on all hosts; returns (exit code, report)."""
    from ..transport.ssh import require_paramiko

    require_paramiko()
    spec = JobSpec(command=("doctor",), num_workers=1, num_servers=0, launcher="ssh", hosts=tuple(hosts),
                   env=tuple(env.items()), environ=tuple(sorted(environ.items())), host_ip=host_ip,
                   port_range=port_range, options=opts)
    iface = spec.interface
    try:
        root = addresses.scheduler_address(spec, {}, backends.get("ssh"))
    except ConfigError as e:
        raise ConfigError(f"the launching host: {e}") from None
    listener = _Listener(root, *port_range)
    job_env = {**jobenv.forwarded(environ), **env}
    try:
        unique = list(dict.fromkeys(hosts))
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(unique))),
                                                   thread_name_prefix="pslaunch-doctor") as pool:
            rows = list(pool.map(lambda h: check_host(h, opts, python, cwd, iface, job_env,
                                                      (root, listener.port), opts.connect_timeout), unique))
    finally:
        listener.close()
    report = format_table(rows, (root, listener.port))
    return (0 if all(r.ok for r in rows) else 1), report


