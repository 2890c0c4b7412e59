"""``pslaunch doctor -H hosts``: the command; the checks are ``launcher.run.doctor``."""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import click

from .. import backends
from ..backends.base import Backend
from ..run.doctor import run_doctor
from ..spec.hosts import read_hostfile
from .common import (
    add_backend_options,
    configure_logging,
    invoke,
    parse_env_item,
    parse_port_range_option,
)

#: doctor checks what an ssh job needs, over the ssh backend's connection settings
SSH = backends.get("ssh")

DOCTOR_HELP = """Check every host of a hostfile before a job, in parallel, and print one table.

\b
Per host: ssh (connection, host key, authentication), python (path, version),
imports (launcher and trainer in the job's directory), interface (what
DMLC_INTERFACE selects there), port (a free one on that address), reach
(a TCP connection back to this host's scheduler address).
Exit code 0 when every check passes on every host, 1 otherwise.

\b
Example:
    pslaunch doctor -H hosts --python /opt/venv/bin/python --env DMLC_INTERFACE=10.1.0.0/16
"""


@click.command(name="pslaunch doctor", help=DOCTOR_HELP,
               context_settings=dict(help_option_names=["-h", "--help"], max_content_width=100))
@click.option("-H", "--hostfile", "--host-file", "hostfile", required=True, help="The job's hostfile.")
@click.option("--sync-dst-dir", default=None, metavar="DIR",
              help="The job's remote working directory (default: this directory's path).")
@click.option("--python", "python", default="python3", show_default=True,
              help="The Python the job runs on the hosts (a venv's python, for example).")
@click.option("--env", "env", multiple=True, metavar="NAME[=VALUE]",
              help="A variable the job sets (DMLC_INTERFACE, PYTHONPATH, ...). Repeatable.")
@click.option("--host-ip", default=None, metavar="auto|ip|dns|ADDRESS", help="The scheduler's address.")
@click.option("--port-range", default="9091-9998", show_default=True, metavar="LOW-HIGH",
              help="The scheduler's port range (reachability is tested on its first free port).")
def doctor_command(**kw: Any) -> None:
    environ = dict(os.environ)
    hosts = read_hostfile(kw["hostfile"])
    env = dict(parse_env_item(e, "--env", environ, True) for e in kw.get("env") or ())
    opts = SSH.make_options(kw)  # the ssh backend's own rules for its connection options
    code, report = run_doctor(hosts, opts, python=kw["python"], cwd=kw.get("sync_dst_dir") or os.getcwd(), env=env,
                              environ=environ, host_ip=kw.get("host_ip"),
                              port_range=parse_port_range_option(kw["port_range"]))
    click.echo(report)
    sys.exit(code)


add_backend_options(doctor_command, [(SSH.name, SSH.connection_options)])


# --- pslaunch doctor --launcher NAME: a backend with checks of its own (slurm) ---------------------


def _own_doctor(cls: type) -> bool:
    return cls.doctor.__func__ is not Backend.doctor.__func__  # type: ignore[attr-defined]


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
    from ..run.preflight import run_preflight

    environ = dict(os.environ)
    cls = backends.get(kw["launcher"])
    env = dict(parse_env_item(e, "--env", environ, True) for e in kw.get("env") or ())
    code, report = run_preflight(cls, environ, env=env, host_ip=kw.get("host_ip"), queue=kw.get("queue"),
                                 options=cls.make_options(kw))
    click.echo(report)
    sys.exit(code)


add_backend_options(backend_doctor_command, [(c.name, c.options) for c in CHECKED])


def _launcher_of(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``--launcher NAME`` (or ``--launcher=NAME``) taken out of ``args``."""
    rest = list(args)
    for i, a in enumerate(rest):
        if a == "--":
            break
        if a == "--launcher" and i + 1 < len(rest):
            return rest[i + 1], rest[:i] + rest[i + 2:]
        if a.startswith("--launcher="):
            return a.split("=", 1)[1], rest[:i] + rest[i + 1:]
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
