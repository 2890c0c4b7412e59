"""What every pslaunch command shares: value parsers, logging, exit codes (click's side is
:mod:`.clickutil`).

Exit codes:

* 0: every process exited 0;
* the first failing process's exit code (128+N for signal N);
* 130 / 143 / 129: stopped by SIGINT / SIGTERM / SIGHUP;
* 124: ``--timeout`` expired;
* 2: a user mistake (bad option, hostfile line, YAML key): one line on stderr;
* 1: the job could not be started (one line on stderr).

Exit codes are mapped only in :func:`guarded` and :func:`.clickutil.invoke`.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Mapping, Optional

import pscontract as pc

from .. import logs
from ..errors import ConfigError, LauncherError
from ..node import safefiles
from ..spec import env as jobenv

# --- value parsers ------------------------------------------------------------------------------


def parse_env_item(item: str, option: str, environ: Mapping[str, str], allow_copy: bool) -> tuple[str, str]:
    """``NAME=VALUE``, or launch.py's ``NAME:VALUE`` (a name never holds ``:``, so the forms cannot be
    confused; ``=`` is tried first: ``A=x:y`` sets A to ``x:y``); a bare ``NAME`` copies the launcher's
    value (``--env`` only)."""
    item = str(item)
    for sep in ("=", ":"):
        name, found, value = item.partition(sep)
        if found and jobenv.is_valid_name(name):
            return name, value
    if allow_copy and jobenv.is_valid_name(item):
        if item not in environ:
            raise ConfigError(f"{option} {item}: {item} is not set in this shell; "
                              f"export it or write {option} {item}=VALUE")
        return item, environ[item]
    form = "NAME, NAME=VALUE or NAME:VALUE" if allow_copy else "NAME=VALUE (or NAME:VALUE)"
    shown = item
    for sep in ("=", ":"):
        name, found, _ = item.partition(sep)
        if found and jobenv.is_secret(name):  # a malformed name does not make the value printable
            shown = f"{name}{sep}{jobenv.REDACTED}"
            break
    raise ConfigError(f"{option} {shown!r}: expected {form} with NAME like OMP_NUM_THREADS")


def parse_port_range_option(text: str) -> tuple[int, int]:
    if not str(text).strip():
        raise ConfigError("--port-range is empty: give LOW-HIGH, for example 9091-9998")
    if len(str(text)) > 40:
        raise ConfigError(f"--port-range {str(text)[:40]!r}...: give LOW-HIGH, for example 9091-9998")
    try:
        return pc.parse_port_range(text)
    except ValueError as e:
        raise ConfigError(f"--port-range: {e}") from None


# --- logging ----------------------------------------------------------------------------------------


def configure_logging(level: str, log_file: Optional[str] = None) -> None:
    """The launcher's own messages go to stderr (and ``--log-file``), prefixed ``pslaunch:``
    (:mod:`launcher.logs`). The file is opened as ``--log-dir``'s are: a link planted at its
    name is not followed, another user's file is not written."""
    stream = None
    if log_file:
        parent, name = os.path.split(os.path.abspath(log_file))
        try:
            dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fd = safefiles.open_file(dfd, name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666, what=log_file)
            finally:
                os.close(dfd)
        except OSError as e:
            raise ConfigError(f"cannot open --log-file {log_file}: {e.strerror or e}") from None
        except safefiles.Refused as e:
            raise ConfigError(f"cannot open --log-file: {e}; name a file of your own") from None
        stream = open(fd, "a", encoding="utf-8")
    logs.configure(level, stream)


# --- running a command --------------------------------------------------------------------------------


MAX_MESSAGE = 2000  # characters: an error about a huge argument must not repeat it whole


def fail(message: str, code: int) -> int:
    """Print ``message`` as pslaunch's one error line (folded, and cut when huge); return ``code``."""
    message = logs.printable(" ".join(message.splitlines()))  # (a host's or a file's words may be in it)
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + f"... ({len(message) - MAX_MESSAGE:,} more characters)"
    sys.stdout.flush()
    sys.stderr.write(f"pslaunch: error: {message}\n")
    sys.stderr.flush()
    return code


def guarded(work: Callable[[], int]) -> int:
    """Run ``work`` and map what it raises to an exit code and at most one line on stderr."""
    try:
        return work()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except LauncherError as e:
        return fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
