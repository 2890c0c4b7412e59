"""``pslaunch doctor -H hosts``: the command; the checks are ``launcher.run.doctor``."""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import click

from .. import backends
from ..backends.base import Backend
from ..backends.ssh import SSHBackend
from ..errors import ConfigError
from ..logs import printable
from ..run.doctor import run_doctor
from ..run.preflight import run_preflight
from ..spec.hosts import read_hosts
from .clickutil import add_backend_options, invoke
from .common import configure_logging, parse_env_item, parse_port_range_option

#: doctor checks what an ssh job needs, over the ssh backend's connection settings
SSH = SSHBackend

DOCTOR_HELP = """Check every host before a job, in parallel, and print one table.

\b
Per host, what the job needs: ssh (connection, host key, authentication),
python3 (what pslaunch's remote wrapper runs), cwd (the job's directory),
program (COMMAND's program as the job finds it; if it is a Python, its
version and the script or -m module), imports (only with --check-import),
interface (what DMLC_INTERFACE selects there), port (a free one on that
address), reach (a TCP connection back to this host's scheduler address).
Anything else is listed as information. Exit code 0 when every check passes
on every host, 1 otherwise.

\b
Example (the job's options and command, as pslaunch would get them):
    pslaunch doctor -H hosts --host-ip 10.1.0.5 --env DMLC_INTERFACE=10.1.0.0/16 \\
        /opt/venv/bin/python train.py --kv-store dist_sync
"""


@click.command(name="pslaunch doctor", help=DOCTOR_HELP,
               context_settings=dict(help_option_names=["-h", "--help"], max_content_width=100,
                                     allow_interspersed_args=False))
@click.option("-H", "--hostfile", "--host-file", "hostfile", required=True, metavar="FILE|HOSTS",
              help="The job's hostfile, or its hosts inline (-H h1,h2:2222,alice@h3).")
@click.option("--sync-dst-dir", default=None, metavar="DIR",
              help="The job's remote working directory (default: this directory's path); the sync creates it.")
@click.option("--python", "python", default=None, metavar="PYTHON",
              help="Also check this Python (path or name on the job's PATH): when COMMAND does not start with "
                   "one, or with no COMMAND.")
@click.option("--check-import", "imports", multiple=True, metavar="MODULE",
              help="Check that the job's Python imports MODULE in the job's directory (e.g. trainer). "
                   "Repeatable.")
@click.option("--env", "env", multiple=True, metavar="NAME[=VALUE]",
              help="A variable the job sets (DMLC_INTERFACE, PYTHONPATH, PATH, ...). Repeatable.")
@click.option("--host-ip", default=None, metavar="auto|ip|dns|ADDRESS", help="The scheduler's address.")
@click.option("--port-range", default="9091-9998", show_default=True, metavar="LOW-HIGH",
              help="The scheduler's port range (reachability is tested on its first free port).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def doctor_command(**kw: Any) -> None:
    environ = dict(os.environ)
    hosts = read_hosts(kw["hostfile"])
    env = dict(parse_env_item(e, "--env", environ, True) for e in kw.get("env") or ())
    opts = SSH.make_options(kw)  # the ssh backend's own rules for its connection options
    command = tuple(kw.get("command") or ())
    if command and command[0] == "--":
        command = command[1:]
    for module in kw.get("imports") or ():
        if not all(part.isidentifier() for part in module.split(".")):
            raise ConfigError(f"--check-import {module!r}: expected a module name such as trainer or trainer.kv")
    code, report = run_doctor(hosts, opts, cwd=kw.get("sync_dst_dir") or os.getcwd(), env=env,
                              environ=environ, host_ip=kw.get("host_ip"),
                              port_range=parse_port_range_option(kw["port_range"]), command=command,
                              python=kw.get("python"), imports=tuple(kw.get("imports") or ()),
                              sync=bool(kw.get("sync_dst_dir")))
    click.echo(printable(report, newlines=True))  # (what hosts and batch systems answered is in it)
    sys.exit(code)


add_backend_options(doctor_command, [(SSH.name, SSH.connection_options)])


# --- pslaunch doctor --launcher NAME: a backend with checks of its own (slurm) ---------------------


def _own_doctor(cls: type[Backend]) -> bool:
    """Whether ``cls`` (or a base class of its own) overrides :meth:`Backend.doctor`."""
    return next(c for c in cls.__mro__ if "doctor" in vars(c)) is not Backend


CHECKED = [cls for cls in backends.classes() if _own_doctor(cls)]

BACKEND_DOCTOR_HELP = """Check what this host lacks for a batch-system backend, and print one table.

\b
--launcher slurm: Slurm's client commands, munge, slurmctld, the partition
(--queue, else the default one) and its free nodes (inside an allocation:
that SLURM_JOB_ID is running), and the scheduler's address (DMLC_INTERFACE
or --host-ip). Exit code 0 when every check passes, 1 otherwise.

\b
Example:
    pslaunch doctor --launcher slurm --queue gpu --env DMLC_INTERFACE=10.1.0.0/16
"""


@click.command(name="pslaunch doctor", help=BACKEND_DOCTOR_HELP,
               context_settings=dict(help_option_names=["-h", "--help"], max_content_width=100))
@click.option("--launcher", "launcher", required=True, type=click.Choice([c.name for c in CHECKED]),
              help="The backend to check.")
@click.option("--queue", default=None, help="The queue (partition) the job would use.")
@click.option("--env", "env", multiple=True, metavar="NAME[=VALUE]",
              help="A variable the job sets (DMLC_INTERFACE, ...). Repeatable.")
@click.option("--host-ip", default=None, metavar="auto|ip|dns|ADDRESS", help="The scheduler's address.")
def backend_doctor_command(**kw: Any) -> None:
    environ = dict(os.environ)
    cls = backends.get(kw["launcher"])
    env = dict(parse_env_item(e, "--env", environ, True) for e in kw.get("env") or ())
    code, report = run_preflight(cls, environ, env=env, host_ip=kw.get("host_ip"), queue=kw.get("queue"),
                                 options=cls.make_options(kw))
    click.echo(printable(report, newlines=True))  # (what hosts and batch systems answered is in it)
    sys.exit(code)


add_backend_options(backend_doctor_command, [(c.name, c.options) for c in CHECKED])


def _launcher_of(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--launcher NAME`` (or ``--launcher=NAME``) taken out of ``args``, among the options only:
    the job's COMMAND, which starts at the first argument that is not an option or an option's
    value, keeps its own ``--launcher``."""
    takes_value = {opt for p in doctor_command.params if isinstance(p, click.Option) and not p.is_flag
                   for opt in p.opts}
    rest = list(args)
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--" or not a.startswith("-"):
            break
        if a == "--launcher" and i + 1 < len(rest):
            return rest[i + 1], rest[:i] + rest[i + 2:]
        if a.startswith("--launcher="):
            return a.split("=", 1)[1], rest[:i] + rest[i + 1:]
        i += 2 if a in takes_value else 1
    return None, rest


def main(args: Sequence[str]) -> int:
    """``pslaunch doctor ARGS``: returns the exit code."""
    configure_logging("WARNING")
    name, rest = _launcher_of(args)
    if name is not None and name in {c.name for c in CHECKED}:
        return invoke(backend_doctor_command, ["--launcher", name, *rest], "pslaunch doctor",
                      "pslaunch doctor --help")
    if name is not None:
        args = rest  # a hostfile backend: the host-by-host checks over ssh
    return invoke(doctor_command, list(args), "pslaunch doctor", "pslaunch doctor --help")
