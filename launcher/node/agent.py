"""The node agent: runs one of the job's commands on a node and reports it to the launcher.

The mpi rank wrapper (:mod:`.mpirank`) and the batch task wrapper (:mod:`.task`) each work
out their process's place and environment, then hand the command to :class:`Agent`, which

1. becomes a child subreaper, so a descendant that leaves the command's process group
   (``setsid()``, a double fork) is still its descendant and is stopped with the rest;
2. starts the command as the leader of a new session and process group, stdin from
   ``/dev/null``, with a dead-man switch (:mod:`.watchdog`) that kills that group if the
   agent itself is killed with SIGKILL;
3. reports it: a start record (pid, host, node address) before any output, every output line
   as a record, and the exit code (128+N for signal N) at the end; or, if the command cannot
   start, one failure record with the reason and the shell's code (127 not found, 126 not
   executable). Records go over the agent's channel to the launcher (:mod:`.wire`); without
   one they go to the agent's own output (see :class:`Agent`);
4. obeys: ``TERM``/``INT`` from the launcher, or SIGTERM/SIGINT/SIGHUP from whoever started
   the agent (mpirun, the batch system, the death of the parent), stop the command's group
   gracefully and kill it after the job's grace period; ``KILL`` kills it; ``ABRT`` and
   SIGUSR1 make Python commands dump their stacks (faulthandler). A channel that ends while
   the command runs means the launcher is gone: the command is stopped;
5. exits with the command's exit code, after stopping whatever the command left behind.

Standard library only.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import time
from typing import Any, Mapping, Optional, Sequence

import pscontract as pc

from . import wire
from .procgroup import (
    become_subreaper,
    kill_children,
    kill_marked,
    resolve_program,
    signal_group,
    stop_group,
)
from .watchdog import Client as Watchdog

# After the command exits, how long its leftover grandchildren may keep its pipes open.
DRAIN_SECONDS = 0.5
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: the launcher's commands that stop the command
_STOP_WORDS = ("TERM", "INT", "KILL")


class AgentError(Exception):
    """A problem the agent reports as one line, with the exit code to use."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


#: Signals that arrived, oldest first; acted on once the command runs (see :func:`catch_signals`).
PENDING: list[int] = []


def _on_signal(signum: int, frame: object) -> None:
    PENDING.append(signum)


def catch_signals() -> None:
    """From now on, a stop or dump signal to this process is kept for the agent (call it first
    thing: a signal that arrives before the command starts must not kill the wrapper silently)."""
    for sig in _FORWARDED:
        signal.signal(sig, _on_signal)


def machine() -> dict[str, Any]:
    """What tells the launcher whether a pid here is a pid on its own machine."""
    info: dict[str, Any] = {"host": socket.gethostname()}
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            info["boot"] = f.read().strip()
        info["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pass
    return info


class Agent:
    """Runs one command and reports it (see the module docstring).

    Args:
        ident: the process's number in the job (records carry it).
        grace: seconds between a graceful stop and SIGKILL.
        channel: the connection to the launcher, or None.
        fallback: where records go without a channel: ``"records"`` writes them, unchanged,
            to this process's stdout/stderr (mpirun relays them to the launcher);
            ``"plain"`` writes the command's output as it is, and a failure as one line
            of text (a batch system keeps both in the task's output files).
        tee: also write the command's output as it is to this process's stdout/stderr while
            the channel carries the records (a batch task's own files keep their content).
        prefix: the agent's name in its own messages (``pslaunch task``).
        linger: after reporting that the command could not start, wait this long (at most) for
            the launcher to stop the job (its stop command, a stop signal, or the channel's end)
            before exiting: under mpirun, a rank that exits non-zero first makes mpirun print its
            own abort banner before the launcher's report of the cause.
    """

    def __init__(self, ident: int, grace: float, channel: Optional[wire.Channel], *,
                 fallback: str = "records", tee: bool = False, prefix: str = "pslaunch agent",
                 linger: float = 0.0) -> None:
        if fallback not in ("records", "plain"):
            raise ValueError(f"unknown fallback {fallback!r}")
        self.ident = ident
        self.grace = grace
        self.channel = channel
        self.fallback = fallback
        self.tee = tee
        self.prefix = prefix
        self.linger = linger
        self.child: Optional[subprocess.Popen] = None
        self.pending = PENDING
        self.kill_at: Optional[float] = None
        self._partial = {1: b"", 2: b""}
        catch_signals()

    # -- where records go ----------------------------------------------------------------

    def emit(self, kind: str, payload: bytes = b"") -> None:
        """One record to the launcher: on the channel, else by the fallback rule."""
        if self.channel is not None:
            try:
                self.channel.send(wire.record(self.ident, kind, payload))
                return
            except OSError:
                self._lose_channel()
        fd = 1 if kind in (wire.STDOUT_LINE, wire.STDOUT_PART, wire.START, wire.EXIT) else 2
        output = kind in (wire.STDOUT_LINE, wire.STDOUT_PART, wire.STDERR_LINE, wire.STDERR_PART)
        if self.tee and output:
            return  # (written as it came: see _output)
        if self.fallback == "records":
            data = wire.record(self.ident, kind, payload)
        elif kind in (wire.STDOUT_LINE, wire.STDERR_LINE):
            data = payload + b"\n"
        elif kind in (wire.STDOUT_PART, wire.STDERR_PART):
            data = payload
        elif kind == wire.FAILED:
            data = f"{self.prefix}: error: {json.loads(payload)['error']}\n".encode("utf-8", "replace")
        else:
            return  # (start and exit: the batch system knows both)
        _write(fd, data)

    def emit_exit(self, code: int) -> None:
        """The exit record. Without a channel, in records mode, on both streams: the launcher
        keeps the first that arrives (a lost exit record would make it guess)."""
        if self.channel is None and self.fallback == "records":
            data = wire.record(self.ident, wire.EXIT, str(code).encode())
            _write(1, data)
            _write(2, data)
            return
        self.emit(wire.EXIT, str(code).encode())

    def error(self, message: str, code: int) -> None:
        """Report that the command could not start (or the agent failed): one line, with its code."""
        text = message.encode("utf-8", "replace")[:wire.MAX_PAYLOAD - 256].decode("utf-8", "ignore")
        self.emit(wire.FAILED, json.dumps({"error": text, "code": code, "host": socket.gethostname()}).encode())

    def _lose_channel(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close()

    def _output(self, fd: int, data: bytes) -> None:
        """Bytes from the command's stdout (``fd`` 1) or stderr (2)."""
        if self.tee or (self.channel is None and self.fallback == "plain"):
            _write(fd, data)
            if self.channel is None:
                return
        line_kind, part_kind = (wire.STDOUT_LINE, wire.STDOUT_PART) if fd == 1 else (wire.STDERR_LINE, wire.STDERR_PART)
        data = self._partial[fd] + data
        *lines, rest = data.split(b"\n")
        for line in lines:
            while len(line) > wire.MAX_PAYLOAD:
                self.emit(part_kind, line[:wire.MAX_PAYLOAD])
                line = line[wire.MAX_PAYLOAD:]
            self.emit(line_kind, line)
        while len(rest) > wire.MAX_PAYLOAD:
            self.emit(part_kind, rest[:wire.MAX_PAYLOAD])
            rest = rest[wire.MAX_PAYLOAD:]
        self._partial[fd] = rest

    def _flush_partial(self) -> None:
        for fd, rest in self._partial.items():
            if rest and not (self.channel is None and self.fallback == "plain"):
                self.emit(wire.STDOUT_LINE if fd == 1 else wire.STDERR_LINE, rest)
            self._partial[fd] = b""

    # -- placement ---------------------------------------------------------------------------

    def placement(self, timeout: float) -> dict[str, str]:
        """Say where this agent runs and wait for the launcher's placement variables
        (``launcher.node.wire``: ``h``, then ``ENV``); call before :meth:`run`.

        Raises:
            AgentError: no connection to the launcher, the connection ended, the job was stopped
                (128+N for signal N, 143 for the launcher's TERM), or nothing came within
                ``timeout`` seconds.
        """
        channel = self.channel
        if channel is None:
            raise AgentError("cannot learn which tasks share this host without a connection to the launcher "
                             "(see the warning above)")
        self.emit(wire.HERE, json.dumps(machine(), separators=(",", ":")).encode())
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        sel.register(channel.fileno(), selectors.EVENT_READ)
        try:
            while channel.env is None:
                stop = [sig for sig in self.pending if sig in _STOP_SIGNALS]
                if stop:
                    raise AgentError("stopped before the command started", 128 + stop[0])
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AgentError(f"the launcher sent no placement within {timeout:g}s (are some of the job's "
                                     "tasks still queued?)")
                if not sel.select(min(left, 0.1)):
                    continue
                try:
                    words = channel.commands()
                except EOFError:
                    raise AgentError("the launcher closed the connection before it sent the placement") from None
                if any(w in _STOP_WORDS for w in words):
                    raise AgentError("stopped by the launcher before the command started", 143)
        finally:
            sel.close()
        return dict(channel.env)

    # -- running ----------------------------------------------------------------------------

    def run(self, argv: Sequence[str], env: Mapping[str, str], cwd: Optional[str] = None,
            start: Optional[Mapping[str, Any]] = None) -> int:
        """Start the command, report and supervise it; its exit code (128+N for signal N).

        ``start`` adds fields to the start record. Never raises for a command that fails to
        start: that is reported (:meth:`error`) and its code returned.
        """
        stop = [s for s in self.pending if s in _STOP_SIGNALS]
        if stop:
            return self._failed("stopped before the command started", 128 + stop[0])
        become_subreaper()
        watchdog = Watchdog(self.grace)
        mark = env.get(pc.PROCESS, "")
        if mark:
            watchdog.mark(mark)
        try:
            argv = [resolve_program(argv[0], env, cwd), *argv[1:]]
            where = socket.gethostname()
            try:
                self.child = subprocess.Popen(argv, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              start_new_session=True, close_fds=True)
            except FileNotFoundError:
                what = f"cannot change to directory {cwd}" if cwd and not os.path.isdir(cwd) else \
                    f"cannot run {argv[0]!r}: no such program or directory (is it on PATH there? give a path " \
                    "such as ./prog)"
                return self._failed(f"{what} on {where}", 127 if "cannot run" in what else 1)
            except PermissionError:
                return self._failed(f"cannot run {argv[0]!r} on {where}: permission denied (is it executable?)",
                                    126)
            except (OSError, ValueError) as e:
                return self._failed(f"cannot run {argv[0]!r} on {where}: {getattr(e, 'strerror', None) or e}", 1)
            child = self.child
            watchdog.watch(child.pid)
            info = {"pid": child.pid, "agent": os.getpid(), **machine(), **(start or {})}
            self.emit(wire.START, json.dumps(info, separators=(",", ":")).encode())
            try:
                code = self._pump(child)
            except BaseException:
                signal_group(child.pid, signal.SIGKILL)  # whatever went wrong, the command goes too
                raise
            self._flush_partial()
            self.emit_exit(code)
            return code
        finally:
            # what the command left behind goes with it: descendants re-parented to us (we are a
            # subreaper), and anything else that carries its PSLAUNCH_PROCESS
            kill_children(keep={watchdog.pid} if watchdog.pid else set())
            if mark:
                kill_marked(mark)
            watchdog.close(wait=True)
            if self.channel is not None:
                self.channel.close()
                self.channel = None

    def fail(self, message: str, code: int) -> int:
        """The command will not run: report why (one line, with ``code``), close, return ``code``."""
        return self._failed(message, code)

    def _failed(self, message: str, code: int) -> int:
        self.error(message, code)
        if self.channel is not None:
            if self.linger > 0:
                self._await_stop(self.linger)
            self.channel.close()
            self.channel = None
        return code

    def _await_stop(self, seconds: float) -> None:
        """Until the launcher stops the job (a stop command or signal, or the channel's end), at most ``seconds``."""
        assert self.channel is not None
        deadline = time.monotonic() + seconds
        sel = selectors.DefaultSelector()
        sel.register(self.channel.fileno(), selectors.EVENT_READ)
        try:
            while not any(sig in _STOP_SIGNALS for sig in self.pending):
                left = deadline - time.monotonic()
                if left <= 0 or (sel.select(min(left, 0.05)) and self._stop_said()):
                    return
        finally:
            sel.close()

    def _stop_said(self) -> bool:
        assert self.channel is not None
        try:
            return any(w in _STOP_WORDS for w in self.channel.commands())
        except EOFError:
            return True

    def _stop(self, sig: int) -> None:
        assert self.child is not None
        stop_group(self.child.pid, sig)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace

    def _obey(self, what: str) -> None:
        """A signal name (``TERM``...) from the launcher or from our own signal handler."""
        assert self.child is not None
        if what in ("TERM", "INT"):
            self._stop(signal.SIGINT if what == "INT" else signal.SIGTERM)
        elif what == "KILL":
            signal_group(self.child.pid, signal.SIGKILL)
        elif what == "ABRT":
            signal_group(self.child.pid, signal.SIGABRT)  # faulthandler: the Python stacks
        elif what == "USR2":
            signal_group(self.child.pid, signal.SIGUSR2)

    def _handle_signals(self) -> None:
        while self.pending:
            signum = self.pending.pop(0)
            if signum == signal.SIGUSR1:
                self._obey("ABRT")
            elif signum == signal.SIGUSR2:
                self._obey("USR2")
            else:
                self._obey("INT" if signum == signal.SIGINT else "TERM")

    def _pump(self, child: subprocess.Popen) -> int:
        assert child.stdout is not None and child.stderr is not None
        sel = selectors.DefaultSelector()
        streams = {child.stdout.fileno(): 1, child.stderr.fileno(): 2}
        for fd in streams:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ, "out")
        if self.channel is not None:
            sel.register(self.channel.fileno(), selectors.EVENT_READ, "channel")
        exited_at: Optional[float] = None
        swept = False
        while len(streams) or child.poll() is None:
            # (with no stream left the select still sleeps for its timeout: the command closed
            # its stdout and stderr but runs on, and signals must still be passed on)
            for key, _ in sel.select(timeout=0.05):
                if key.data == "channel":
                    self._read_commands(sel)
                    continue
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    self._output(streams[key.fd], chunk)
                else:
                    sel.unregister(key.fd)
                    del streams[key.fd]
            self._handle_signals()
            now = time.monotonic()
            if self.kill_at is not None and now >= self.kill_at:
                signal_group(child.pid, signal.SIGKILL)
                self.kill_at = None
            if exited_at is None and child.poll() is not None:
                exited_at = now
            if exited_at is not None and streams and now - exited_at > DRAIN_SECONDS:
                if not swept:  # grandchildren still hold the pipes: they go with the job
                    signal_group(child.pid, signal.SIGKILL)
                    swept = True
                elif now - exited_at > 2 * DRAIN_SECONDS + 1.0:
                    break  # something outside the group holds them; stop reading
        sel.close()
        code = child.wait()
        signal_group(child.pid, signal.SIGKILL)  # leftovers of a finished command go with it
        return 128 - code if code < 0 else code

    def _read_commands(self, sel: selectors.BaseSelector) -> None:
        assert self.channel is not None
        try:
            commands = self.channel.commands()
        except EOFError:
            sel.unregister(self.channel.fileno())
            self._lose_channel()
            self._obey("TERM")  # the launcher is gone: the command goes too
            return
        for what in commands:
            self._obey(what)


def _write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:
        pass  # whoever reads our output is gone; keep going so the command is still stopped
