"""click's side of the command line: the value types of pslaunch's options, backend options as
click options, and :func:`invoke` (click's outcomes as exit codes).
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Optional, Sequence

import click

from ..backends.base import BackendOption
from ..errors import ConfigError
from .common import fail, guarded
from .hints import foreign_flags


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


class WorkerCount(click.ParamType):
    """``-n``: a number of workers (``4``), or for a collective job that may go on with fewer after
    hosts were left out, ``MIN:MAX`` (``2:4``): the tuple ``(MIN, MAX)``. (Not an int type: a YAML
    config's ``num-workers: '2:4'`` is text for it.)"""

    name = "N|MIN:MAX"

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        if isinstance(value, tuple):
            return value
        text = str(value).strip()
        if ":" not in text:
            return BOUNDED_INT.convert(value, param, ctx)
        lo, _, hi = text.partition(":")
        if not (lo.strip().isdigit() and hi.strip().isdigit()) or len(lo.strip()) > 9 or len(hi.strip()) > 9:
            self.fail(f"{text[:40]!r} is not N or MIN:MAX (whole numbers, e.g. -n 4 or -n 2:4)", param, ctx)
        low, high = int(lo), int(hi)
        if not 1 <= low <= high:
            self.fail(f"{text[:40]!r}: MIN:MAX needs 1 <= MIN <= MAX, e.g. -n 2:4", param, ctx)
        return (low, high)


class Duration(FiniteFloat):
    """A length of time: seconds (``90``, ``1.5``) or a number with a unit, ``s``, ``m``, ``h`` or
    ``d`` (``90s``, ``30m``, ``1h``, ``2d``); never negative."""

    name = "duration"
    UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> float:
        if isinstance(value, (int, float)):
            number = super().convert(value, param, ctx)
        else:
            m = re.fullmatch(r"\s*(\d{1,9}(?:\.\d{1,6})?)\s*([smhd]?)\s*", str(value)[:40])
            if not m:
                self.fail(f"{str(value)[:40]!r} is not a length of time; give seconds or a number with s, m, h "
                          "or d, e.g. 90, 30m or 1h", param, ctx)
            number = float(m.group(1)) * self.UNITS[m.group(2) or "s"]
        if number < 0:
            self.fail(f"{value} is negative; give 0 or more", param, ctx)
        return number


FINITE_FLOAT = FiniteFloat()
DURATION = Duration()
BOUNDED_INT = BoundedInt()
WORKER_COUNT = WorkerCount()


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


# --- a job's command line -------------------------------------------------------------------------

#: ``ctx.meta`` key: the arguments of a :class:`JobCommand` as given (what an answer re-quotes)
ARGV = "pslaunch.argv"


def takes_value(params: Iterable[click.Parameter]) -> dict[str, bool]:
    """Each option's spelling -> whether it takes a value (``--help`` and ``--config`` included)."""
    out: dict[str, bool] = {}
    for p in params:
        if isinstance(p, click.Option):
            for name in (*p.opts, *p.secondary_opts):
                out[name] = not (p.is_flag or p.count)
    return out


class OptionalValue(click.Option):
    """An option whose value may be left out (``--ui`` or ``--ui 8080``): it takes the next
    argument only when ``looks_like`` says it is its value, so ``--ui python train.py`` is a bare
    ``--ui`` followed by the command (click alone would take ``python`` as the value)."""

    def __init__(self, *args: Any, looks_like: Any, **kw: Any) -> None:
        kw["is_flag"] = False
        super().__init__(*args, **kw)
        self.looks_like = looks_like


def attach_optional_values(args: Sequence[str], params: Iterable[click.Parameter]) -> list[str]:
    """``args`` with each :class:`OptionalValue` among the options that is not followed by its
    value written ``--ui=`` (its value when alone), so that click leaves the next argument alone;
    the options end, as click reads them, at the first argument that is not an option or a value."""
    params = list(params)
    optional = {name: p for p in params if isinstance(p, OptionalValue) for name in p.opts}
    arity = takes_value(params)
    out = list(args)
    i = 0
    while i < len(out):
        arg = out[i]
        if arg == "--" or arg == "-" or not arg.startswith("-"):
            break
        name, eq, _ = arg.partition("=") if arg.startswith("--") else (arg[:2], "", "")
        p = optional.get(arg)
        if p is not None:
            given = i + 1 < len(out) and p.looks_like(out[i + 1])
            if not given:
                out[i] = f"{arg}={p.flag_value}"
            i += 2 if given else 1
            continue
        attached = bool(eq) if arg.startswith("--") else len(arg) > 2
        i += 2 if arity.get(name) and not attached else 1
    return out


class JobCommand(click.Command):
    """A command that takes a job's options (``pslaunch`` and ``pslaunch doctor``): it keeps its
    arguments as given (``ctx.meta[ARGV]``), and answers torchrun's and mpirun's own flags among
    its options in pslaunch's spelling (:func:`.hints.foreign_flags`) before click reads them."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[ARGV] = list(args)
        args = attach_optional_values(args, self.params)
        answer = foreign_flags(args, takes_value(self.params))
        if answer:
            raise ConfigError(answer)
        return super().parse_args(ctx, args)


def options_given(ctx: click.Context, command: Sequence[str]) -> Optional[list[str]]:
    """The options of ``ctx``'s command line, before ``command`` (None when the arguments do not
    end with it: it came from a YAML config)."""
    argv = ctx.meta.get(ARGV)
    if argv is None:
        return None
    if not command:
        return list(argv)
    if list(argv[len(argv) - len(command):]) != list(command):
        return list(argv)
    options = list(argv[:len(argv) - len(command)])
    return options[:-1] if options[-1:] == ["--"] else options


def invoke(command: click.Command, args: list[str], prog_name: str, help_hint: str) -> int:
    """Run a click command and map every outcome to an exit code and at most one line on stderr."""
    def work() -> int:
        try:
            command.main(args=args, prog_name=prog_name, standalone_mode=False)
            return 0
        except click.exceptions.Exit as e:
            return e.exit_code
        except click.exceptions.Abort:
            return fail("aborted", 130)
        except click.UsageError as e:
            return fail(f"{e.format_message()} (see {help_hint})", 2)
        except click.ClickException as e:
            return fail(e.format_message(), e.exit_code)

    return guarded(work)
