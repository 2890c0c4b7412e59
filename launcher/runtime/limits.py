"""What this machine lets the launcher start: process and open-file limits.

A local job is ``N + S + 1`` processes, each a child of the launcher holding two pipes open
in it (stdout and stderr). Before anything starts, :func:`local_capacity` says how many
processes fit under the kernel's and this user's limits, so ``-n 100000`` is one line instead
of a fork storm that ends in ``EAGAIN`` halfway through.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from typing import Optional

#: open files the launcher keeps for itself (its own pipes, the watchdog, logs, sockets)
RESERVED_FDS = 64
#: open files the launcher holds per local process (the read ends of its stdout and stderr pipes)
FDS_PER_PROCESS = 2


@dataclass(frozen=True)
class Capacity:
    """At most ``processes`` more processes here; ``limit`` names the binding limit and its fix."""

    processes: int
    limit: str


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _count_tasks() -> int:
    """Processes on this machine now (entries of /proc; each may hold several threads)."""
    try:
        return sum(1 for name in os.listdir("/proc") if name.isdigit())
    except OSError:
        return 0


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 16


def local_capacity() -> Capacity:
    """The smallest of: the open-file hard limit (the soft one is raised as needed, see
    :func:`raise_open_files`), the user's process limit (not for root), and the kernel's
    ``pid_max`` and ``threads-max``, each less what is already in use."""
    found: list[Capacity] = []
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:
        n = max(0, (hard - RESERVED_FDS - _open_fds()) // FDS_PER_PROCESS)
        found.append(Capacity(n, f"the open-file limit ({hard:,}, ulimit -Hn; {FDS_PER_PROCESS} pipes per "
                                 "process stay open in the launcher)"))
    tasks = None
    if os.geteuid() != 0:  # root is exempt from RLIMIT_NPROC
        soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
        if soft != resource.RLIM_INFINITY:
            tasks = _count_tasks()
            found.append(Capacity(max(0, soft - tasks), f"this user's process limit ({soft:,}, ulimit -u)"))
    for path, what in (("/proc/sys/kernel/pid_max", "the kernel's pid_max"),
                       ("/proc/sys/kernel/threads-max", "the kernel's threads-max")):
        value = _read_int(path)
        if value is not None:
            tasks = _count_tasks() if tasks is None else tasks
            found.append(Capacity(max(0, value - tasks), f"{what} ({value:,}, {path})"))
    if not found:
        return Capacity(1 << 31, "none known")
    return min(found, key=lambda c: c.processes)


def raise_open_files(processes: int, per_process: int = FDS_PER_PROCESS) -> None:
    """Raise the soft open-file limit towards the hard one when ``processes`` need more
    (``per_process`` descriptors each: a local child's pipes, a node agent's connection)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = _open_fds() + RESERVED_FDS + per_process * processes
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(hard, want)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # the spawn that runs out reports it
