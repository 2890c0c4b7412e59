"""``pslaunch doctor -H hosts [COMMAND...]``: pre-flight checks of every host, in parallel, in one table.

It checks what the job needs, per host, over the same ssh settings a job would use
(``~/.ssh/config``, ``--ssh-*``, strict host keys):

* **ssh**: connection, host key and authentication;
* **python3**: the ``python3`` that pslaunch's own remote wrapper and interface lookup run
  (>= 3.7);
* **cwd**: the job's working directory (``--sync-dst-dir``, else this directory's path) exists
  there; with ``--sync-dst-dir`` a missing one is information (the sync creates it);
* **program**: the command's program (``COMMAND``'s first word, found on the job's ``PATH`` or
  in the working directory, as the job finds it: 127 if missing, 126 if not executable); when
  it is a Python (``python3``, a venv's ``python``, or a script whose ``#!`` line names one),
  its version, and the script or ``-m`` module it is given;
* **imports** (only with ``--check-import MODULE``, e.g. ``trainer``): that Python imports it in
  the working directory with the job's ``PYTHONPATH``;
* **interface**: the address ``DMLC_INTERFACE`` selects there (else the address the connection
  reached), which becomes ``DMLC_NODE_HOST``;
* **port**: that address can bind a free TCP port (as ps-lite nodes do);
* **reach**: the host can connect to the launching host's scheduler address (a listener opened
  here on the first free port of ``--port-range``).

Anything else worth knowing (no command given, a directory the sync will create, no
``DMLC_INTERFACE``, a program found in the directory rather than on ``PATH``) is listed as
information, never as a failure; pslaunch's own packages need not be installed on the hosts. Exit code
0 when every check passes on every host, 1 otherwise, 2 for a usage error. Problems are
listed below the table, one line each.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .. import backends, node
from ..backends.ssh import bootstrap_command, wrapper_preamble
from ..errors import ConfigError, LauncherError
from ..node.protocol import blob
from ..runtime import ports
from ..spec import env as jobenv
from ..spec.job import Host, JobSpec
from ..transport import sync as treesend
from ..transport.ssh import (
    HostSession,
    SSHOptions,
    connect,
    key_type_label,
    require_paramiko,
    resolve_targets,
)
from . import addresses

log = logging.getLogger(__name__)

COLUMNS = ("ssh", "python3", "cwd", "program", "imports", "interface", "port", "reach")
MIN_PYTHON = (3, 7)  # pscontract/netif.py, run by python3 on the hosts; the node agent itself needs 3.5
WRAPPER_PYTHON = "python3"

@dataclass
class Row:
    """One host's results: a short cell per column, one-line problems, and information."""

    host: Host
    cells: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    info: list[str] = field(default_factory=list)

    def fail(self, column: str, cell: str, problem: str) -> None:
        self.cells[column] = f"FAIL {cell}".strip()
        self.problems.append(f"{self.host.name}: {column}: {problem}")

    def note(self, text: str) -> None:
        self.info.append(f"{self.host.name}: {text}")

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Checks:
    """What to check on every host (the same for all)."""

    cwd: str
    command: tuple[str, ...] = ()
    python: Optional[str] = None     # --python: the Python to check when the command does not name one
    imports: tuple[str, ...] = ()    # --check-import
    sync: bool = False               # --sync-dst-dir given: a missing cwd is created by the sync
    iface: str = ""
    env: dict[str, str] = field(default_factory=dict)
    #: the command's words that name a file --sync-dst-dir sends: {"executable", "head"} (its first line)
    synced: dict[str, dict[str, Any]] = field(default_factory=dict)

    def args(self, peer: str, root: tuple[str, int], timeout: float) -> dict[str, Any]:
        """The arguments of the checks on a host (pure; ``launcher.node.probe``)."""
        return {"cwd": self.cwd, "env": self.env, "iface": self.iface, "peer": peer, "root": root[0],
                "root_port": root[1], "timeout": timeout, "command": list(self.command),
                "python": self.python, "imports": list(self.imports), "synced": self.synced}


#: how many of the command's words are looked for in the synced tree
SYNCED_WORDS = 64


def synced_files(command: Sequence[str], src: str, dst: str, opts: SSHOptions) -> dict[str, dict[str, Any]]:
    """The command's words that name a file ``--sync-dst-dir`` sends from ``src`` (a path relative
    to the job's directory, or an absolute one below ``dst``): whether it is executable and its
    first line (a ``#!`` names its Python), so that a host counts it as there before the first
    sync, and checks the Python it names."""
    found: dict[str, str] = {}
    prefix = dst.rstrip("/") + "/"
    for word in command[:SYNCED_WORDS]:
        if not word or word.startswith("-"):
            continue
        rel = word[len(prefix):] if word.startswith(prefix) else word
        if not os.path.isabs(rel) and os.path.isfile(os.path.join(src, rel)):
            found[word] = rel
    if not found:
        return {}
    ignored = () if opts.sync_no_gitignore else (treesend.git_ignored(src)[0] or ())
    out: dict[str, dict[str, Any]] = {}
    for word, rel in found.items():
        if treesend.sends(src, rel, opts.sync_exclude, ignored):
            path = os.path.join(src, rel)
            try:
                with open(path, "rb") as f:
                    head = f.readline(512).decode("utf-8", "replace")
            except OSError:
                continue
            out[word] = {"executable": os.access(path, os.X_OK), "head": head}
    return out


def probe_input(args: dict[str, Any], bundle: Optional[bytes] = None) -> bytes:
    """What the checks' channel reads on its stdin (pure): the loader, the node bundle that runs
    ``launcher.node.probe``, then ``args``."""
    return wrapper_preamble(node.bundle("probe") if bundle is None else bundle) + blob(json.dumps(args).encode())


def check_host(host: Host, opts: SSHOptions, checks: Checks, root: tuple[str, int], timeout: float,
               bundle: Optional[bytes] = None) -> Row:
    """Run every check on one host (``bundle``: the probe's node bundle, built once); never raises."""
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
        args = checks.args(session.peer_address, root, min(timeout, 5.0))
        r = session.exec(bootstrap_command(WRAPPER_PYTHON), stdin=probe_input(args, bundle), timeout=max(60.0, timeout))
        line = next((x for x in r.stdout.decode(errors="replace").splitlines() if x.startswith("PSLAUNCH-DOCTOR ")),
                    None)
        if line is None:
            row.fail("python3", "", f"{WRAPPER_PYTHON} did not run the checks ({r.err_line}); pslaunch's remote "
                     f"wrapper needs python3 >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} on the login PATH there")
            for c in COLUMNS[2:]:
                row.cells[c] = "-"
            return row
        fill(row, json.loads(line.split(" ", 1)[1]), checks)
    except LauncherError as e:
        row.problems.append(f"{host.name}: {e}")
        for c in COLUMNS:
            row.cells.setdefault(c, "-")
    finally:
        session.close()
    return row


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".") if x.isdigit())


def fill(row: Row, res: dict, checks: Checks) -> None:
    """One host's results into its row (pure)."""
    if _version(res["version"]) < MIN_PYTHON:
        row.fail("python3", res["version"], f"{res['python']} is Python {res['version']}; pslaunch's remote "
                 f"wrapper needs python3 >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} on the login PATH")
    else:
        row.cells["python3"] = f"ok {res['version']}"
    cwd = res["cwd"]
    if checks.sync and cwd.get("refused"):
        row.fail("cwd", "not yours", f"--sync-dst-dir refuses it: {cwd['refused']}")
    elif cwd["exists"]:
        row.cells["cwd"] = "ok"
    elif checks.sync:
        row.cells["cwd"] = "ok (synced)"
        row.note(f"{cwd['path']} does not exist yet; --sync-dst-dir creates it")
    else:
        row.fail("cwd", "missing", f"the job's working directory {cwd['path']} does not exist there (use "
                 "--sync-dst-dir DIR, or a directory every host shares)")
    _fill_program(row, res, checks)
    if checks.imports:
        imports = res.get("imports")
        if imports is None:
            row.cells["imports"] = "-"
        else:
            bad = {m: why for m, why in imports.items() if why != "ok"}
            if bad:
                row.fail("imports", " ".join(sorted(bad)), "; ".join(
                    f"import {m} in {cwd['path']}: {why}" for m, why in bad.items()))
            else:
                row.cells["imports"] = "ok " + " ".join(checks.imports)
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


def _fill_program(row: Row, res: dict, checks: Checks) -> None:
    prog = res.get("program")
    interp = res.get("interpreter")
    if res.get("python_error"):
        row.fail("program", "python", f"--python {res['python_error']} on the job's PATH")
    if prog is None and interp is None:
        row.cells["program"] = "-"
        return
    parts = []
    if prog is not None:
        name = prog["name"]
        if "error" in prog:
            why = ("no such program on the job's PATH or in its directory (exit code 127)" if prog["code"] == 127
                   else "it is not executable (exit code 126)")
            row.fail("program", f"{name} {prog['error']}", f"{name}: {why}")
            return
        parts.append(name)
        if prog.get("synced"):
            row.note(f"{name} is sent by --sync-dst-dir: checked as this directory's copy")
        if prog.get("local"):
            row.note(f"{name} is not on PATH; it runs as ./{name} from the working directory")
        script = prog.get("script")
        if script is not None and not script["ok"]:
            row.fail("program", f"{script['name']} missing", f"{script['name']}: no such file in {res['cwd']['path']}")
            return
        if script is not None and script.get("synced"):
            row.note(f"{script['name']} is not in {res['cwd']['path']} yet; --sync-dst-dir sends it")
        module = prog.get("module")
        if module is not None and not module["ok"]:
            row.fail("program", f"-m {module['name']}", f"{prog['path']} -m {module['name']}: no such module there"
                     + (f" ({module['error']})" if module.get("error") else ""))
            return
    if interp is not None:
        if not interp.get("version"):
            row.fail("program", f"{interp['path']}", f"{interp['path']} does not run: {interp.get('error')}")
            return
        parts.append(f"python {interp['version']}")
    row.cells["program"] = "ok " + " ".join(parts)


def format_table(rows: Sequence[Row], root: tuple[str, int], checks: Optional[Checks] = None,
                 info: Sequence[str] = ()) -> str:
    columns = [c for c in COLUMNS if c != "imports" or (checks is not None and checks.imports)]
    head = ["HOST"] + [c.upper() for c in columns]
    table = [head] + [[r.host.display] + [r.cells.get(c, "-") for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(head))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
    problems = [p for r in rows for p in r.problems]
    notes = list(info) + [n for r in rows for n in r.info]
    ok = sum(1 for r in rows if r.ok)
    out.append("")
    out.append(f"{ok} of {len(rows)} host{'s' if len(rows) != 1 else ''} ready; scheduler address "
               f"{root[0]}:{root[1]} (this host)")
    if problems:
        out.append("problems:")
        out.extend(f"  {p}" for p in problems)
    if notes:
        out.append("information:")
        out.extend(f"  {n}" for n in notes)
    return "\n".join(out)


class _Listener:
    """The launching host's scheduler address, listening while the hosts try to reach it."""

    def __init__(self, address: str, lo: int, hi: int) -> None:
        try:
            self.sock = ports.bind_in_range(address, lo, hi)
        except ports.NoFreePort as e:
            raise e.for_user("the scheduler") from None
        except ports.BindError as e:
            raise ConfigError(f"cannot listen on {address}:{e.port} here: {e.strerror}") from None
        self.port = self.sock.getsockname()[1]
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


def run_doctor(hosts: Sequence[Host], opts: SSHOptions, *, cwd: str, env: dict[str, str], environ: dict[str, str],
               host_ip: Optional[str], port_range: tuple[int, int], command: Sequence[str] = (),
               python: Optional[str] = None, imports: Sequence[str] = (),
               sync_src: Optional[str] = None) -> tuple[int, str]:
    """All checks on all hosts; returns (exit code, report). ``sync_src``: the directory that
    ``--sync-dst-dir`` (``cwd``) sends, when it is given."""
    require_paramiko()
    spec = JobSpec(command=tuple(command) or ("doctor",), num_workers=1, num_servers=0, launcher="ssh",
                   hosts=tuple(hosts), env=tuple(env.items()), environ=tuple(sorted(environ.items())),
                   host_ip=host_ip, port_range=port_range, options=opts)
    try:
        root = addresses.scheduler_address(spec, {}, backends.get("ssh"))
    except ConfigError as e:
        raise ConfigError(f"the launching host: {e}") from None
    synced = synced_files(command, sync_src, cwd, opts) if sync_src is not None else {}
    checks = Checks(cwd=cwd, command=tuple(command), python=python, imports=tuple(imports),
                    sync=sync_src is not None, iface=spec.interface, env={**jobenv.forwarded(environ), **env},
                    synced=synced)
    info = []
    if not command and not python:
        info.append("no command given: its program and Python were not checked (pslaunch doctor -H HOSTS "
                    "python train.py ...)")
    if not spec.interface:
        info.append("DMLC_INTERFACE is not set: each node binds the address its ssh connection reached")
    listener = _Listener(root, *port_range)
    try:
        unique = list(dict.fromkeys(hosts))
        bundle = node.bundle("probe")
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(unique))),
                                                   thread_name_prefix="pslaunch-doctor") as pool:
            rows = list(pool.map(lambda h: check_host(h, opts, checks, (root, listener.port),
                                                      opts.connect_timeout, bundle), unique))
    finally:
        listener.close()
    report = format_table(rows, (root, listener.port), checks, info)
    return (0 if all(r.ok for r in rows) else 1), report
