"""The dead-man switch: kills a job's process groups if the program that started them dies.

:class:`Client` starts this module as a separate process (its own session, stdin a pipe from
the client) before it starts anything else, and tells it about every process group it creates.
If the pipe reaches EOF without a ``done`` line, the client is gone (``kill -9``, a crash): the
watchdog sends SIGTERM to every group, runs the registered cleanup commands (``qdel``-style,
removing files that hold the job's secret), waits the rest of the grace period, sends SIGKILL
to what is left, and exits. The launcher uses
one for every local process group; the node agent (:mod:`.agent`) uses one for its command.

Protocol, one line each: ``grace SECONDS``, ``pgid N``, ``forget N``, ``mark PREFIX`` (also stop
every process whose ``PSLAUNCH_PROCESS`` starts with PREFIX: what left its group with
``setsid()``), ``cmd JSON-ARGV``, ``done``. Standard library only.
"""

from __future__ import annotations

import signal
import sys

from .procgroup import group_alive, kill_marked, marked, signal_group, stop_group

# The watchdog process imports only what reading its commands needs: it starts with every job,
# and a job that ends at once waits for it (json, subprocess and typing would double its
# 12 ms). The rest is imported where it is used.
TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    import subprocess
    from typing import Optional, Sequence


def main() -> int:
    """The watchdog process: read commands from stdin until ``done`` or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    grace = 10.0
    groups: set[int] = set()
    marks: list[str] = []
    commands: list[list[str]] = []
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            break  # the client is gone
        word, _, arg = line.decode(errors="replace").strip().partition(" ")
        try:
            if word == "done":
                return 0
            if word == "grace":
                grace = float(arg)
            elif word == "pgid":
                groups.add(int(arg))
            elif word == "forget":
                groups.discard(int(arg))
            elif word == "mark" and arg:
                marks.append(arg)
            elif word == "cmd":
                import json

                commands.append([str(a) for a in json.loads(arg)])
        except ValueError:
            continue
    import subprocess
    import time

    for pgid in groups:
        stop_group(pgid, signal.SIGTERM)
    for prefix in marks:
        kill_marked(prefix, signal.SIGTERM)
        kill_marked(prefix, signal.SIGCONT)
    for argv in commands:  # (during the grace period: a batch job's qdel, a secret file's rm)
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and (any(group_alive(g) for g in groups) or any(marked(m) for m in marks)):
        time.sleep(0.05)
    for pgid in groups:
        signal_group(pgid, signal.SIGKILL)
    for prefix in marks:
        kill_marked(prefix)
    return 0


class Client:
    """The starting side: one watchdog process, told about every group as soon as it exists.

    A watchdog that cannot start (no Python at the expected path) leaves the client working
    without one: the groups are then stopped only by the normal teardown.
    """

    def __init__(self, grace: float, python: str = "") -> None:
        import subprocess
        import threading

        from . import command  # (the package's __init__: where node programs are)

        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self.pid: Optional[int] = None
        try:
            self._proc = subprocess.Popen(
                command("watchdog", python), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        except OSError:
            return
        self.pid = self._proc.pid
        self._send(f"grace {max(1.0, grace)}")

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.stdin is None:
                return
            try:
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass

    def watch(self, pgid: int) -> None:
        """Kill group ``pgid`` if the client dies."""
        self._send(f"pgid {pgid}")

    def forget(self, pgid: int) -> None:
        self._send(f"forget {pgid}")

    def mark(self, prefix: str) -> None:
        """Also stop every process whose ``PSLAUNCH_PROCESS`` starts with ``prefix`` if the client dies."""
        self._send(f"mark {prefix}")

    def on_abandon(self, argv: Sequence[str]) -> None:
        """Run ``argv`` if the client dies (for batch jobs: cancel them)."""
        import json

        self._send("cmd " + json.dumps(list(argv)))

    def close(self, wait: bool = False) -> None:
        """Normal end: the watchdog reads ``done`` and exits without touching anything.

        Not waited for unless ``wait`` (the launcher's exit would pay the watchdog's start-up
        time); the ``done`` line stays in the pipe until the watchdog reads it.
        """
        self._send("done")
        proc = self._proc
        if proc is None:
            return
        try:
            assert proc.stdin is not None
            proc.stdin.close()
        except OSError:
            pass
        if wait:
            if not _ended_within(proc, 5.0):
                proc.kill()
            proc.wait()
        else:
            proc.poll()


def _ended_within(proc: subprocess.Popen, seconds: float) -> bool:
    """Whether child ``proc`` ends within ``seconds``, told the moment it does by a pidfd
    (``Popen.wait(timeout)`` sleeps in growing steps, up to 50 ms past the exit)."""
    import os
    import select
    import subprocess

    try:
        pidfd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):  # no pidfds (Linux < 5.3)
        try:
            proc.wait(timeout=seconds)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([pidfd], [], [], seconds)[0])
    finally:
        os.close(pidfd)
