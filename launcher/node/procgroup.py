# ruff: noqa: UP004, UP031
"""Process groups and programs: the one copy that the launcher and every node program share.

Every process a job starts is the leader of its own session and process group, so signalling
the group reaches whatever it started (unless that called ``setsid()`` itself: see
:func:`become_subreaper` and :func:`kill_children`). Standard library only, Python 3.5 syntax:
the node agent imports this module on ssh hosts with an old ``python3``.
"""

import collections
import os
import shutil
import signal
import time

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def signal_group(pgid, sig):
    """Send ``sig`` to process group ``pgid``; a group that is gone (or not ours) is no error.

    Never ``pgid`` 0 (the caller's own group) or 1, and never -1 (every process of the user).
    """
    if pgid > 1:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_group(pgid, sig=signal.SIGTERM):
    """Ask group ``pgid`` to stop: ``sig`` (SIGTERM), then SIGCONT, so that a stopped process (SIGSTOP,
    a debugger, Ctrl-Z) gets the signal now instead of when someone resumes it."""
    signal_group(pgid, sig)
    signal_group(pgid, signal.SIGCONT)


def group_alive(pgid):
    """True while any process of group ``pgid`` exists (zombies included)."""
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def exit_status(pid):
    """The exit code of child ``pid`` once it has ended (128+N: killed by signal N), else None.

    Does not reap it: while the zombie exists its pid, which is also its group's id, cannot be
    reused, so signalling the group later can never hit a stranger.
    """
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return 128 + signal.SIGKILL
    if info is None or info.si_pid == 0:
        return None
    if info.si_code == os.CLD_EXITED:
        return info.si_status
    return 128 + info.si_status


def resolve_program(argv0, environ, cwd=None):
    """dmlc's rule: a bare name that is not on ``PATH`` but is an executable in ``cwd`` runs as ``./name``."""
    if "/" in argv0 or shutil.which(argv0, path=environ.get("PATH", os.defpath)):
        return argv0
    local = os.path.join(cwd or os.getcwd(), argv0)
    if os.path.isfile(local) and os.access(local, os.X_OK):
        return "./" + argv0
    return argv0


def _libc_prctl():
    """Linux's ``prctl`` function, or None where it is not available."""
    try:
        import ctypes  # (here: the node programs that import this module seldom need it)

        return ctypes.CDLL(None, use_errno=True).prctl  # the C library is loaded already
    except (OSError, AttributeError):
        return None


def _prctl(option, value):
    """Linux ``prctl(option, value)``; False where it is not available."""
    prctl = _libc_prctl()
    return prctl is not None and prctl(option, int(value), 0, 0, 0) == 0


def set_parent_death_signal(sig):
    """Linux: this process gets ``sig`` when its parent dies."""
    return _prctl(_PR_SET_PDEATHSIG, sig)


def parent_death_signal(sig):
    """A ``preexec_fn`` that does :func:`set_parent_death_signal` in the child: it gets ``sig`` when
    the thread that started it ends. ``prctl`` is looked up now: nothing is looked up between fork
    and exec."""
    prctl, sig = _libc_prctl(), int(sig)

    def set_it():
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    return set_it


def single_threaded():
    """Whether this process runs one thread only (Linux: ``/proc/self/task``; elsewhere, say no).

    Code between fork and exec (a ``preexec_fn``) is safe only then: another thread may hold a
    lock (the C library's, Python's) that the child would wait on for ever.
    """
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def become_subreaper():
    """Linux: orphaned descendants of this process are re-parented to it, not to init.

    A program that calls ``setsid()`` or double-forks leaves its process group; as our
    child it can still be found (:func:`children`) and stopped.
    """
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


class ProcStat(collections.namedtuple("ProcStat", "pid state ppid pgid start ticks rss")):
    """What pslaunch reads of one process's ``/proc/<pid>/stat``: ``pid``, ``state`` (a letter:
    ``R``, ``S``, ``Z`` for a zombie...), ``ppid``, ``pgid``, ``start`` (its start time, in
    clock ticks after boot: with the pid, it names one process for good), ``ticks`` (the CPU time
    it used so far, user and system, in clock ticks) and ``rss`` (its resident pages)."""

    __slots__ = ()

    @property
    def alive(self):
        """Running or asleep or stopped: not a zombie, not dead."""
        return self.state not in ("Z", "X")


def stat(pid):
    """Process ``pid``'s :class:`ProcStat`; None when it is gone (or there is no ``/proc``).

    The line is ``pid (comm) state ppid pgrp session ...`` with utime, stime the 14th and 15th
    fields, the start time the 22nd and rss the 24th; ``comm`` (the program's name, up to 15
    bytes) may hold spaces and parentheses, so the fields are counted from the last ``)``.
    """
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            line = f.read()
    except OSError:
        return None
    fields = line[line.rfind(b")") + 2:].split()
    try:
        return ProcStat(pid, fields[0].decode("ascii"), int(fields[1]), int(fields[2]), int(fields[19]),
                        int(fields[11]) + int(fields[12]), int(fields[21]))
    except (IndexError, ValueError):
        return None


def scan():
    """The :class:`ProcStat` of every process in ``/proc``, zombies included; None without ``/proc``."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    found = []
    for entry in entries:
        if entry.isdigit():
            st = stat(int(entry))
            if st is not None:
                found.append(st)
    return found


def _children_of(pid):
    """The pids of ``pid``'s children, forked by any of its threads (``/proc/<pid>/task/*/children``)."""
    found = []
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return found
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/children" % (pid, tid), "rb") as f:
                found.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            pass  # (the thread ended)
    return found


def tree(root):
    """The :class:`ProcStat` of ``root`` and of every descendant of it, zombies included; None where
    the kernel has no ``children`` files (Linux before 3.5, or without ``CONFIG_PROC_CHILDREN``).

    For a subreaper (a node agent, the launcher) that is everything it runs, orphans re-parented
    to it included, at the cost of the job's own processes instead of all of ``/proc``'s.
    """
    if not os.path.exists("/proc/%d/task/%d/children" % (root, root)):
        return None
    found, seen, todo = [], set(), [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        st = stat(pid)
        if st is not None:
            found.append(st)
            todo.extend(_children_of(pid))
    return found


def _sysconf(name, default):
    try:
        value = os.sysconf(name)
    except (ValueError, OSError, AttributeError):
        return default
    return value if value > 0 else default


class UsageMeter(object):
    """The CPU use and resident memory of process trees, from one pass over ``/proc`` per look.

    :meth:`look` reads the ``stat`` of every process under a root once (:func:`tree`; every process
    of ``/proc`` where the kernel cannot list children), however many trees are asked about
    (``docs/architecture.md``, *Usage*, has the cost). :meth:`usage` sums over the
    process group a leader leads and every descendant of its members (``sh -c``, a program that
    forks data loaders, one that left the group but not its parent): CPU as percent of one core
    between the last two looks (utime + stime; a process that started in between counts whole,
    one that ended in between loses its last slice), RSS in bytes at the last look (pages that
    forked processes share count once per process, as ``top``'s RES does). Not thread-safe.
    """

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.hertz = float(_sysconf("SC_CLK_TCK", 100))
        self.page = _sysconf("SC_PAGE_SIZE", 4096)
        self.looked = None  # when the last look was (the clock's time), or None
        self._before = None  # (when, {(pid, start): ticks}) of the look before the last
        self._last = None  # (when, {(pid, start): ticks}, {pgid: [ProcStat]}, {ppid: [ProcStat]})

    def look(self, root=None):
        """Read ``/proc`` once: the tree under ``root`` (:func:`tree`: a subreaper passes its own
        pid), or where that cannot be read, or without ``root``, every process. False without ``/proc``."""
        procs = tree(root) if root is not None else None
        if procs is None:
            procs = scan()
        now = self.clock()
        if procs is None:
            self._before = self._last = self.looked = None
            return False
        ticks, by_group, by_parent = {}, {}, {}
        for p in procs:
            ticks[(p.pid, p.start)] = p.ticks
            by_group.setdefault(p.pgid, []).append(p)
            by_parent.setdefault(p.ppid, []).append(p)
        self._before = (self._last[0], self._last[1]) if self._last is not None else None
        self._last = (now, ticks, by_group, by_parent)
        self.looked = now
        return True

    def usage(self, leader):
        """``(CPU percent of one core, RSS bytes)`` of the tree of group ``leader`` between the last
        two looks; None before the second look, or when the leader is gone, a zombie or leaving
        (no memory left)."""
        if self._before is None or self._last is None:
            return None
        then, old = self._before
        now, _, by_group, by_parent = self._last
        members = list(by_group.get(leader, ()))
        if now <= then or not any(p.pid == leader and p.alive for p in members):
            return None
        seen = set(p.pid for p in members)
        todo = list(members)
        while todo:
            for child in by_parent.get(todo.pop().pid, ()):
                if child.pid not in seen:
                    seen.add(child.pid)
                    members.append(child)
                    todo.append(child)
        used = sum(max(0, p.ticks - old.get((p.pid, p.start), 0)) for p in members)
        rss = sum(p.rss for p in members if p.alive)
        if not rss:  # (the leader is leaving: its memory already given back, no sample worth sending)
            return None
        return (used / self.hertz / (now - then) * 100.0, rss * self.page)


def children(pid=None):
    """The pids of the live (non-zombie) children of ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return [p.pid for p in scan() or () if p.ppid == pid and p.alive]


def has_children():
    """False when this process has no child at all, running or ended (``waitid`` says so
    without a scan of ``/proc`` and without reaping anything)."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    except (AttributeError, OSError):  # no waitid here: assume there may be
        return True
    return True


def kill_children(sig=signal.SIGKILL, keep=()):
    """Signal the group of every live child of this process (and the child itself), except ``keep``.

    For a subreaper this reaches every descendant that escaped its group: each is our child
    now, or a descendant of one. Repeats until no child is left to signal (a dying child's own
    children are re-parented to us in turn); returns how many processes were signalled.
    """
    signalled = set()
    for _ in range(50):
        pids = [p for p in children() if p not in keep and p not in signalled and not is_watchdog(p)]
        if not pids:
            break
        for p in pids:
            signalled.add(p)
            _signal_with_group(p, sig)
        _reap_any()
    return len(signalled)


#: in the environment of a node program's watchdog (launcher.node.watchdog): the client's pid
WATCHDOG_NAME = "PSLAUNCH_WATCHDOG_OF"


def is_watchdog(pid):
    """Whether ``pid`` is the watchdog of a node program (a node agent's), which
    :func:`kill_children` leaves alone: once its client is gone it stops the client's processes,
    removes the client's files (an agent's error files) and exits by itself, within its grace.
    An agent killed by mpirun leaves its watchdog to a subreaper launcher, whose sweep would
    otherwise kill it before its clean-up."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            return (b"\0" + WATCHDOG_NAME.encode() + b"=") in b"\0" + f.read()
    except (OSError, ValueError):
        return False


MARK_NAME = "PSLAUNCH_PROCESS"  # (pscontract.PROCESS: spelled here too, this file is Python 3.5 syntax)


def marked(prefix):
    """The pids of live processes whose environment has ``PSLAUNCH_PROCESS=<prefix>``: exactly
    that process's marker, or with a ``prefix`` that ends in ``/`` (``<job id>/``) any under it.

    Every process of a job has its ``PSLAUNCH_PROCESS`` (``<job id>/<process>``), and so has
    everything it starts, however it detaches: a grandchild that called ``setsid()`` or
    double-forked is found here, wherever it was re-parented to. (Worker 1's marker is a prefix
    of worker 10's: only a whole marker may stop one process's descendants.)
    """
    needle = ("%s=%s" % (MARK_NAME, prefix)).encode()
    under = prefix.endswith("/")
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    me = os.getpid()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open("/proc/%s/environ" % entry, "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if any(v.startswith(needle) if under else v == needle for v in environ.split(b"\0")):
            st = stat(int(entry))
            if st is not None and st.alive:
                found.append(st.pid)
    return found


def kill_marked(prefix, sig=signal.SIGKILL):
    """Signal every live process of :func:`marked` ``prefix``, and its group; the number signalled."""
    pids = marked(prefix)
    for pid in pids:
        _signal_with_group(pid, sig)
    return len(pids)


def _signal_with_group(pid, sig):
    """``sig`` to ``pid`` and to its process group (unless that group is ours)."""
    try:
        pgid = os.getpgid(pid)
    except OSError:
        pgid = 0
    if pgid > 1 and pgid != os.getpgid(0):
        signal_group(pgid, sig)
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def _reap_any():
    """Reap every child that has ended (a subreaper inherits zombies it must collect)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
