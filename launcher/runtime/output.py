"""Labelled, line-buffered output of every process, plus per-process log files.

Each process gets a :class:`ProcOutput`. Its two :class:`LineStream` objects
(stdout and stderr) take raw bytes from wherever they come from (a local pipe,
an ssh channel, a batch system's output file), decode UTF-8 incrementally (a
character split across two reads survives), cut lines at ``\\n`` or ``\\r``,
and write each line once, whole, with a ``[worker 0]`` prefix, to the
launcher's own stdout or stderr. The last lines are kept for the failure
report; with ``--log-dir`` every line also goes to the process's own file.

The log directory is opened once and must be the user's own, not a link; each log file is opened
relative to it, never through a link, and must be the user's regular file
(:mod:`launcher.node.safefiles`). A line that cannot be logged (a full disk, a link planted in
the directory) is still shown: the first such line is said at once in one warning, and the count
goes to the end of the job and ``--summary-json`` (:meth:`Console.log_errors`).

A line's control characters (terminal escapes: a window title, a clipboard write, a cleared
screen, a cursor moved up to fake a line of pslaunch) are shown, kept and logged visibly, as
``cat -v`` shows them (:func:`launcher.logs.printable`); with ``--log-raw`` the log files get the
line as the process wrote it. On the console only, the line's colours (a strict list of SGR
sequences: :func:`launcher.logs.printable_colors`) pass when the console is coloured (as the labels
are: a terminal, no ``NO_COLOR``), and such a line ends with a reset; on any other console they
are dropped (as the program would print without forced colours). Tabs stay; a ``\\r`` ends a
line, as a ``\\n`` does (a progress bar that redraws itself with ``\r`` is one line per redraw).

On a terminal the console can also keep one *status line* at the bottom of stdout
(:meth:`Console.set_status`, drawn by ``launcher.run.progress``): every write first erases
it (``\\r`` and erase-to-end-of-line), writes its whole lines, then draws it again, all under
the console's lock, so a status never ends up inside a labelled line. The launcher's own
log messages go through :func:`around_status` for the same reason (this module installs it as
:mod:`launcher.logs`'s write hook).

While a job's scheduler may still lose its port to another process, the supervisor counts what
the attempt's processes print as the attempt's (:meth:`Console.begin_attempt`): it is shown as it
comes, and when the attempt lost the race (the job starts again), :meth:`Console.discard` silences
everything the attempt prints from then on and says how many of its lines were shown (the
supervisor's one line about the restart points at them). Nothing is held back: a program that
never listens (not a ps-lite program) is seen at once, not after ``--start-timeout``.

The console says a thing once where many processes say the same (the log files keep every line):
a Python traceback that another process printed already, line for line, is one line, ``[worker 0]
(the same traceback as worker 1: 21 lines)``; a C++ stack trace's frames (``[bt] (3) ...``) are
left out; the reason of a ``pslaunch-cause:`` line (the launcher's own protocol, for the failure
report, never shown) is shown in full the first time a process prints it, and as ``(the cause
above)`` after that (a hung worker's heartbeat sentence, which the scheduler, every server and
every worker print). A process the scheduler told to stop writes the reason in a line of its own
first (:func:`pscontract.relayed_cause_line`): the pipes of two processes are read in no set order,
so the scheduler's cause line may come after a worker's words that repeat it.
"""

from __future__ import annotations

import codecs
import collections
import logging
import os
import re
import selectors
import sys
import threading
from typing import BinaryIO, Callable, Optional

from pscontract import CAUSE_PREFIX, cause_reason, parse_cause

from .. import logs
from ..errors import ConfigError
from ..logs import RESET, printable, printable_colors
from ..node import safefiles
from ..spec.only import Selector, shows

log = logging.getLogger(__name__)

TAIL_LINES = 20
_MAX_LINE = 64 * 1024  # a longer line without a newline is written in pieces

_COLORS = {"scheduler": "35", "server": "36", "worker": "32"}
TRACEBACK = "Traceback (most recent call last):"
MAX_TRACEBACK = 500  # a "traceback" longer than this is shown as it comes, not held to be compared
SAME_CAUSE = "(the cause above)"
#: a frame of a C++ stack trace (dmlc-core's, XGBoost's: ``  [bt] (3) .../libxgboost.so(+0x1a0d3e) [0x7f...]``)
_BACKTRACE = re.compile(r"\s*\[bt\] \(\d+\) ")
_CLOCK = re.compile(r"\d\d:\d\d:\d\d")  # (a time in a message: two tracebacks a second apart are the same)


def _use_color(stream: BinaryIO) -> bool:
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return os.isatty(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False


_ERASE = b"\r\x1b[K"  # back to column 0, erase to the end of the line

#: the console whose status line is on the screen now (for :func:`around_status`)
_active: Console | None = None


def is_terminal(stream: BinaryIO) -> bool:
    """``stream`` is a terminal that understands ``\\r`` and erase-line (not ``TERM=dumb``)."""
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return os.isatty(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return False


def around_status(write: Callable[[], None]) -> None:
    """Run ``write`` (which writes to the launcher's stdout or stderr) with the status line, if
    one is shown, erased first and drawn again after."""
    console = _active
    if console is None:
        write()
    else:
        console.around(write)


logs.write_around(around_status)


class Console:
    """The launcher's terminal: serialises whole lines from many threads."""

    def __init__(self, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
                 log_dir: str | None = None, color: bool | None = None, log_raw: bool = False,
                 only: tuple[Selector, ...] = ()) -> None:
        self.stdout = stdout or sys.stdout.buffer
        self.stderr = stderr or sys.stderr.buffer
        self.log_dir = log_dir
        self.log_raw = log_raw  # the log files get the lines as written, control characters and all
        #: ``--only``: whose lines the console shows (empty: everyone's); the log files, the tails
        #: kept for the failure report and the observers get every line all the same
        self.only = only
        #: applied to every line of every process before it is shown, logged or kept for the
        #: failure report (the job's secret values: see ``launcher.spec.env.Redactor``)
        self.redact: Callable[[str], str] | None = None
        #: called when any process's stdout or stderr ends (the supervisor looks at once: the
        #: process has most likely exited)
        self.on_stream_end: Callable[[], None] | None = None
        self.color = _use_color(self.stdout) if color is None else color
        self._lock = threading.RLock()
        self._status = b""  # the status line now on the screen (empty: none)
        self._observers: dict[str, Callable[[str], None]] = {}
        #: called with ``(name, line, err)`` for every line of every process (the job page's
        #: model): after redaction, control characters made visible, ``--only`` or not
        self.tap: Callable[[str, str, bool], None] | None = None
        # every output made since Console.begin_attempt (None: no attempt counts), which a discard silences
        self._attempt: Optional[list[ProcOutput]] = None
        #: written to each log file as it is opened (a restart's attempt; None: nothing)
        self.log_banner: Optional[str] = None
        self._log_fd: Optional[int] = None  # the log directory, open
        self._lines_on_screen = 0  # the lines of processes shown so far (ProcOutput.shown_above)
        self._tracebacks: dict[tuple[str, ...], str] = {}  # each traceback shown, and whose it was
        self._causes: dict[str, bool] = {}  # each pslaunch-cause reason, and whether it was shown
        self._one_target: Optional[bool] = None  # stdout and stderr are one file (_same_target)
        self._not_logged = 0  # lines that could not be written to their log file
        self._log_error: Optional[str] = None  # the first reason
        if log_dir:
            try:
                self._log_fd = safefiles.open_dir(log_dir, f"--log-dir {log_dir}", create=True)
            except safefiles.Refused as e:
                raise ConfigError(str(e)) from None

    # -- the log files ----------------------------------------------------------------------

    def _open_log(self, name: str) -> Optional[int]:
        """``name``'s log file, opened for appending (None: it cannot be, and that was said)."""
        assert self._log_fd is not None
        try:
            return safefiles.open_file(self._log_fd, name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        except (OSError, ValueError) as e:
            self.log_failed(name, e)
            return None

    def log_failed(self, name: str, error: Optional[Exception], lines: int = 0) -> None:
        """A log file could not be opened or written (``error``; None: as was said before) and
        ``lines`` were not logged: the first time, one warning at once; every time, counted."""
        with self._lock:
            self._not_logged += lines
            if self._log_error is not None or error is None:
                return
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            self._log_error = reason if reason.startswith(name) else f"{name}: {reason}"
        log.warning("--log-dir %s: %s; the console still shows every line, the lines the log files miss are "
                    "counted (at the end and in --summary-json)", self.log_dir, self._log_error)

    def log_errors(self) -> Optional[dict]:
        """``{"lines_not_logged", "first_error"}`` when a line did not reach its log file, else None."""
        with self._lock:
            if self._log_error is None:
                return None
            return {"lines_not_logged": self._not_logged, "first_error": self._log_error}

    # -- the status line ------------------------------------------------------------------

    def set_status(self, text: str) -> None:
        """Show ``text`` (one line, already cut to the terminal's width) as the status line."""
        global _active
        data = text.encode("utf-8", "replace")
        with self._lock:
            if data == self._status:
                return
            self._status = data
            _active = self if data else None
            self._raw(self.stdout, _ERASE + data)

    def clear_status(self) -> None:
        self.set_status("")

    def around(self, write: Callable[[], None]) -> None:
        """Erase the status line, ``write``, draw the status line again (one lock)."""
        with self._lock:
            if self._status:
                self._raw(self.stdout, _ERASE)
            try:
                write()
            finally:
                if self._status:
                    self._raw(self.stdout, self._status)

    # -- an attempt's output ------------------------------------------------------------------

    def begin_attempt(self) -> None:
        """Count every output made from now on as the attempt's (a later :meth:`discard`
        silences them); what they print is shown as it comes."""
        with self._lock:
            self._attempt = []

    def discard(self) -> int:
        """Silence every output of the attempt from now on (it lost the scheduler's port and is
        stopped, to start again); how many of its lines were shown before."""
        with self._lock:
            for out in self._attempt or ():
                out.silenced = True
                out._close_log()
            shown = sum(out.lines_shown for out in self._attempt or ())
            self._attempt = None
            return shown

    def _raw(self, target: BinaryIO, data: bytes) -> None:
        try:
            target.write(data)
            target.flush()
        except (BrokenPipeError, ValueError, OSError):
            pass

    def observe(self, name: str, callback: Callable[[str], None]) -> None:
        """Call ``callback(line)`` for every line of the process ``name`` (``worker-0``) from now on."""
        self._observers[name] = callback

    def proc(self, name: str, label: str, role: str) -> ProcOutput:
        """The output of one process; ``name`` is its log file's stem (``worker-0``)."""
        prefix = f"[{label}] "
        if self.color:
            prefix = f"\x1b[{_COLORS.get(role, '0')}m[{label}]\x1b[0m "
        out = ProcOutput(self, prefix.encode(), None)
        out.shown = shows(self.only, name)
        out.label = label
        out.name = name
        if self._log_fd is not None:
            out.log_name = f"{name}.log"
            out.log = self._open_log(out.log_name)
            out.mark(self.log_banner)
        out.observer = self._observers.get(name)
        with self._lock:
            if self._attempt is not None:
                self._attempt.append(out)
        return out

    def write(self, err: bool, data: bytes) -> None:
        target = self.stderr if err else self.stdout
        with self._lock:
            if self._status:
                self._raw(self.stdout, _ERASE)
            try:
                target.write(data)
                target.flush()
            except (BrokenPipeError, ValueError):
                pass  # our own stdout went away (| head); keep supervising
            if self._status:
                self._raw(self.stdout, self._status)

    def _said_before(self, line: str, data: bytes) -> bytes:
        """``data`` (the line on the console) with the reason of a ``pslaunch-cause:`` line that a
        process showed before replaced by :data:`SAME_CAUSE` (under the lock)."""
        for reason, shown in self._causes.items():
            if reason in line:
                if not shown:
                    self._causes[reason] = True
                else:
                    data = data.replace(reason.encode("utf-8", "replace"), SAME_CAUSE.encode())
        return data

    def _same_target(self) -> bool:
        """stdout and stderr are the same file (a terminal, ``2>&1``): a line on either is above the
        report (looked at once)."""
        if self._one_target is None:
            try:
                a, b = os.fstat(self.stdout.fileno()), os.fstat(self.stderr.fileno())
                self._one_target = (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
            except (AttributeError, OSError, ValueError):
                self._one_target = self.stdout is self.stderr
        return self._one_target


class ProcOutput:
    """One process's output: two line streams, a tail buffer and an optional log file."""

    def __init__(self, console: Console, prefix: bytes, log: Optional[int]) -> None:
        self.console = console
        self.prefix = prefix
        self.log = log  # the log file's descriptor
        self.log_name: Optional[str] = None  # its name (None: no --log-dir)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.observer: Callable[[str], None] | None = None  # Console.observe
        #: ``(role, rank, reason)`` from the first ``pslaunch-cause:`` line the process wrote
        #: (:func:`pscontract.cause_line`): why it stopped the job, and who is at fault
        self.cause: Optional[tuple[Optional[str], Optional[int], str]] = None
        self.shown = True  # its lines reach the console (--only may leave them to the log file alone)
        self.silenced = False  # its attempt lost the scheduler's port: nothing of it is shown (Console.discard)
        self.lines_shown = 0  # lines shown on the console (Console.discard tells an attempt's)
        self.label = ""  # ``worker 1``: how the console names it
        self.name = ""  # ``worker-1``: its log file's stem (what Console.tap calls it)
        #: a traceback being printed, held until it ends to be compared (Console._tracebacks)
        self._block: Optional[list[tuple[str, bool, bytes, bytes]]] = None
        #: for each of its last lines shown: the console's count of lines then (None: not shown)
        self._shown_at: collections.deque[Optional[int]] = collections.deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()
        self.stdout = LineStream(self, err=False)
        self.stderr = LineStream(self, err=True)

    def mark(self, banner: Optional[str]) -> None:
        """Write ``banner`` (where an attempt begins) in the log file alone: the next attempt's
        lines follow the last attempt's in the same file."""
        if not banner:
            return
        with self._lock:
            if self.log is None:
                return
            try:
                os.write(self.log, (banner + "\n").encode())
            except OSError as e:
                failed = e
            else:
                return
        self.console.log_failed(self.log_name or "", failed, 1)

    def process_ended(self) -> None:
        """The process has ended (its output may still be in its pipes): look at it now."""
        hook = self.console.on_stream_end
        if hook is not None:
            hook()

    def emit(self, line: str, err: bool) -> None:
        redact = self.console.redact
        if redact is not None:
            line = redact(line)
        shown = printable(line)
        if self.cause is None and shown.startswith(CAUSE_PREFIX):
            self.cause = parse_cause(shown)
        with self._lock:
            self.tail.append(shown)
        data = logged = shown.encode("utf-8", "replace")
        if shown is not line:
            if self.console.log_raw:
                logged = line.encode("utf-8", "replace")
            if "\x1b[" in line:  # (colours pass to a coloured console, and are dropped on any other)
                on_console, kept = printable_colors(line, keep=self.console.color)
                data = (on_console + RESET if kept else on_console).encode("utf-8", "replace")
        if self.silenced:
            return
        tap = self.console.tap
        if tap is not None and not shown.startswith(CAUSE_PREFIX):  # (the launcher's protocol: never shown)
            tap(self.name, shown, err)
        self.lines_shown += self.shown
        self._deliver(shown, err, data, logged)

    def _deliver(self, line: str, err: bool, data: bytes, logged: bytes) -> None:
        """Show (unless ``--only`` leaves it out) and observe one line (``data``, the line as
        bytes), and log it (``logged``); a ``pslaunch-cause:`` line is not shown, and a traceback
        is held until it ends (:meth:`_hold_traceback`)."""
        if line.startswith(CAUSE_PREFIX):
            reason = cause_reason(line)
            if reason is not None:
                self.console._causes.setdefault(reason, False)
            self._log(line, logged)
            return
        if self._block is not None and self._block[0][1] == err or line == TRACEBACK:
            self._hold_traceback(line, err, data, logged)
            return
        if _BACKTRACE.match(line):  # (noise to a user: logged, not shown)
            self._log(line, logged)
            return
        if line.strip() == "Stack trace:":
            data += b" (its frames are left out here" + (b", not from its log file)" if self.log_name else b")")
        self._show(line, err, data, logged)

    def _show(self, line: str, err: bool, data: bytes, logged: bytes) -> None:
        """:meth:`_deliver`'s line on the console (a cause's reason said before shortened; unless
        ``--only`` leaves it out), and logged."""
        with self.console._lock:
            on_console = self.shown
            if on_console:
                self.console.write(err, self.prefix + self.console._said_before(line, data) + b"\n")
                self.console._lines_on_screen += 1
            above = err or self.console._same_target()
            self._shown_at.append(self.console._lines_on_screen if above and on_console else None)
        self._log(line, logged)

    def _log(self, line: str, logged: bytes) -> None:
        if self.observer is not None:
            self.observer(line)
        lost, failed = False, None
        with self._lock:
            if self.log is not None:
                try:
                    safefiles.write_all(self.log, logged + b"\n")
                except OSError as e:
                    lost, failed = True, e
            else:
                lost = self.log_name is not None  # (it could not be opened: that was said)
            name = self.log_name or ""
        if lost:
            self.console.log_failed(name, failed, lines=1)

    def _hold_traceback(self, line: str, err: bool, data: bytes, logged: bytes) -> None:
        """Keep the lines of a traceback until its last (the first that is not indented: the
        exception); then show it, or, where another process showed the same lines, one line that
        says so (every line is logged)."""
        if self._block is None:
            self._block = []
        self._block.append((line, err, data, logged))
        if len(self._block) > 1 and line[:1] not in (" ", "\t") or len(self._block) > MAX_TRACEBACK:
            self._end_traceback()

    def _end_traceback(self) -> None:
        """Show or note the traceback :meth:`_hold_traceback` kept (also when the output ends in it)."""
        block, self._block = self._block, None
        if not block:
            return
        console = self.console
        with console._lock:
            if not self.shown:  # (--only leaves it out: logged, and no shown traceback is said to be it)
                for b in block:
                    self._show(*b)
                return
            first = console._tracebacks.setdefault(tuple(_CLOCK.sub("", b[0]) for b in block), self.label)
            if first == self.label or len(block) == 1:
                for b in block:
                    self._show(*b)
                return
            note = f"(the same traceback as {first}: {len(block)} lines)"
            console.write(block[0][1], self.prefix + note.encode() + b"\n")
            console._lines_on_screen += 1
            for line, _err, _data, logged in block:
                self._shown_at.append(console._lines_on_screen)  # (shown above, as the note says)
                self._log(line, logged)

    def lines(self) -> list[str]:
        with self._lock:
            return list(self.tail)

    def stream_ended(self, err: bool) -> None:
        """One of its streams ended: a traceback it was printing there is shown now."""
        with self.console._lock:
            if self._block is not None and self._block[0][1] == err:
                self._end_traceback()

    def shown_above(self, window: int) -> bool:
        """Its last lines (up to :data:`TAIL_LINES`) are on the console with at most ``window``
        lines of any process after the first of them: a report just below need not show them again."""
        with self.console._lock:
            shown = list(self._shown_at)
            first = shown[0] if shown else None
            return first is not None and None not in shown and self.console._lines_on_screen - first <= window

    @property
    def closed(self) -> bool:
        return self.stdout.closed and self.stderr.closed

    def close(self) -> None:
        self.stdout.close()
        self.stderr.close()
        self._close_log()

    def _close_log(self) -> None:
        if not self.silenced:
            self._end_traceback()  # (a traceback cut short by the end of the output)
        with self._lock:
            log, self.log, self.log_name = self.log, None, None
        if log is not None:
            try:
                os.close(log)
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
        self.owner.stream_ended(self.err)
        self.done.set()
        hook = self.owner.console.on_stream_end
        if hook is not None:
            hook()


class PipePump:
    """One thread that moves bytes from many local pipes into their line streams, and says
    at once when a watched process has ended (a pidfd per process, where Linux has them)."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        self._sel.register(self._rfd, selectors.EVENT_READ, None)
        # (fd, feed, close): a pipe's bytes go to feed and its end to close; feed None is a pidfd
        self._pending: list[tuple[int, Optional[Callable[[bytes], None]], Callable[[], None]]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pslaunch-pump", daemon=True)
        self._thread.start()

    def add(self, fd: int, feed: Callable[[bytes], None], close: Callable[[], None]) -> None:
        """Pump ``fd`` until EOF, then call ``close``. The pump owns and closes ``fd``."""
        os.set_blocking(fd, False)
        with self._lock:
            self._pending.append((fd, feed, close))
        self._wake()

    def watch_exit(self, pid: int, ended: Callable[[], None]) -> None:
        """Call ``ended`` from the pump's thread when child ``pid`` has ended (it is not reaped:
        the exit status stays for whoever polls it). A process closes its output a moment
        before it exits, so the end of its output alone would leave the supervisor to find
        the exit at its next look, 20 ms later. Without pidfds (Linux < 5.3), nothing."""
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        with self._lock:
            self._pending.append((pidfd, None, ended))  # (no feed: a pidfd has no data)
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
                if self._stopping and all(k.data is None or k.data[0] is None
                                          for k in self._sel.get_map().values()):
                    break
            for key, _ in self._sel.select(timeout=0.5):
                if key.data is None:
                    try:
                        os.read(self._rfd, 4096)
                    except BlockingIOError:
                        pass
                    continue
                feed, close = key.data
                if feed is None:  # a pidfd: the process has ended
                    self._sel.unregister(key.fd)
                    os.close(key.fd)
                    close()
                    continue
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
        for key in list(self._sel.get_map().values()):
            if key.data is not None and key.data[0] is None:
                os.close(key.fd)
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
