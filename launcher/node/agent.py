# ruff: noqa: UP004, UP031 - Python 3.5 syntax: the ssh backend runs the agent with a host's own python3
"""The node agent: runs a node's processes for the launcher, reports them, and obeys it.

Every backend but the local one runs its servers and workers under an agent: the ssh backend one
per host for all of that host's processes (:mod:`.ssh_wrapper`), the mpi backend one per rank
(:mod:`.mpirank`), the batch backends one per task (:mod:`.task`). It speaks :mod:`.protocol`.
The agent

1. becomes a child subreaper, so a descendant that leaves its process's group (``setsid()``, a
   double fork) is still its descendant and is stopped with the rest;
2. starts each process as the leader of a new session and process group, stdin from
   ``/dev/null``, with a parent-death signal (Linux: ``PR_SET_PDEATHSIG``): if the agent itself is
   killed with SIGKILL, each process gets SIGTERM (SIGKILL without a watchdog); with ``watchdog``, a
   dead-man switch (:mod:`.watchdog`) then also stops the groups, and what left them, staged;
3. reports each process: ``p`` once it runs, its output as ``o``/``e``, ``x`` with its exit code
   (128+N for signal N) once it exited and its pipes are read (to their end, or for
   :data:`DRAIN_SECONDS` when something it started keeps them open); or one ``f`` with the reason
   and the shell's code (127: not found, 126: not executable) when it cannot start. A process is
   not reaped before the agent ends, so its pid, its group's id, cannot be reused while the
   launcher may still signal it;
4. obeys: ``X TERM`` or ``INT`` from the launcher, or SIGTERM, SIGINT or SIGHUP from whoever
   started the agent (sshd, mpirun, the batch system, the death of its parent), stop a process's
   group: that signal, SIGCONT, and SIGKILL after the job's grace (the *staged stop*); ``KILL``
   kills the group; ``ABRT`` and SIGABRT make Python processes dump their stacks (faulthandler);
   ``USR1``/``USR2`` and SIGUSR1/SIGUSR2 (a batch system's notice before a time limit, a
   suspension or a removal: Slurm's ``--signal``, Grid Engine's ``-notify``) are passed on to
   every group as they are, and the processes go on; one that arrives before they started is
   dropped (a process would die of it before it could set a handler). The end of the channel,
   or no keep-alive for ``lost_after`` seconds, means that the launcher is gone: every process
   gets the staged stop;
5. ends after its last process (with ``hold``, the ssh backend's way: once the launcher has also
   closed the channel, which it does when the whole job is over), after SIGKILL to every group,
   to every process that carries one of its processes' ``PSLAUNCH_PROCESS``
   (:func:`.procgroup.kill_marked`) and to every descendant left (:func:`.procgroup.kill_children`).

Where frames go: on the channel (transport a or b of :mod:`.protocol`); without one (it could not
be opened, or broke), by the ``fallback`` rule: ``"in-band"`` writes them in-band to the agent's
stdout and stderr (transport c: mpirun and srun relay them), ``"plain"`` writes the output as it
is and a failure as one line of text (a batch system keeps both in the task's files), None drops
them. ``tee`` also writes the output as it is while the channel carries it.

Standard library only, Python 3.5 syntax.
"""

import errno
import json
import os
import select
import signal
import socket
import subprocess
import time

from . import errorfile, protocol
from .procgroup import (
    MARK_NAME,
    UsageMeter,
    become_subreaper,
    exit_status,
    kill_children,
    kill_marked,
    parent_death_signal,
    resolve_program,
    signal_group,
    single_threaded,
    stop_group,
)

#: After a process exited, how long what it started may keep its pipes open before it is reported.
DRAIN_SECONDS = 0.5
#: How often the agent looks at its processes and its signals when nothing else happens.
TICK = 0.05
#: Stop reading the processes' pipes while this much output waits for the channel.
OUT_CAP = 4 * 1024 * 1024
CONNECT_TIMEOUT = 10.0
#: A launcher that takes no frame for this long is gone (transport b).
SEND_TIMEOUT = 60.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: passed on to every process's group as they are (:func:`_handle_signals`)
_NOTICES = {signal.SIGUSR1: "USR1", signal.SIGUSR2: "USR2", signal.SIGABRT: "ABRT"}
_FORWARDED = _STOP_SIGNALS + tuple(_NOTICES)
#: the launcher's signals that stop a process
_STOP_WORDS = (b"TERM", b"INT", b"KILL")
_OUTPUT = (protocol.STDOUT, protocol.STDERR)


class AgentError(Exception):
    """A problem the agent reports as one line, with the exit code to use."""

    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


#: Signals that arrived, oldest first; acted on by the agent (see :func:`catch_signals`).
PENDING = []  # type: list[int]


def _on_signal(signum, frame):
    PENDING.append(signum)


def catch_signals():
    """From now on, a stop or dump signal to this process is kept for the agent (a node program
    calls it first thing: a signal before its processes start must not kill it silently)."""
    for sig in _FORWARDED:
        signal.signal(sig, _on_signal)


def _pending_stop():
    """The first stop signal that arrived, or None."""
    return next((s for s in PENDING if s in _STOP_SIGNALS), None)


def machine():
    """What tells the launcher whether a pid here is a pid on its own machine."""
    info = {"host": socket.gethostname()}
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            info["boot"] = f.read().strip()
        info["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pass
    return info


def start_error(e, argv0, here):
    """``(message, code)`` for a process that could not start; ``here`` names the host in the
    message (None: the launcher names it, as the ssh backend does)."""
    on = " on %s" % here if here else ""
    if isinstance(e, FileNotFoundError):
        return ("cannot run %r: no such program or directory (is it on PATH%s? give a path such as ./prog)%s"
                % (argv0, " there" if here else "", on)), 127
    if isinstance(e, PermissionError):
        return "cannot run %r%s: permission denied (is it executable?)" % (argv0, on), 126
    return "cannot run %r%s: %s" % (argv0, on, (e.strerror if isinstance(e, OSError) else None) or e), 1


def _write(fd, data):
    try:
        os.write(fd, data)
    except OSError:
        pass  # whoever reads our output is gone; keep going so the processes are still stopped


class Dropped(ConnectionError):
    """The launcher closed the connection before the handshake ended: a hub that holds many
    strangers' idle connections drops the oldest, which may have been ours (try again)."""


def _read_line(sock):
    """One handshake line, without reading past its newline (frames may follow at once)."""
    data = b""
    while len(data) <= protocol.LINE_MAX:
        chunk = sock.recv(protocol.LINE_MAX, socket.MSG_PEEK)
        if not chunk:
            raise Dropped("the launcher closed the connection")
        end = chunk.find(b"\n")
        data += sock.recv(end + 1 if end >= 0 else len(chunk))
        if end >= 0:
            return data[:-1]
    raise ConnectionError("the launcher's greeting is too long")


class Channel(object):
    """The connection to the launcher: frames both ways (:mod:`.protocol`, transport a or b).

    On descriptors (``rfd``, ``wfd``: an ssh channel's stdin and stdout) writes are buffered and
    never block, as the agent must go on answering keep-alives: :meth:`flush` writes what ``wfd``
    takes now, and while :data:`OUT_CAP` bytes wait the agent stops reading its processes' output.
    On a socket (``sock``: the hub) a frame is sent at once, within :data:`SEND_TIMEOUT`.
    """

    def __init__(self, rfd=0, wfd=1, limit=protocol.MAX_TO_NODE, sock=None):
        self.sock = sock
        self.rfd, self.wfd = (sock.fileno(), sock.fileno()) if sock is not None else (rfd, wfd)
        self.decoder = protocol.Decoder(limit)
        self.out = bytearray()
        self.last_input = time.monotonic()
        if sock is None:
            os.set_blocking(self.wfd, False)

    def send(self, kind, ident, payload=b""):
        """Send one frame (OSError: the connection is broken)."""
        if self.sock is not None:
            self.sock.sendall(protocol.frame(kind, ident, payload))
        else:
            self.out += protocol.frame(kind, ident, payload)

    def flush(self, deadline=None):
        """Write what ``wfd`` takes now; with ``deadline``, keep trying until then (OSError: broken)."""
        while self.out:
            try:
                del self.out[:os.write(self.wfd, bytes(self.out[:65536]))]
            except (BlockingIOError, InterruptedError):
                left = 0.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return
                select.select([], [self.wfd], [], min(0.1, left))

    def read(self):
        """The frames that arrived (call when :attr:`rfd` is readable). EOFError: the launcher
        closed the connection, or it broke."""
        try:
            if self.sock is not None:
                data = self.sock.recv(65536, socket.MSG_DONTWAIT)
            else:
                data = os.read(self.rfd, 65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            raise EOFError
        self.last_input = time.monotonic()
        return self.decoder.feed(data)

    def wait(self, timeout=None):
        """:meth:`read`, after waiting at most ``timeout`` seconds (None: for ever) for input."""
        if not select.select([self.rfd], [], [], timeout)[0]:
            return []
        return self.read()

    def close(self):
        try:
            self.flush(time.monotonic() + 2.0)
        except OSError:
            pass
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_WR)  # the launcher reads everything, then EOF
            except OSError:
                pass
            self.sock.close()


def connect(address, ident, secret):
    """The channel to the launcher's hub for process ``ident`` (transport b), once both sides
    proved that they hold ``secret``. OSError or ValueError when it cannot be opened."""
    import hmac

    host, port = str(address[0]), int(address[1])
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    try:
        hello = _read_line(sock)
        if not hello.startswith(protocol.HELLO):
            raise ConnectionError("%s:%d is not a pslaunch launcher" % (host, port))
        server_nonce = bytes.fromhex(hello[len(protocol.HELLO):].decode("ascii"))
        client_nonce = os.urandom(16)
        mac = protocol.channel_mac(secret, "client", server_nonce, client_nonce, ident)
        sock.sendall(("%d %s %s\n" % (ident, client_nonce.hex(), mac)).encode())
        answer = _read_line(sock).decode("ascii", "replace")
        expected = "ok " + protocol.channel_mac(secret, "server", server_nonce, client_nonce, ident)
        if not hmac.compare_digest(answer, expected):
            raise ConnectionError("%s:%d did not prove it holds the job's secret" % (host, port))
    except (ConnectionResetError, BrokenPipeError):
        sock.close()  # (it dropped us as our answer arrived: the answer or the read then meets its reset)
        raise Dropped("the launcher closed the connection") from None
    except (OSError, ValueError):
        sock.close()
        raise
    sock.settimeout(SEND_TIMEOUT)
    return Channel(limit=protocol.ENV_MAX, sock=sock)


class Child(object):
    """One process of the agent: ``spec`` is ``{"id", "argv", "env", "cwd", "start"}`` (``env`` is
    its whole environment; ``start``: more fields for its ``p`` frame)."""

    def __init__(self, spec):
        self.id = int(spec["id"])
        self.argv = [str(a) for a in spec["argv"]]
        self.env = dict(spec.get("env") or {})
        self.cwd = spec.get("cwd") or None
        self.start = dict(spec.get("start") or {})
        self.mark = self.env.get(MARK_NAME, "")
        self.proc = None  # (kept: a Popen that is collected reaps its process, which must wait for the end)
        self.pid = 0
        self.streams = {}  # fd -> (kind, the pipe's file object)
        self.code = None  # once it ended: its exit code, 128+N for signal N
        self.ended_at = None
        self.ended_wall = None  # (time.time() then: what x says)
        self.error_file = None  # its errorfile.Slot, once it is about to start
        self.kill_at = None  # when the staged stop sends SIGKILL
        self.failed = False  # it could not start
        self.reported = False  # its x or f went out


class Agent(object):
    """Runs processes and reports them (see the module docstring).

    Args:
        grace: seconds between a graceful stop and SIGKILL.
        channel: the connection to the launcher (:class:`Channel`, :func:`connect`), or None.
        fallback: where frames go without a channel: ``"in-band"``, ``"plain"`` or None.
        tee: also write the output as it is to the agent's stdout/stderr while the channel carries it.
        hold: stay after the last process, until the launcher closes the channel (it sweeps a
            host once the whole job is over); its end then does not lose the channel's output side.
        lost_after: with no input from the launcher for this long (it sends keep-alives), it is gone.
        linger: after reporting that a process could not start, wait this long at most for the
            launcher to stop the job (a stop signal, ``X``, or the channel's end): under mpirun, a
            rank that exits non-zero first makes mpirun print its own abort banner before the
            launcher's report of the cause.
        here: the host's name in start errors (None where the launcher names the host itself).
        prefix: the agent's name in the one-line failures of the ``plain`` fallback.
        watchdog: run a dead-man switch for the processes' groups: True, a program of this
            installation; ``"fork"``, a fork of the agent (an ssh host has no installation). Where
            the watchdog module cannot be imported (Python < 3.7 on an ssh host), the
            parent-death signal alone stops the processes.
        pass_notices: pass a SIGUSR1, SIGUSR2 or SIGABRT that this agent gets on to its processes'
            groups; False where whoever sends them signals every process of the task itself, as
            Slurm does (its proctrack plugins cgroup and linuxproc: they would get it twice). The
            launcher's ``X`` frames are always passed on.
        usage: report each running process's CPU and RSS (``u``) every ``usage`` seconds; 0: never
            (the launcher asks only for a job page or report: a job without one pays nothing).
    """

    def __init__(self, grace, channel=None, fallback=None, tee=False, hold=False, lost_after=None, linger=0.0,
                 here=None, prefix="pslaunch agent", watchdog=False, pass_notices=True, usage=0.0):
        if fallback not in (None, "in-band", "plain"):
            raise ValueError("unknown fallback %r" % fallback)
        self.grace = grace
        self.channel = channel
        self.fallback = fallback
        self.tee = tee
        self.hold = hold
        self.lost_after = lost_after
        self.linger = linger
        self.here = here
        self.prefix = prefix
        self.use_watchdog = watchdog
        self.pass_notices = pass_notices
        self.watchdog = None
        self.error_base = None  # the directory of the processes' error files (errorfile.Base)
        self.death_signal = None  # the preexec_fn that sets each process's parent-death signal
        self.children = []
        self.unread = []  # frames read before :meth:`run` that it must still obey
        self.listening = channel is not None  # the launcher's frames may still come
        self.stopping = False  # every process gets the staged stop, and the agent ends after them
        self.machine = machine()
        self.usage = usage if usage > 0 else 0.0
        self.meter = UsageMeter() if self.usage else None
        self.next_usage = 0.0  # (monotonic: when to look at the processes' usage next)

    # -- where frames go -----------------------------------------------------------------------

    def send(self, kind, ident, payload=b""):
        """One frame to the launcher: on the channel, else by the fallback rule."""
        if self.channel is not None:
            try:
                self.channel.send(kind, ident, payload)
                return
            except OSError:
                self._lose_channel()
        if self.tee and kind in _OUTPUT:
            return  # (written as it came: see _output)
        if self.fallback == "in-band":
            self._in_band(kind, ident, payload)
        elif self.fallback == "plain":
            if kind in _OUTPUT:
                _write(1 if kind == protocol.STDOUT else 2, payload)
            elif kind == protocol.FAILED:
                error = protocol.parse_json(payload).get("error")
                _write(2, ("%s: error: %s\n" % (self.prefix, error)).encode("utf-8", "replace"))

    def _in_band(self, kind, ident, payload):
        """Transport c: each frame one line, output in pieces; ``x`` on both streams."""
        fd = 2 if kind in (protocol.STDERR, protocol.FAILED) else 1
        if kind in _OUTPUT:
            for at in range(0, len(payload), protocol.LINE_PAYLOAD):
                _write(fd, protocol.envelope(kind, ident, payload[at:at + protocol.LINE_PAYLOAD]))
            return
        if kind == protocol.RECORD and len(payload) > protocol.LINE_PAYLOAD:
            payload = errorfile.fit(protocol.parse_json(payload), protocol.LINE_PAYLOAD)
        line = protocol.envelope(kind, ident, payload)
        _write(fd, line)
        if kind in (protocol.EXIT, protocol.RECORD):
            _write(2, line)  # (the launcher keeps the first: a lost exit frame would make it guess)

    def send_json(self, kind, ident, obj):
        self.send(kind, ident, json.dumps(obj, separators=(",", ":")).encode("utf-8"))

    def error(self, ident, message, code):
        """Report that process ``ident`` could not start (or the agent failed): one line, with its code."""
        text = str(message)
        while True:  # (in-band, the frame must fit in one line)
            payload = json.dumps({"error": text, "code": code, "host": self.machine["host"]}).encode()
            if len(payload) <= protocol.LINE_PAYLOAD or not text:
                break
            text = text[:len(text) * 3 // 4]
        self.send(protocol.FAILED, ident, payload)

    def _lose_channel(self):
        channel, self.channel = self.channel, None
        self.listening = False
        if channel is not None:
            channel.close()

    def _output(self, child, kind, data):
        if self.tee or (self.channel is None and self.fallback == "plain"):
            _write(1 if kind == protocol.STDOUT else 2, data)
            if self.channel is None:
                return
        self.send(kind, child.id, data)

    def _flush(self):
        if self.channel is not None and self.channel.out:
            try:
                self.channel.flush()
            except OSError:
                if self.hold:
                    self.channel.out = bytearray()  # the launcher is gone; its end is seen on the input
                else:
                    self._lose_channel()

    # -- before the processes ---------------------------------------------------------------------

    def placement(self, ident, timeout):
        """Say where this agent runs and wait for process ``ident``'s placement variables
        (:mod:`.protocol`, *Placement*: ``h``, then ``E``); call before :meth:`run`.

        Raises:
            AgentError: no connection to the launcher, the connection ended, the job was stopped
                (128+N for signal N, 143 for the launcher's TERM), or nothing came within
                ``timeout`` seconds.
        """
        channel = self.channel
        if channel is None:
            raise AgentError("cannot learn which tasks share this host without a connection to the launcher "
                             "(see the warning above)")
        self.send_json(protocol.HERE, ident, self.machine)
        deadline = time.monotonic() + timeout
        while True:
            stop = _pending_stop()
            if stop is not None:
                raise AgentError("stopped before the command started", 128 + stop)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError("the launcher sent no placement within %gs (are some of the job's tasks still "
                                 "queued?)" % timeout)
            try:
                frames = channel.wait(min(left, 0.1))
            except EOFError:
                raise AgentError("the launcher closed the connection before it sent the placement") from None
            if any(kind == protocol.SIGNAL and payload in _STOP_WORDS for kind, _, payload in frames):
                raise AgentError("stopped by the launcher before the command started", 143)
            for at, (kind, fid, payload) in enumerate(frames):
                env = protocol.parse_env(payload) if kind == protocol.PLACE and fid == ident else None
                if env is not None:
                    self.unread = frames[at + 1:]  # (what came with it: for :meth:`run`)
                    return env

    def fail(self, ident, message, code):
        """Process ``ident`` will not run: report why (one line, with ``code``), end, return ``code``."""
        self.error(ident, message, code)
        self._end_channel(True)
        return code

    def _end_channel(self, failed):
        if self.channel is not None and failed and self.linger > 0:
            self._await_stop(self.linger)
        self._lose_channel()

    def _await_stop(self, seconds):
        """Until the launcher stops the job (a stop signal or ``X``, or the channel's end), at most ``seconds``."""
        deadline = time.monotonic() + seconds
        while self.channel is not None and _pending_stop() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                frames = self.channel.wait(min(left, TICK))
            except EOFError:
                return
            if any(kind == protocol.SIGNAL and payload in _STOP_WORDS for kind, _, payload in frames):
                return

    # -- running ---------------------------------------------------------------------------------

    def run(self, specs, frames=()):
        """Start the processes (:class:`Child` ``specs``), report and supervise them until the end;
        their exit codes, in order. ``frames``: what the launcher sent that is not read yet.

        A process that cannot start is reported (:meth:`error`) with its code; whatever goes
        wrong here, what was started is stopped before this returns or raises.
        """
        PENDING[:] = [s for s in PENDING if s in _STOP_SIGNALS]  # (a notice before the start: see 4.)
        stop = _pending_stop()
        if stop is not None:  # (the agent's starter is stopping already: nothing starts)
            for spec in specs:
                self.error(int(spec["id"]), "stopped before the command started", 128 + stop)
            self._end_channel(True)
            return [128 + stop for _ in specs]
        become_subreaper()
        if self.use_watchdog:
            try:
                from .watchdog import Client  # (Python 3.7 syntax)
            except (ImportError, SyntaxError):  # an old python3 on an ssh host: the parent-death signal only
                Client = None
            if Client is not None:
                self.watchdog = Client(self.grace, fork=self.use_watchdog == "fork")
        try:
            self.error_base = errorfile.Base(self.watchdog)
        except OSError:
            self.error_base = None  # (no temporary directory here: the processes run without error files)
        if single_threaded():  # (code between fork and exec is safe only then: mpi4py may run threads)
            watched = self.watchdog is not None and self.watchdog.pid is not None
            self.death_signal = parent_death_signal(signal.SIGTERM if watched else signal.SIGKILL)
        try:
            for spec in specs:
                child = Child(spec)
                self.children.append(child)
                self._start(child)
            self._commands(list(self.unread) + list(frames))
            self.unread = []
            while not self._over():
                self._step()
        finally:
            self._finish()
        return [c.code for c in self.children]

    def _start(self, child):
        if child.cwd and not os.path.isdir(child.cwd):
            why = " on %s" % self.here if self.here else ": %s" % os.strerror(errno.ENOENT)
            return self._failed(child, "cannot change to directory %s%s" % (child.cwd, why), 1)
        argv = [resolve_program(child.argv[0], child.env, child.cwd)] + child.argv[1:]
        if self.watchdog is not None and child.mark:
            self.watchdog.mark(child.mark)
        try:
            child.error_file = self.error_base.slot() if self.error_base is not None else None
            if child.error_file is not None:
                child.env.update(child.error_file.env())
        except OSError:
            child.error_file = None  # (no temporary directory here: the process runs without one)
        try:
            proc = subprocess.Popen(argv, env=child.env, cwd=child.cwd, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    close_fds=True, preexec_fn=self.death_signal)
        except Exception as e:  # noqa: BLE001 - ValueError (a NUL byte), ...: the others must stay supervised
            if child.error_file is not None:
                child.error_file.discard()
            message, code = start_error(e, argv[0], self.here)
            return self._failed(child, message, code)
        child.proc, child.pid = proc, proc.pid
        if self.watchdog is not None:
            self.watchdog.watch(child.pid)
        info = dict(self.machine, pid=child.pid, agent=os.getpid())
        info.update(child.start)
        self.send_json(protocol.STARTED, child.id, info)
        for pipe, kind in ((proc.stdout, protocol.STDOUT), (proc.stderr, protocol.STDERR)):
            os.set_blocking(pipe.fileno(), False)
            child.streams[pipe.fileno()] = (kind, pipe)

    def _failed(self, child, message, code):
        child.code = code
        child.failed = child.reported = True
        self.error(child.id, message, code)

    def _over(self):
        """Whether the agent's work is done (see the module docstring, 5)."""
        if not all(c.reported for c in self.children):
            return self.stopping and all(c.code is not None for c in self.children)  # (_finish reports them)
        return self.stopping or not self.hold

    def _step(self):
        """Relay what is ready within :data:`TICK`, then act on signals, exits and the time."""
        channel = self.channel
        pipes = {}
        if channel is None or len(channel.out) < OUT_CAP:
            for c in self.children:
                for fd in c.streams:
                    pipes[fd] = c
        readers = list(pipes) + ([channel.rfd] if self.listening else [])
        writers = [channel.wfd] if channel is not None and channel.out else []
        try:
            ready, _, _ = select.select(readers, writers, [], TICK)
        except (OSError, ValueError):  # (EINTR on old Pythons)
            ready = []
        for fd in ready:
            if fd in pipes:
                self._read(pipes[fd], fd)
            elif self.listening:
                self._listen()
        self._flush()
        self._handle_signals()
        self._check_exits()
        now = time.monotonic()
        for c in self.children:
            if c.kill_at is not None and now >= c.kill_at:
                signal_group(c.pid, signal.SIGKILL)
                c.kill_at = None
        if self.meter is not None and now >= self.next_usage:
            self.next_usage = now + self.usage
            self._report_usage()
        if self.listening and self.lost_after and now - self.channel.last_input > self.lost_after:
            self.listening = False  # no keep-alive: the network, the launcher's host or sshd is gone
            self._stop("TERM")

    def _report_usage(self):
        """One ``u`` per running process: its tree's CPU and RSS since the last look (none after the
        first look, nor where no frame can reach the launcher)."""
        running = [c for c in self.children if c.pid and c.code is None]
        if not running or (self.channel is None and self.fallback != "in-band"):
            return
        self.meter.look(os.getpid())  # (a subreaper: whatever its processes started is below it)
        for c in running:
            value = self.meter.usage(c.pid)
            if value is not None:
                self.send(protocol.USAGE, c.id, protocol.usage_payload(*value))

    def _read(self, child, fd):
        """Forward what one of ``child``'s pipes holds (a read or two; never blocks)."""
        kind, pipe = child.streams[fd]
        try:
            data = os.read(fd, 65536)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if data:
            self._output(child, kind, data)
            return True
        del child.streams[fd]
        pipe.close()
        return False

    def _drain(self, child, seconds=0.0):
        """Forward what ``child``'s pipes hold now; with ``seconds``, wait that long at most for their end."""
        deadline = time.monotonic() + seconds
        while child.streams:
            for fd in list(child.streams):
                for _ in range(64):  # (bounded: something may write as fast as we read)
                    if not self._read(child, fd):
                        break
            left = deadline - time.monotonic()
            if not child.streams or left <= 0:
                return
            select.select(list(child.streams), [], [], min(left, TICK))

    def _listen(self):
        try:
            frames = self.channel.read()
        except EOFError:
            self.listening = False
            if not self.hold:
                self._lose_channel()  # the launcher is gone (a held channel's output side may still work)
            self._stop("TERM")
            return
        self._commands(frames)

    def _commands(self, frames):
        for kind, ident, payload in frames:
            if kind == protocol.PING:
                self.send(protocol.ALIVE, protocol.NODE)
            elif kind == protocol.SIGNAL:
                what = payload.decode("ascii", "replace")
                if what in protocol.SIGNALS:
                    self._obey(what, None if ident == protocol.NODE else ident)

    def _obey(self, what, ident=None):
        """``TERM``/``INT`` (the staged stop), ``KILL``, ``ABRT``, ``USR1`` or ``USR2`` to the group of
        process ``ident`` (None: of every one) while it runs."""
        for c in self.children:
            if (ident is not None and c.id != ident) or not c.pid or c.code is not None:
                continue
            if what in ("TERM", "INT"):
                stop_group(c.pid, signal.SIGINT if what == "INT" else signal.SIGTERM)
                if c.kill_at is None:
                    c.kill_at = time.monotonic() + self.grace
            elif what in ("KILL", "ABRT", "USR1", "USR2"):
                signal_group(c.pid, getattr(signal, "SIG" + what))

    def _stop(self, what):
        self.stopping = True
        self._obey(what)

    def _handle_signals(self):
        while PENDING:
            signum = PENDING.pop(0)
            if signum in _NOTICES:
                if self.pass_notices:
                    self._obey(_NOTICES[signum])
            else:
                self._stop("INT" if signum == signal.SIGINT else "TERM")

    def _check_exits(self):
        now = time.monotonic()
        for c in self.children:
            if not c.pid or c.reported:
                continue
            if c.code is None:
                c.code = exit_status(c.pid)
                if c.code is None:
                    continue
                c.ended_at = now
                c.ended_wall = time.time()
            if not c.streams or now - c.ended_at >= DRAIN_SECONDS:
                self._drain(c)  # what it wrote before it exited, then its code
                self._report_exit(c)

    def _report_exit(self, child):
        """``r`` (what it wrote to its error file, if anything), then ``x`` with the node's time."""
        child.reported = True
        doc = child.error_file.collect() if child.error_file is not None else None
        if doc is not None:
            self.send(protocol.RECORD, child.id, errorfile.fit(doc, protocol.MAX_FROM_NODE))
        self.send(protocol.EXIT, child.id, protocol.exit_payload(child.code, child.ended_wall))

    def _finish(self):
        """The end: kill what is left, sweep, reap, report, close (see the module docstring, 5)."""
        started = [c for c in self.children if c.pid]
        for c in started:
            signal_group(c.pid, signal.SIGKILL)
        for mark in sorted(set(c.mark for c in self.children if c.mark)):
            kill_marked(mark)  # what left the groups, wherever it was re-parented to
        for c in started:
            try:
                _, status = os.waitpid(c.pid, 0)
                code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            except ChildProcessError:
                code = 128 + signal.SIGKILL
            if c.code is None:
                c.code = code
                c.ended_wall = time.time()
        # descendants re-parented to us (a subreaper) that carried no mark (a scrubbed environment)
        kill_children(keep=(self.watchdog.pid,) if self.watchdog is not None and self.watchdog.pid else ())
        deadline = time.monotonic() + 1.0
        for c in started:
            self._drain(c, max(0.0, deadline - time.monotonic()))
            if not c.reported:
                self._report_exit(c)
        if self.error_base is not None:
            self.error_base.close()
        if self.watchdog is not None:
            self.watchdog.close(wait=True)
        self._end_channel(any(c.failed for c in self.children))
