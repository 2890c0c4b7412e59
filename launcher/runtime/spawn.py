"""Children of the launcher on this machine: :func:`spawn`, the one place that starts one.

Every child that the launcher starts and leaves running (a local server or worker, the
scheduler, a tracker program, ``mpirun``, Slurm's ``srun`` and ``salloc``) is started here:

* ``argv`` is a list (no shell); the environment and the working directory are the caller's;
* it leads a new session and process group: signalling the group reaches whatever it starts, and
  a Ctrl-C at the terminal reaches only the launcher;
* its stdin is ``/dev/null`` (or a pipe: a tracker program's leash); it holds no descriptor of
  the launcher's but ``pass_fds``;
* its stdout and stderr are pipes (stderr may share stdout's) whose read ends the caller hands
  to a reader, usually a :class:`~launcher.runtime.output.PipePump`;
* it starts inside :func:`spawn_guard` and is known to the watchdog before the guard ends, so
  that no Ctrl-C comes between its start and its registration, and a ``kill -9`` of the
  launcher does not leave it running. A child that the watchdog does not look after (``srun``,
  ``salloc``) may instead get a ``death_signal`` when the thread that started it ends;
* when it cannot start, every descriptor is closed again and :class:`LaunchError` says why in
  one line: for a job's process (``label``), exit code 127 when the program is not there and
  126 when it may not run, as a shell says.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

from ..errors import LaunchError
from ..node.agent import start_error
from ..node.procgroup import parent_death_signal
from ..node.watchdog import Client as Watchdog

_spawning = 0


def spawning() -> bool:
    """True while a child is being created and registered (signal handlers must not raise then)."""
    return _spawning > 0


@contextlib.contextmanager
def spawn_guard() -> Iterator[None]:
    """While inside, a Ctrl-C is held back until the child (or the batch job) being started has
    a handle that stops it (see :mod:`launcher.run.signals`); nests."""
    global _spawning
    _spawning += 1
    try:
        yield
    finally:
        _spawning -= 1


@dataclass
class Child:
    """A started child: its ``Popen`` and the read ends of its output pipes, the caller's to read
    and close (:meth:`PipePump.add <launcher.runtime.output.PipePump.add>` does both)."""

    popen: subprocess.Popen
    stdout: int
    stderr: Optional[int]  # None: its stderr goes to stdout's pipe

    @property
    def pid(self) -> int:
        return self.popen.pid


def spawn(argv: Sequence[str], env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None, *,
          stdin: int = subprocess.DEVNULL, merge_stderr: bool = False, pass_fds: Sequence[int] = (),
          watchdog: Optional[Watchdog] = None, death_signal: Optional[int] = None,
          label: Optional[str] = None) -> Child:
    """Start ``argv`` as the module docstring says.

    Args:
        env: the child's whole environment (None: the launcher's).
        stdin: ``subprocess.DEVNULL`` or ``subprocess.PIPE`` (then ``popen.stdin`` is the write end).
        merge_stderr: its stderr goes to its stdout's pipe.
        watchdog: the group to watch (the child's pid is its process group's id).
        death_signal: the signal the child gets when the thread that starts it ends.
        label: a job's process (``worker 0``): its errors name it and use the shell's exit codes.

    Raises:
        LaunchError: the program cannot be run.
    """
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe() if not merge_stderr else (None, out_w)
    try:
        with spawn_guard():
            popen = subprocess.Popen(list(argv), env=None if env is None else dict(env), cwd=cwd, stdin=stdin,
                                     stdout=out_w, stderr=err_w, start_new_session=True, close_fds=True,
                                     pass_fds=tuple(pass_fds),
                                     preexec_fn=None if death_signal is None else parent_death_signal(death_signal))
            if watchdog is not None:
                watchdog.watch(popen.pid)
    except BaseException as e:
        for fd in (out_r, err_r):
            if fd is not None:
                os.close(fd)
        if isinstance(e, (OSError, ValueError)):  # (ValueError: a NUL byte in argv or env)
            raise _cannot_run(argv[0], e, label) from None
        raise
    finally:
        os.close(out_w)
        if err_r is not None:
            os.close(err_w)
    return Child(popen, out_r, err_r)


def _cannot_run(program: str, e: Exception, label: Optional[str]) -> LaunchError:
    if label is None:
        return LaunchError(f"cannot run {program}: {getattr(e, 'strerror', None) or e}")
    message, code = start_error(e, program, None)
    return LaunchError(f"{label}: {message}", exit_code=code)
