"""``pslaunch``: options and YAML in, one :class:`~launcher.spec.JobSpec` out.

This module only parses, validates and maps errors to exit codes:

* 0: every process exited 0;
* the first failing process's exit code (128+N for signal N);
* 130 / 143 / 129: stopped by SIGINT / SIGTERM / SIGHUP;
* 124: ``--timeout`` expired;
* 2: a user mistake (bad option, hostfile line, YAML key): one line on stderr;
* 1: the job could not be started (one line on stderr).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping, Optional, Sequence

import click

from . import __version__, envvars
from .errors import ConfigError, LauncherError
from .hosts import read_hostfile
from .spec import BACKENDS, JobSpec, MPIOptions, SGEOptions, SSHOptions, parse_memory_mb

log = logging.getLogger("launcher")

HELP = """Start one scheduler, S servers and N workers, each running COMMAND.

\b
Every process gets the dmlc/ps-lite environment (DMLC_ROLE, DMLC_PS_ROOT_URI,
DMLC_PS_ROOT_PORT, DMLC_NUM_WORKER, DMLC_NUM_SERVER, DMLC_TASK_ID, ...), so
MXNet programs and our trainer run unchanged: DMLC_ROLE decides what each
process becomes. The scheduler runs on this machine; servers start first.

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


# --- value parsers ------------------------------------------------------------------


def parse_env_item(item: str, option: str, environ: Mapping[str, str], allow_copy: bool) -> tuple[str, str]:
    """``NAME=VALUE``; ``NAME:VALUE`` for ``--env-server/--env-worker`` (launch.py);
    a bare ``NAME`` copies the launcher's value (``--env`` only)."""
    item = str(item)
    for sep in ("=", ":"):
        name, found, value = item.partition(sep)
        if found and envvars.is_valid_name(name):
            if sep == ":" and allow_copy:
                break
            return name, value
    if allow_copy and envvars.is_valid_name(item):
        if item not in environ:
            raise ConfigError(f"{option} {item}: {item} is not set in this shell; "
                              f"export it or write {option} {item}=VALUE")
        return item, environ[item]
    form = "NAME or NAME=VALUE" if allow_copy else "NAME=VALUE (or NAME:VALUE)"
    shown = item
    for sep in ("=", ":"):
        name, found, _ = item.partition(sep)
        if found and envvars.is_secret(name):  # a malformed name does not make the value printable
            shown = f"{name}{sep}{envvars.REDACTED}"
            break
    raise ConfigError(f"{option} {shown!r}: expected {form} with NAME like OMP_NUM_THREADS")


def parse_port_range_option(text: str) -> tuple[int, int]:
    try:
        return envvars.parse_port_range(text)
    except ValueError as e:
        raise ConfigError(f"--port-range: {e}") from None


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
              help="Number of servers (default: the number of workers, as launch.py). "
                   "0: no scheduler and no servers.")
@click.option("-H", "--hostfile", "--host-file", "hostfile", type=str, default=None,
              help="Hostfile: one host per line (host, host:port, user@host:port, host slots=N).")
@click.option("--launcher", "--cluster", "launcher", type=click.Choice(BACKENDS), default=None,
              envvar=envvars.SUBMIT_CLUSTER, show_envvar=True,
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
# ssh
@click.option("--ssh-user", default=None, help="ssh: user for hosts whose line gives none.")
@click.option("--ssh-port", type=int, default=None, help="ssh: port for hosts whose line gives none.")
@click.option("--ssh-key", default=None, metavar="FILE", help="ssh: private key file.")
@click.option("--ssh-connect-timeout", type=float, default=10.0, show_default=True, metavar="SECONDS",
              help="ssh: connection timeout per host.")
@click.option("--ssh-keepalive", type=float, default=5.0, show_default=True, metavar="SECONDS",
              help="ssh: keep-alive interval; a host silent for 4 intervals is lost (the job fails), and its "
                   "processes stop themselves.")
@click.option("--accept-new-host-keys", is_flag=True,
              help="ssh: trust and record host keys not yet in known_hosts (a changed key is always refused).")
@click.option("--sync-exclude", multiple=True, metavar="PATTERN",
              help="--sync-dst-dir: skip files matching PATTERN (.git and __pycache__ always). Repeatable.")
@click.option("--sync-delete", is_flag=True, help="--sync-dst-dir: delete remote files that are gone here.")
# mpi
@click.option("--mpirun", default="mpirun", show_default=True, metavar="PATH",
              help="mpi: the mpirun to use (Open MPI or MPICH).")
@click.option("--mpirun-args", default=None, metavar="ARGS",
              help="mpi: extra mpirun options, one shell-quoted string "
                   "(e.g. \"--mca plm_rsh_args '-p 2222'\").")
# cluster schedulers (sge, yarn)
@click.option("--queue", default=None, help="sge/yarn: queue to submit to.")
@click.option("--jobname", default=None, help="sge/yarn: job name (default: pslaunch-<program>).")
@click.option("--worker-cores", type=int, default=1, show_default=True, help="sge/yarn: cores per worker.")
@click.option("--worker-memory", default=None, help="sge/yarn: memory per worker (e.g. 2g, 512m; "
              "default: 1g on yarn, no limit on sge).")
@click.option("--server-cores", type=int, default=1, show_default=True, help="sge/yarn: cores per server.")
@click.option("--server-memory", default=None, help="sge/yarn: memory per server (as --worker-memory).")
@click.option("--sge-native", default=None, metavar="TEXT", help="sge: extra native specification (qsub options).")
@click.option("--sge-log-dir", default=None, metavar="DIR", help="sge: task output files (default: <jobname>.log/).")
@click.option("--sge-pe", default="smp", show_default=True, metavar="PE",
              help="sge: parallel environment for --worker-cores/--server-cores above 1.")
@click.option("--files", multiple=True, metavar="FILE", help="yarn: extra files to ship. Repeatable.")
@click.option("--archives", multiple=True, metavar="FILE", help="yarn: archives to ship and unpack. Repeatable.")
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
    s = kw["num_servers"] if kw.get("num_servers") is not None else n
    hostfile = kw.get("hostfile")
    hosts = read_hostfile(hostfile) if hostfile else ()
    launcher = kw.get("launcher") or ("ssh" if hostfile else "local")
    if hostfile and launcher in ("local", "sge", "yarn"):
        raise ConfigError(f"--launcher {launcher} does not use a hostfile; drop -H {hostfile} "
                          "or choose --launcher ssh or mpi")
    if kw.get("sync_dst_dir") and launcher in ("local", "sge", "yarn"):
        raise ConfigError(f"--sync-dst-dir copies the working directory to remote hosts over ssh; "
                          f"--launcher {launcher} has none (drop --sync-dst-dir)")
    env = tuple(parse_env_item(e, "--env", environ, True) for e in kw.get("env") or ())
    env_server = tuple(parse_env_item(e, "--env-server", environ, False) for e in kw.get("env_server") or ())
    env_worker = tuple(parse_env_item(e, "--env-worker", environ, False) for e in kw.get("env_worker") or ())
    for option, value in (("--ssh-port", kw.get("ssh_port")),):
        if value is not None and not 1 <= value <= 65535:
            raise ConfigError(f"{option} {value}: must be a port number from 1 to 65535")
    if kw.get("ssh_key") and not os.path.isfile(os.path.expanduser(kw["ssh_key"])):
        raise ConfigError(f"--ssh-key {kw['ssh_key']}: no such file")
    for name in ("ssh_connect_timeout", "ssh_keepalive"):
        if kw.get(name) is not None and kw[name] <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive")
    for role_env in (env_server, env_worker):
        try:  # what the processes would refuse at start is refused before anything starts
            envvars.heartbeat_settings({**environ, **dict(env), **dict(role_env)})
        except envvars.ClusterEnvError as e:
            raise ConfigError(str(e)) from None
    ssh = SSHOptions(
        user=kw.get("ssh_user"), port=kw.get("ssh_port"),
        key=os.path.expanduser(kw["ssh_key"]) if kw.get("ssh_key") else None,
        connect_timeout=kw.get("ssh_connect_timeout") or 10.0,
        accept_new_host_keys=bool(kw.get("accept_new_host_keys")),
        sync_exclude=(".git", "__pycache__") + tuple(kw.get("sync_exclude") or ()),
        sync_delete=bool(kw.get("sync_delete")),
        keepalive=kw.get("ssh_keepalive") or 5.0,
    )
    return JobSpec(
        command=command, num_workers=n, num_servers=s, launcher=launcher, hosts=hosts, hostfile=hostfile,
        sync_dst_dir=kw.get("sync_dst_dir"), env=env, env_server=env_server, env_worker=env_worker,
        environ=tuple(sorted(environ.items())), host_ip=kw.get("host_ip"),
        log_level=str(kw.get("log_level") or "INFO").upper(), log_file=kw.get("log_file"),
        queue=kw.get("queue"), jobname=kw.get("jobname"),
        worker_cores=kw.get("worker_cores", 1), server_cores=kw.get("server_cores", 1),
        worker_memory_mb=parse_memory_mb(kw["worker_memory"], "--worker-memory") if kw.get("worker_memory") else None,
        server_memory_mb=parse_memory_mb(kw["server_memory"], "--server-memory") if kw.get("server_memory") else None,
        files=tuple(kw.get("files") or ()), archives=tuple(kw.get("archives") or ()),
        dry_run=bool(kw.get("dry_run")), log_dir=kw.get("log_dir"), summary_json=kw.get("summary_json"),
        port_range=parse_port_range_option(kw.get("port_range") or "9091-9998"),
        start_timeout=kw.get("start_timeout", 60.0), kill_grace=kw.get("kill_grace", 10.0),
        timeout=kw.get("timeout"), workdir=os.getcwd(), p3=bool(kw.get("p3")),
        ssh=ssh, mpi=MPIOptions(mpirun=kw.get("mpirun") or "mpirun",
                                extra_args=_split_args(kw.get("mpirun_args"), "--mpirun-args")),
        sge=SGEOptions(native=kw.get("sge_native"), log_dir=kw.get("sge_log_dir"), pe=kw.get("sge_pe") or "smp"),
    )


def _split_args(text: Optional[str], option: str) -> tuple[str, ...]:
    import shlex

    try:
        return tuple(shlex.split(text or ""))
    except ValueError as e:
        raise ConfigError(f"{option} {text!r}: {e}") from None


def execute(spec: JobSpec) -> int:
    """Run (or dry-run) the job; return the exit code."""
    from . import backends
    from .supervisor import dry_run_plan, format_dry_run, run_job

    if spec.dry_run:
        plan = dry_run_plan(spec)
        extra: Sequence[str] = ()
        try:
            backend_cls = backends.get(spec.launcher)
        except LauncherError as e:
            extra = [f"note: {e}"]
        else:
            extra = backend_cls.dry_run(spec, plan)
        click.echo(format_dry_run(spec, plan, extra))
        return 0
    return run_job(spec).exit_code


# --- logging -------------------------------------------------------------------------------


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


def configure_logging(level: str, log_file: Optional[str] = None) -> None:
    """The launcher's own messages go to stderr (and ``--log-file``), prefixed ``pslaunch:``."""
    root = logging.getLogger("launcher")
    root.handlers.clear()
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    root.propagate = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root.addHandler(handler)
    if log_file:
        try:
            fh = logging.FileHandler(log_file, encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot open --log-file {log_file}: {e.strerror or e}") from None
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(fh)


# --- entry point ---------------------------------------------------------------------------


def _fail(message: str, code: int) -> int:
    click.echo(f"pslaunch: error: {message}", err=True)
    return code


def main(argv: Optional[Sequence[str]] = None, prog_name: str = "pslaunch") -> int:
    """Console entry point. With ``argv=None`` it reads ``sys.argv`` and exits with the job's code."""
    args = list(sys.argv[1:] if argv is None else argv)
    code = _main(args, prog_name)
    if argv is None:
        sys.stdout.flush()
        sys.exit(code)
    return code


def _main(args: list[str], prog_name: str) -> int:
    if args and args[0] == "doctor":
        from . import doctor
        return doctor.main(args[1:])
    return invoke(run_command, args, prog_name, "pslaunch --help")


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
