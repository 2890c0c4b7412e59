"""``pslaunch doctor -H hosts``: the command; the checks are ``launcher.run.doctor``."""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import click

from .. import backends
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


def main(args: Sequence[str]) -> int:
    """``pslaunch doctor ARGS``: returns the exit code."""
    configure_logging("WARNING")
    return invoke(doctor_command, list(args), "pslaunch doctor", "pslaunch doctor --help")
