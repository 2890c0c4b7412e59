"""What a user coming from torchrun or mpirun writes, answered in pslaunch's words before
anything starts: their launchers' own flags (:func:`foreign_flags`), and a Python file given
as the command, which torchrun runs with ``python`` and pslaunch runs as a program
(:func:`python_file_hint`). Each answer is one line: a usage error, exit 2.
"""

from __future__ import annotations

import os
import shlex
import shutil
from typing import Callable, Mapping, Optional, Sequence

#: how the processes' count is described wherever -n is the answer
_N_MEANS = "processes per job; with -H the hosts share them"


def _value(args: Sequence[str], i: int) -> tuple[Optional[str], int]:
    """The value of the flag at ``args[i]`` (``--flag=V`` or ``--flag V``) and the next index."""
    flag, eq, value = args[i].partition("=")
    if eq:
        return value, i + 1
    if i + 1 < len(args):
        return args[i + 1], i + 2
    return None, i + 1


def _slots_hosts(value: str) -> str:
    """mpirun's ``--host h1:2,h2`` (``:N`` is a slot count there) in pslaunch's -H form (``:N`` is
    an ssh port here, so slots are written ``slots=N``)."""
    items = []
    for item in value.split(","):
        name, colon, count = item.rpartition(":")
        items.append(f"{name} slots={count}" if colon and count.isdigit() and ":" not in name else item)
    joined = ",".join(items)
    return shlex.quote(joined) if " " in joined else joined


def _is_count(value: Optional[str]) -> bool:
    return value is not None and value.isdigit() and len(value) <= 6


# Each answer: (the flag's spellings, takes a value, the answer given the value and every flag seen)
_Answer = Callable[[Optional[str], Mapping[str, Optional[str]]], str]


def _nproc(value: Optional[str], seen: Mapping[str, Optional[str]]) -> str:
    nodes = seen.get("nnodes")
    if _is_count(value) and _is_count(nodes) and int(str(nodes)) > 1:
        total = int(str(value)) * int(str(nodes))
        return (f"pslaunch spells this -n {total} -H HOSTS (-n counts the processes of the whole job, "
                f"{nodes} hosts x {value}; -H names the hosts, which share them)")
    n = value if _is_count(value) else "N"
    return f"pslaunch spells this -n {n} ({_N_MEANS})"


def _nnodes(value: Optional[str], seen: Mapping[str, Optional[str]]) -> str:
    if "nproc" in seen:
        return "see --nproc-per-node"
    return ("pslaunch spells this -H HOSTS (a hostfile or -H h1,h2: the hosts themselves, not their "
            "number; -n counts the processes of the whole job)")


def _master_addr(value: Optional[str], seen: Mapping[str, Optional[str]]) -> str:
    return (f"pslaunch spells this --host-ip {value or 'ADDRESS'} (the store runs on this machine; every "
            "process gets MASTER_ADDR)")


def _master_port(value: Optional[str], seen: Mapping[str, Optional[str]]) -> str:
    p = value if _is_count(value) else "PORT"
    return f"pslaunch spells this --port-range {p}-{p} (the store takes the first free port of the range)"


def _rdzv_endpoint(value: Optional[str], seen: Mapping[str, Optional[str]]) -> str:
    host, _, port = (value or "").rpartition(":")
    if host and port.isdigit():
        return f"pslaunch spells this --host-ip {host} --port-range {port}-{port} (the store runs on this machine)"
    return "pslaunch spells this --host-ip ADDRESS --port-range PORT-PORT (the store runs on this machine)"


def _drop(what: str) -> _Answer:
    return lambda value, seen: f"pslaunch needs none: {what}; drop it"


def _np(value: Optional[str], seen: Mapping[str, Optional[str]]) -> str:
    n = value if _is_count(value) else "N"
    return f"pslaunch spells this -n {n} ({_N_MEANS})"


def _hostfile(value: Optional[str], seen: Mapping[str, Optional[str]]) -> str:
    return (f"pslaunch spells this -H {shlex.quote(value) if value else 'FILE'} (the same lines: host, "
            "host slots=N)")


def _host(value: Optional[str], seen: Mapping[str, Optional[str]]) -> str:
    if not value:
        return "pslaunch spells this -H h1,h2 (slots: -H 'h1 slots=2,h2')"
    return f"pslaunch spells this -H {_slots_hosts(value)} (in -H, ':N' is an ssh port; slots are 'slots=N')"


#: (key, spellings, takes a value, answer): torchrun's and mpirun's flags that pslaunch spells otherwise
FOREIGN: tuple[tuple[str, tuple[str, ...], bool, _Answer], ...] = (
    ("nproc", ("--nproc-per-node", "--nproc_per_node"), True, _nproc),
    ("nnodes", ("--nnodes",), True, _nnodes),
    ("node_rank", ("--node-rank", "--node_rank"), True,
     _drop("it starts every host's processes itself and gives each its RANK")),
    ("master_addr", ("--master-addr", "--master_addr"), True, _master_addr),
    ("master_port", ("--master-port", "--master_port"), True, _master_port),
    ("rdzv_endpoint", ("--rdzv-endpoint", "--rdzv_endpoint"), True, _rdzv_endpoint),
    ("rdzv_backend", ("--rdzv-backend", "--rdzv_backend"), True,
     _drop("--tracker torch runs the store on this machine")),
    ("rdzv_id", ("--rdzv-id", "--rdzv_id"), True, _drop("each job has its own store")),
    ("standalone", ("--standalone",), False,
     _drop("--tracker torch always runs its own store on this machine (pslaunch -n N --tracker torch python "
           "x.py)")),
    ("max_restarts", ("--max_restarts",), True,
     lambda value, seen: f"pslaunch spells this --max-restarts {value or 'N'}"),
    ("np", ("-np", "--np", "-c"), True, _np),
    ("hostfile", ("-hostfile", "--machinefile", "-machinefile"), True, _hostfile),
    ("host", ("--host", "-host"), True, _host),
)
_BY_FLAG = {flag: entry for entry in FOREIGN for flag in entry[1]}


def foreign_flags(args: Sequence[str], takes_value: Mapping[str, bool]) -> Optional[str]:
    """The one-line answer for torchrun's or mpirun's flags among pslaunch's options in ``args``,
    or None when there are none.

    Only the options are read: they end, as click reads them, at the first argument that is not
    an option or an option's value (``takes_value``: pslaunch's own options); everything from
    there on is the user's command and its flags are its own.
    """
    found: list[tuple[str, str, Optional[str]]] = []  # (key, the flag as written, its value)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--" or arg == "-" or not arg.startswith("-"):
            break
        flag = arg.partition("=")[0]
        entry = _BY_FLAG.get(flag)
        if entry is not None and flag not in takes_value:
            key, _, needs_value, _answer = entry
            value, i = _value(args, i) if needs_value else (None, i + 1)
            found.append((key, flag, value))
            continue
        if arg.startswith("--"):
            name, eq, _ = arg.partition("=")
            i += 2 if takes_value.get(name) and not eq else 1
        else:
            name = arg[:2]
            i += 2 if takes_value.get(name) and len(arg) == 2 else 1
    if not found:
        return None
    seen = {key: value for key, _, value in found}
    answers = []
    for key, flag, value in found:
        answer = _BY_FLAG[flag][3](value, seen)
        if answer.startswith("see "):
            continue  # (answered together with the flag it names)
        shown = flag if value is None else f"{flag} {value}"
        if key == "nproc" and "nnodes" in seen:
            shown = f"--nnodes {seen['nnodes']} {shown}"
        answers.append(f"{shown}: {answer}")
    return "; ".join(answers)


# --- a Python file as the command ---------------------------------------------------------------


def _first_line(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.readline(256)
    except OSError:
        return b""


def python_file_hint(command: Sequence[str], options: Optional[Sequence[str]], environ: Mapping[str, str],
                     cwd: str) -> Optional[str]:
    """``ddp.py is a Python file; run: pslaunch OPTIONS python ddp.py ...`` when the command's
    program is a Python file (``.py``) that cannot run as a program: not executable, or without a
    ``#!`` line (torchrun runs a script with ``python``; pslaunch runs the command as it is
    given). None otherwise, and for a name found on ``PATH`` (the job runs that one).

    ``options``: pslaunch's own arguments before the command, re-quoted into the answer (None
    when unknown: the answer then says ``pslaunch ...``).
    """
    if not command:
        return None
    program = command[0]
    if not program.endswith(".py"):
        return None
    if "/" not in program and shutil.which(program, path=environ.get("PATH", os.defpath)):
        return None
    path = os.path.join(cwd, program)
    if not os.path.isfile(path):
        return None
    if os.access(path, os.X_OK) and _first_line(path).startswith(b"#!"):
        return None
    python = "python" if shutil.which("python", path=environ.get("PATH", os.defpath)) else "python3"
    head = "pslaunch " + (shlex.join(options) + " " if options else "") if options is not None else "pslaunch ... "
    return f"{program} is a Python file; run: {head}{python} {shlex.join(command)}"
