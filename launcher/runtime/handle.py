"""Process handles and groups: the one interface the supervisor uses for every backend.

A backend starts the servers and workers and returns a :class:`ProcGroup`: one
:class:`ProcessHandle` per process, and the way to signal them all at once (one ``mpirun``,
one YARN application, one write of signal frames to each ssh host's wrapper: each backend
knows its own). The supervisor polls the handles (:meth:`ProcessHandle.poll`), signals the groups
(:meth:`ProcGroup.terminate`, :meth:`~ProcGroup.kill`, :meth:`~ProcGroup.dump_stacks`) and
reads each handle's :meth:`~ProcessHandle.record` for the report.
"""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Optional, Protocol

from ..logs import printable
from ..node import errorfile, procgroup
from ..node.procgroup import group_alive
from ..spec.plan import ProcSpec
from .output import ProcOutput


class Clock(Protocol):
    """What a handle reads its times from: the ``time`` module, or a test's clock."""

    def time(self) -> float: ...


def normalize_exitcode(code: int) -> int:
    """Popen's ``-N`` (killed by signal N) becomes the shell's ``128+N``."""
    return 128 - code if code < 0 else code


def signal_name(code: int | None) -> str | None:
    """``137`` -> ``"SIGKILL"``; ``None`` for a normal exit code."""
    if code is None or code <= 128 or code > 128 + 64:
        return None
    try:
        return signal.Signals(code - 128).name
    except ValueError:
        return None


def describe_exit(code: int) -> str:
    sig = signal_name(code)
    return f"was killed by {sig} (exit code {code})" if sig else f"exited with code {code}"


@dataclass(frozen=True)
class ProgramError:
    """What a process wrote to its error file (``PSLAUNCH_ERROR_FILE``, ``TORCHELASTIC_ERROR_FILE``:
    torch's ``@record``), as :mod:`launcher.node.errorfile` parsed it, here or on its node.

    Made from the program's (or a node's) words, so :meth:`from_doc` trusts none of them: wrong
    types give no error, the lengths are cut again, and every control character is made visible
    (:func:`~launcher.logs.printable`; the message is one line). ``time`` is when it was written,
    by the clock of the process's host.
    """

    message: str
    traceback: str
    time: Optional[float]

    @classmethod
    def from_doc(cls, doc: Any) -> Optional[ProgramError]:
        """The error of a :func:`~launcher.node.errorfile.parse` document (an ``r`` frame's), or None."""
        if not isinstance(doc, dict) or not isinstance(doc.get("message"), str) or not doc["message"].strip():
            return None
        trace = doc.get("traceback")
        when = doc.get("time")
        if not isinstance(when, (int, float)) or isinstance(when, bool) or not 0 < when < 1e11:
            when = None
        most_m, most_t = errorfile.MESSAGE_MAX, errorfile.TRACE_MAX
        message = printable(errorfile.cut(doc["message"].strip(), most_m))
        trace = printable(errorfile.cut_start(trace, most_t), newlines=True) if isinstance(trace, str) else ""
        return cls(message=errorfile.cut(message, most_m),  # (cut again: ^X takes two characters)
                   traceback=errorfile.cut_start(trace, most_t), time=float(when) if when is not None else None)

    def lines(self, max_lines: int = 20) -> list[str]:
        """The message, then the traceback's last ``max_lines`` lines (its innermost frames and the
        exception), after one line that counts those left out."""
        trace = self.traceback.split("\n") if self.traceback else []  # (not splitlines: it splits at \x85 too)
        if len(trace) > max_lines:
            trace = [f"[... {len(trace) - max_lines} earlier line{'' if len(trace) - max_lines == 1 else 's'}]",
                     *trace[-max_lines:]]
        return [self.message, *trace]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class ProcRecord:
    """What ``--summary-json`` says about one process."""

    name: str
    role: str
    rank: int
    task_id: Optional[int]
    host: str
    pid: Optional[int]
    start_time: Optional[float]
    end_time: Optional[float]
    exit_code: Optional[int]
    signal: Optional[str]
    stopped_by_launcher: bool
    #: what it wrote to its error file (:class:`ProgramError`'s fields), if it wrote one
    error: Optional[dict] = None
    #: the ``CUDA_VISIBLE_DEVICES`` pslaunch gave it (``--gpus-per-process``, ``gpus=``), if any
    gpus: Optional[str] = None
    #: it was lost and a replacement took its place (``--restart-scope process``)
    replaced: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


class ProcessHandle:
    """A started server or worker (or the scheduler), wherever it runs.

    Subclasses implement :meth:`_poll`, :meth:`terminate`, :meth:`kill`; the base class keeps
    times, the exit code and the output. A subclass that learns when the process ended (a
    node's exit frame, ``x``) sets :attr:`ended_at` before :meth:`_poll` returns the code, so the
    first failure is the first to have happened, not the first to be seen; where the node said
    when by its own clock (:attr:`node_ended_at`), that time counts (the hosts' clocks are assumed
    to agree), unless it is later than the launcher's.
    """

    def __init__(self, proc: ProcSpec, output: ProcOutput, host: str, clock: Clock = time) -> None:
        self.proc = proc
        self.output = output
        self.host = host
        self.clock = clock
        self.pid: int | None = None
        self.start_time = clock.time()
        self.end_time: float | None = None
        self.ended_at: float | None = None
        #: when it ended by its node's clock (the node's ``x``), set before :meth:`_poll` returns the code
        self.node_ended_at: float | None = None
        self.exit_code: int | None = None
        #: why the process could not start at all (one line), set with its exit code
        self.failure: str | None = None
        #: what it wrote to its error file, if it wrote one: set before :meth:`_poll` returns the code
        self.error: ProgramError | None = None

    @property
    def name(self) -> str:
        return self.proc.name

    @property
    def label(self) -> str:
        return self.proc.label

    def _poll(self) -> int | None:
        raise NotImplementedError

    def poll(self) -> int | None:
        """The exit code (128+N for signal N) once the process has ended, else ``None``."""
        if self.exit_code is None:
            code = self._poll()
            if code is not None:
                self.exit_code = normalize_exitcode(code)
                seen = self.ended_at or self.clock.time()
                self.end_time = seen if self.node_ended_at is None else min(self.node_ended_at, seen)
        return self.exit_code

    def terminate(self) -> None:
        """Ask the process (and everything it started) to stop: SIGTERM."""
        raise NotImplementedError

    def kill(self) -> None:
        """Force the process and everything it started to stop: SIGKILL."""
        raise NotImplementedError

    def dump_stacks(self) -> None:
        """Make Python processes print their stacks (faulthandler on SIGABRT)."""

    def forward(self, signame: str) -> None:
        """Pass a batch system's notice (``USR1``, ``USR2``: SIGUSR1, SIGUSR2) on to the process and
        everything it started, which go on running (a program checkpoints on it)."""

    def cleanup(self, groups: Mapping[int, list[int]] | None = None) -> None:
        """Kill anything the process left behind after it exited.

        ``groups`` is a :func:`scan_groups` snapshot shared by all handles.
        """

    def usage(self) -> Optional[tuple[float, int]]:
        """``(CPU percent of one core over the last sampling interval, RSS bytes)`` of the process
        and everything it started (its group and their descendants), or None when not known: not
        started, ended, not sampled yet (the first value comes about a second after the first
        look), or a handle that cannot tell. Node agents sample only when the spec asks
        (:attr:`~launcher.spec.job.JobSpec.wants_usage`); a local process is sampled when asked."""
        return None

    def host_lost(self) -> Optional[str]:
        """Why the launcher lost the process's host (no answer to keep-alives, the connection
        gone), or None: the host is not to blame, or the handle cannot tell. The supervisor leaves
        such a host out of the next attempts (``launcher.run.hosthealth``)."""
        return None

    def describe(self) -> str:
        where = f"on {self.host}" + (f", pid {self.pid}" if self.pid else "")
        return f"{self.label} ({where})"

    def describe_error(self, max_lines: int = 20) -> list[str]:
        """What it wrote to its error file, as lines to show (:meth:`ProgramError.lines`): the
        message, then the traceback's end; ``[]`` when it wrote none."""
        return self.error.lines(max_lines) if self.error is not None else []

    def record(self, stopped_by_launcher: bool = False, replaced: bool = False) -> ProcRecord:
        return ProcRecord(
            name=self.name, role=str(self.proc.role), rank=self.proc.rank, task_id=self.proc.task_id,
            host=self.host, pid=self.pid, start_time=self.start_time, end_time=self.end_time,
            exit_code=self.exit_code, signal=signal_name(self.exit_code),
            stopped_by_launcher=stopped_by_launcher, error=self.error.to_dict() if self.error else None,
            gpus=self.proc.gpus, replaced=replaced,
        )


def scan_groups() -> dict[int, list[int]] | None:
    """Live (non-zombie) pids by process group, from one pass over ``/proc``; None without /proc."""
    procs = procgroup.scan()
    if procs is None:
        return None
    groups: dict[int, list[int]] = {}
    for p in procs:
        if p.alive:
            groups.setdefault(p.pgid, []).append(p.pid)
    return groups


def group_members(pgid: int, groups: Mapping[int, list[int]] | None = None) -> list[int]:
    """Live (non-zombie) pids in process group ``pgid`` (from ``groups`` if given, else ``/proc``)."""
    if groups is None:
        groups = scan_groups()
        if groups is None:
            return [pgid] if group_alive(pgid) else []
    return list(groups.get(pgid, ()))




class ProcGroup:
    """The processes one backend started, and how to signal all of them at once.

    The default signals each handle; a backend whose processes share one controller (one
    ``mpirun``, one YARN application, one connection per ssh host) overrides these methods to
    signal it once. Every method is idempotent and never raises for a process that has ended.
    """

    def __init__(self, handles: Iterable[ProcessHandle] = ()) -> None:
        self.handles = list(handles)

    def running(self) -> list[ProcessHandle]:
        return [h for h in self.handles if h.poll() is None]

    def terminate(self) -> None:
        """Ask every running process to stop (SIGTERM, or what stands for it)."""
        for h in self.running():
            h.terminate()

    def kill(self) -> None:
        """Stop every running process now (SIGKILL)."""
        for h in self.running():
            h.kill()

    def dump_stacks(self) -> None:
        """Make every running Python process print its stacks (faulthandler on SIGABRT)."""
        for h in self.running():
            h.dump_stacks()

    def forward(self, signame: str) -> None:
        """Pass ``USR1`` or ``USR2`` on to every running process, once each (:meth:`ProcessHandle.forward`)."""
        for h in self.running():
            h.forward(signame)

    def cleanup(self, groups: Optional[Mapping[int, list[int]]] = None) -> None:
        """The job is over: remove whatever the processes left behind (see :meth:`ProcessHandle.cleanup`)."""
        for h in self.handles:
            h.cleanup(groups)
