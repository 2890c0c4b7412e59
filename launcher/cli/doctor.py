"""``pslaunch doctor -H hosts``: the command; the checks are ``launcher.run.doctor``."""

from __future__ import annotations

import os
import sys
from typing import Any, Sequence

import click

from .. import backends
from ..errors import ConfigError
from ..run.doctor import run_doctor
from ..spec.hosts import read_hosts
from .common import (
    add_backend_options,
    configure_logging,
    invoke,
    parse_env_item,
    parse_port_range_option,
)

#: doctor checks what an ssh job needs, over the ssh backend's connection settings
SSH = backends.get("ssh")

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
    click.echo(report)
    sys.exit(code)


add_backend_options(doctor_command, [(SSH.name, SSH.connection_options)])


def main(args: Sequence[str]) -> int:
    """``pslaunch doctor ARGS``: returns the exit code."""
    configure_logging("WARNING")
    return invoke(doctor_command, list(args), "pslaunch doctor", "pslaunch doctor --help")
