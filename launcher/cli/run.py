"""``pslaunch [OPTIONS] COMMAND...``: click's command, options and YAML in, one validated, frozen
JobSpec out (built by :mod:`.job`, with the chosen backend's own options checked by its class).

Every backend's options come from its class (``launcher.backends``); exit codes are mapped in
:mod:`.common` and :mod:`.clickutil`.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Optional, Sequence

import click

import pscontract as pc

from .. import __version__, backends, logs
from ..errors import ConfigError
from ..spec.job import RESTART_SCOPES, SCHEDULERS
from .clickutil import (
    BOUNDED_INT,
    DURATION,
    FINITE_FLOAT,
    WORKER_COUNT,
    JobCommand,
    OptionalValue,
    add_backend_options,
    options_given,
    takes_value,
)
from .config import load_config
from .hints import python_file_hint
from .job import looks_like_address, ui_value
from .job import run as run_job

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
0 if all succeed, 2 for a usage error, 127 if the program is not found,
126 if it is not executable, 124 after --timeout, 130 on Ctrl-C.
Hosts: -H FILE (lines: host, host:port, user@host:port, [ipv6]:port,
host slots=N, host gpus=0,2) or inline: -H h1,h2:2222,alice@h3.
Before a multi-host job: pslaunch doctor, then the job's own options and
command (ssh, python3, the command's program, interface, ports, reachability).
The job as Kubernetes YAML instead (Pods, or a Kubeflow PyTorchJob/MXJob):
pslaunch manifest --k8s-image IMAGE, then the job's own options and command.
From torchrun: pslaunch -n 4 --tracker torch python ddp.py (-n counts every
process of the job; docs/usage.md lists torchrun's and mpirun's flags).
"""


# --- YAML config (launcher.cli.config) ---------------------------------------------------


def _load_config_callback(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[str]:
    if value:
        assert ctx.command is not None
        ctx.default_map = {**(ctx.default_map or {}), **load_config(value, ctx.command)}
    return value


# --- the command ------------------------------------------------------------------------


@click.command(
    name="pslaunch", help=HELP, cls=JobCommand,
    context_settings=dict(allow_interspersed_args=False, help_option_names=["-h", "--help"],
                          max_content_width=100),
)
@click.option("--config", type=click.Path(dir_okay=False), is_eager=True, expose_value=False,
              callback=_load_config_callback, help="YAML file with any of these options as keys "
              "(num-workers: 2, hostfile: hosts, env: {OMP_NUM_THREADS: 2}, command: [python, x.py]); "
              "options on the command line win.")
@click.option("-n", "--num-workers", type=WORKER_COUNT, required=True, metavar="N|MIN:MAX",
              help="Number of workers. MIN:MAX (collective jobs: --tracker torch, rabit, xgboost): MAX at "
                   "first; with --max-restarts, when hosts were left out and no spare is left, the next "
                   "attempt runs as many as the hosts left hold, if at least MIN (WORLD_SIZE, DMLC_NUM_WORKER "
                   "follow). See docs/restarts.md.")
@click.option("-s", "--num-servers", type=BOUNDED_INT, default=None,
              help="Number of servers (default: the number of workers, as launch.py; 0 with "
                   "--tracker rabit, xgboost or torch). 0: no scheduler and no servers.")
@click.option("--tracker", type=click.Choice(pc.TRACKERS), default=None,
              help="What the processes find each other through: ps (a scheduler and servers; the "
                   "default with servers), rabit (dmlc's rabit tracker from XGBoost up to 2.0; the "
                   "default with -s 0), xgboost (XGBoost 2.1+'s own tracker) or torch "
                   "(torch.distributed's env:// contract: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, "
                   "...). The tracker runs on this machine; workers get its address.")
@click.option("--tracker-python", default=None, metavar="PYTHON",
              help="The Python that runs the tracker on this machine: one with xgboost 2.0 or older "
                   "for rabit, xgboost 2.1+ for xgboost, torch for torch (default: the command's "
                   "interpreter when the command is a Python, else python3).")
@click.option("--scheduler", type=click.Choice(SCHEDULERS), default="command", show_default=True,
              help="What runs as a ps job's scheduler: command (COMMAND with DMLC_ROLE=scheduler, as "
                   "launch.py does) or builtin (pslaunch's own ps-lite scheduler, for MXNet and other "
                   "ps-lite programs over the zmq van: it listens at once and spares the job one start "
                   "of COMMAND, about 1.5 s of CPU for MXNet; not for BytePS, DMLC_LOCAL or our trainer).")
@click.option("-H", "--hostfile", "--host-file", "hostfile", type=str, default=None, metavar="FILE|HOSTS",
              help="Hostfile: one host per line (host, host:port, user@host:port, host slots=N, host "
                   "gpus=0,2); - reads standard input. Or the hosts inline, comma-separated: -H h1,h2:2222,alice@h3 "
                   "(':N' is a port; slots: -H 'h1 slots=2,h2'). A name that is an existing file is a file.")
@click.option("--launcher", "--cluster", "launcher", type=click.Choice(backends.available()), default=None,
              envvar=pc.SUBMIT_CLUSTER, show_envvar=True,
              help="Where processes run (default: local without a hostfile, ssh with one).")
@click.option("--sync-dst-dir", default=None,
              help="Copy the working directory to DIR on every host first (ssh); DIR becomes "
                   "the remote working directory.")
@click.option("--env", "env", multiple=True, metavar="NAME[=VALUE]|GLOB",
              help="Set a variable for every process (NAME=VALUE, or launch.py's NAME:VALUE); a bare "
                   "NAME copies this shell's value (best for secrets: the value stays off the command "
                   "line); a glob ('WANDB_*', quoted) copies every variable of this shell that matches "
                   "(none: a warning). Repeatable; wins over --env-file.")
@click.option("--env-file", "env_file", multiple=True, metavar="FILE",
              help="Set the variables of a dotenv file for every process: NAME=VALUE lines (export "
                   "NAME=VALUE too, 'single' and \"double\" quotes, # comments; a bare NAME copies this "
                   "shell's value). No value reaches a command line. Repeatable; see docs/environment.md.")
@click.option("--env-server", multiple=True, metavar="NAME=VALUE",
              help="Set a variable for servers only (NAME:VALUE works too). Repeatable.")
@click.option("--env-worker", multiple=True, metavar="NAME=VALUE",
              help="Set a variable for workers only (NAME:VALUE works too). Repeatable.")
@click.option("--host-ip", default=None, metavar="auto|ip|dns|ADDRESS",
              help="The scheduler's address as the nodes see it (default: from DMLC_INTERFACE, "
                   "else 127.0.0.1 for local jobs, else the address that routes to the hosts).")
@click.option("--port-range", default="9091-9998", show_default=True, metavar="LOW-HIGH",
              help="The scheduler takes the first free port in this range.")
@click.option("--start-timeout", type=FINITE_FLOAT, default=60.0, show_default=True, metavar="SECONDS",
              help="Longest wait for the scheduler to listen, and for the backend to start the other "
                   "processes (remote wrappers, batch tasks leaving the queue). Also exported as "
                   "PS_START_TIMEOUT: how long pslaunch's own KVStore waits for every node to register "
                   "(MXNet's ps-lite reads no such variable and waits without limit).")
@click.option("--kill-grace", type=FINITE_FLOAT, default=10.0, show_default=True, metavar="SECONDS",
              help="After SIGTERM, wait this long before SIGKILL.")
@click.option("--timeout", type=FINITE_FLOAT, default=None, metavar="SECONDS",
              help="Stop the whole job after this long (dumping Python stacks first); exit 124.")
@click.option("--max-restarts", type=BOUNDED_INT, default=0, show_default=True, metavar="N",
              help="When a process fails, stop the whole job and start every role again, up to N times "
                   "for the whole job (a Ctrl-C, --timeout or an error before anything ran never restarts). "
                   "Each process learns its attempt from PSLAUNCH_ATTEMPT (0 first); a program resumes from "
                   "its own checkpoint (the bundled trainer: --resume). See docs/restarts.md.")
@click.option("--restart-delay", type=DURATION, default=1.0, show_default=True, metavar="DURATION",
              help="Wait this long before the first restart; each further one waits twice as long as the "
                   "last (at most 60s, +-10% jitter).")
@click.option("--restart-window", type=DURATION, default=None, metavar="DURATION",
              help="An attempt that runs this long (e.g. 1h) without failing gives the restart budget "
                   "back, and the delay starts again from --restart-delay.")
@click.option("--restart-scope", type=click.Choice(RESTART_SCOPES), default="job", show_default=True,
              help="What a failure restarts: job (every process) or process (a lost worker of a "
                   "parameter-server job is replaced in place, with its rank, while the scheduler, the servers "
                   "and the other workers run on; a lost server or scheduler still restarts the job). Each "
                   "replacement uses one of --max-restarts. See docs/restarts.md.")
@click.option("--host-cooldown", type=str, default=None, metavar="LOWER[:UPPER]",
              help="With --max-restarts: how long a host that was left out (lost, or its processes failed "
                   "first in 2 attempts in a row) stays out: LOWER the first time, then twice as long each "
                   "time, at most UPPER, plus up to LOWER of jitter (default 1m:1h). Hostfile lines marked "
                   "'spare' take such a host's place. See docs/restarts.md.")
@click.option("--gpus-per-process", type=BOUNDED_INT, default=None, metavar="N",
              help="Give each worker N GPUs of its host as CUDA_VISIBLE_DEVICES: a host's workers get "
                   "disjoint consecutive slices in local-rank order (0..N-1, N..2N-1, ...), taken from the "
                   "host's gpus= in the hostfile when it names them (-H 'h1 gpus=0,2'). Servers and the "
                   "scheduler get none. local and ssh launchers; not with --env CUDA_VISIBLE_DEVICES.")
@click.option("--dry-run", is_flag=True, help="Print the plan (hosts, roles, command, environment "
              "with secrets redacted) and exit without starting anything.")
@click.option("--log-dir", default=None, metavar="DIR",
              help="Also write each process's output to DIR/<role>-<rank>.log.")
@click.option("--only", "only", multiple=True, metavar="SELECTOR",
              help="Show only these processes' lines on the console: scheduler, server, worker, server:R, "
                   "worker:R, worker:A-B or rank:R (a worker's rank, as in a collective job), comma-separated "
                   "or repeated (--only worker:0-3,server). The --log-dir files still get every line, a failing "
                   "process's last lines are still in the failure report, and pslaunch's own lines (its "
                   "tracker's too) are always shown.")
@click.option("--log-raw", is_flag=True, help="Write the processes' output to --log-dir as they wrote it, "
              "terminal escapes and all. Without it the log files get what the console shows: control "
              "characters made visible, as cat -v does (ESC as ^[), so that no program's output sets "
              "the terminal's title, writes its clipboard or fakes a line of pslaunch.")
@click.option("--ui", "ui", cls=OptionalValue, looks_like=looks_like_address, flag_value="", default=None,
              metavar="[HOST:]PORT",
              help="Serve a live page of the job: every process's state, CPU, memory, throughput and last lines. "
                   "--ui alone: 127.0.0.1 on a free port; another address only as written (--ui 0.0.0.0:8080). "
                   "pslaunch prints its address with a secret token (#token=...); without it, every request gets "
                   "403.")
@click.option("--ui-linger", type=DURATION, default=0.0, metavar="DURATION",
              help="Keep serving the job page this long after the job ended (default: 0).")
@click.option("--report", default=None, metavar="FILE.html",
              help="When the job ends (any way), write the job page as one static HTML file (no scripts).")
@click.option("--summary-json", default=None, metavar="FILE",
              help="Write one record per process (role, rank, host, pid, times, exit code, signal).")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(list(logs.LEVELS), case_sensitive=False),
              help="The launcher's own messages.")
@click.option("--log-file", default=None, metavar="FILE", help="Also write the launcher's messages to FILE.")
@click.option("--no-progress", is_flag=True, help="No live status line (processes running per role and host, "
              "elapsed time, worker 0's latest Epoch/Batch and speed); it is shown only when stdout is a "
              "terminal.")
@click.option("--p3", is_flag=True, help="Priority-based parameter propagation (sets DMLC_PS_VAN_TYPE=p3 "
              "and DMLC_PS_WATER_MARK=10 for every process, as launch.py --p3).")
# cluster schedulers (dmlc-submit's options)
@click.option("--queue", default=None, help="sge/yarn/slurm: queue (slurm: partition) to submit to.")
@click.option("--jobname", default=None, help="sge/yarn/slurm: job name (default: pslaunch-<program>).")
@click.option("--worker-cores", type=BOUNDED_INT, default=1, show_default=True,
              help="sge/yarn/slurm: cores per worker.")
@click.option("--worker-memory", default=None, help="sge/yarn/slurm: memory per worker (e.g. 2g, 512m; "
              "default: 1g on yarn, no limit on sge, the partition's default on slurm).")
@click.option("--server-cores", type=BOUNDED_INT, default=1, show_default=True,
              help="sge/yarn/slurm: cores per server.")
@click.option("--server-memory", default=None, help="sge/yarn/slurm: memory per server (as --worker-memory).")
@click.version_option(__version__, "--version", prog_name="pslaunch")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run_command(**kw: Any) -> None:
    command = [str(a) for a in kw.get("command") or ()]
    command = command[1:] if command[:1] == ["--"] else command
    if kw.get("ui"):
        ui_value(kw["ui"])  # (--ui python train.py: that, before a hint about train.py)
    hint = python_file_hint(command, options_given(click.get_current_context(), command), os.environ, os.getcwd())
    if hint:  # (before anything starts: torchrun runs a script with python, pslaunch as it is given)
        raise ConfigError(hint)
    sys.exit(run_job(kw, dict(os.environ)))


_CORE_PARAMS = len(run_command.params)


def with_backend_options() -> click.Command:
    """:data:`run_command` with every backend's options as well (it imports every backend
    module, which a plain job's command line does not need). ``--help``, a YAML config and tests
    want them all."""
    if len(run_command.params) == _CORE_PARAMS:
        add_backend_options(run_command, ((cls.name, cls.options) for cls in backends.classes()))
    return run_command


def add_job_options(command: click.Command, optional: bool = False) -> None:
    """Give ``command`` (a subcommand that takes a job's command line as it is: ``pslaunch
    doctor``, ``pslaunch manifest``) every option of a run, pslaunch's and every backend's, that it
    has not of its own (``--version`` excepted), before its arguments; ``optional``: none of them
    required."""
    names = {p.name for p in command.params}
    spellings = set(takes_value(command.params))
    extra = []
    for p in with_backend_options().params:
        if not isinstance(p, click.Option) or p.name in names or p.name == "version" or \
                any(o in spellings for o in (*p.opts, *p.secondary_opts)):
            continue
        q = copy.copy(p)
        if optional:
            q.required = False
        extra.append(q)
    cut = next(i for i, p in enumerate(command.params) if isinstance(p, click.Argument))
    command.params[cut:cut] = extra


def command_for(args: Sequence[str]) -> click.Command:
    """The command that parses ``args``: the core options alone when ``args`` cannot name a
    backend's option, else :func:`with_backend_options`.

    Click stops at the first argument that is not an option (the job's command), so this reads
    options the same way up to there: a long option must be a core one (exactly: click has no
    abbreviations), a short one a core one whose value is attached or follows. Anything else
    (a backend's option, a typo for click to explain, ``--config``, ``--help``) takes the full
    command: the outcome of parsing never depends on this shortcut, only its cost does.
    """
    arity = takes_value(p for p in run_command.params[:_CORE_PARAMS] if p.name not in ("config", "help"))
    optional = {o: p for p in run_command.params if isinstance(p, OptionalValue) for o in p.opts}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            return run_command
        name = arg.partition("=")[0] if arg.startswith("--") else arg[:2]
        if name not in arity:
            return with_backend_options()
        attached = ("=" in arg) if arg.startswith("--") else len(arg) > 2
        if attached and not arity[name]:
            return with_backend_options()  # (combined short flags: click's to read)
        if name in optional and not attached:  # (--ui: a value when the next argument looks like one)
            i += 2 if i + 1 < len(args) and optional[name].looks_like(args[i + 1]) else 1
            continue
        i += 2 if arity[name] and not attached else 1
    return run_command
