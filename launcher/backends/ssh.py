"""The ssh backend: servers and workers on the hostfile's hosts, over paramiko.

Lifecycle (driven by the supervisor, see :mod:`launcher.backends.base`):

1. :meth:`SSHBackend.prepare`: resolve each host that gets a process through
   ``~/.ssh/config`` (:func:`launcher.transport.ssh.resolve_target`), connect to
   all of them in parallel (bounded fan-out, retries, strict host keys), then
   per host and in parallel start the host's wrapper: one session channel on
   its connection runs :func:`wrapper_command` (a few lines of Python that read
   the node bundle from stdin and run ``launcher.node.ssh_wrapper`` from memory;
   nothing is installed). Through the wrapper, work out ``DMLC_NODE_HOST`` (the
   interface ``DMLC_INTERFACE`` selects there; without it, the address the
   connection reached) and, with ``--sync-dst-dir``, copy the working directory
   (:mod:`launcher.transport.wiresync`: what differs in size or mtime).
2. :meth:`SSHBackend.start`: the argv, environment and working directory of every
   process of a host go to its waiting wrapper as one frame (:func:`header_frame`),
   so no value ever appears on a command line. The wrapper (a node agent) starts each
   process in its own process group and reports it in frames
   (``launcher.node.protocol``, transport a), which go to the process's handle
   (:class:`SSHProcess`, a :class:`~launcher.runtime.remote.RemoteProcess`). One login
   shell and one Python per host, however many processes it runs and whatever it syncs.
3. Supervision: the launcher sends a keep-alive to every host's wrapper each
   ``--ssh-keepalive`` seconds and the wrapper answers. A host silent for
   :data:`LOST_FACTOR` intervals is *lost*: its processes count as failed
   (exit code 255) and the job stops; the wrapper there stops its process
   groups on its own when the keep-alives stop reaching it.
4. Teardown: ``X`` frames ask a host's wrapper to send ``TERM`` (with ``CONT``) to
   the processes' groups, ``KILL`` after ``--kill-grace``; then the wrapper's stdin
   is closed and it kills what is left of every group (and what left them). If the
   launcher dies (``kill -9``), sshd closes the channel and the wrapper does the same.
   Only a start that failed half-way sends ``kill`` as a shell command
   (:func:`kill_command`).

Every remote command line is built by a pure function (:func:`wrapper_command`,
:func:`kill_command`) with every argument ``shlex``-quoted.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import getpass
import json
import logging
import os
import queue
import shlex
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import pscontract as pc
from pscontract import netif

from .. import node
from ..errors import ConfigError, LauncherError, LaunchError
from ..node import protocol
from ..node.protocol import BOOTSTRAP, NODE, blob, frame
from ..node.watchdog import Client as Watchdog
from ..runtime.handle import ProcGroup
from ..runtime.output import Console, ProcOutput
from ..runtime.remote import RemoteProcess
from ..spec import network
from ..spec.job import Host, JobSpec
from ..spec.plan import Plan, ProcSpec, place
from ..transport.options import SSHOptions
from ..transport.ssh import (
    HostSession,
    SSHConnectError,
    Target,
    connect_all,
    require_paramiko,
    resolve_targets,
    send_patiently,
)
from ..transport.sync import SyncPlan, plan_sync, size_text
from ..transport.wiresync import SyncStats, TreeSync
from .base import Backend, BackendOption

if TYPE_CHECKING:  # (an optional dependency, imported where it is used)
    import paramiko

log = logging.getLogger(__name__)

REMOTE_PYTHON = "python3"
LOST_FACTOR = 4  # a host is lost after this many keep-alive intervals without a reply
EXIT_LOST = 255  # ssh's own code for "the connection failed"
_PING = frame(protocol.PING, NODE)
_ANSWERS = (protocol.IFACE_ANSWER, protocol.SYNC_ANSWER, protocol.DONE_ANSWER)
#: The longest answer a host may send when no request waits for it, or to a request without data
#: (``i``, ``d``); an ``s`` answer lists some of the request's paths, so it may take twice the
#: request's bytes (JSON's escapes) plus this.
ANSWER_MIN = 64 * 1024
#: What a host may print before its wrapper's first frame (a login shell's rc files, a banner): more
#: drops the host. Of that, and of the wrapper's stderr, at most SHOWN_LINES lines of at most
#: SHOWN_WIDTH characters are shown, then one line says how many more were not.
PREAMBLE_MAX = 1 << 20
SHOWN_LINES = 20
SHOWN_WIDTH = 500


# --- pure builders (golden-tested) -----------------------------------------------------------


def bootstrap_command(python: str = REMOTE_PYTHON) -> str:
    """``python -S -c BOOTSTRAP``: runs the node program of the bundle that follows on stdin
    (``launcher.node.protocol``, transport a); nothing job-specific."""
    return f"{shlex.quote(python)} -S -c {shlex.quote(BOOTSTRAP)}"


def wrapper_command(python: str = REMOTE_PYTHON) -> str:
    """The remote command of a host's wrapper channel: the bootstrap, nothing job-specific."""
    return f"exec {bootstrap_command(python)}"


def wrapper_header(procs: Sequence[tuple[int, ProcSpec]], cwd: Optional[str], keepalive: float,
                   grace: float, usage: bool = False) -> dict:
    """What the wrapper needs to start a host's processes (``(id, proc)`` pairs, in start order);
    with ``usage``, it reports their CPU and RSS (``u`` frames).

    Sent on the channel's stdin, never on a command line.
    """
    header = {"procs": [{"id": i, "argv": list(p.argv), "env": dict(p.env), "cwd": cwd} for i, p in procs],
              "keepalive": keepalive, "lost_after": LOST_FACTOR * keepalive, "grace": grace}
    if usage:
        header["usage"] = protocol.USAGE_INTERVAL
    return header


def wrapper_preamble(bundle: Optional[bytes] = None) -> bytes:
    """The bytes written first to a wrapper channel's stdin: the loader and the node bundle
    (``launcher.node.protocol``, transport a); requests and the header follow as frames."""
    if bundle is None:
        return _default_preamble()
    with open(node.path("ssh_loader"), "rb") as f:
        loader = f.read()
    return blob(loader) + blob(bundle)


@functools.lru_cache(maxsize=1)
def _default_preamble() -> bytes:
    """This installation's preamble, built once (every host gets the same)."""
    return wrapper_preamble(node.bundle("ssh_wrapper"))


def header_frame(header: Mapping) -> bytes:
    """The ``H`` frame: the processes start."""
    return frame(protocol.HEADER, NODE, json.dumps(header, separators=(",", ":")).encode("utf-8"))


def wrapper_payload(header: Mapping, bundle: Optional[bytes] = None) -> bytes:
    """Everything a wrapper needs to start processes at once: preamble, then header."""
    return wrapper_preamble(bundle) + header_frame(header)


def kill_command(signame: str, pgids: Sequence[int]) -> str:
    """``kill -s SIG -- -PGID ...`` for every process group; never a pgid below 2.

    ``-1`` would signal every process of the user and ``-0`` the shell's own group.
    """
    if signame not in ("TERM", "KILL", "ABRT", "INT"):
        raise ValueError(f"unexpected signal {signame!r}")
    groups = sorted({int(p) for p in pgids if int(p) > 1})
    if not groups:
        raise ValueError("no process group to signal")
    targets = " ".join(f"-{g}" for g in groups)
    if signame in ("TERM", "INT"):  # and SIGCONT: a stopped process gets it now, not when resumed
        return f"kill -s {signame} -- {targets} 2>/dev/null; kill -s CONT -- {targets} 2>/dev/null; exit 0"
    return f"kill -s {signame} -- {targets} 2>/dev/null; exit 0"


def hosts_with_processes(spec: JobSpec) -> list[Host]:
    """The hostfile lines that get at least one process, in hostfile order."""
    used = {s.host for s in place(spec.num_workers, spec.num_servers, spec.hosts)}
    return [h for h in spec.hosts if h in used]


def _basic_target(host: Host, opts: SSHOptions) -> Target:
    """A target without ``~/.ssh/config`` (dry runs must not need paramiko)."""
    return Target(host=host, hostname=host.name, port=host.port or opts.port or 22,
                  user=host.user or opts.user or _local_user(),
                  key_files=(opts.key,) if opts.key else ())


def _local_user() -> str:
    return getpass.getuser()


# --- one host at run time --------------------------------------------------------------------


class KeepaliveTicker:
    """One thread that pings every connected host's wrapper at the host's interval and checks that
    it answers, instead of a thread per host (a job on 64 hosts held 64 such threads, asleep).

    A host takes part from :meth:`add` until its :meth:`RemoteHost.keepalive_tick` returns False
    (its channel ended or the host closed); the thread ends when no host is left and starts again
    with the next :meth:`add`. A tick never waits for a host (see :meth:`RemoteHost.keepalive_tick`),
    so one stalled host does not delay the others' pings or checks.
    """

    def __init__(self, name: str = "pslaunch-keepalive") -> None:
        self.name = name
        self._due: dict[int, tuple[float, Any]] = {}  # id(host) -> (next tick, host)
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def add(self, host: Any) -> None:
        """Tick ``host`` (anything with ``interval`` and ``keepalive_tick()``) from one interval on."""
        with self._cond:
            self._due[id(host)] = (time.monotonic() + host.interval, host)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, host: Any) -> None:
        with self._cond:
            self._due.pop(id(host), None)
            self._cond.notify()

    @property
    def hosts(self) -> int:
        """How many hosts are ticked now."""
        with self._cond:
            return len(self._due)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if not self._due:
                        self._thread = None
                        return
                    now = time.monotonic()
                    due = [(key, host) for key, (at, host) in self._due.items() if at <= now]
                    if due:
                        break
                    self._cond.wait(min(at for at, _ in self._due.values()) - now)
            for key, host in due:
                try:
                    keep = host.keepalive_tick()
                except Exception:  # noqa: BLE001 - one host's failure must not stop the others' keep-alives
                    log.debug("keep-alive of %s failed", getattr(host, "label", host), exc_info=True)
                    keep = True
                with self._cond:
                    if key in self._due:
                        if keep:
                            self._due[key] = (time.monotonic() + host.interval, host)
                        else:
                            del self._due[key]


#: the keep-alives of every host of every ssh job of this process
KEEPALIVES = KeepaliveTicker()


class RemoteHost:
    """A connected host: its session, its wrapper channel, keep-alives and the signal queue."""

    def __init__(self, session: HostSession, spec: JobSpec) -> None:
        self.session = session
        self.spec = spec
        self.label = session.label
        self.node_address: Optional[str] = None
        self.interface: Optional[str] = None  # the interface DMLC_INTERFACE selects there, by name
        self.workdir: Optional[str] = spec.workdir
        self.procs: list[SSHProcess] = []
        self.chan: Optional[paramiko.Channel] = None
        self.closed = False  # the wrapper channel ended (or we closed it)
        self.last_heard = time.monotonic()
        self.lost = False
        self.lost_reason = ""
        self.interval = max(0.1, spec.options.keepalive)
        self.lost_after = LOST_FACTOR * self.interval
        self._stall_limit = max(self.lost_after, 30.0)  # a frame the host takes none of for this long fails
        self._stop = threading.Event()
        self._signals: queue.Queue[Optional[tuple[str, list[SSHProcess]]]] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._signaled = False  # the signal thread runs
        self._lock = threading.Lock()
        self._cleaned: set[int] = set()
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=5)
        self._by_id: dict[int, SSHProcess] = {}
        self._replies: queue.Queue[tuple[bytes, dict]] = queue.Queue()  # the wrapper's answers (i, s, d)
        self._send_lock = threading.Lock()
        # what the wrapper says; an answer is accepted at its request's length (request())
        self._decoder = protocol.Decoder(protocol.MAX_FROM_NODE, marker=protocol.MAGIC,
                                         limits=dict.fromkeys(_ANSWERS, ANSWER_MIN), on_drop=self._dropped)
        self._preamble = 0  # bytes printed before the wrapper's first frame
        self._framing = False  # the wrapper's first frame came
        self._shown = 0  # lines of the host's own text shown (before the frames, the wrapper's stderr)
        self._hidden = 0  # ... and not shown
        self.refused = ""  # why the host was dropped for what it sent

    # -- the wrapper channel ------------------------------------------------------------

    def open(self) -> None:
        """Start the wrapper (the login shell, ``python3``, the node bundle) and read what it says;
        it waits for requests (:meth:`request`) and then the processes (:meth:`launch`)."""
        import paramiko

        chan = self.session.open_channel()
        self.chan = chan
        try:
            chan.settimeout(0.5)
            chan.exec_command(wrapper_command())
            send_patiently(chan, wrapper_preamble(), self._stall_limit, lambda: self.closed)
        except (paramiko.SSHException, EOFError, OSError) as e:
            self.closed = True
            chan.close()
            raise LaunchError(f"{self.label}: cannot start pslaunch's remote wrapper: {e}") from None
        self.last_heard = time.monotonic()
        self._start_thread(self._read, "reader")

    def send(self, kind: bytes, payload: bytes = b"") -> None:
        """One frame about the host to the wrapper."""
        self.send_bytes(frame(kind, NODE, payload))

    def send_bytes(self, data: bytes) -> None:
        """Frames to the wrapper."""
        import paramiko

        chan = self.chan
        if chan is None or self.closed:
            raise LaunchError(self._gone_text())
        try:
            with self._send_lock:
                send_patiently(chan, data, self._stall_limit, lambda: self.closed)
        except (paramiko.SSHException, EOFError, OSError) as e:
            # (a host dropped for what it sent may close the channel under this write: say why)
            raise LaunchError(self.refused or f"{self.label}: the connection to pslaunch's remote wrapper "
                              f"failed: {e or type(e).__name__}") from None

    def request(self, kind: bytes, payload: bytes, reply: bytes, timeout: float = 600.0) -> dict:
        """Send a frame and wait for the wrapper's JSON answer of kind ``reply`` (at most twice the
        request's length plus :data:`ANSWER_MIN` bytes)."""
        self._decoder.limits[reply] = min(protocol.MAX_ANSWER, 2 * len(payload) + ANSWER_MIN)
        try:
            self.send(kind, payload)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    got, doc = self._replies.get(timeout=0.2)
                except queue.Empty:
                    if self.closed:
                        raise LaunchError(self._gone_text()) from None
                    if time.monotonic() > deadline:
                        raise LaunchError(f"{self.label}: pslaunch's remote wrapper did not answer within "
                                          f"{timeout:g}s") from None
                    continue
                if got == reply:
                    return doc
        finally:
            self._decoder.limits[reply] = ANSWER_MIN

    def _gone_text(self) -> str:
        if self.refused:
            return self.refused
        tail = f": {self._stderr_tail[-1]}" if self._stderr_tail else ""
        return (f"pslaunch's remote wrapper on {self.label} ended{tail}; the ssh backend needs python3 >= 3.5 "
                "on every host")

    def launch(self, procs: Sequence[SSHProcess]) -> None:
        """Hand the wrapper ``procs`` (returns at once; pids arrive as frames)."""
        if self.chan is None:
            self.open()
        self.procs.extend(procs)
        self._by_id.update((p.ident, p) for p in procs)
        header = wrapper_header([(p.ident, p.proc) for p in procs], self.workdir, self.interval,
                                self.spec.kill_grace, self.spec.wants_usage)
        try:
            self.send_bytes(header_frame(header))
        except LaunchError as e:
            raise LaunchError(f"{self.label}: cannot start pslaunch's remote wrapper: {e}") from None
        self.last_heard = time.monotonic()
        KEEPALIVES.add(self)  # (one thread for every host; the signal thread starts with the first signal)

    def _start_thread(self, target: Callable[[], object], name: str) -> None:
        t = threading.Thread(target=target, name=f"pslaunch-{name}-{self.label}", daemon=True)
        t.start()
        self._threads.append(t)

    def _read(self) -> None:
        import paramiko

        chan = self.chan
        assert chan is not None
        by_id = self._by_id
        decoder = self._decoder
        while True:
            self._drain_stderr()
            try:
                data = chan.recv(65536)
            except socket.timeout:
                if self.closed:
                    break
                continue
            except (paramiko.SSHException, EOFError, OSError):
                data = b""
            if not data:
                break
            self.last_heard = time.monotonic()
            frames = decoder.feed(data)
            if not self._framing:  # (what the host printed comes before what its frames make happen)
                self._preamble += len(decoder.preamble)
                self._show(bytes(decoder.preamble), "the login shell printed: ")
                decoder.preamble.clear()
                if decoder.framing:
                    self._framing = True
                    self._show_hidden()
                elif self._preamble > PREAMBLE_MAX:
                    self.refuse(f"{self.label} printed more than {size_text(PREAMBLE_MAX)} before pslaunch's remote "
                                "wrapper started (a login banner, or the login shell's rc files); dropped that host: "
                                "make its shell print nothing for a non-interactive ssh command")
            for kind, ident, payload in frames:
                proc = by_id.get(ident)
                if proc is not None:
                    proc.frame(kind, payload)
                elif ident == NODE and kind in _ANSWERS:
                    self._replies.put((kind, protocol.parse_json(payload) or {"error": "an answer that is not JSON"}))
            if self.refused:
                break
        if self.refused:
            chan.close()  # (the wrapper there, if it is one, stops its processes)
        else:
            self._drain_stderr()
        self._show_hidden()
        status = chan.recv_exit_status() if chan.exit_status_ready() else None
        deliberate = self.closed
        self.closed = True
        unfinished = [p for p in self.procs if p.running]
        if unfinished and not self.lost and not deliberate:
            tail = f": {self._stderr_tail[-1]}" if self._stderr_tail else ""
            if self.refused:
                why = self.refused
                if any(p.started.is_set() for p in unfinished):
                    log.error("%s", why)
            elif not any(p.started.is_set() for p in unfinished):
                why = (f"pslaunch's remote wrapper on {self.label} ended before starting the processes "
                       f"(ssh exit status {status}){tail}; the ssh backend needs python3 >= 3.5 on every host")
            else:
                how = (f"ssh exit status {status}" if status is not None
                       else "no exit status: the wrapper was killed, or sshd")
                why = f"pslaunch's remote wrapper on {self.label} ended without their exit codes ({how}){tail}"
                log.error("%s", why)
            for p in unfinished:
                p.wrapper_gone(why, status)
        for p in self.procs:
            p.started.set()
            if not p.lost:
                p.output.close()
        self.session.channel_closed()

    def _dropped(self, kind: bytes, ident: int, length: int) -> None:
        """A frame too long to accept (pslaunch's wrapper sends none): the host is dropped, and an
        answer that never comes fails its request now."""
        limit = self._decoder.limits.get(kind, self._decoder.limit)
        if ident == NODE and kind in _ANSWERS:
            self._replies.put((kind, {"error": f"its answer takes {length} bytes, more than the "
                                               f"{limit} pslaunch accepts"}))
        self.refuse(f"{self.label} announced a {kind.decode(errors='replace')!r} frame of {length:,} bytes, more "
                    f"than the {limit:,} pslaunch accepts (is that pslaunch's wrapper?); dropped that host")

    def refuse(self, why: str) -> None:
        """Drop the host for what it sent (the reader stops and closes its channel): ``why`` is one line."""
        if not self.refused:
            self.refused = why

    def _show(self, data: bytes, what: str) -> None:
        """The host's own text (before the frames, or the wrapper's stderr), as warnings: at most
        :data:`SHOWN_LINES` lines of :data:`SHOWN_WIDTH` characters."""
        for line in data.decode(errors="replace").splitlines():
            if not line.strip():
                continue
            if self._shown >= SHOWN_LINES:
                self._hidden += 1
                continue
            self._shown += 1
            cut = f"... ({len(line) - SHOWN_WIDTH:,} more characters)" if len(line) > SHOWN_WIDTH else ""
            log.warning("%s: %s%s%s", self.label, what, line[:SHOWN_WIDTH], cut)

    def _show_hidden(self) -> None:
        if self._hidden:
            log.warning("%s: %s more line%s of its login shell's or pslaunch's wrapper's output not shown (at most "
                        "%d are)", self.label, f"{self._hidden:,}", "" if self._hidden == 1 else "s", SHOWN_LINES)
            self._hidden = 0

    def _drain_stderr(self) -> None:
        """The wrapper's own stderr (a shell's 'python3: not found', a traceback): shown on the console."""
        chan = self.chan
        while chan is not None and chan.recv_stderr_ready():
            data = chan.recv_stderr(65536)
            if not data:
                break
            text = data.decode(errors="replace")
            self._stderr_tail.extend(x[:SHOWN_WIDTH] for x in text.splitlines()[-5:] if x.strip())
            self._show(data, "")

    def keepalive_tick(self) -> bool:
        """Ping the wrapper and check that the host answered lately (from :data:`KEEPALIVES`'s thread).

        Never waits: while another thread sends to the host (a sync's file, signals) this tick is
        left out, ping and check (the wrapper takes any input as a sign of life, and a send that
        stalls ends at its own limit: :func:`send_patiently`); the ping alone is left out while the
        channel's window is full. Returns False once the host needs no more ticks."""
        chan = self.chan
        if chan is None or self.closed or self._stop.is_set():
            return False
        if not self._send_lock.acquire(blocking=False):
            return True
        try:
            if chan.send_ready():
                chan.sendall(_PING)
        except Exception:  # noqa: BLE001 - a closed channel: the reader notices
            pass
        finally:
            self._send_lock.release()
        silent = time.monotonic() - self.last_heard
        if any(p.running for p in self.procs) and silent > self.lost_after and not self.lost:
            self.mark_lost(f"no reply to keep-alives for {silent:.0f}s")
        return True

    def mark_lost(self, why: str) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost = True
            self.lost_reason = why
        running = [p for p in self.procs if p.running]
        if any(p.started.is_set() for p in running):
            log.error("host %s is lost: %s (link down, host down or sshd gone); its %d running process%s "
                      "count as failed (exit code %d); the wrapper there stops them once the keep-alives stop",
                      self.label, why, len(running), "" if len(running) == 1 else "es", EXIT_LOST)
        for p in running:  # (one that had not started fails the start now, with one line: start())
            p.set_lost(f"host {self.label} is lost before its processes started: {why} (link down, host down "
                       "or sshd gone)")

    # -- signals --------------------------------------------------------------------

    def signal(self, signame: str, procs: Sequence[SSHProcess]) -> None:
        """Send ``signame`` to the groups of ``procs`` (``X`` frames to the wrapper, from the host's signal
        thread: started by the first signal, as most hosts get none until the job ends)."""
        with self._lock:
            if not self._signaled:
                self._signaled = True
                self._start_thread(self._signal_loop, "signals")
        self._signals.put((signame, list(procs)))

    def _signal_loop(self) -> None:
        while True:
            item = self._signals.get()
            if item is None:
                return
            signame, procs = item
            ids = [p.ident for p in procs if p.pid and p.running]
            if not ids or self.lost or self.closed:
                continue
            try:  # the wrapper signals the groups (it started them): no shell, no round trip
                self.send_bytes(b"".join(protocol.signal_frame(i, signame) for i in ids))
                log.debug("%s: %s to %d process%s", self.label, signame, len(ids), "" if len(ids) == 1 else "es")
            except LaunchError as e:
                log.debug("%s: %s failed: %s", self.label, signame, e)

    def kill_now(self, pgids: Sequence[int]) -> None:
        """SIGKILL ``pgids`` and wait for the command (a failed start)."""
        try:
            self.session.exec(kill_command("KILL", pgids), timeout=5.0)
        except (LaunchError, ValueError) as e:
            log.debug("%s: kill after a failed start: %s", self.label, e)

    # -- the end ------------------------------------------------------------------------

    def cleaned(self, proc: SSHProcess) -> None:
        """The supervisor is done with ``proc``; once done with all, the wrapper sweeps and exits."""
        with self._lock:
            self._cleaned.add(proc.ident)
            done = len(self._cleaned) >= len(self.procs)
        chan = self.chan
        if done and chan is not None and not self.closed and not self.lost:
            try:
                chan.shutdown_write()  # EOF: the wrapper kills what is left of every group and exits
            except Exception:  # noqa: BLE001
                pass

    def close(self) -> None:
        """Stop the threads, close the channel (the wrapper then stops every group), disconnect.

        A kill command still in flight is waited for (briefly): its login shell is left to finish.
        """
        self._stop.set()
        KEEPALIVES.remove(self)
        self._signals.put(None)
        for t in self._threads:
            if t.name.startswith("pslaunch-signals") and not self.lost:
                t.join(5.0)
        if self.chan is not None:
            self.closed = True
            try:
                self.chan.close()
            except Exception:  # noqa: BLE001
                pass
        self.session.close()


# --- the process handle --------------------------------------------------------------------


class SSHProcess(RemoteProcess):
    """A server or worker on a remote host, run by that host's wrapper (its frames: :class:`RemoteProcess`)."""

    def __init__(self, proc: ProcSpec, output: ProcOutput, host: RemoteHost, ident: int) -> None:
        super().__init__(proc, output, host.label, ident)
        self.remote = host
        self.lost = False
        self.gone = ""  # why its host's wrapper ended without its exit code

    def on_start(self, info: dict) -> None:
        super().on_start(info)
        self.start_time = time.time()

    def wrapper_gone(self, why: str, status: Optional[int]) -> None:
        """The wrapper channel ended before this process's exit code came."""
        if not self.started.is_set():
            self.failure = why
            self.failure_code = status or EXIT_LOST  # (None or 0: no code of its own)
        self.reported = EXIT_LOST if status in (None, 0) or self.started.is_set() else status
        self.gone = why

    @property
    def running(self) -> bool:
        """No exit code yet (the reader thread's view; :meth:`poll` is the supervisor's)."""
        return self.reported is None

    def set_lost(self, why: str = "") -> None:
        self.lost = True
        if not self.started.is_set():
            self.failure = why or f"host {self.host} is lost"
            self.failure_code = EXIT_LOST
        if self.reported is None:
            self.reported = EXIT_LOST
        self.output.close()  # nothing more will come; the supervisor need not wait for it
        self.started.set()

    def terminate(self) -> None:
        self.remote.signal("TERM", [self])

    def kill(self) -> None:
        self.remote.signal("KILL", [self])

    def dump_stacks(self) -> None:
        self.remote.signal("ABRT", [self])

    def forward(self, signame: str) -> None:
        self.remote.signal(signame, [self])

    def cleanup(self, groups: Optional[Mapping[int, list[int]]] = None) -> None:
        """The job is over for this process: its host's wrapper sweeps leftovers once all are.

        ``groups`` (the local process table) does not apply to remote processes.
        """
        self.remote.cleaned(self)

    def host_lost(self) -> Optional[str]:
        """Its host stopped answering keep-alives (:meth:`RemoteHost.mark_lost`), or the connection
        to its wrapper ended before its exit code came (sshd gone, the connection reset)."""
        if self.lost:
            return self.remote.lost_reason or "lost"
        if self.gone and self.started.is_set():
            return f"the connection ended before its exit code came ({self.gone})"
        return None

    def describe(self) -> str:
        where = f"on {self.host}" + (f", pid {self.pid}" if self.pid else "")
        if self.lost:
            where += f"; host lost: {self.remote.lost_reason}"
        elif self.gone and self.started.is_set():
            where += "; its host's wrapper ended without its exit code"
        return f"{self.label} ({where})"


class SSHGroup(ProcGroup):
    """The processes of an ssh job: a signal is one write per host to its wrapper, an ``X`` frame per
    running process (:meth:`RemoteHost.signal`), and the wrapper signals their groups."""

    def _each_host(self, signame: str) -> None:
        by_host: dict[int, tuple[RemoteHost, list[SSHProcess]]] = {}
        for h in self.running():
            assert isinstance(h, SSHProcess)
            by_host.setdefault(id(h.remote), (h.remote, []))[1].append(h)
        for host, procs in by_host.values():
            host.signal(signame, procs)

    def terminate(self) -> None:
        self._each_host("TERM")

    def kill(self) -> None:
        self._each_host("KILL")

    def dump_stacks(self) -> None:
        self._each_host("ABRT")

    def forward(self, signame: str) -> None:
        self._each_host(signame)


# --- the backend ----------------------------------------------------------------------------


class SSHBackend(Backend):
    """``--launcher ssh``: see the module docstring."""

    name = "ssh"
    remote = True
    uses_hostfile = True
    requires_hostfile = True
    supports_sync = True
    node_address_from_launcher = True
    can_replace = True
    Options = SSHOptions
    #: the options that say how to connect (``pslaunch doctor`` takes these too)
    connection_options = (
        BackendOption(("--ssh-user",), "user", "user for hosts whose line gives none."),
        BackendOption(("--ssh-port",), "port", "port for hosts whose line gives none.", kind="int"),
        BackendOption(("--ssh-key",), "key", "private key file.", metavar="FILE"),
        BackendOption(("--ssh-connect-timeout",), "connect_timeout", "connection timeout per host.", kind="float",
                      default=10.0, metavar="SECONDS", show_default=True),
        BackendOption(("--accept-new-host-keys",), "accept_new_host_keys",
                      "trust and record host keys not yet in known_hosts (a changed key is always refused).",
                      kind="flag"),
    )
    options = connection_options + (
        BackendOption(("--ssh-keepalive",), "keepalive", "keep-alive interval; a host silent for 4 intervals is "
                      "lost (the job fails), and its processes stop themselves.", kind="float", default=5.0,
                      metavar="SECONDS", show_default=True),
        BackendOption(("--sync-exclude",), "sync_exclude", "--sync-dst-dir skips files matching PATTERN (.git and "
                      "__pycache__ always). Repeatable.", kind="multiple", metavar="PATTERN"),
        BackendOption(("--sync-delete",), "sync_delete", "--sync-dst-dir deletes remote files that are gone here.",
                      kind="flag"),
        BackendOption(("--sync-no-gitignore",), "sync_no_gitignore", "--sync-dst-dir sends what .gitignore "
                      "ignores too (by default, in a git work tree, it does not; virtual environments are "
                      "always skipped).", kind="flag"),
    )

    @classmethod
    def make_options(cls, values: Mapping[str, Any]) -> SSHOptions:
        opts = super().make_options(values)
        changes: dict[str, object] = {"sync_exclude": SSHOptions.sync_exclude + tuple(values.get("sync_exclude") or ())}
        if opts.key:
            changes["key"] = os.path.expanduser(opts.key)
        return dataclasses.replace(opts, **changes)

    def __init__(self, spec: JobSpec, console: Console, watchdog: Optional[Watchdog]) -> None:
        super().__init__(spec, console, watchdog)
        self.opts: SSHOptions = self.spec.options or SSHOptions()
        self.hosts: dict[tuple, RemoteHost] = {}
        self._adopted: dict[tuple, RemoteHost] = {}
        self.by_line: dict[Host, RemoteHost] = {}
        self.handles: list[SSHProcess] = []
        self.sync_stats: dict[str, SyncStats] = {}
        self.timings: dict[str, float] = {}
        self.tree: Optional[TreeSync] = None
        self._closing = False
        self._lock = threading.Lock()

    # -- dry run ---------------------------------------------------------------------------

    @classmethod
    def dry_targets(cls, spec: JobSpec, hosts: Sequence[Host]) -> tuple[list[Target], str]:
        """The hosts' connection settings as a job resolves them (``~/.ssh/config`` included), and a
        note when that cannot be done here (no paramiko: the config is not read)."""
        opts = spec.options or SSHOptions()
        try:
            require_paramiko()
            return resolve_targets(hosts, opts), ""
        except LauncherError as e:  # no paramiko; a config the job itself would refuse (ProxyJump, ...)
            note = " (paramiko is not installed)" if "paramiko" in str(e) else f": {e}"
            return [_basic_target(h, opts) for h in hosts], f"~/.ssh/config not applied{note}"

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        lines = [f"ssh: one connection per host; on each, one channel runs \"exec {REMOTE_PYTHON} -S -c "
                 "'<bootstrap>'\", which reads pslaunch's remote wrapper, then each process's argv, environment "
                 "and directory from the channel's stdin (never a command line)"]
        per_host: dict[Host, list[str]] = collections.defaultdict(list)
        for p in plan.procs:
            if p.host is not None:
                per_host[p.host].append(p.label.split(" @ ")[0])
        cwd = spec.sync_dst_dir or spec.workdir or "."
        opts = spec.options or SSHOptions()
        targets, note = cls.dry_targets(spec, list(per_host))
        if note:
            lines.append(f"  note: {note}")
        for (host, labels), t in zip(per_host.items(), targets):
            lines.append(f"  {host.display}: {t.address}, cwd {cwd}: {', '.join(labels)}")
        if spec.sync_dst_dir:
            sync_plan = cls.sync_plan(spec)
            tree = TreeSync(sync_plan.src, spec.sync_dst_dir, opts.sync_exclude, skip=sync_plan.skipped,
                            delete=opts.sync_delete)
            lines.append(f"sync to {spec.sync_dst_dir} on each host, through its wrapper on the job's connection "
                         f"(files that differ in size or modification time; {tree.files:,} to compare"
                         f"{'; what is gone here is deleted there' if opts.sync_delete else ''}):")
            lines.extend(f"  {x}" for x in sync_plan.describe())
            warning = sync_plan.warning(len(per_host))
            if warning:
                lines.append(f"  warning: {warning}")
            if not spec.sync_dst_dir.startswith("/"):
                lines.append(f"  ({spec.sync_dst_dir} is relative to the home directory on each host)")
        iface = spec.interface
        if iface:
            lines.append(f"DMLC_NODE_HOST: each host's address on DMLC_INTERFACE={iface}, resolved there before launch")
        return lines

    @classmethod
    def dry_run_sockets(cls, spec: JobSpec) -> list[str]:
        """Host by host: the launcher works out each host's interface before the start."""
        lines = hosts_with_processes(spec)
        targets = cls.dry_targets(spec, lines)[0]
        return network.socket_lines(spec, [(h.display, t.hostname) for h, t in zip(lines, targets)], all_here=False)

    @classmethod
    def machines(cls, spec: JobSpec) -> Optional[Sequence[str]]:
        """The hosts that get a process, as ``~/.ssh/config`` names them (an alias's ``HostName``)."""
        lines = hosts_with_processes(spec)
        return [t.hostname for t in cls.dry_targets(spec, lines)[0]]

    @classmethod
    def sync_plan(cls, spec: JobSpec) -> SyncPlan:
        """What ``--sync-dst-dir`` sends (one walk of the working directory, here)."""
        opts = spec.options or SSHOptions()
        return plan_sync(spec.workdir or os.getcwd(), opts.sync_exclude, gitignore=not opts.sync_no_gitignore)

    # -- prepare ------------------------------------------------------------------------------

    def check(self) -> None:
        require_paramiko()

    def prepare(self) -> Mapping[Host, str]:
        spec = self.spec
        lines = hosts_with_processes(spec)
        targets = resolve_targets(lines, self.opts)
        t0 = time.monotonic()
        try:
            sessions = connect_all(targets, self.opts, on_connect=self._adopt)
        except SSHConnectError as e:  # (which hostfile lines did not answer: the supervisor may leave them out)
            e.unreachable = tuple(line for line, t in zip(lines, targets) if t.ident in e.unreachable_targets)
            raise
        self.timings["connect"] = time.monotonic() - t0
        ordered = {t.ident: self._adopted[t.ident] for t in targets}  # hostfile order, for messages
        self.hosts = ordered
        for line, target in zip(lines, targets):
            self.by_line[line] = self.hosts[target.ident]
        log.debug("connected to %d host%s in %.2fs", len(sessions), "" if len(sessions) == 1 else "s",
                  self.timings["connect"])
        t1 = time.monotonic()
        if spec.sync_dst_dir:
            sync_plan = self.sync_plan(spec)
            warning = sync_plan.warning(len(self.hosts))
            if warning:
                log.warning("%s", warning)
            log.debug("sync plan: %s", "; ".join(sync_plan.describe()))
            self.tree = TreeSync(sync_plan.src, spec.sync_dst_dir, self.opts.sync_exclude, skip=sync_plan.skipped,
                                 delete=self.opts.sync_delete)
        self._per_host(self._prepare_host, "prepare")
        self.timings["prepare"] = time.monotonic() - t1
        addresses = {}
        for line in lines:
            address = self.by_line[line].node_address
            assert address is not None  # (_prepare_host set it, or raised)
            addresses[line] = address
        return addresses

    def _prepare_host(self, host: RemoteHost) -> None:
        """Per host, in parallel: start its wrapper, then through it work out ``DMLC_NODE_HOST`` and
        sync the working directory; the wrapper then waits for the processes."""
        host.open()
        self._resolve_address(host)
        if self.tree is not None:
            host.workdir, self.sync_stats[host.label] = self.tree.sync(host.label, host.request, host.send)
            st = self.sync_stats[host.label]
            # (without DMLC_INTERFACE the sync is the wrapper's first request, so its time includes
            # the wrapper's start there: the login shell and python3)
            log.info("synced %s to %s:%s: %d file%s, %s sent%s in %.2fs%s", self.tree.src, host.label, host.workdir,
                     st.files, "" if st.files == 1 else "s", size_text(st.bytes),
                     f", {st.deleted} deleted" if st.deleted else "", st.seconds,
                     "" if self.spec.interface else " (with the wrapper's start there)")

    def _adopt(self, session: HostSession) -> None:
        with self._lock:
            if self._closing:
                session.close()
                raise LaunchError(f"{session.label}: the launcher is stopping")
            host = RemoteHost(session, self.spec)
            self._adopted[session.target.ident] = host
            self.hosts[session.target.ident] = host  # close() reaches it from now on

    def _per_host(self, fn: Callable[[RemoteHost], object], what: str) -> None:
        """Run ``fn(host)`` for every host in parallel; raise the first error in hostfile order."""
        hosts = list(self.hosts.values())
        errors: dict[int, BaseException] = {}
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(hosts))),
                                                     thread_name_prefix=f"pslaunch-{what}")
        try:
            futures = {pool.submit(fn, h): i for i, h in enumerate(hosts)}
            for fut in concurrent.futures.as_completed(futures):
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - re-raised below
                    errors[futures[fut]] = e
        except BaseException:
            # Ctrl-C or SIGTERM: do not wait for the hosts (close() ends what they do by closing
            # the connections)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        if errors:
            first = errors[min(errors)]
            more = len(errors) - 1
            suffix = f" ({more} more host{'s' if more > 1 else ''} failed too)" if more else ""
            if isinstance(first, ConfigError):
                raise ConfigError(f"{first}{suffix}") from None
            if isinstance(first, LaunchError):
                raise LaunchError(f"{first}{suffix}", exit_code=first.exit_code) from None
            raise LaunchError(f"{what}: {first}{suffix}") from None

    def _resolve_address(self, host: RemoteHost) -> None:
        iface = self.spec.interface
        if not iface:
            address = host.session.peer_address
            for candidate in (address, host.session.target.hostname):
                try:
                    host.node_address = netif.resolve_ipv4(candidate)
                    break
                except netif.NetifError:
                    continue
            else:
                raise ConfigError(f"{host.label}: no IPv4 address for DMLC_NODE_HOST (the connection reached "
                                  f"{address}; ps-lite needs IPv4): set DMLC_INTERFACE to the host's IPv4 network")
            unset = set(network.SOCKET_NAMES) - set(network.user_socket_settings(self.spec))
            if self.spec.tracker == "torch" and unset:
                self._resolve_carrier(host)  # (gloo and NCCL on the network ssh reached the host on)
            return
        doc = host.request(protocol.IFACE, json.dumps({"iface": iface}).encode(), protocol.IFACE_ANSWER, timeout=60.0)
        if "error" in doc:
            raise ConfigError(f"{host.label}: {doc['error']}; set DMLC_INTERFACE to a name or CIDR that every "
                              "host has (a CIDR such as 10.1.0.0/16 works when names differ)")
        host.node_address = str(doc["address"])
        host.interface = str(doc.get("interface") or "") or None
        log.debug("%s: DMLC_INTERFACE=%s is %s (%s)", host.label, iface, doc.get("interface"), host.node_address)

    def _resolve_carrier(self, host: RemoteHost) -> None:
        """Without ``DMLC_INTERFACE``, a torch job's gloo and NCCL on ``host`` bind the interface
        that carries the address ssh reached it on (:func:`pscontract.netif.carrier_spec`), found
        there; none found (a NAT or a proxy in between): they pick their own, as before."""
        spec = netif.carrier_spec(None, host.node_address)
        if spec is None:
            return
        doc = host.request(protocol.IFACE, json.dumps({"iface": spec}).encode(), protocol.IFACE_ANSWER, timeout=60.0)
        if "error" in doc:
            log.info("%s: no interface there carries %s (%s); gloo and NCCL pick their own", host.label,
                     host.node_address, doc["error"])
            return
        host.interface = str(doc.get("interface") or "") or None

    # -- start ---------------------------------------------------------------------------

    def start(self, procs: Sequence[ProcSpec]) -> ProcGroup:
        return self._launch(procs, self.by_line)

    def replace(self, proc: ProcSpec) -> ProcGroup:
        """A lost worker's replacement, on its host: a wrapper of its own there (a fresh channel of
        the host's connection: a wrapper runs the processes of one header), which needs no new
        address or sync. When that host is lost, on the job's connected host that runs the fewest
        processes, with that host's ``DMLC_NODE_HOST``; with none left, a ``LaunchError``."""
        old = self.by_line.get(proc.host) if proc.host is not None else None
        if old is None:
            raise LaunchError(f"{proc.label}: no connection to its host (internal error)")
        if old.lost:
            proc = self._elsewhere(proc, old)
            old = self.by_line[proc.host]  # type: ignore[index]  # (_elsewhere gives a connected line)
        host = RemoteHost(old.session, self.spec)
        host.node_address, host.interface, host.workdir = old.node_address, old.interface, old.workdir
        with self._lock:
            if self._closing:
                raise LaunchError(f"{old.label}: the launcher is stopping")
            self.hosts[(old.session.target.ident, len(self.hosts))] = host  # close() reaches it from now on
        host.open()
        assert proc.host is not None
        return self._launch([proc], {proc.host: host})

    def _elsewhere(self, proc: ProcSpec, lost: RemoteHost) -> ProcSpec:
        """``proc`` moved off the lost host ``lost`` to the connected host with the fewest running
        processes of the job (hostfile order breaks ties)."""
        load = collections.Counter(id(h.remote) for h in self.handles if h.running)
        usable = [(line, h) for line, h in self.by_line.items() if not h.lost and not h.closed and h is not lost]
        if not usable:
            raise LaunchError(f"{lost.label} is lost ({lost.lost_reason or 'no answer'}) and no other host of the job "
                              f"is connected: {proc.label} cannot be replaced")
        line, host = min(usable, key=lambda item: load[id(item[1])])
        log.warning("%s is lost (%s): %s's replacement runs on %s", lost.label, lost.lost_reason or "no answer",
                    proc.label, host.label)
        env = dict(proc.env)
        if host.node_address:
            env[pc.NODE_HOST] = host.node_address
        return dataclasses.replace(proc, host=line, env=env)

    def _launch(self, procs: Sequence[ProcSpec], hosts: Mapping[Host, RemoteHost]) -> ProcGroup:
        """Start ``procs``, each through the wrapper of its line in ``hosts``."""
        t0 = time.monotonic()
        handles: list[SSHProcess] = []
        per_host: dict[int, tuple[RemoteHost, list[SSHProcess]]] = {}
        told: set[str] = set()
        try:
            for i, p in enumerate(procs):
                if p.host is None or p.host not in hosts:
                    raise LaunchError(f"{p.label}: no connection to its host (internal error)")
                host = hosts[p.host]
                extra = pc.torch_sockets(p.env, host.interface)  # (a torch job: gloo and NCCL on that network)
                if extra:
                    if host.label not in told:
                        told.add(host.label)
                        log.info("%s: %s", host.label, network.socket_text(extra, host.interface, host.node_address,
                                                                          self.spec.interface))
                    p = dataclasses.replace(p, env={**p.env, **extra})
                h = SSHProcess(p, self.console.proc(p.name, p.label, str(p.role)), host, i)
                handles.append(h)
                per_host.setdefault(id(host), (host, []))[1].append(h)
            self.handles.extend(handles)
            self._run_parallel(lambda item: item[0].launch(item[1]), list(per_host.values()))
            deadline = time.monotonic() + max(self.spec.start_timeout, 1.0)
            for h in handles:
                if not h.started.wait(max(0.0, deadline - time.monotonic())):
                    raise LaunchError(f"{h.label}: pslaunch's remote wrapper on {h.host} did not start the "
                                      f"process within --start-timeout {self.spec.start_timeout:g}s")
                if h.failure is not None:
                    raise LaunchError(f"{h.label}: {h.failure}", exit_code=h.failure_code)
        except BaseException:
            self._abort([host for host, _ in per_host.values()])
            raise
        self.timings["spawn"] = time.monotonic() - t0
        log.debug("started %d process%s in %.2fs", len(handles), "" if len(handles) == 1 else "es",
                  self.timings["spawn"])
        return SSHGroup(handles)

    @staticmethod
    def _run_parallel(fn: Callable[[Any], object], items: list) -> None:
        errors: list[BaseException] = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(items))),
                                                   thread_name_prefix="pslaunch-start") as pool:
            for fut in [pool.submit(fn, item) for item in items]:
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
        if errors:
            raise errors[0]

    def _abort(self, hosts: Sequence[RemoteHost]) -> None:
        """A start failed or was interrupted: kill everything it started, now, then close the wrapper
        channels (a wrapper whose channel closes stops its groups too, should the kill not get through)."""
        for host in hosts:
            pgids = [p.pid for p in host.procs if p.pid and p.running]
            if pgids and not host.lost and not host.closed:
                host.kill_now(pgids)
            if host.chan is not None:
                host.closed = True
                try:
                    host.chan.close()
                except Exception:  # noqa: BLE001
                    pass

    # -- close --------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        hosts = list(self.hosts.values())
        live = [h for h in hosts if not h.lost]
        for h in live:
            h.close()
        lost = [h for h in hosts if h.lost]
        if lost:  # closing a connection to a lost host may block: do it in the background
            def close_lost() -> None:
                for h in lost:
                    h.close()

            t = threading.Thread(target=close_lost, daemon=True, name="pslaunch-close-lost")
            t.start()
            t.join(2.0)


__all__ = ["SSHBackend", "SSHGroup", "SSHProcess", "kill_command", "wrapper_command",
           "wrapper_header", "wrapper_payload"]
