"""A plain job's options read without click: ``pslaunch -n 2 -s 1 python train.py`` starts its first
process before click (11 ms, a third of Python's whole start-up) would have been imported.

:func:`parse` reads the core options of :mod:`.run`'s command, exactly as click reads them, or
declines: it returns None for anything it does not read exactly the same (``--help``,
``--version``, ``--config``, a backend's option, an unknown or misspelt option, a value that is
not plainly valid, ``--``, a missing command), and click then parses the whole command line and
explains every mistake. So the outcome of a command line never depends on which of the two read
it, only its cost does; ``tests/unit/test_quick.py`` holds this table to click's declarations and
both parsers to the same results.
"""

from __future__ import annotations

import pscontract as pc

from .. import backends, logs
from ..spec.job import SCHEDULERS

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Mapping, Optional, Sequence

#: (parameter name, its flags, kind, default) of every core option this parser reads; kind is
#: int (at most 9 digits), float, str, flag, multiple (repeatable str) or a tuple of choices
OPTIONS: tuple[tuple[str, tuple[str, ...], Any, Any], ...] = (
    ("num_workers", ("-n", "--num-workers"), "int", None),
    ("num_servers", ("-s", "--num-servers"), "int", None),
    ("tracker", ("--tracker",), pc.TRACKERS, None),
    ("tracker_python", ("--tracker-python",), "str", None),
    ("scheduler", ("--scheduler",), SCHEDULERS, "command"),
    ("hostfile", ("-H", "--hostfile", "--host-file"), "str", None),
    ("launcher", ("--launcher", "--cluster"), "launcher", None),
    ("sync_dst_dir", ("--sync-dst-dir",), "str", None),
    ("env", ("--env",), "multiple", ()),
    ("env_server", ("--env-server",), "multiple", ()),
    ("env_worker", ("--env-worker",), "multiple", ()),
    ("host_ip", ("--host-ip",), "str", None),
    ("port_range", ("--port-range",), "str", "9091-9998"),
    ("start_timeout", ("--start-timeout",), "float", 60.0),
    ("kill_grace", ("--kill-grace",), "float", 10.0),
    ("timeout", ("--timeout",), "float", None),
    ("dry_run", ("--dry-run",), "flag", False),
    ("log_dir", ("--log-dir",), "str", None),
    ("summary_json", ("--summary-json",), "str", None),
    ("log_level", ("--log-level",), "log_level", "INFO"),
    ("log_file", ("--log-file",), "str", None),
    ("no_progress", ("--no-progress",), "flag", False),
    ("p3", ("--p3",), "flag", False),
    ("queue", ("--queue",), "str", None),
    ("jobname", ("--jobname",), "str", None),
    ("worker_cores", ("--worker-cores",), "int", 1),
    ("worker_memory", ("--worker-memory",), "str", None),
    ("server_cores", ("--server-cores",), "int", 1),
    ("server_memory", ("--server-memory",), "str", None),
)
LOG_LEVELS = tuple(logs.LEVELS)
REQUIRED = ("num_workers",)

_BY_FLAG = {flag: (name, kind) for name, flags, kind, _ in OPTIONS for flag in flags}


class _Decline(Exception):
    """Not for this parser: click reads the command line."""


def _value(kind: Any, text: str) -> Any:
    """``text`` as an option of ``kind``, or :class:`_Decline` where click might read it otherwise."""
    if text.startswith("-"):
        raise _Decline  # (a negative number, or a missing value: click's to read or explain)
    if kind in ("str", "multiple"):
        return text
    if kind == "int":
        if not (text.isascii() and text.isdigit() and len(text) <= 9):
            raise _Decline
        return int(text)
    if kind == "float":
        whole, _, part = text.partition(".")
        if not (whole.isascii() and whole.isdigit() and (not part or (part.isascii() and part.isdigit()))):
            raise _Decline
        number = float(text)
        if number - number != 0.0:  # (not finite: 400 digits are inf, for click's type to refuse)
            raise _Decline
        return number
    if kind == "log_level":
        if text.upper() not in LOG_LEVELS:
            raise _Decline
        return text.upper()
    choices = backends.available() if kind == "launcher" else kind
    if text not in choices:
        raise _Decline
    return text


def parse(args: Sequence[str], environ: Mapping[str, str]) -> Optional[dict[str, Any]]:
    """The parameters click's command would pass for ``args`` (``pslaunch``'s arguments), or None
    where click must read them."""
    kw: dict[str, Any] = {name: default for name, _, _, default in OPTIONS}
    given: set[str] = set()
    i = 0
    try:
        while i < len(args):
            arg = args[i]
            if not arg.startswith("-"):
                break
            if arg.startswith("--"):
                flag, eq, attached = arg.partition("=")
            else:
                flag, attached = arg[:2], arg[2:]
                eq = attached
            name, kind = _BY_FLAG.get(flag, (None, None))
            if name is None:
                raise _Decline  # (-, --, --help, --config, a backend's option, a typo)
            if kind == "flag":
                if eq:
                    raise _Decline
                kw[name] = True
                i += 1
                continue
            if eq:
                text = attached
                i += 1
            elif i + 1 < len(args):
                text = args[i + 1]
                i += 2
            else:
                raise _Decline
            value = _value(kind, text)
            kw[name] = (*kw[name], value) if kind == "multiple" else value
            given.add(name)
        if i >= len(args) or any(name not in given for name in REQUIRED):
            raise _Decline
        if "launcher" not in given and environ.get(pc.SUBMIT_CLUSTER):
            kw["launcher"] = _value("launcher", environ[pc.SUBMIT_CLUSTER])
    except _Decline:
        return None
    kw["command"] = tuple(args[i:])
    return kw
