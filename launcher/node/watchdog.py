# ruff: noqa: UP004, UP031 - Python 3.5 syntax: an ssh host's wrapper forks one (:mod:`.agent`)
"""The dead-man switch: kills a job's process groups if the program that started them dies.

:class:`Client` starts this module as a separate process (its own session, stdin a pipe from
the client) before it starts anything else, and tells it about every process group it creates.
If the pipe reaches EOF without a ``done`` line, the client is gone (``kill -9``, a crash): the
watchdog sends SIGTERM to every group, runs the registered cleanup commands (``qdel``-style,
removing files that hold the job's secret), waits the rest of the grace period, sends SIGKILL
to what is left, and exits. The launcher uses
one for every local process group; the node agent (:mod:`.agent`) uses one for its command.

Protocol, one line each: ``grace SECONDS``, ``pgid N``, ``forget N``, ``mark MARKER`` (also stop
every process whose ``PSLAUNCH_PROCESS`` is MARKER, or is under it when it ends in ``/``: what
left its group with ``setsid()``), ``cmd JSON-ARGV``, ``remove GLOB`` (once everything is killed, remove what it
matches: what a killed process could not), ``done``. Standard library only.
"""

import os
import signal
import sys

from .procgroup import WATCHDOG_NAME, group_alive, kill_marked, marked, signal_group, stop_group

# The watchdog process starts with every job, and a job that ends at once waits for it: what
# only some commands need (json, subprocess, threading, ...) is imported where it is used.
# Python 3.5 syntax (types in comments): the ssh wrapper forks one on a host's own python3.
MYPY = False
if MYPY:  # (typing's TYPE_CHECKING is Python 3.5.2)
    import subprocess  # noqa: F401 - (named in the type comments)
    from typing import IO, BinaryIO, List, Optional, Sequence, Set, Tuple  # noqa: F401


def main(stdin=None):
    # type: (Optional[BinaryIO]) -> int
    """The watchdog process: read commands from ``stdin`` (default: standard input) until ``done`` or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    grace = 10.0
    groups = set()  # type: Set[int]
    marks = []  # type: List[str]
    commands = []  # type: List[List[str]]
    removals = []  # type: List[str]
    empty_dirs = []  # type: List[str]
    stdin = sys.stdin.buffer if stdin is None else stdin
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
            elif word == "remove" and arg:
                removals.append(arg)
            elif word == "rmdir" and arg:
                empty_dirs.append(arg)
            elif word == "mark" and arg:
                marks.append(arg)
            elif word == "cmd":
                import json

                commands.append([str(a) for a in json.loads(arg)])
        except ValueError:
            continue
    import subprocess  # noqa: F401 - (named in the type comments)
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
    remove_matching(removals)
    for path in empty_dirs:  # (after the removals, which may have emptied them)
        try:
            os.rmdir(path)
        except OSError:
            pass
    return 0


def remove_matching(patterns):
    # type: (Sequence[str]) -> List[str]
    """Remove the files and directories that the glob ``patterns`` match, and each one's parent
    directory once it is empty; returns what was removed."""
    import glob
    import os
    import shutil

    removed = []
    for pattern in patterns:
        for path in glob.glob(pattern):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    continue
            removed.append(path)
            try:
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass
    return removed


class Client(object):
    """The starting side: one watchdog process, told about every group as soon as it exists.

    ``fork``: the watchdog is a fork of this process (no second interpreter to start: 10 ms of
    a core, on a 2-core machine, that the job's own start-up would wait for) while this process
    runs no other thread (the launcher, before its job starts); else ``python`` (default: this
    one) runs this module. A watchdog that cannot start leaves the client working without
    one: the groups are then stopped only by the normal teardown.
    """

    def __init__(self, grace, python="", fork=False):
        # type: (float, str, bool) -> None
        import threading

        self._lock = threading.Lock()
        self._stdin = None  # type: Optional[IO[bytes]]
        self._proc = None  # type: Optional[subprocess.Popen[bytes]]  # (a started one; a fork has only its pid)
        self.pid = None  # type: Optional[int]
        try:
            if fork and threading.active_count() == 1:
                self.pid, self._stdin = _fork()
            else:
                self._proc = _start(python)
                self.pid, self._stdin = self._proc.pid, self._proc.stdin
        except OSError:
            return
        self._send("grace %r" % max(1.0, grace))

    def _send(self, line):
        # type: (str) -> None
        with self._lock:
            if self._stdin is None:
                return
            try:
                self._stdin.write(line.encode() + b"\n")
                self._stdin.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass

    def watch(self, pgid):
        # type: (int) -> None
        """Kill group ``pgid`` if the client dies."""
        self._send("pgid %d" % pgid)

    def forget(self, pgid):
        # type: (int) -> None
        self._send("forget %d" % pgid)

    def mark(self, prefix):
        # type: (str) -> None
        """Also stop every process whose ``PSLAUNCH_PROCESS`` starts with ``prefix`` if the client dies."""
        self._send("mark %s" % prefix)

    def on_abandon(self, argv):
        # type: (Sequence[str]) -> None
        """Run ``argv`` if the client dies (for batch jobs: cancel them)."""
        import json

        self._send("cmd " + json.dumps(list(argv)))

    def remove_after_kill(self, pattern):
        # type: (str) -> None
        """If the client dies, remove what the glob ``pattern`` matches once every process is
        killed (what they leave behind when killed), and its parent directory once empty."""
        self._send("remove " + pattern.replace("\n", " "))

    def remove_dir_after_kill(self, path):
        # type: (str) -> None
        """If the client dies, remove the directory ``path`` once every process is killed and the
        :meth:`remove_after_kill` patterns are removed, if it is empty by then."""
        self._send("rmdir " + path.replace("\n", " "))

    def close(self, wait=False):
        # type: (bool) -> None
        """Normal end: the watchdog reads ``done`` and exits without touching anything.

        A started watchdog is not waited for unless ``wait`` (the launcher's exit would pay its
        start-up time; the ``done`` line stays in the pipe until it reads it, and ``subprocess``
        reaps it later). A forked one is always waited for: it has nothing to start, and nothing
        else would reap it.
        """
        self._send("done")
        with self._lock:
            stdin, self._stdin = self._stdin, None
        if stdin is None or self.pid is None:
            return
        try:
            stdin.close()
        except OSError:
            pass
        if self._proc is not None and not wait:
            self._proc.poll()
            return
        import os

        if not _ended_within(self.pid, 5.0):
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass
        if self._proc is not None:
            self._proc.wait()
            return
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


def _start(python):
    # type: (str) -> subprocess.Popen[bytes]
    """This module as a program of ``python``, in its own session, reading its stdin."""
    import subprocess  # noqa: F401 - (named in the type comments)

    from . import command  # (the package's __init__: where node programs are)

    env = dict(os.environ)
    env[WATCHDOG_NAME] = str(os.getpid())  # (a subreaper's sweep leaves it to finish: procgroup.is_watchdog)
    return subprocess.Popen(command("watchdog", python), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True, env=env)


def _fork():
    # type: () -> Tuple[int, BinaryIO]
    """A fork of this process that runs :func:`main` in its own session: (pid, its stdin).

    The child keeps nothing of its parent's but the read end of the pipe: every other descriptor
    is closed (it would hold the parent's output pipes open after the parent ended), stdout and
    stderr go to ``/dev/null``, and each signal that the parent may catch is back to its default.
    It leaves with ``os._exit``: no parent's ``atexit``, buffers or ``finally`` run twice.
    """
    import os

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child; tests see what it does)
        code = 1
        try:
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(r, 0)
            os.dup2(null, 1)
            os.dup2(null, 2)
            os.closerange(3, _max_fd())
            for signum in (signal.SIGTERM, signal.SIGQUIT, signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2,
                           signal.SIGCHLD, signal.SIGPIPE):
                signal.signal(signum, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, ())
            code = main(os.fdopen(0, "rb"))
        finally:
            os._exit(code)
    os.close(r)
    return pid, os.fdopen(w, "wb")


def _max_fd():
    # type: () -> int
    import os

    try:
        return int(os.sysconf("SC_OPEN_MAX"))
    except (OSError, ValueError):
        return 65536


def _ended_within(pid, seconds):
    # type: (int, float) -> bool
    """Whether child ``pid`` ends within ``seconds``, told the moment it does by a pidfd (a wait
    in steps would sleep past the exit); not reaped."""
    import os
    import select
    import time

    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):  # no pidfds (Linux < 5.3): look every 10 ms
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True
            except ChildProcessError:
                return True
            time.sleep(0.01)
        return False
    try:
        return bool(select.select([pidfd], [], [], seconds)[0])
    finally:
        os.close(pidfd)
