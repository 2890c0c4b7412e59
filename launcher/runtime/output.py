"""Labelled, line-buffered output of every process, plus per-process log files.

Each process gets a :class:`ProcOutput`. Its two :class:`LineStream` objects
(stdout and stderr) take raw bytes from wherever they come from (a local pipe,
an ssh channel, a batch system's output file), decode UTF-8 incrementally (a
character split across two reads survives), cut lines at ``\\n`` or ``\\r``,
and write each line once, whole, with a ``[worker 0]`` prefix, to the
launcher's own stdout or stderr. The last lines are kept for the failure
report; with ``--log-dir`` every line also goes to the process's own file.
"""

from __future__ import annotations

import codecs
import collections
import os
import selectors
import sys
import threading
from typing import BinaryIO, Callable, Optional

from pscontract import CAUSE_PREFIX, parse_cause

TAIL_LINES = 20
_MAX_LINE = 64 * 1024  # a longer line without a newline is written in pieces

_COLORS = {"scheduler": "35", "server": "36", "worker": "32"}


def _use_color(stream: BinaryIO) -> bool:
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return os.isatty(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False


class Console:
    """The launcher's terminal: serialises whole lines from many threads."""

    def __init__(self, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
                 log_dir: str | None = None, color: bool | None = None) -> None:
        self.stdout = stdout or sys.stdout.buffer
        self.stderr = stderr or sys.stderr.buffer
        self.log_dir = log_dir
        #: applied to every line of every process before it is shown, logged or kept for the
        #: failure report (the job's secret values: see ``launcher.spec.env.Redactor``)
        self.redact: Callable[[str], str] | None = None
        #: called when any process's stdout or stderr ends (the supervisor looks at once: the
        #: process has most likely exited)
        self.on_stream_end: Callable[[], None] | None = None
        self.color = _use_color(self.stdout) if color is None else color
        self._lock = threading.Lock()
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)

    def proc(self, name: str, label: str, role: str) -> ProcOutput:
        """The output of one process; ``name`` is its log file's stem (``worker-0``)."""
        prefix = f"[{label}] "
        if self.color:
            prefix = f"\x1b[{_COLORS.get(role, '0')}m[{label}]\x1b[0m "
        log = None
        if self.log_dir:
            log = open(os.path.join(self.log_dir, f"{name}.log"), "ab", buffering=0)
        return ProcOutput(self, prefix.encode(), log)

    def write(self, err: bool, data: bytes) -> None:
        target = self.stderr if err else self.stdout
        with self._lock:
            try:
                target.write(data)
                target.flush()
            except (BrokenPipeError, ValueError):
                pass  # our own stdout went away (| head); keep supervising


class ProcOutput:
    """One process's output: two line streams, a tail buffer and an optional log file."""

    def __init__(self, console: Console, prefix: bytes, log: BinaryIO | None) -> None:
        self.console = console
        self.prefix = prefix
        self.log = log
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        #: ``(role, rank, reason)`` from the first ``pslaunch-cause:`` line the process wrote
        #: (:func:`pscontract.cause_line`): why it stopped the job, and who is at fault
        self.cause: Optional[tuple[Optional[str], Optional[int], str]] = None
        self._lock = threading.Lock()
        self.stdout = LineStream(self, err=False)
        self.stderr = LineStream(self, err=True)

    def emit(self, line: str, err: bool) -> None:
        redact = self.console.redact
        if redact is not None:
            line = redact(line)
        if self.cause is None and line.startswith(CAUSE_PREFIX):
            self.cause = parse_cause(line)
        data = line.encode("utf-8", "replace")
        self.console.write(err, self.prefix + data + b"\n")
        with self._lock:
            self.tail.append(line)
            if self.log is not None:
                try:
                    self.log.write(data + b"\n")
                except (OSError, ValueError):
                    pass

    def lines(self) -> list[str]:
        with self._lock:
            return list(self.tail)

    @property
    def closed(self) -> bool:
        return self.stdout.closed and self.stderr.closed

    def close(self) -> None:
        self.stdout.close()
        self.stderr.close()
        if self.log is not None:
            try:
                self.log.close()
            except OSError:
                pass


class LineStream:
    """Turns a byte stream into whole lines for :meth:`ProcOutput.emit`."""

    def __init__(self, owner: ProcOutput, err: bool) -> None:
        self.owner = owner
        self.err = err
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""
        self._lock = threading.Lock()
        self.closed = False
        self.done = threading.Event()

    def feed(self, data: bytes) -> None:
        with self._lock:
            text = self._partial + self._decoder.decode(data)
            lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
            self._partial = lines.pop()
            while len(self._partial) > _MAX_LINE:
                lines.append(self._partial[:_MAX_LINE])
                self._partial = self._partial[_MAX_LINE:]
        for line in lines:
            self.owner.emit(line, self.err)

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            rest = self._partial + self._decoder.decode(b"", final=True)
            self._partial = ""
        if rest:
            self.owner.emit(rest, self.err)
        self.done.set()
        hook = self.owner.console.on_stream_end
        if hook is not None:
            hook()


class PipePump:
    """One thread that moves bytes from many local pipes into their line streams."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._sel.register(self._rfd, selectors.EVENT_READ, None)
        self._pending: list[tuple[int, Callable[[bytes], None], Callable[[], None]]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pslaunch-pump", daemon=True)
        self._thread.start()

    def add(self, fd: int, feed: Callable[[bytes], None], close: Callable[[], None]) -> None:
        """Pump ``fd`` until EOF, then call ``close``. The pump owns and closes ``fd``."""
        os.set_blocking(fd, False)
        with self._lock:
            self._pending.append((fd, feed, close))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wfd, b"x")
        except (BlockingIOError, OSError):
            pass

    def _run(self) -> None:
        while True:
            with self._lock:
                for fd, feed, close in self._pending:
                    self._sel.register(fd, selectors.EVENT_READ, (feed, close))
                self._pending.clear()
                if self._stopping and len(self._sel.get_map()) == 1:
                    break
            for key, _ in self._sel.select(timeout=0.5):
                if key.data is None:
                    try:
                        os.read(self._rfd, 4096)
                    except BlockingIOError:
                        pass
                    continue
                feed, close = key.data
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    feed(chunk)
                else:
                    self._sel.unregister(key.fd)
                    os.close(key.fd)
                    close()
        self._sel.close()
        os.close(self._rfd)
        os.close(self._wfd)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop once every pipe reached EOF, or after ``timeout`` (pipes held open by
        leftover grandchildren are abandoned)."""
        with self._lock:
            self._stopping = True
        self._wake()
        self._thread.join(timeout)
