"""Processes on this machine: :class:`LocalProcess`, the handle of the local backend and of the scheduler.

Each process is the leader of its own session and process group (so signalling the group
reaches everything it started), gets ``argv`` as a list (no shell), stdin from ``/dev/null``,
and its stdout and stderr on pipes that one pump thread reads into its labelled output. Its
group is registered with the launcher's watchdog at once, so a ``kill -9`` of the launcher
cannot leave it running.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping, Optional

from ..errors import LaunchError
from ..node.procgroup import group_alive, resolve_program, signal_group, stop_group
from ..node.watchdog import Client as Watchdog
from ..spec.plan import ProcSpec
from .handle import ProcessHandle, group_members, spawn_guard
from .output import PipePump, ProcOutput


class LocalProcess(ProcessHandle):
    """A process on this machine, leader of its own session and process group."""

    def __init__(self, proc: ProcSpec, output: ProcOutput, pump: PipePump, watchdog: Optional[Watchdog],
                 env: Mapping[str, str], cwd: str | None = None, host: str = "localhost") -> None:
        super().__init__(proc, output, host)
        argv = list(proc.argv)
        argv[0] = resolve_program(argv[0], env, cwd)
        with spawn_guard():
            self._spawn(proc, argv, env, cwd, output, pump, watchdog)

    def _spawn(self, proc: ProcSpec, argv: list[str], env: Mapping[str, str], cwd: str | None,
               output: ProcOutput, pump: PipePump, watchdog: Optional[Watchdog]) -> None:
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
        self.pid = self.pgid = self._popen.pid
        self._watchdog = watchdog
        if watchdog is not None:
            watchdog.watch(self.pgid)
        pump.add(out_r, output.stdout.feed, output.stdout.close)
        pump.add(err_r, output.stderr.feed, output.stderr.close)
        pump.watch_exit(self.pid, output.process_ended)

    def _poll(self) -> int | None:
        return self._popen.poll()

    def terminate(self) -> None:
        stop_group(self.pgid, signal.SIGTERM)

    def kill(self) -> None:
        signal_group(self.pgid, signal.SIGKILL)

    def dump_stacks(self) -> None:
        signal_group(self.pgid, signal.SIGABRT)

    def leftovers(self) -> list[int]:
        """Processes of this group still alive (the leader included, if running)."""
        return group_members(self.pgid)

    def cleanup(self, groups: Mapping[int, list[int]] | None = None) -> None:
        if group_members(self.pgid, groups) if groups is not None else group_alive(self.pgid):
            signal_group(self.pgid, signal.SIGKILL)
        if self._watchdog is not None and self.poll() is not None:
            self._watchdog.forget(self.pgid)

