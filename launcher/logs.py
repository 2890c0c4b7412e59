"""The launcher's own messages: ``pslaunch: ...`` lines on stderr, through the standard ``logging``.

Modules log with ``logging.getLogger(__name__)`` (every name under ``launcher``). :func:`configure`
gives the ``launcher`` logger its handlers: one to stderr with :class:`Formatter` (``pslaunch:
error: ...``, ``pslaunch: warning: ...``, ``pslaunch: ...``, and ``pslaunch: [name] ...`` for
debug), and with ``--log-file`` one to that file with timestamps. Where :func:`configure` was
never called (tests, a program that uses the launcher as a library), the messages go wherever
that program's ``logging`` sends them.

The stderr handler writes each line through a hook (:func:`write_around`): the live status line
(``launcher.runtime.output``) installs one that erases the status line first and draws it again
after, so a message never ends up inside it. This module imports nothing of the launcher.

:func:`printable` is the one place where text from outside (a process's output, a host's
answer, a network peer's message, a file) loses the control characters a terminal would act on
(escape sequences that set the window title, write the clipboard, clear the screen or move the
cursor to fake a line of pslaunch): they are shown as ``cat -v`` shows them (``ESC`` as ``^[``).
Every message of the launcher passes through it here (a value from outside inside a message
cannot carry a line break either, unless the message's own text has one). :func:`printable_colors`
is the same for a process's line on the console, but for the colours of a strict list of SGR
sequences (``ESC [ 32 m``), which it keeps (for a coloured console) or drops (for any other).
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Callable, TextIO

LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}

# The characters a terminal acts on: C0 (the tab aside), DEL, and C1 (U+0080-U+009F, the 8-bit
# CSI U+009B among them), as cat -v writes them: ^[ for ESC, ^? for DEL, M-^[ for U+009B.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_CONTROL_BUT_NEWLINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CARETS = {chr(c): ("M-" if c >= 0x80 else "") + "^" + chr((c & 0x7F) ^ 0x40)
           for c in (*range(0x20), *range(0x7F, 0xA0))}


def _caret(match: re.Match[str]) -> str:
    return _CARETS[match.group()]


def printable(text: str, newlines: bool = False) -> str:
    """``text`` with every control character but the tab (and the newline, with ``newlines``)
    made visible, as ``cat -v`` does: ``"\\x1b[2J"`` becomes ``"^[[2J"``. Other text (UTF-8 letters
    too) is returned as it is, and at once when there is nothing to change."""
    if text.isprintable():  # (the common case, and 2-3 times faster than the search below)
        return text
    if "\x1b" in text:  # (colours, the common escapes: at the speed of str.replace)
        text = text.replace("\x1b", "^[")
        if text.isprintable():
            return text
    pattern = _CONTROL_BUT_NEWLINE if newlines else _CONTROL
    return pattern.sub(_caret, text) if pattern.search(text) else text


# The colours a process may show on a coloured console: SGR sequences (ESC [ params m) whose params
# (";"-separated, an empty one is 0) are only reset 0, bold 1, faint 2, italic 3, underline 4, their
# ends 22-24, the 8 and 16 colours 30-37, 40-47, 90-97, 100-107, the defaults 39 and 49, and 256 or
# RGB colours 38;5;N, 48;5;N, 38;2;R;G;B, 48;2;R;G;B (each 0-255). Not blink 5, reverse 7, conceal 8.
_BYTE = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])?"
_COLOR = rf"(?:[0-4]|2[2-4]|[34][0-79]|9[0-7]|10[0-7]|[34]8;5;{_BYTE}|[34]8;2;{_BYTE};{_BYTE};{_BYTE})?"
_COLORS = rf"{_COLOR}(?:;{_COLOR})*"
_COLOR_SGR = re.compile(rf"\x1b\[(?=[0-9;]{{0,64}}m){_COLORS}m")  # (64 characters at most: the longest take 43)
_SGR = re.compile(r"\x1b\[([0-9;]*)m")  # any SGR sequence, colours or not
#: what ends a line that kept a colour: its colour never reaches the next line's label
RESET = "\x1b[0m"


def printable_colors(text: str, keep: bool) -> tuple[str, bool]:
    """``text`` as :func:`printable` makes it, but for its colours (``_COLOR_SGR``), which are
    kept as they are with ``keep`` (a coloured console) and dropped without; and whether a colour
    was kept (then the line must end with :data:`RESET`). Any other sequence, the 8-bit CSI and a
    malformed SGR are shown as :func:`printable` shows them."""
    if text.isprintable() or "\x1b[" not in text:
        return printable(text), False
    rest = _COLOR_SGR.sub("", text)
    if rest.isprintable():  # (colours and text only: the common case)
        return (text, True) if keep else (rest, False)
    parts = _SGR.split(text)  # text, params, text, params, ..., text
    shown = [printable(parts[0])]
    kept = False
    for i in range(1, len(parts), 2):
        params = parts[i]
        if not _COLOR_SGR.fullmatch(f"\x1b[{params}m"):
            shown.append(f"^[[{params}m")
        elif keep:
            shown.append(f"\x1b[{params}m")
            kept = True
        shown.append(printable(parts[i + 1]))
    return "".join(shown), kept


def _write(write: Callable[[], None]) -> None:
    write()


#: what runs a write of a line to stderr (see :func:`write_around`)
_around: Callable[[Callable[[], None]], None] = _write


def write_around(hook: Callable[[Callable[[], None]], None]) -> None:
    """Have ``hook(write)`` run every write of a line to stderr (``write`` writes the line)."""
    global _around
    _around = hook


def message_of(record: logging.LogRecord) -> str:
    """The record's message, :func:`printable` (line breaks only where its own text has them)."""
    return printable(record.getMessage(), newlines="\n" in str(record.msg))


class FileFormatter(logging.Formatter):
    """``--log-file``'s lines: timestamped, and :func:`printable` as on stderr."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = message_of(record)
        return super().formatMessage(record)


class Formatter(logging.Formatter):
    """One message as pslaunch prints it on stderr."""

    def format(self, record: logging.LogRecord) -> str:
        message = message_of(record)
        if record.levelno >= logging.ERROR:
            return f"pslaunch: error: {message}"
        if record.levelno >= logging.WARNING:
            return f"pslaunch: warning: {message}"
        if record.levelno <= logging.DEBUG:
            return f"pslaunch: [{record.name}] {message}"
        return f"pslaunch: {message}"


class StderrHandler(logging.Handler):
    """The current ``sys.stderr``, one whole line at a time, through the :func:`write_around` hook."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record) + "\n"

            def write() -> None:
                sys.stderr.write(text)
                sys.stderr.flush()

            _around(write)
        except Exception:
            self.handleError(record)


class _OpenFileHandler(logging.StreamHandler):
    """To a file opened by the caller (``logging.FileHandler`` opens by name, following links),
    which it closes when it is closed."""

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            super().close()


def terminal_only(name: str, message: str, *args: object) -> None:
    """Log ``message`` at INFO on stderr alone, whatever ``--log-level``: never to ``--log-file``
    (the job page's address with its token is a secret, for the user's terminal only)."""
    root = logging.getLogger("launcher")
    record = root.makeRecord(name, logging.INFO, "", 0, message, args, None)
    handlers = [h for h in root.handlers if isinstance(h, StderrHandler)]
    for handler in handlers:
        handler.handle(record)
    if not handlers:  # (configure was never called: a program using the launcher as a library)
        text = Formatter().format(record) + "\n"
        _around(lambda: (sys.stderr.write(text), sys.stderr.flush()) and None)


def configure(level: str, log_file: TextIO | None = None) -> None:
    """The launcher's messages at ``level`` and above go to stderr, prefixed ``pslaunch:``, and
    with ``log_file`` (an open text file, which the handler closes when replaced) also there,
    timestamped."""
    handlers: list[logging.Handler] = [StderrHandler()]
    handlers[0].setFormatter(Formatter())
    if log_file is not None:
        handlers.append(_OpenFileHandler(log_file))
        handlers[1].setFormatter(FileFormatter())
    root = logging.getLogger("launcher")
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.setLevel(LEVELS.get(level.upper(), logging.INFO))
    root.propagate = False
    for handler in handlers:
        root.addHandler(handler)
