"""External commands that the launcher runs on the launching host and waits for: one way to run them.

Slurm's client commands (``scontrol``, ``squeue``, ``sinfo``, ``scancel``, ``srun --version``),
``mpirun --version`` and ``git ls-files`` all go through :func:`call` (in the manner of
dask-jobqueue's ``Job._call``): it logs the command line at DEBUG, runs it without a shell,
standard input ``/dev/null`` and both outputs captured, and raises one :class:`CommandError`
carrying the command line, the exit code, standard output and standard error when the program
is missing, does not answer within its timeout, or exits non-zero. Each caller turns that into
its own one-line message.

A command line never carries a secret (the job's secret travels in environment variables and
in files only readable by the user), so logging it is safe.

Not run here: the children the launcher supervises while they run (``mpirun``, ``srun`` steps,
``salloc``, the trackers: they have pipes, sessions and watchdogs), and the clean-up commands
the watchdog (:mod:`launcher.node.watchdog`) runs once the launcher is gone (``qdel``,
``yarn application -kill``, ``scancel``): nobody is left to tell about those.
"""

from __future__ import annotations

import logging
import shlex
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence

from .errors import LaunchError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """A command that ran to its end: its exit code (0, unless :func:`call` had ``check=False``)
    and its output as text (standard output decoded losslessly, ``surrogateescape``, since it
    may hold file names; standard error with ``replace``: it is for people)."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


class CommandError(LaunchError):
    """A command that did not succeed; ``str(e)`` is one line that says which and why.

    Attributes:
        argv: the command line.
        returncode: its exit code; None when it never ran (a missing program) or was killed at
            its timeout.
        timed_out: it was killed at its timeout.
        stdout, stderr: what it printed (what it had printed by then, for a timeout).
    """

    def __init__(self, message: str, argv: Sequence[str], returncode: Optional[int] = None, stdout: str = "",
                 stderr: str = "", timed_out: bool = False) -> None:
        super().__init__(message)
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.timed_out = timed_out


def call(argv: Sequence[str], timeout: float, *, check: bool = True) -> Result:
    """Run ``argv`` (no shell) and wait at most ``timeout`` seconds for it.

    Returns:
        its :class:`Result`; with ``check=False`` also when it exited non-zero.

    Raises:
        CommandError: ``argv[0]`` cannot be run (``scontrol: not found on PATH``, ``cannot run
            /x/mpirun: Permission denied``), did not end within ``timeout`` (it is killed:
            ``scontrol ping did not answer within 30s``), or, with ``check``, exited non-zero
            (``scontrol show job 7 failed (exit code 1): <its stderr on one line>``).
    """
    argv = tuple(argv)
    line = shlex.join(argv)
    log.debug("running %s", line)
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise CommandError(f"{line} did not answer within {timeout:g}s", argv, stdout=_out(e.stdout),
                           stderr=_err(e.stderr), timed_out=True) from None
    except FileNotFoundError:
        where = "no such file" if "/" in argv[0] else "not found on PATH"
        raise CommandError(f"{argv[0]}: {where}", argv) from None
    except OSError as e:
        raise CommandError(f"cannot run {argv[0]}: {e.strerror or e}", argv) from None
    result = Result(argv, proc.returncode, _out(proc.stdout), _err(proc.stderr))
    if check and result.returncode != 0:
        said = " ".join((result.stderr or result.stdout).split())
        raise CommandError(f"{line} failed (exit code {result.returncode}){': ' + said if said else ''}", argv,
                           result.returncode, result.stdout, result.stderr)
    return result


def _out(data: Optional[bytes]) -> str:
    return data.decode("utf-8", "surrogateescape") if data else ""


def _err(data: Optional[bytes]) -> str:
    return data.decode("utf-8", "replace") if data else ""


__all__ = ["CommandError", "Result", "call"]
