"""``pslaunch doctor``: the command, which takes a job's own command line; the checks are
``launcher.run.doctor`` (hosts over ssh) and ``launcher.run.preflight`` (a batch system's own)."""

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
from .clickutil import JobCommand, invoke
from .common import configure_logging, job_env, parse_port_range_option, read_hosts_option
from .run import add_job_options

#: doctor checks what an ssh job needs, over the ssh backend's connection settings
SSH = SSHBackend


def _own_doctor(cls: type[Backend]) -> bool:
    """Whether ``cls`` (or a base class of its own) overrides :meth:`Backend.doctor`."""
    return next(c for c in cls.__mro__ if "doctor" in vars(c)) is not Backend


#: the backends with checks of their own (slurm): ``--launcher NAME`` runs those instead of the hosts'
CHECKED = [cls for cls in backends.classes() if _own_doctor(cls)]

DOCTOR_HELP = f"""Check what a job needs before it runs, and print one table. Give it the
job's own command line: the options it does not check are accepted and ignored.

\b
With -H (the hosts, checked in parallel over ssh), per host: ssh (connection,
host key, authentication), python3 (what pslaunch's remote wrapper runs),
cwd (the job's directory), program (COMMAND's program as the job finds it;
if it is a Python, its version and the script or -m module; with
--sync-dst-dir, a file the sync sends counts as there), imports (only with
--check-import), interface (what DMLC_INTERFACE selects there), port (a free
one on that address), reach (a TCP connection back to this host's scheduler
address). Anything else is listed as information.

\b
With --launcher {"|".join(c.name for c in CHECKED)}: what this host lacks for that batch system:
its client commands, munge, the controller, the partition (--queue, else the
default one) and its free nodes (inside an allocation: that SLURM_JOB_ID is
running), and the scheduler's address (DMLC_INTERFACE or --host-ip).

\b
Exit code 0 when every check passes, 1 otherwise, 2 for a usage error.

\b
Examples (the job's options and command, as pslaunch would get them):
    pslaunch doctor -n 2 -s 1 -H hosts --host-ip 10.1.0.5 \\
        --env DMLC_INTERFACE=10.1.0.0/16 /opt/venv/bin/python train.py
    pslaunch doctor -n 8 -H hosts --tracker torch --sync-dst-dir /tmp/job python ddp.py
    pslaunch doctor --launcher slurm --queue gpu --env DMLC_INTERFACE=10.1.0.0/16
    pslaunch doctor --launcher ray -n 8 -s 2 --worker-cores 2 --host-ip 10.1.0.5
"""


@click.command(name="pslaunch doctor", help=DOCTOR_HELP, cls=JobCommand,
               context_settings=dict(help_option_names=["-h", "--help"], max_content_width=100,
                                     allow_interspersed_args=False))
@click.option("-H", "--hostfile", "--host-file", "hostfile", default=None, metavar="FILE|HOSTS",
              help="The job's hostfile, or its hosts inline (-H h1,h2:2222,alice@h3): the hosts to check.")
@click.option("--sync-dst-dir", default=None, metavar="DIR",
              help="The job's remote working directory (default: this directory's path); the sync creates it "
                   "and sends this directory's files there.")
@click.option("--python", "python", default=None, metavar="PYTHON",
              help="Also check this Python (path or name on the job's PATH): when COMMAND does not start with "
                   "one, or with no COMMAND.")
@click.option("--check-import", "imports", multiple=True, metavar="MODULE",
              help="Check that the job's Python imports MODULE in the job's directory (e.g. trainer). "
                   "Repeatable.")
@click.option("--env", "env", multiple=True, metavar="NAME[=VALUE]|GLOB",
              help="A variable the job sets (DMLC_INTERFACE, PYTHONPATH, PATH, ...), or a glob of this shell's "
                   "('WANDB_*'); --env-file's variables count too. Repeatable.")
@click.option("--host-ip", default=None, metavar="auto|ip|dns|ADDRESS", help="The scheduler's address.")
@click.option("--port-range", default="9091-9998", show_default=True, metavar="LOW-HIGH",
              help="The scheduler's port range (reachability is tested on its first free port).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def doctor_command(**kw: Any) -> None:
    environ = dict(os.environ)
    env = dict(job_env(kw.get("env") or (), kw.get("env_file") or (), environ))  # (as the job's: globs, files)
    checked = next((c for c in CHECKED if c.name == kw.get("launcher")), None)
    if checked is not None:
        code, report = run_preflight(checked, environ, env=env, host_ip=kw.get("host_ip"), queue=kw.get("queue"),
                                     options=checked.make_options(kw), job=kw)
    elif not kw.get("hostfile"):
        raise click.UsageError("give the job's hosts: -H FILE or -H h1,h2 (or --launcher "
                               f"{'|'.join(c.name for c in CHECKED)} for a batch system's checks)")
    else:
        code, report = _check_hosts(kw, environ, env)
    click.echo(printable(report, newlines=True))  # (what hosts and batch systems answered is in it)
    sys.exit(code)


def _check_hosts(kw: dict[str, Any], environ: dict[str, str], env: dict[str, str]) -> tuple[int, str]:
    """The host-by-host checks over ssh: ``(exit code, report)``."""
    hosts = read_hosts_option(kw["hostfile"])
    opts = SSH.make_options(kw)  # the ssh backend's own rules for its connection and sync options
    command = tuple(kw.get("command") or ())
    if command and command[0] == "--":
        command = command[1:]
    for module in kw.get("imports") or ():
        if not all(part.isidentifier() for part in module.split(".")):
            raise ConfigError(f"--check-import {module!r}: expected a module name such as trainer or trainer.kv")
    sync = kw.get("sync_dst_dir")
    return run_doctor(hosts, opts, cwd=sync or os.getcwd(), env=env, environ=environ, host_ip=kw.get("host_ip"),
                      port_range=parse_port_range_option(kw["port_range"]), command=command,
                      python=kw.get("python"), imports=tuple(kw.get("imports") or ()),
                      sync_src=os.getcwd() if sync else None)


add_job_options(doctor_command, optional=True)


def main(args: Sequence[str]) -> int:
    """``pslaunch doctor ARGS``: returns the exit code."""
    configure_logging("WARNING")
    return invoke(doctor_command, list(args), "pslaunch doctor", "pslaunch doctor --help")
