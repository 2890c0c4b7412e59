# ruff: noqa: UP004, UP022, UP031 - Python 3.5 syntax: it must run far enough on an old python3 to say how old it is
"""``pslaunch doctor``'s checks on a host: what a job would find there, as one JSON line.

The doctor sends this in the node bundle, through the same bootstrap as the ssh backend's wrapper
(:mod:`.protocol`, transport a): after the bundle, the launcher writes one :func:`.protocol.blob`
of JSON arguments ``{"cwd", "env", "iface", "peer", "root", "root_port", "timeout", "command",
"python", "imports", "synced"}`` (``synced``: the command's files that ``--sync-dst-dir`` sends, which
count as there), and the probe prints ``PSLAUNCH-DOCTOR <JSON>`` (``launcher.run.doctor``
reads it): the host's ``python3`` and its version, the working directory, the command's program
(found by the job's own rule, :func:`.procgroup.resolve_program`), the Python that runs it and
what it imports, the address on ``DMLC_INTERFACE`` (:mod:`pscontract.netif`), a port bound there,
and whether the launching host can be reached. Standard library only.
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

from . import safefiles
from .procgroup import resolve_program
from .protocol import read_blob

_PY = re.compile(r"^python[0-9.]*$")
_VERSION = "import sys; print('%d.%d.%d' % tuple(sys.version_info[:3]))"


def _last(text):
    lines = [x for x in text.decode("utf-8", "replace").splitlines() if x.strip()]
    return lines[-1] if lines else ""


class Probe(object):
    """The checks for one argument document (see the module docstring)."""

    def __init__(self, args):
        self.args = args
        self.env = dict(os.environ)
        self.env.update(args["env"])
        cwd = os.path.expanduser(args["cwd"])  # a relative one is below the login's home
        self.cwd = cwd if os.path.isabs(cwd) else os.path.join(os.path.expanduser("~"), cwd)
        self.path = self.env.get("PATH", os.defpath)
        self.synced = args.get("synced") or {}  # the command's files --sync-dst-dir sends: there already

    def run(self, argv, timeout=60):
        """``(exit code, stdout, the last line of stderr)`` of ``argv`` in the job's environment."""
        try:
            p = subprocess.run(argv, env=self.env, cwd=self.cwd if os.path.isdir(self.cwd) else None,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            return 1, "", str(e)
        return p.returncode, p.stdout.decode("utf-8", "replace").strip(), _last(p.stderr)

    def locate(self, name):
        """``(path, found in the directory rather than on PATH)`` of a program, by the job's rule
        (a file that ``--sync-dst-dir`` sends is in the directory already)."""
        if "/" in name:
            return (name if os.path.isabs(name) else os.path.join(self.cwd, name)), False
        if resolve_program(name, self.env, self.cwd) == "./" + name:
            return os.path.join(self.cwd, name), True
        found = shutil.which(name, path=self.path)
        sent = self.synced.get(name)
        if found is None and sent is not None and sent["executable"]:
            return os.path.join(self.cwd, name), True
        return found, False

    def interpreter(self, path, first=None):
        """The Python a script's ``#!`` line names (``#!/usr/bin/env python3``, ``#!/opt/venv/bin/python -u``);
        ``first``: that line, when it is known (a file the sync sends)."""
        if first is None:
            try:
                with open(path, "rb") as f:
                    first = f.readline(512).decode("utf-8", "replace")
            except OSError:
                return None
        if not first.startswith("#!"):
            return None
        words = first[2:].split()
        if words and os.path.basename(words[0]) == "env":
            words = [w for w in words[1:] if not w.startswith("-")]
        if words and _PY.match(os.path.basename(words[0])):
            return words[0] if "/" in words[0] else shutil.which(words[0], path=self.path)
        return None

    def program(self, command):
        """``(the program's row, the Python to check or None)``."""
        prog = {"name": command[0]}
        path, local = self.locate(command[0])
        prog["path"], prog["local"] = path, local
        sent = self.synced.get(command[0])
        if sent is not None:  # the sync puts this directory's copy there, mode and all
            prog["synced"] = True
            if not sent["executable"]:
                prog["error"], prog["code"] = "not executable", 126
                return prog, None
            if not _PY.match(os.path.basename(command[0])):
                return prog, self.interpreter(path, sent["head"])
        elif path is None or not os.path.exists(path):
            prog["error"], prog["code"] = "not found", 127
            return prog, None
        elif os.path.isdir(path) or not os.access(path, os.X_OK):
            prog["error"], prog["code"] = "not executable", 126
            return prog, None
        if not _PY.match(os.path.basename(path)):
            return prog, self.interpreter(path)
        args = command[1:]
        while args and args[0].startswith("-") and args[0] not in ("-m", "-c", "-"):
            args = args[1:]
        if args[:1] == ["-m"] and len(args) > 1:
            code, _, err = self.run([path, "-c", "import importlib.util, sys; "
                                     "sys.exit(importlib.util.find_spec(sys.argv[1]) is None)", args[1]])
            prog["module"] = {"name": args[1], "ok": code == 0, "error": err}
        elif args and not args[0].startswith("-"):
            script = args[0] if os.path.isabs(args[0]) else os.path.join(self.cwd, args[0])
            prog["script"] = {"name": args[0], "ok": os.path.isfile(script)}
            if not prog["script"]["ok"] and args[0] in self.synced:
                prog["script"].update(ok=True, synced=True)
        return prog, path

    def checks(self):
        a = self.args
        r = {"python": sys.executable, "version": "%d.%d.%d" % tuple(sys.version_info[:3]),
             "cwd": {"path": self.cwd, "exists": os.path.isdir(self.cwd)}}
        try:  # what --sync-dst-dir would refuse there: a link, another user's directory
            os.close(safefiles.open_dir(self.cwd, self.cwd))
        except safefiles.Refused as e:
            r["cwd"]["refused"] = str(e)
        except OSError:
            pass
        py = None
        if a["command"]:
            r["program"], py = self.program(a["command"])
        if a["python"]:
            py = a["python"] if "/" in a["python"] else shutil.which(a["python"], path=self.path)
            if py is None:
                r["python_error"] = "%s not found" % a["python"]
        if py:
            code, out, err = self.run([py, "-c", _VERSION])
            r["interpreter"] = {"path": py, "version": out if code == 0 else None, "error": err or "exit %d" % code}
            if code == 0:
                imports = {}
                for m in a["imports"]:
                    code, _, err = self.run([py, "-c", "import " + m])
                    imports[m] = "ok" if code == 0 else (err or "exit %d" % code)
                r["imports"] = imports
        address = a["peer"]
        if a["iface"]:
            try:  # (netif needs Python 3.7 or later: an older one fails the python3 check anyway)
                from pscontract import netif

                iface = netif.match(a["iface"], netif.interfaces())
                r["interface"] = {"name": iface.name, "address": iface.address}
                address = iface.address
            except Exception as e:  # noqa: BLE001 - netif.NetifError, or a SyntaxError before Python 3.7
                r["interface"] = {"error": str(e)}
                address = None
        if address:
            s = socket.socket()
            try:
                s.bind((address, 0))
                s.listen(1)
                r["port"] = {"address": address, "port": s.getsockname()[1]}
            except OSError as e:
                r["port"] = {"error": "cannot bind %s: %s" % (address, e.strerror)}
            finally:
                s.close()
        t0 = time.monotonic()
        try:
            socket.create_connection((a["root"], a["root_port"]), timeout=a["timeout"]).close()
            r["reach"] = {"ms": (time.monotonic() - t0) * 1000}
        except OSError as e:
            r["reach"] = {"error": "%s:%d: %s" % (a["root"], a["root_port"], e.strerror or e)}
        return r


def main():
    print("PSLAUNCH-DOCTOR " + json.dumps(Probe(json.loads(read_blob(0).decode("utf-8"))).checks()))
    return 0
