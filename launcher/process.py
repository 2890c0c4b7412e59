"""Process handles: the one interface the supervisor uses for every backend.

A backend returns one :class:`ProcessHandle` per server or worker. The
supervisor only ever calls :meth:`~ProcessHandle.poll`,
:meth:`~ProcessHandle.terminate`, :meth:`~ProcessHandle.kill`,
:meth:`~ProcessHandle.dump_stacks` and reads :meth:`~ProcessHandle.record`.
:class:`LocalProcess` runs a program on this machine in its own session, so
signalling its process group reaches everything it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Iterator, Mapping, Optional, Sequence

from .errors import LaunchError
from .output import PipePump, ProcOutput
from .plan import ProcSpec

_spawning = 0


def spawning() -> bool:
    """True while a child is being created and registered (signal handlers must not raise then)."""
    return _spawning > 0


@contextlib.contextmanager
def spawn_guard() -> Iterator[None]:
    global _spawning
    _spawning += 1
    try:
        yield
    finally:
        _spawning -= 1


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

    def to_dict(self) -> dict:
        return asdict(self)


class ProcessHandle:
    """A started server or worker (or the scheduler), wherever it runs.

    Subclasses implement :meth:`_poll`, :meth:`terminate`, :meth:`kill`; the
    base class keeps times, the exit code and the output.
    """

    def __init__(self, proc: ProcSpec, output: ProcOutput, host: str) -> None:
        self.proc = proc
        self.output = output
        self.host = host
        self.pid: int | None = None
        self.start_time = time.time()
        self.end_time: float | None = None
        self.exit_code: int | None = None
        self.stopped_by_launcher = False

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
                self.end_time = time.time()
        return self.exit_code

    def terminate(self) -> None:
        """Ask the process (and everything it started) to stop: SIGTERM."""
        raise NotImplementedError

    def kill(self) -> None:
        """Force the process and everything it started to stop: SIGKILL."""
        raise NotImplementedError

    def dump_stacks(self) -> None:
        """Make Python processes print their stacks (faulthandler on SIGABRT)."""

    def cleanup(self, groups: Mapping[int, list[int]] | None = None) -> None:
        """Kill anything the process left behind after it exited.

        ``groups`` is a :func:`scan_groups` snapshot shared by all handles.
        """

    def describe(self) -> str:
        where = f"on {self.host}" + (f", pid {self.pid}" if self.pid else "")
        return f"{self.label} ({where})"

    def record(self) -> ProcRecord:
        return ProcRecord(
            name=self.name, role=str(self.proc.role), rank=self.proc.rank, task_id=self.proc.task_id,
            host=self.host, pid=self.pid, start_time=self.start_time, end_time=self.end_time,
            exit_code=self.exit_code, signal=signal_name(self.exit_code),
            stopped_by_launcher=self.stopped_by_launcher,
        )


def scan_groups() -> dict[int, list[int]] | None:
    """Live (non-zombie) pids by process group, from one pass over ``/proc``; None without /proc."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    groups: dict[int, list[int]] = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ..." - comm may contain spaces and parens
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and fields[0] not in (b"Z", b"X"):
            groups.setdefault(int(fields[2]), []).append(int(entry))
    return groups


def group_members(pgid: int, groups: Mapping[int, list[int]] | None = None) -> list[int]:
    """Live (non-zombie) pids in process group ``pgid`` (from ``groups`` if given, else ``/proc``)."""
    if groups is None:
        groups = scan_groups()
        if groups is None:
            return [pgid] if _group_exists(pgid) else []
    return list(groups.get(pgid, ()))


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Watchdog:
    """Client side of :mod:`launcher.watchdog`, the dead-man switch.

    Started once per job before any process; every local process group is
    registered at once after it is created.
    """

    def __init__(self, grace: float) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py")
        self._proc = subprocess.Popen(
            [sys.executable, "-S", "-u", script], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            close_fds=True,
        )
        self._lock = threading.Lock()
        self._send(f"grace {max(1.0, grace)}")

    def _send(self, line: str) -> None:
        with self._lock:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass

    def watch(self, pgid: int) -> None:
        self._send(f"pgid {pgid}")

    def forget(self, pgid: int) -> None:
        self._send(f"forget {pgid}")

    def on_abandon(self, argv: Sequence[str]) -> None:
        """Run ``argv`` if the launcher dies (for batch jobs: cancel them)."""
        import json
        self._send("cmd " + json.dumps(list(argv)))

    def close(self) -> None:
        """Normal end: the watchdog reads ``done`` and exits without touching anything.

        Not waited for (it would add its start-up time to every job's exit);
        the ``done`` line stays in the pipe until the watchdog reads it.
        """
        self._send("done")
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        except OSError:
            pass
        self._proc.poll()


def resolve_program(argv0: str, env: Mapping[str, str], cwd: str | None) -> str:
    """dmlc's rule: a bare name not on PATH but present in the working directory runs as ``./name``."""
    if "/" in argv0 or shutil.which(argv0, path=env.get("PATH", os.defpath)):
        return argv0
    local = os.path.join(cwd or os.getcwd(), argv0)
    if os.path.isfile(local) and os.access(local, os.X_OK):
        return "./" + argv0
    return argv0


class LocalProcess(ProcessHandle):
    """A process on this machine, leader of its own session and process group."""

    def __init__(self, proc: ProcSpec, output: ProcOutput, pump: PipePump, watchdog: Watchdog | None,
                 env: Mapping[str, str], cwd: str | None = None, host: str = "localhost") -> None:
        super().__init__(proc, output, host)
        argv = list(proc.argv)
        argv[0] = resolve_program(argv[0], env, cwd)
        with spawn_guard():
            self._spawn(proc, argv, env, cwd, output, pump, watchdog)

    def _spawn(self, proc: ProcSpec, argv: list[str], env: Mapping[str, str], cwd: str | None,
               output: ProcOutput, pump: PipePump, watchdog: Watchdog | None) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            self._popen = subprocess.Popen(
                argv, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=out_w,
                stderr=err_w, start_new_session=True, close_fds=True,
            )
        except OSError as e:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            if isinstance(e, FileNotFoundError):
                raise LaunchError(f"{proc.label}: cannot run {argv[0]!r}: no such program or directory "
                                  "(is it on PATH? give a path such as ./prog)", exit_code=127) from None
            if isinstance(e, PermissionError):
                raise LaunchError(f"{proc.label}: cannot run {argv[0]!r}: permission denied "
                                  "(is it executable?)", exit_code=126) from None
            raise LaunchError(f"{proc.label}: cannot run {argv[0]!r}: {e.strerror or e}") from None
        os.close(out_w)
        os.close(err_w)
        self.pid = self._popen.pid
        self.pgid = self._popen.pid
        self._watchdog = watchdog
        if watchdog is not None:
            watchdog.watch(self.pgid)
        pump.add(out_r, output.stdout.feed, output.stdout.close)
        pump.add(err_r, output.stderr.feed, output.stderr.close)

    def _poll(self) -> int | None:
        return self._popen.poll()

    def terminate(self) -> None:
        _signal_group(self.pgid, signal.SIGTERM)

    def kill(self) -> None:
        _signal_group(self.pgid, signal.SIGKILL)

    def dump_stacks(self) -> None:
        _signal_group(self.pgid, signal.SIGABRT)

    def leftovers(self) -> list[int]:
        """Processes of this group still alive (the leader included, if running)."""
        return group_members(self.pgid)

    def cleanup(self, groups: Mapping[int, list[int]] | None = None) -> None:
        if group_members(self.pgid, groups):
            _signal_group(self.pgid, signal.SIGKILL)
        if self._watchdog is not None and self.poll() is not None:
            self._watchdog.forget(self.pgid)
