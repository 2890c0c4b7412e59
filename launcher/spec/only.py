"""``--only``: which processes' lines reach the console.

A selector names a role, and for servers and workers optionally ranks::

    scheduler            the scheduler
    server, worker       every server, every worker
    worker:2             worker 2
    worker:0-3           workers 0 to 3
    rank:0               worker 0: a collective job's ranks are its workers (torch's RANK)
    worker:0,2           a bare number or range after a selector continues its role

``--only`` is repeatable and takes comma lists; a process is shown when any selector names it.
Only the console is filtered: the ``--log-dir`` files, the failure report and pslaunch's own
lines stay whole, so that a filtered-out process that fails is still explained. Output that is
no server's, worker's or the scheduler's (a collective job's tracker, mpirun) is pslaunch's own
and always shown.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Optional

from ..errors import ConfigError

#: the roles a selector may name, and ``rank`` (a worker's rank)
ROLES = ("scheduler", "server", "worker")
FORMS = "scheduler, server, worker, server:R, worker:R, worker:A-B or rank:R (a worker's rank), comma-separated"
_RANKS = re.compile(r"(\d{1,6})(?:-(\d{1,6}))?")
_NAME = re.compile(r"(server|worker)-(\d+)")


@dataclass(frozen=True)
class Selector:
    """One ``--only`` item: ``role``, and the inclusive rank range ``lo``-``hi`` (None: every
    process of the role). ``text`` is how the user wrote it, for messages."""

    role: str
    lo: Optional[int] = None
    hi: Optional[int] = None
    text: str = field(default="", compare=False)

    def matches(self, name: str) -> bool:
        """Whether the process ``name`` (``scheduler``, ``server-0``, ``worker-3``) is selected."""
        if self.role == "scheduler":
            return name == "scheduler"
        m = _NAME.fullmatch(name)
        if m is None or m.group(1) != self.role:
            return False
        return self.lo is None or self.hi is None or self.lo <= int(m.group(2)) <= self.hi

    def __str__(self) -> str:
        if self.lo is None:
            return self.role
        return f"{self.role}:{self.lo}" if self.lo == self.hi else f"{self.role}:{self.lo}-{self.hi}"


def _usage(piece: str, why: str = "") -> ConfigError:
    shown = piece if len(piece) <= 30 else piece[:30] + "..."
    return ConfigError(f"--only {shown!r}: {why + '; ' if why else ''}expected {FORMS}, e.g. --only worker:0-3,server")


def _ranks(text: str, piece: str) -> tuple[int, int]:
    m = _RANKS.fullmatch(text)
    if m is None:
        raise _usage(piece, "a rank is a number (R) or a range (A-B)")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if hi < lo:
        raise _usage(piece, f"the range {lo}-{hi} runs backwards")
    return lo, hi


def parse_only(items: Iterable[str]) -> tuple[Selector, ...]:
    """``--only`` values (each a comma list) to selectors, in order; a bad one raises a one-line
    :class:`ConfigError` that names the valid forms.

    >>> [str(s) for s in parse_only(["worker:0-3,server", "rank:5"])]
    ['worker:0-3', 'server', 'worker:5']
    """
    out: list[Selector] = []
    for item in items:
        previous: Optional[str] = None  # the role a bare number continues (worker:0,2)
        for raw in str(item).split(","):
            piece = raw.strip()
            if not piece:
                raise _usage(str(item), "an empty selector")
            role, colon, ranks = piece.partition(":")
            if not colon and _RANKS.fullmatch(piece):
                if previous is None:
                    raise _usage(piece, "a bare rank continues a server:R or worker:R before it")
                lo, hi = _ranks(piece, piece)
                out.append(Selector(previous, lo, hi, piece))
                continue
            if role == "rank":
                role = "worker"
            elif role not in ROLES:
                raise _usage(piece, f"unknown role {role!r}" if role else "")
            if role == "scheduler" and colon:
                raise _usage(piece, "there is one scheduler; it has no rank")
            if not colon:
                out.append(Selector(role, text=piece))
                previous = None
                continue
            lo, hi = _ranks(ranks, piece)
            out.append(Selector(role, lo, hi, piece))
            previous = role
    return tuple(out)


def check_only(selectors: Iterable[Selector], num_workers: int, num_servers: int) -> None:
    """Each selector names processes the job has (``--only worker:5`` of a 2-worker job is a typo,
    not a request for silence)."""
    for s in selectors:
        if s.role == "scheduler" and num_servers == 0:
            raise ConfigError(f"--only {s.text}: this job has no scheduler (-s 0); select workers, e.g. "
                              "--only worker:0")
        count = num_servers if s.role == "server" else num_workers
        if s.role == "server" and count == 0:
            raise ConfigError(f"--only {s.text}: this job has no servers (-s 0); select workers, e.g. "
                              "--only worker:0")
        if s.hi is not None and s.hi >= count:
            have = f"{s.role} 0" if count == 1 else f"{s.role}s 0-{count - 1}"
            raise ConfigError(f"--only {s.text}: this job has {have}")


def shows(selectors: Iterable[Selector], name: str) -> bool:
    """Whether the lines of the process ``name`` reach the console under ``selectors`` (none:
    every process's). What is no scheduler's, server's or worker's is pslaunch's own: shown."""
    selectors = tuple(selectors)
    if not selectors or not (name == "scheduler" or _NAME.fullmatch(name)):
        return True
    return any(s.matches(name) for s in selectors)
