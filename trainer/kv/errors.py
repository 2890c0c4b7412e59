"""Exceptions of the KVStore, and the one line that names why a job stops.

Every message is one line naming the problem and the fix.
"""

from __future__ import annotations

import sys
import threading

import pscontract as pc


class KVStoreError(RuntimeError):
    """Base class of every KVStore error."""


class KVConfigError(KVStoreError, ValueError):
    """The environment or an argument is wrong (missing secret, bad key, bad shape...)."""


class KVTimeoutError(KVStoreError, TimeoutError):
    """A peer did not answer in time (start-up, handshake)."""


class KVAuthError(KVStoreError, PermissionError):
    """A peer rejected our job secret, or could not prove it knows it."""


class KVAbortError(KVStoreError):
    """The job was aborted: another node failed, or the scheduler was lost."""


class KVAbortedByScheduler(KVAbortError):
    """The scheduler told this process to stop; it has named the culprit already."""


_cause_lock = threading.Lock()
_cause_written: list[str] = []


def report_cause(reason: str, role: str | None, rank: int | None) -> None:
    """Write :func:`pscontract.cause_line` to stderr, once per process (the first cause wins).

    Called where a KV process decides to stop the job, naming the process at
    fault (``role``/``rank``; a scheduler has no rank): the launcher puts that
    process in its report instead of whoever happened to exit first.
    """
    _write_cause(pc.cause_line(reason, role, rank))


def relay_cause(reason: str) -> None:
    """Write :func:`pscontract.relayed_cause_line` to stderr (unless this process wrote a cause
    already): the scheduler told this process to stop for ``reason``, and the launcher's console
    learns it before this process's own error line repeats it."""
    _write_cause(pc.relayed_cause_line(reason))


def _write_cause(line: str) -> None:
    """``line`` on stderr, unless this process wrote a cause line already."""
    with _cause_lock:
        if _cause_written:
            return
        _cause_written.append(line)
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def own_rank(role: str, task_id: int | None, num_workers: int) -> int | None:
    """A node's rank as its task id implies (the scheduler confirms it later): worker
    rank = task id, server rank = task id - number of workers."""
    if task_id is None or role == "scheduler":
        return None
    rank = task_id - num_workers if role == "server" else task_id
    return rank if rank >= 0 else None
