"""The task wrapper: what a batch system runs in each task of a job (sge, yarn).

A batch system starts N identical copies of one command and tells each copy
its index in its own way: Grid Engine sets ``SGE_TASK_ID`` (1-based), skein
sets ``SKEIN_CONTAINER_ID`` (``worker_3``, 0-based). This wrapper turns that
into the launcher's contract and then *execs* the user's command, so the
command's exit code and signals are the task's own:

* ``DMLC_TASK_ID``: the role's first task id plus the 0-based index (workers
  ``0..N-1``, servers ``N..N+S-1``, the same numbering as every backend);
* ``DMLC_NODE_HOST``: this node's address on ``DMLC_INTERFACE`` (a name, a
  prefix or a CIDR, resolved here, on the execution host), else the address
  this node uses to reach the scheduler;
* the job's variables, from the task file the launcher wrote (mode 0600, so
  the job secret is never part of the job's description in ``qstat -j`` or
  YARN's application spec), on top of the task's own environment.

Task file (JSON)::

    {"version": 1,
     "argv": ["python", "train.py"],            # optional (yarn passes argv after --)
     "env": {"PSLAUNCH_SECRET": "..."},         # for every role
     "roles": {"server": {"first_task_id": 2, "count": 1, "env": {...}},
               "worker": {"first_task_id": 0, "count": 2, "env": {...}}}}

Run as ``python .../launcher/task.py --task-file F --role worker --index sge``
(or ``-m launcher.task``). Standard library only, plus ``launcher.envvars``
and ``launcher.netif``, which are standard library only too.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any, Mapping, Sequence

if __package__ in (None, ""):  # run as a file: make the package importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launcher import envvars, netif  # noqa: E402

TASK_FILE_VERSION = 1
INDEX_SOURCES = ("sge", "skein")
PREFIX = "pslaunch task"


class TaskError(Exception):
    """The task cannot start; ``str(e)`` is one line for the task's error file."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def task_index(source: str, environ: Mapping[str, str]) -> int:
    """The 0-based index of this task within its role.

    Args:
        source: ``sge`` (``SGE_TASK_ID``, 1-based) or ``skein``
            (``SKEIN_CONTAINER_ID`` = ``<service>_<instance>``, 0-based).
        environ: the task's environment.

    Raises:
        TaskError: the variable is missing or malformed (for example
            ``SGE_TASK_ID=undefined`` in a job that is not an array).
    """
    if source == "sge":
        raw = environ.get(envvars.SGE_TASK_ID, "")
        if not raw.isdigit() or int(raw) < 1:
            raise TaskError(f"{envvars.SGE_TASK_ID}={raw!r}: not a task of an array job "
                            "(pslaunch submits bulk jobs; is this running outside Grid Engine?)")
        return int(raw) - 1
    if source == "skein":
        raw = environ.get(envvars.SKEIN_CONTAINER_ID, "")
        _, _, instance = raw.rpartition("_")
        if not instance.isdigit():
            raise TaskError(f"{envvars.SKEIN_CONTAINER_ID}={raw!r}: expected <service>_<instance>")
        return int(instance)
    raise TaskError(f"unknown index source {source!r} (expected one of {', '.join(INDEX_SOURCES)})")


def load_task_file(path: str) -> dict[str, Any]:
    """Read and check the task file; :class:`TaskError` with the reason otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise TaskError(f"cannot read the task file {path}: {e.strerror or e} "
                        "(is the launcher's directory shared with this host?)") from None
    except ValueError as e:
        raise TaskError(f"task file {path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != TASK_FILE_VERSION:
        raise TaskError(f"task file {path}: unsupported version {doc.get('version') if isinstance(doc, dict) else None!r}"
                        f" (this wrapper reads version {TASK_FILE_VERSION})")
    return doc


def node_address(environ: Mapping[str, str]) -> str:
    """``DMLC_NODE_HOST`` for this node: ``DMLC_INTERFACE``'s address, else the route to the scheduler."""
    if not environ.get(envvars.INTERFACE, "").strip() and not environ.get(envvars.ROOT_URI, "").strip():
        raise TaskError(f"{envvars.ROOT_URI} is not set in the task file")
    try:
        return netif.node_address(environ.get(envvars.INTERFACE), environ.get(envvars.ROOT_URI))
    except netif.NetifError as e:
        raise TaskError(f"cannot work out this node's address: {e}") from None


def task_environment(doc: Mapping[str, Any], role: str, index: int,
                     environ: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: the task's own, then the job's, then the contract.

    Args:
        doc: the task file.
        role: ``server`` or ``worker``.
        index: 0-based index within the role (:func:`task_index`).
        environ: the task's environment as the batch system set it.

    Raises:
        TaskError: unknown role, or an index outside the role's count.
    """
    roles = doc.get("roles") or {}
    if role not in roles:
        raise TaskError(f"role {role!r} is not in the task file (it has {', '.join(sorted(roles)) or 'none'})")
    spec = roles[role]
    count = int(spec["count"])
    if not 0 <= index < count:
        raise TaskError(f"{role} index {index} is out of range: the job has {count} {role}(s)")
    env = dict(environ)
    env.update(doc.get("env") or {})
    env.update(spec.get("env") or {})
    env[envvars.ROLE] = role
    env[envvars.TASK_ID] = str(int(spec["first_task_id"]) + index)
    return env


def _exec(argv: Sequence[str], env: Mapping[str, str]) -> None:
    try:
        os.execvpe(argv[0], list(argv), dict(env))
    except FileNotFoundError:
        raise TaskError(f"cannot run {argv[0]!r}: no such program (PATH={env.get(envvars.PATH, '')})",
                        127) from None
    except PermissionError:
        raise TaskError(f"cannot run {argv[0]!r}: permission denied", 126) from None
    except OSError as e:
        raise TaskError(f"cannot run {argv[0]!r}: {e.strerror or e}", 126) from None


def _report(directory: str, role: str, rank: int, env: Mapping[str, str]) -> None:
    """Tell the launcher where this task runs (host, pid), through the shared directory."""
    record = {"host": socket.gethostname(), "pid": os.getpid(), "node_host": env.get(envvars.NODE_HOST),
              "time": time.time()}
    path = os.path.join(directory, f"{role}-{rank}.started")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except OSError:
        pass  # only informational (labels and --summary-json)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="launcher/task.py", description=__doc__.splitlines()[0])
    ap.add_argument("--task-file", required=True)
    ap.add_argument("--role", required=True, choices=("server", "worker"))
    ap.add_argument("--index", required=True, choices=INDEX_SOURCES)
    ap.add_argument("--report-dir", default=None, help="write <role>-<rank>.started here")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND... (else the task file's argv)")
    a = ap.parse_args(argv)
    try:
        doc = load_task_file(a.task_file)
        index = task_index(a.index, os.environ)
        env = task_environment(doc, a.role, index, os.environ)
        env[envvars.NODE_HOST] = node_address(env)
        command = list(a.command[1:] if a.command[:1] == ["--"] else a.command) or list(doc.get("argv") or [])
        if not command:
            raise TaskError("no command: neither after -- nor in the task file")
        if a.report_dir:
            rank = int(env[envvars.TASK_ID]) - int(doc["roles"][a.role]["first_task_id"])
            _report(a.report_dir, a.role, rank, env)
        sys.stdout.flush()
        _exec(command, env)
    except TaskError as e:
        print(f"{PREFIX}: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 0  # not reached: exec replaced us


if __name__ == "__main__":
    sys.exit(main())
