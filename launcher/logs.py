"""The launcher's own messages: ``pslaunch: ...`` lines on stderr, from :func:`getLogger` loggers.

The standard ``logging`` module (with ``traceback``, ``tokenize``, ``textwrap`` and ``string``)
costs 5 ms to import, a tenth of a small job's whole start-up. So a launcher whose messages go
only to stderr (:func:`configure` without a log file, the command line's usual case) writes
each line itself and never imports it; with ``--log-file``, or where :func:`configure` was never
called (tests, a program that uses the launcher as a library and sets up ``logging`` its own
way), every message goes through ``logging`` under the logger's name, as before. Either way a
line reads the same (:func:`line`).
"""

from __future__ import annotations

import sys
from _thread import allocate_lock

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Any, Optional

DEBUG, INFO, WARNING, ERROR = 10, 20, 30, 40
LEVELS = {"DEBUG": DEBUG, "INFO": INFO, "WARNING": WARNING, "ERROR": ERROR}

#: the level below which a message is dropped, when messages go straight to stderr; None: through logging
_direct: Optional[int] = None
_write_lock = allocate_lock()  # (one whole line at a time, from any thread)


def line(level: int, name: str, message: str) -> str:
    """One message as pslaunch prints it."""
    if level >= ERROR:
        return f"pslaunch: error: {message}"
    if level >= WARNING:
        return f"pslaunch: warning: {message}"
    if level <= DEBUG:
        return f"pslaunch: [{name}] {message}"
    return f"pslaunch: {message}"


def _to_stderr(text: str) -> None:
    from .runtime.output import around_status

    def write() -> None:
        with _write_lock:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()

    around_status(write)


class Logger:
    """A logger by name: ``debug``, ``info``, ``warning``, ``error`` with ``%``-style arguments."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 (logging's name)
        if _direct is not None:
            return level >= _direct
        import logging

        return logging.getLogger(self.name).isEnabledFor(level)

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        if _direct is not None:
            if level >= _direct:
                _to_stderr(line(level, self.name, msg % args if args else msg))
            return
        import logging

        logging.getLogger(self.name).log(level, msg, *args, **kwargs)

    def debug(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.log(DEBUG, msg, *args, **kwargs)

    def info(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.log(INFO, msg, *args, **kwargs)

    def warning(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.log(WARNING, msg, *args, **kwargs)

    def error(self, msg: str, *args: Any, **kwargs: Any) -> None:
        self.log(ERROR, msg, *args, **kwargs)


def getLogger(name: str) -> Logger:  # noqa: N802 (logging's name)
    return Logger(name)


def configure(level: str, log_file: Optional[str] = None) -> None:
    """The launcher's messages at ``level`` and above go to stderr, prefixed ``pslaunch:``, and
    with ``log_file`` also to that file (timestamped); raises OSError if it cannot be opened."""
    global _direct
    threshold = LEVELS.get(level.upper(), INFO)
    if not log_file:
        _direct = threshold
        return
    import logging

    class Formatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return line(record.levelno, record.name, record.getMessage())

    class StderrHandler(logging.Handler):
        """stderr, around the live status line when one is shown."""

        def emit(self, record: logging.LogRecord) -> None:
            _to_stderr(self.format(record))

    fh = logging.FileHandler(log_file, encoding="utf-8")
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    _direct = None
    root = logging.getLogger("launcher")
    root.handlers.clear()
    root.setLevel(threshold)
    root.propagate = False
    handler = StderrHandler()
    handler.setFormatter(Formatter())
    root.addHandler(handler)
    root.addHandler(fh)
