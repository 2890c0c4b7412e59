"""``pslaunch [OPTIONS] COMMAND...``: options and YAML in, one validated, frozen JobSpec out.

This module only parses and validates (into a :class:`~launcher.spec.job.JobSpec`, with the
chosen backend's own options checked by its class) and hands the spec to the supervisor or the
dry run. Every backend's options come from its class (``launcher.backends``); exit codes are
mapped in :mod:`.common`.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping, Optional

import click

import pscontract as pc

from .. import __version__, backends
from ..errors import ConfigError
from ..spec.hosts import read_hostfile
from ..spec.job import JobSpec, parse_memory_mb
from .common import add_backend_options, configure_logging, parse_env_item, parse_port_range_option

log = logging.getLogger("launcher")

HELP = """Start one scheduler, S servers and N workers, each running COMMAND.

\b
Every process gets the dmlc/ps-lite environment (DMLC_ROLE, DMLC_PS_ROOT_URI,
DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, DMLC_NUM_SERVER, DMLC_TASK_ID, ...), so
MXNet programs and our trainer run unchanged: DMLC_ROLE decides what each
process becomes. The scheduler runs on this machine; servers start first.

\b
Collective jobs (workers only; the tracker runs on this machine):
    pslaunch -n 2 -s 0 python xgb20.py                 # rabit: XGBoost <= 2.0
    pslaunch -n 4 --tracker xgboost python xgb.py       # XGBoost 2.1+
    pslaunch -n 8 -H hosts --tracker torch python ddp.py

\b
COMMAND starts at the first argument that is not an option of pslaunch, and
everything after it belongs to COMMAND (a leading -- is dropped):
    pslaunch -n 2 python train.py -n 5       # -n 5 goes to train.py

\b
Examples:
    pslaunch -n 2 -s 1 python train_mnist.py --kv-store dist_sync
    pslaunch -n 4 -H hosts --sync-dst-dir /tmp/job python train.py
    PS_VERBOSE=1 pslaunch -n 2 --env OMP_NUM_THREADS=2 python train.py
    pslaunch --config job.yaml --dry-run

\b
Exit code: the first failing process's code (128+N if killed by signal N),
0 if all succeed, 2 for a usage error, 124 after --timeout, 130 on Ctrl-C.
Hostfile lines: host, host:port, user@host:port, [ipv6]:port, host slots=N.
Before a multi-host job: pslaunch doctor -H hosts (checks ssh, python, ports).
"""


# --- YAML config -----------------------------------------------------------------------


def _option_keys(command: click.Command) -> dict[str, click.Parameter]:
    keys: dict[str, click.Parameter] = {}
    for p in command.params:
        if p.name in ("config", "version", "help") or p.name is None:
            continue
        keys[p.name] = p
        for opt in getattr(p, "opts", []):
            if opt.startswith("--"):
                keys[opt[2:].replace("-", "_")] = p
    return keys


def load_config(path: str, command: click.Command) -> dict[str, Any]:
    """YAML mapping of option names (``num-workers`` or ``num_workers``) to values."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read --config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise ConfigError(f"{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values, got {type(data).__name__}")
    keys = _option_keys(command)
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("-", "_")
        param = keys.get(key)
        if param is None:
            import difflib

            hint = difflib.get_close_matches(key, list(keys), n=1)
            suggestion = f" (did you mean {hint[0].replace('_', '-')!r}?)" if hint else ""
            raise ConfigError(f"{path}: unknown key {raw_key!r}{suggestion}; keys are the long option "
                              "names, e.g. num-workers, hostfile, env")
        assert param.name is not None
        if param.name in ("env", "env_server", "env_worker") and isinstance(value, dict):
            value = [k if v is None else f"{k}={v}" for k, v in value.items()]
        if param.name == "command" and isinstance(value, str):
            import shlex
            value = shlex.split(value)
        if getattr(param, "multiple", False) or param.name == "command":
            if isinstance(value, (str, int, float)):
                value = [value]
            if not isinstance(value, list):
                raise ConfigError(f"{path}: {raw_key} must be a list")
            value = [str(v) for v in value]
        elif isinstance(value, (list, dict)):
            raise ConfigError(f"{path}: {raw_key} takes a single value, not a {type(value).__name__}")
        elif isinstance(value, bool) and not getattr(param, "is_flag", False):
            raise ConfigError(f"{path}: {raw_key} takes a value, not true/false")
        out[param.name] = value
    return out


def _load_config_callback(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[str]:
    if value:
        assert ctx.command is not None
        ctx.default_map = {**(ctx.default_map or {}), **load_config(value, ctx.command)}
    return value


# --- the command ------------------------------------------------------------------------


@click.command(
    name="pslaunch", help=HELP,
    context_settings=dict(allow_interspersed_args=False, help_option_names=["-h", "--help"],
                          max_content_width=100),
)
@click.option("--config", type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
              callback=_load_config_callback, help="YAML file with any of these options as keys "
              "(num-workers: 2, hostfile: hosts, env: {OMP_NUM_THREADS: 2}, command: [python, x.py]); "
              "options on the command line win.")
@click.option("-n", "--num-workers", type=int, required=True, help="Number of workers.")
@click.option("-s", "--num-servers", type=int, default=None,
              help="Number of servers (default: the number of workers, as launch.py; 0 with "
                   "--tracker rabit, xgboost or torch). 0: no scheduler and no servers.")
@click.option("--tracker", type=click.Choice(pc.TRACKERS), default=None,
              help="What the processes find each other through: ps (a scheduler and servers; the "
                   "default with servers), rabit (dmlc's rabit tracker, for XGBoost up to 2.0; the "
                   "default with -s 0), xgboost (XGBoost 2.1+'s own tracker) or torch "
                   "(torch.distributed's env:// contract: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                   "...). The tracker runs on this machine; workers get its address.")
@click.option("--tracker-python", default=None, metavar="PYTHON",
              help="The Python (with xgboost 2.1+, or torch) that runs the xgboost tracker or the torch "
                   "rendezvous store on this machine (default: the command's interpreter when the "
                   "command is a Python, else python3).")
@click.option("-H", "--hostfile", "--host-file", "hostfile", type=str, default=None,
              help="Hostfile: one host per line (host, host:port, user@host:port, host slots=N).")
@click.option("--launcher", "--cluster", "launcher", type=click.Choice(backends.available()), default=None,
              envvar=pc.SUBMIT_CLUSTER, show_envvar=True,
              help="Where processes run (default: local without a hostfile, ssh with one).")
@click.option("--sync-dst-dir", default=None,
              help="Copy the working directory to DIR on every host first (ssh); DIR becomes "
                   "the remote working directory.")
@click.option("--env", "env", multiple=True, metavar="NAME[=VALUE]",
              help="Set a variable for every process; a bare NAME copies this shell's value. Repeatable.")
@click.option("--env-server", multiple=True, metavar="NAME=VALUE",
              help="Set a variable for servers only (NAME:VALUE works too). Repeatable.")
@click.option("--env-worker", multiple=True, metavar="NAME=VALUE",
              help="Set a variable for workers only (NAME:VALUE works too). Repeatable.")
@click.option("--host-ip", default=None, metavar="auto|ip|dns|ADDRESS",
              help="The scheduler's address as the nodes see it (default: from DMLC_INTERFACE, "
                   "else 127.0.0.1 for local jobs, else the address that routes to the hosts).")
@click.option("--port-range", default="9091-9998", show_default=True, metavar="LOW-HIGH",
              help="The scheduler takes the first free port in this range.")
@click.option("--start-timeout", type=float, default=60.0, show_default=True, metavar="SECONDS",
              help="Longest wait for the scheduler to listen and for nodes to register.")
@click.option("--kill-grace", type=float, default=10.0, show_default=True, metavar="SECONDS",
              help="After SIGTERM, wait this long before SIGKILL.")
@click.option("--timeout", type=float, default=None, metavar="SECONDS",
              help="Stop the whole job after this long (dumping Python stacks first); exit 124.")
@click.option("--dry-run", is_flag=True, help="Print the plan (hosts, roles, command, environment "
              "with secrets redacted) and exit without starting anything.")
@click.option("--log-dir", default=None, metavar="DIR",
              help="Also write each process's output to DIR/<role>-<rank>.log.")
@click.option("--summary-json", default=None, metavar="FILE",
              help="Write one record per process (role, rank, host, pid, times, exit code, signal).")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
              help="The launcher's own messages.")
@click.option("--log-file", default=None, metavar="FILE", help="Also write the launcher's messages to FILE.")
@click.option("--p3", is_flag=True, help="Priority-based parameter propagation (sets DMLC_PS_VAN_TYPE=p3 "
              "and DMLC_PS_WATER_MARK=10 for every process, as launch.py --p3).")
# cluster schedulers (dmlc-submit's options)
@click.option("--queue", default=None, help="sge/yarn/slurm: queue (slurm: partition) to submit to.")
@click.option("--jobname", default=None, help="sge/yarn/slurm: job name (default: pslaunch-<program>).")
@click.option("--worker-cores", type=int, default=1, show_default=True, help="sge/yarn/slurm: cores per worker.")
@click.option("--worker-memory", default=None, help="sge/yarn/slurm: memory per worker (e.g. 2g, 512m; "
              "default: 1g on yarn, no limit on sge, the partition's default on slurm).")
@click.option("--server-cores", type=int, default=1, show_default=True, help="sge/yarn/slurm: cores per server.")
@click.option("--server-memory", default=None, help="sge/yarn/slurm: memory per server (as --worker-memory).")
@click.version_option(__version__, "--version", prog_name="pslaunch")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run_command(**kw: Any) -> None:
    spec = build_spec(kw, dict(os.environ))
    configure_logging(spec.log_level, spec.log_file)
    sys.exit(execute(spec))


def build_spec(kw: Mapping[str, Any], environ: Mapping[str, str]) -> JobSpec:
    """Turn parsed option values into a validated, frozen :class:`JobSpec`."""
    command = tuple(kw.get("command") or ())
    if command and command[0] == "--":
        command = command[1:]
    n = kw["num_workers"]
    tracker = kw.get("tracker")
    s = kw["num_servers"] if kw.get("num_servers") is not None else (n if tracker in (None, "ps") else 0)
    hostfile = kw.get("hostfile")
    hosts = read_hostfile(hostfile) if hostfile else ()
    launcher = kw.get("launcher") or ("ssh" if hostfile else "local")
    backend = backends.get(launcher)
    env = tuple(parse_env_item(e, "--env", environ, True) for e in kw.get("env") or ())
    env_server = tuple(parse_env_item(e, "--env-server", environ, False) for e in kw.get("env_server") or ())
    env_worker = tuple(parse_env_item(e, "--env-worker", environ, False) for e in kw.get("env_worker") or ())
    for role_env in (env_server, env_worker):
        try:  # what the processes would refuse at start is refused before anything starts
            pc.heartbeat_settings({**environ, **dict(env), **dict(role_env)})
        except pc.ClusterEnvError as e:
            raise ConfigError(str(e)) from None
    spec = JobSpec(
        command=command, num_workers=n, num_servers=s, launcher=launcher, hosts=hosts, hostfile=hostfile,
        sync_dst_dir=kw.get("sync_dst_dir"), env=env, env_server=env_server, env_worker=env_worker,
        environ=tuple(sorted(environ.items())), host_ip=kw.get("host_ip"),
        log_level=str(kw.get("log_level") or "INFO").upper(), log_file=kw.get("log_file"),
        queue=kw.get("queue"), jobname=kw.get("jobname"),
        worker_cores=kw.get("worker_cores", 1), server_cores=kw.get("server_cores", 1),
        worker_memory_mb=parse_memory_mb(kw["worker_memory"], "--worker-memory") if kw.get("worker_memory") else None,
        server_memory_mb=parse_memory_mb(kw["server_memory"], "--server-memory") if kw.get("server_memory") else None,
        dry_run=bool(kw.get("dry_run")), log_dir=kw.get("log_dir"), summary_json=kw.get("summary_json"),
        port_range=parse_port_range_option(kw.get("port_range") or "9091-9998"),
        start_timeout=kw.get("start_timeout", 60.0), kill_grace=kw.get("kill_grace", 10.0),
        timeout=kw.get("timeout"), workdir=os.getcwd(), p3=bool(kw.get("p3")),
        options=backend.make_options(kw), tracker=tracker, tracker_python=kw.get("tracker_python"),
    )
    backend.check_spec(spec)
    return spec


def execute(spec: JobSpec) -> int:
    """Run (or dry-run) the job; return the exit code."""
    from .. import trackers
    from ..run.report import format_dry_run
    from ..run.supervisor import dry_run_plan, run_job

    if spec.dry_run:
        backend = backends.get(spec.launcher)
        plan = dry_run_plan(spec, backend)
        click.echo(format_dry_run(spec, plan, backend.dry_run(spec, plan), inherits=not backend.remote,
                                  tracker=trackers.describe(spec, plan)))
        return 0
    return run_job(spec, adopt_orphans=True).exit_code


add_backend_options(run_command, ((cls.name, cls.options) for cls in backends.classes()))
