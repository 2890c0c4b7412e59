"""Processes on this machine: :class:`LocalProcess`, the handle of the local backend and of the scheduler.

Each process is started by :func:`launcher.runtime.spawn.spawn`: the leader of its own session
and process group (so signalling the group reaches everything it started), ``argv`` as a list
(no shell), stdin from ``/dev/null``, its group registered with the launcher's watchdog at once
(a ``kill -9`` of the launcher cannot leave it running); its stdout and stderr are pipes that
one pump thread reads into its labelled output.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from typing import Mapping, Optional

from ..node import errorfile
from ..node.procgroup import UsageMeter, group_alive, resolve_program, signal_group, stop_group
from ..node.watchdog import Client as Watchdog
from ..spec.plan import ProcSpec
from .handle import ProcessHandle, ProgramError, group_members
from .output import PipePump, ProcOutput
from .spawn import spawn, spawn_guard

_error_base: Optional[errorfile.Base] = None


def error_slot(watchdog: Optional[Watchdog]) -> errorfile.Slot:
    """A new local process's error file, in the launcher's one directory of them
    (:class:`~launcher.node.errorfile.Base`): made at the first, and registered then with the
    launcher's watchdog, so that a ``kill -9`` of the launcher leaves none behind; the directory
    goes when the launcher exits.

    Raises:
        OSError: no temporary directory here.
    """
    global _error_base
    if _error_base is None:
        _error_base = errorfile.Base(watchdog)
        atexit.register(_error_base.close)
    return _error_base.slot()


#: the shortest time between two looks at the local processes' usage (a look reads the stat of every process
#: under the launcher)
USAGE_INTERVAL = 1.0
_meter = UsageMeter()
_meter_lock = threading.Lock()


def local_usage(pgid: int, interval: float = USAGE_INTERVAL) -> Optional[tuple[float, int]]:
    """``(CPU percent, RSS bytes)`` of local group ``pgid``'s tree (:class:`UsageMeter`), shared by
    every local process: /proc is read when someone asks, at most once per ``interval`` for all
    of them, so a job nobody looks at pays nothing. None until two looks were made."""
    with _meter_lock:
        if _meter.looked is None or time.monotonic() - _meter.looked >= interval:
            _meter.look(os.getpid())  # (its children's trees; a subreaper launcher's, their orphans too)
        return _meter.usage(pgid)


class LocalProcess(ProcessHandle):
    """A process on this machine, leader of its own session and process group."""

    def __init__(self, proc: ProcSpec, output: ProcOutput, pump: PipePump, watchdog: Optional[Watchdog],
                 env: Mapping[str, str], cwd: str | None = None, host: str = "localhost") -> None:
        super().__init__(proc, output, host)
        argv = list(proc.argv)
        argv[0] = resolve_program(argv[0], env, cwd)
        #: its error file (launcher.node.errorfile), read back once it ended
        self._error_file: Optional[errorfile.Slot] = None
        try:
            self._error_file = error_slot(watchdog)
        except OSError:
            pass  # (no temporary directory: it runs without one, as on a node)
        with spawn_guard():  # (until the pump reads it: a Ctrl-C then finds a handle)
            try:
                child = spawn(argv, {**env, **(self._error_file.env() if self._error_file else {})}, cwd,
                              watchdog=watchdog, label=proc.label)
            except BaseException:
                if self._error_file is not None:
                    self._error_file.discard()
                raise
            self._popen = child.popen
            self.pid = self.pgid = child.pid
            self._watchdog = watchdog
            pump.add(child.stdout, output.stdout.feed, output.stdout.close)
            assert child.stderr is not None
            pump.add(child.stderr, output.stderr.feed, output.stderr.close)
            pump.watch_exit(self.pid, output.process_ended)

    def _poll(self) -> int | None:
        code = self._popen.poll()
        if code is not None and self._error_file is not None and not self._error_file.done:
            self.error = ProgramError.from_doc(self._error_file.collect())
        return code

    def usage(self) -> Optional[tuple[float, int]]:
        return None if self.exit_code is not None else local_usage(self.pgid)

    def terminate(self) -> None:
        stop_group(self.pgid, signal.SIGTERM)

    def kill(self) -> None:
        signal_group(self.pgid, signal.SIGKILL)

    def dump_stacks(self) -> None:
        signal_group(self.pgid, signal.SIGABRT)

    def forward(self, signame: str) -> None:
        signal_group(self.pgid, getattr(signal, f"SIG{signame}"))

    def leftovers(self) -> list[int]:
        """Processes of this group still alive (the leader included, if running)."""
        return group_members(self.pgid)

    def cleanup(self, groups: Mapping[int, list[int]] | None = None) -> None:
        if group_members(self.pgid, groups) if groups is not None else group_alive(self.pgid):
            signal_group(self.pgid, signal.SIGKILL)
        if self._watchdog is not None and self.poll() is not None:
            self._watchdog.forget(self.pgid)

