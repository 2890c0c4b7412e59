"""What every pslaunch command shares: value parsers, backend options, logging, exit codes.

Exit codes (mapped only in :func:`invoke`):

* 0: every process exited 0;
* the first failing process's exit code (128+N for signal N);
* 130 / 143 / 129: stopped by SIGINT / SIGTERM / SIGHUP;
* 124: ``--timeout`` expired;
* 2: a user mistake (bad option, hostfile line, YAML key): one line on stderr;
* 1: the job could not be started (one line on stderr).
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any, Iterable, Mapping, Optional, Sequence

import click

import pscontract as pc

from ..backends.base import BackendOption
from ..errors import ConfigError, LauncherError
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


class FiniteFloat(click.ParamType):
    """A float that is a real number of seconds: ``nan`` and ``inf`` are refused (a ``nan``
    deadline never passes, and ``inf`` waits for ever)."""

    name = "float"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{str(value)[:40]!r} is not a number", param, ctx)
        if not math.isfinite(number):
            shown = repr(str(value)) if len(str(value)) <= 40 else f"a {len(str(value)):,}-character value"
            self.fail(f"{shown} is not a finite number", param, ctx)
        return number


class BoundedInt(click.types.IntParamType):
    """An int of at most 9 digits: a huge number can only be a mistake, and C libraries (protobuf,
    DRMAA) overflow on it."""

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> int:
        text = str(value).strip()
        if len(text.lstrip("+-")) > 9 and text.lstrip("+-").isdigit():
            self.fail(f"a number of {len(text.lstrip('+-'))} digits is far too large", param, ctx)
        return int(super().convert(value, param, ctx))


FINITE_FLOAT = FiniteFloat()
BOUNDED_INT = BoundedInt()

# --- backend options as click options ------------------------------------------------------------

_KINDS = {"str": str, "int": BOUNDED_INT, "float": FINITE_FLOAT}


def click_option(opt: BackendOption, backend: str) -> click.Option:
    """The click option for one backend option (its help says which backend it is for)."""
    help_text = f"{backend}: {opt.help}"
    if opt.kind == "flag":
        return click.Option([*opt.flags, opt.param], is_flag=True, default=bool(opt.default), help=help_text)
    if opt.kind == "multiple":
        return click.Option([*opt.flags, opt.param], multiple=True, metavar=opt.metavar, help=help_text)
    return click.Option([*opt.flags, opt.param], type=_KINDS[opt.kind], default=opt.default, metavar=opt.metavar,
                        show_default=opt.show_default, help=help_text)


def add_backend_options(command: click.Command, backends: Iterable[tuple[str, Sequence[BackendOption]]]) -> None:
    """Append every backend's options to ``command`` (before ``--version`` and the arguments)."""
    cut = next((i for i, p in enumerate(command.params) if isinstance(p, click.Argument) or p.name == "version"),
               len(command.params))
    extra = [click_option(o, name) for name, options in backends for o in options]
    command.params[cut:cut] = extra


# --- logging ----------------------------------------------------------------------------------------


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.levelno >= logging.ERROR:
            return f"pslaunch: error: {msg}"
        if record.levelno >= logging.WARNING:
            return f"pslaunch: warning: {msg}"
        if record.levelno <= logging.DEBUG:
            return f"pslaunch: [{record.name}] {msg}"
        return f"pslaunch: {msg}"


class _StderrHandler(logging.StreamHandler):
    """stderr, around the live status line when one is shown (it must not end up inside a message)."""

    def emit(self, record: logging.LogRecord) -> None:
        from ..runtime.output import around_status

        around_status(lambda: super(_StderrHandler, self).emit(record))


def configure_logging(level: str, log_file: Optional[str] = None) -> None:
    """The launcher's own messages go to stderr (and ``--log-file``), prefixed ``pslaunch:``."""
    root = logging.getLogger("launcher")
    root.handlers.clear()
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    root.propagate = False
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root.addHandler(handler)
    if log_file:
        try:
            fh = logging.FileHandler(log_file, encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot open --log-file {log_file}: {e.strerror or e}") from None
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(fh)


# --- running a command --------------------------------------------------------------------------------


MAX_MESSAGE = 2000  # characters: an error about a huge argument must not repeat it whole


def _fail(message: str, code: int) -> int:
    message = " ".join(message.splitlines())
    if len(message) > MAX_MESSAGE:
        message = message[:MAX_MESSAGE] + f"... ({len(message) - MAX_MESSAGE:,} more characters)"
    click.echo(f"pslaunch: error: {message}", err=True)
    return code


def invoke(command: click.Command, args: list[str], prog_name: str, help_hint: str) -> int:
    """Run a click command and map every outcome to an exit code and at most one line on stderr."""
    try:
        command.main(args=args, prog_name=prog_name, standalone_mode=False)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.exceptions.Abort:
        return _fail("aborted", 130)
    except click.UsageError as e:
        return _fail(f"{e.format_message()} (see {help_hint})", 2)
    except click.ClickException as e:
        return _fail(e.format_message(), e.exit_code)
    except LauncherError as e:
        return _fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)

