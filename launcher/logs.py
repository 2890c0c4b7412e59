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
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, TextIO

LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR}



def _write(write: Callable[[], None]) -> None:
    write()


#: what runs a write of a line to stderr (see :func:`write_around`)
_around: Callable[[Callable[[], None]], None] = _write


def write_around(hook: Callable[[Callable[[], None]], None]) -> None:
    """Have ``hook(write)`` run every write of a line to stderr (``write`` writes the line)."""
    global _around
    _around = hook


class Formatter(logging.Formatter):
    """One message as pslaunch prints it on stderr."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
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


def configure(level: str, log_file: TextIO | None = None) -> None:
    """The launcher's messages at ``level`` and above go to stderr, prefixed ``pslaunch:``, and
    with ``log_file`` (an open text file, which the handler closes when replaced) also there,
    timestamped."""
    handlers: list[logging.Handler] = [StderrHandler()]
    handlers[0].setFormatter(Formatter())
    if log_file is not None:
        handlers.append(_OpenFileHandler(log_file))
        handlers[1].setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("launcher")
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.setLevel(LEVELS.get(level.upper(), logging.INFO))
    root.propagate = False
    for handler in handlers:
        root.addHandler(handler)
