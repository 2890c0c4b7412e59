"""The slurm backend: servers and workers as job steps of a Slurm allocation, one step per role.

**Where.** Inside an allocation (``SLURM_JOB_ID`` set: under ``salloc``, in an ``sbatch``
script) the job runs in that allocation. Outside one, pslaunch asks Slurm for one with
``salloc --no-shell`` (S+N tasks of ``--*-cores`` CPUs and ``--*-memory`` each, the larger
role's; ``--queue`` as the partition, ``--jobname``, a time limit from ``--timeout``,
``--slurm-account``, ``--slurm-nodes``, ``--slurm-args``), waits for it (at most
``--start-timeout``), runs the job in it and cancels it at the end, however the job ended.

**Placement.** The hostfile backends' rule, over the allocation's nodes in Slurm's order:
servers first, then workers, round-robin (:func:`launcher.spec.plan.place`). In an allocation
pslaunch made, a node takes at most as many processes as Slurm allocated tasks on it (the
hostfile's ``slots=``). The scheduler runs on the launching host, as on every backend.

**How.** Each role is one step, ``srun --jobid J -n K --distribution arbitrary -w
NODE,NODE,...`` (the node of each task, in task order), ``--overlap`` (the two steps share the
allocation's CPUs: without it the second step waits for the first), ``--overcommit`` (an
allocation of one CPU per node still runs several processes), ``--kill-on-bad-exit=0``
(pslaunch, not Slurm, stops the job: it reports the first failure) and ``--label``. Each task
runs the task wrapper (``launcher.node.task --index slurm``: ``SLURM_PROCID`` is the index in
the role), which works out ``DMLC_NODE_HOST`` on its node and runs the command under the node
agent. The agent connects back to the launcher's hub (``launcher.backends.batch``): start,
output and exit code arrive as they happen, and the launcher stops processes gracefully and
makes them dump their stacks through it, which srun cannot do (it SIGKILLs its tasks on
SIGTERM). An agent that cannot connect writes the same frames in-band to its stdout and
stderr instead (``--in-band``: transport c of :mod:`launcher.node.protocol`), which srun
relays: nothing is lost, only graceful stops go through ``scancel --signal``.

**The environment.** srun carries the launcher's environment to the tasks (Slurm's default,
``--export=ALL``: loaded modules and virtual environments work as they do with srun), straight
to the nodes' slurmd: it is never part of the job's record (``scontrol show job``, ``squeue``).
The job's own variables, the secret among them, ride in srun's environment as the task document
of the step's role: ``PSLAUNCH_TASK`` (and ``PSLAUNCH_TASK_1``, ... when it is over 96 KiB: execve
refuses a single variable over 128 KiB), which the wrapper removes; nothing secret is on a
command line or in a file.

**Failures and leftovers.**

* srun's own messages are read: ``Node failure on sn2`` and slurmstepd's ``CANCELLED ... DUE
  TO NODE FAILURE`` (or ``TIME LIMIT``, ``PREEMPTION``) name why Slurm ended the steps. A
  process killed by a signal the launcher did not send is held back for a moment
  (:data:`HOLD`), so that when Slurm loses a node, the first failure reported is that node's
  process, named with its node, not a process Slurm stopped because of it.
* srun is started with a parent-death signal (SIGKILL): if pslaunch is killed with SIGKILL,
  srun dies with it, and srun's shepherd cancels the step. The agents, whose connection
  ends, stop their commands too, and the watchdog runs ``scancel`` on every step (and on the
  allocation pslaunch made). salloc gets SIGTERM when pslaunch dies, which withdraws a
  pending request.
* A worker lost under ``--restart-scope process`` is replaced by a step of one task on its node
  (:meth:`SlurmBackend.submit_replacement`), whose agent connects under an id the hub admits for
  it alone (:meth:`launcher.backends.batch.BatchBackend.replace`).
* At the end every step still running is cancelled (``scancel J.S``), and an allocation made
  here is cancelled and waited for until ``squeue`` no longer lists it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import pscontract as pc

from .. import external, node
from ..errors import BackendUnavailableError, ConfigError, LaunchError
from ..node import task as task_wrapper
from ..node.protocol import unwrap
from ..runtime.output import ProcOutput
from ..runtime.spawn import spawn, spawn_guard
from ..spec.job import Host, JobSpec, Role
from ..spec.plan import Plan, ProcSpec, place
from .base import BackendOption
from .batch import BatchBackend, BatchTask, agent_line, build_task_file, role_procs, task_roles

log = logging.getLogger(__name__)

#: The variable of srun's environment that carries the task document (see the module docstring).
TASK_ENV = "PSLAUNCH_TASK"
SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
#: srun options given as variables that would fight the ones pslaunch sets for its steps
#: (inherited from an sbatch/salloc that set them for its own tasks).
STEP_SHAPE_VARIABLES = ("SLURM_NTASKS_PER_NODE", "SLURM_NTASKS_PER_SOCKET", "SLURM_NTASKS_PER_CORE",
                        "SLURM_NTASKS_PER_GPU", "SLURM_DISTRIBUTION", "SLURM_HOSTFILE", "SLURM_ARBITRARY",
                        "SLURM_EXPORT_ENV")
#: The Slurm commands the backend runs (``check`` wants them on PATH).
COMMANDS = ("srun", "scontrol", "scancel")

#: How long ``scontrol show hostnames`` may take (it asks no daemon; an unreadable slurm.conf
#: makes it retry for a minute).
HOSTNAMES_TIMEOUT = 10.0
#: How long an exit by a signal the launcher did not send waits for Slurm to say why.
HOLD = 0.5
#: How long :meth:`SlurmBackend.release` waits for Slurm to drop the allocation it cancelled.
RELEASE_WAIT = 20.0
#: Extra minutes of the allocation's time limit beyond ``--timeout`` (stack dumps, grace, teardown).
TIME_MARGIN_S = 90.0
#: A node's state (``sinfo %t``) that means Slurm lost it.
_LOST_STATES = ("down", "fail", "drain", "boot", "futr", "unk", "npc", "plnd")

_LABEL = re.compile(r"^\s*(\d+): ?(.*)$", re.DOTALL)
_TASK_STATUS = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-\[\]]+): (.+)$")
_NODE_FAILURE = re.compile(r"^srun: error: Node failure on (\S+)")
_CANCELLED = re.compile(
    r"slurmstepd(?:-\S+)?: error: \*\*\* (?:STEP|JOB) (\S+) ON (\S+) CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))?"
    r"(?:,.*)? \*\*\*")
_GRANTED = re.compile(r"Granted job allocation (\d+)")
_PENDING = re.compile(r"Pending job allocation (\d+)")
_BAD_PARTITION = re.compile(r"\s|,")
_SIGNALS_BY_TEXT = {signal.strsignal(s) or "": int(s) for s in signal.valid_signals()
                    if 0 < int(s) < 65 and signal.strsignal(s)}


# --- options ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmOptions:
    """``--slurm-*``: the allocation pslaunch asks for, and what each step adds.

    Attributes:
        account: ``salloc --account``.
        nodes: how many nodes; in an allocation pslaunch makes, ``salloc --nodes``; inside an
            existing allocation, its first N nodes.
        args: more ``salloc`` options (``--constraint=ib --qos=high``), after pslaunch's own.
        srun_args: more ``srun`` options for every step (``--gpus-per-task=1``).
    """

    account: Optional[str] = None
    nodes: Optional[int] = None
    args: Optional[str] = None
    srun_args: Optional[str] = None

    def __post_init__(self) -> None:
        if self.nodes is not None and self.nodes < 1:
            raise ConfigError(f"--slurm-nodes must be at least 1, got {self.nodes}")
        if self.account is not None and (not self.account or re.search(r"\s", self.account)):
            raise ConfigError(f"--slurm-account {self.account!r}: an account name has no spaces")
        for option, text in (("--slurm-args", self.args), ("--slurm-srun-args", self.srun_args)):
            if text:
                try:
                    shlex.split(text)
                except ValueError as e:
                    raise ConfigError(f"{option} {text!r}: {e} (quote it as a shell would)") from None

    @property
    def salloc_extra(self) -> list[str]:
        return shlex.split(self.args) if self.args else []

    @property
    def srun_extra(self) -> list[str]:
        return shlex.split(self.srun_args) if self.srun_args else []


# --- builders and parsers (pure, but for the host lists that parse_job has Slurm expand) ------


def expand_ids(text: str) -> list[int]:
    """A Slurm id list: ``0-1,4`` -> ``[0, 1, 4]`` (the tasks in srun's messages, ``CPU_IDs=``
    of ``scontrol show job -d``).

    Raises:
        ValueError: not such a list.
    """
    ids: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        ids.extend(range(int(lo), int(hi) + 1) if sep else (int(lo),))
    return ids


@dataclass(frozen=True)
class Allocation:
    """One Slurm job (an allocation), from ``scontrol show job -d``.

    Attributes:
        nodes: the allocation's nodes, in Slurm's order.
        cpus: CPUs allocated on each node (same order; empty when Slurm did not say).
        made_here: pslaunch asked for it (and cancels it at the end).
    """

    job_id: str
    state: str
    reason: str = ""
    nodes: tuple[str, ...] = ()
    cpus: tuple[int, ...] = ()
    cpus_per_task: int = 1
    made_here: bool = False

    @property
    def nodelist(self) -> str:
        return ",".join(self.nodes)


def parse_job(text: str, job_id: str) -> Allocation:
    """The allocation ``job_id`` in the text of ``scontrol show job -d JOB``.

    Reads ``JobState``, ``Reason``, ``NodeList``, ``CPUs/Task`` and the detail lines
    ``Nodes=sn[0-1] CPU_IDs=0-1 Mem=200`` (the CPUs on each node). Of a heterogeneous job,
    only the component whose id is ``job_id`` (its first): srun runs steps there unless told
    ``--het-group``.

    The host lists are expanded by Slurm (:func:`hostnames`).

    Raises:
        LaunchError: the text holds no record of that job, or Slurm cannot expand its NodeList (a
            detail line that it cannot expand leaves the CPUs on each node unknown).
    """
    records = [r for r in re.split(r"\n\s*\n", text) if r.strip()]
    found = [r for r in records if re.search(rf"(?:^|\s)JobId={re.escape(job_id)}(?:\s|$)", r)]
    if not found:
        raise LaunchError(f"scontrol show job {job_id} printed no record of job {job_id}: "
                          f"{' '.join(text.split())[:200]}")
    rec = found[0]
    fields = dict(re.findall(r"(?:^|\s)([A-Za-z/:_]+)=(\S*)", rec))
    nodelist = fields.get("NodeList", "")
    expanded: dict[str, list[str]] = {}  # (the detail lines usually repeat the NodeList)

    def expand(hostlist: str) -> list[str]:
        if hostlist not in expanded:
            expanded[hostlist] = hostnames(hostlist)
        return expanded[hostlist]

    nodes = expand(nodelist) if nodelist and nodelist != "(null)" else []
    cpus: dict[str, int] = {}
    try:
        for m in re.finditer(r"(?:^|\s)Nodes=(\S+) CPU_IDs=(\S+)", rec):
            for n in expand(m.group(1)):
                cpus[n] = cpus.get(n, 0) + len(expand_ids(m.group(2)))
    except (ValueError, LaunchError):  # (the CPUs on each node stay unknown)
        cpus = {}
    per_node = tuple(cpus[n] for n in nodes) if nodes and all(n in cpus for n in nodes) else ()
    per_task = fields.get("CPUs/Task", "")
    reason = fields.get("Reason", "")
    return Allocation(job_id=job_id, state=fields.get("JobState", ""), reason="" if reason == "None" else reason,
                      nodes=tuple(nodes), cpus=per_node, cpus_per_task=int(per_task) if per_task.isdigit() else 1)


def task_cores(spec: JobSpec) -> int:
    """CPUs per task of an allocation pslaunch makes: the larger role's (one shape for all tasks)."""
    return max(spec.worker_cores, spec.server_cores if spec.num_servers else 1)


def task_memory_mb(spec: JobSpec) -> Optional[int]:
    """Memory per task of an allocation pslaunch makes: the larger role's, if any was given."""
    given = [m for m in (spec.worker_memory_mb, spec.server_memory_mb if spec.num_servers else None) if m]
    return max(given) if given else None


def time_limit_minutes(timeout: Optional[float], kill_grace: float) -> Optional[int]:
    """``salloc --time`` in minutes for ``--timeout``: room for the stack dumps, the grace period
    and the teardown after it, so that pslaunch, not Slurm, ends a job that runs too long."""
    if timeout is None:
        return None
    return max(1, math.ceil((timeout + kill_grace + TIME_MARGIN_S) / 60.0))


def partition_of(queue: Optional[str]) -> Optional[str]:
    """``--queue`` as a partition; ``None`` or dmlc's ``default`` leave the choice to Slurm."""
    if not queue or queue == "default":
        return None
    if _BAD_PARTITION.search(queue):
        raise ConfigError(f"--queue {queue!r}: give one partition name (sinfo lists them)")
    return queue


def build_salloc(spec: JobSpec, salloc: str = "salloc") -> list[str]:
    """The ``salloc`` that makes an allocation for ``spec`` (outside one).

    Example:
        >>> build_salloc(JobSpec(command=("python",), num_workers=3, num_servers=1, launcher="slurm",
        ...                      jobname="mnist", queue="gpu", worker_cores=2, worker_memory_mb=3000,
        ...                      timeout=600.0, kill_grace=10.0))
        ['salloc', '--no-shell', '--job-name=mnist', '--ntasks=4', '--cpus-per-task=2', '--partition=gpu', \
'--mem-per-cpu=1500M', '--time=13']
    """
    opts: SlurmOptions = spec.options or SlurmOptions()
    cores = task_cores(spec)
    argv = [salloc, "--no-shell", f"--job-name={spec.name}", f"--ntasks={spec.num_procs}",
            f"--cpus-per-task={cores}"]
    partition = partition_of(spec.queue)
    if partition:
        argv.append(f"--partition={partition}")
    if opts.nodes:
        argv.append(f"--nodes={min(opts.nodes, spec.num_procs)}")
    memory = task_memory_mb(spec)
    if memory:
        argv.append(f"--mem-per-cpu={math.ceil(memory / cores)}M")
    minutes = time_limit_minutes(spec.timeout, spec.kill_grace)
    if minutes:
        argv.append(f"--time={minutes}")
    if opts.account:
        argv.append(f"--account={opts.account}")
    return argv + opts.salloc_extra


def placement_hosts(alloc: Allocation, nodes: Optional[int] = None, procs: int = 0) -> tuple[Host, ...]:
    """The allocation's nodes as hostfile lines: with ``slots=`` (the tasks Slurm allocated
    on each: its CPUs over ``--cpus-per-task``) for an allocation made here, without (dmlc's
    round-robin) for the user's, or when those slots cannot hold ``procs`` processes (an
    allocation made with ``--overcommit`` has one CPU per node, whatever its task count)."""
    names = list(alloc.nodes[:nodes] if nodes else alloc.nodes)
    if alloc.made_here and alloc.cpus:
        per = max(alloc.cpus_per_task, 1)
        slots = [max(c // per, 1) for c in alloc.cpus[:len(names)]]
        if sum(slots) >= procs:
            return tuple(Host(n, slots=k) for n, k in zip(names, slots))
    return tuple(Host(n) for n in names)


def place_on(spec: JobSpec, hosts: Sequence[Host]) -> dict[tuple[Role, int], str]:
    """``(role, rank) -> node`` by the hostfile backends' rule (servers first, round-robin)."""
    try:
        slots = place(spec.num_workers, spec.num_servers, hosts)
    except ConfigError as e:
        raise LaunchError(f"the Slurm allocation has too few task slots: {e}") from None
    return {(s.role, s.rank): s.host.name for s in slots if s.host is not None}


def parse_version(text: str) -> Optional[tuple[int, int]]:
    """``srun --version`` (``slurm 22.05.8``, ``slurm-wlm 22.05.8``) -> ``(22, 5)``; None if unreadable."""
    m = re.search(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


#: ``--overlap`` exists from Slurm 20.11, which made steps exclusive by default; before, steps shared CPUs.
OVERLAP_SINCE = (20, 11)


def build_srun(spec: JobSpec, role: Role, nodes: Sequence[str], *, job_id: str, wrapper: Sequence[str],
               in_allocation: bool, srun: str = "srun", overlap: bool = True) -> list[str]:
    """One role's step: ``len(nodes)`` tasks, task i on ``nodes[i]``.

    ``--cpus-per-task`` is the role's cores in an allocation made here; inside the user's
    it is passed only when more than 1 was asked for (else the allocation's own applies).
    ``overlap``: pass ``--overlap`` (Slurm 20.11 and later; older ones share without it).

    Example:
        >>> build_srun(JobSpec(command=("python", "t.py"), num_workers=2, num_servers=0, launcher="slurm",
        ...                    jobname="j"), Role.WORKER, ["sn1", "sn0"], job_id="42", wrapper=["W"],
        ...            in_allocation=True)  # doctest: +NORMALIZE_WHITESPACE
        ['srun', '--jobid=42', '--job-name=j.worker', '--ntasks=2', '--distribution=arbitrary',
         '--nodelist=sn1,sn0', '--overlap', '--overcommit', '--kill-on-bad-exit=0', '--label',
         '--export=ALL', '--input=none', 'W', '--task-env', 'PSLAUNCH_TASK', '--role', 'worker',
         '--index', 'slurm', '--no-tee', '--in-band', '--', 'python', 't.py']
    """
    opts: SlurmOptions = spec.options or SlurmOptions()
    cores = spec.server_cores if role is Role.SERVER else spec.worker_cores
    argv = [srun, f"--jobid={job_id}", f"--job-name={spec.name}.{role}", f"--ntasks={len(nodes)}",
            "--distribution=arbitrary", f"--nodelist={','.join(nodes)}", *(("--overlap",) if overlap else ()),
            "--overcommit", "--kill-on-bad-exit=0", "--label", "--export=ALL", "--input=none"]
    if not in_allocation or cores > 1:
        argv.append(f"--cpus-per-task={cores}")
    return [*argv, *opts.srun_extra, *wrapper, "--task-env", TASK_ENV, "--role", str(role), "--index", "slurm",
            "--no-tee", "--in-band", "--", *spec.command]


def step_environment(environ: Mapping[str, str], task_doc: Mapping[str, Any]) -> dict[str, str]:
    """srun's environment: the launcher's, less the step-shape variables an enclosing
    ``sbatch``/``salloc`` set for its own tasks (and the task document of a pslaunch around this
    one), plus the task document, split over ``PSLAUNCH_TASK``, ``PSLAUNCH_TASK_1``, ... where it is
    longer than one variable may be (execve refuses one over 128 KiB: ``Argument list too long``)."""
    env = {k: v for k, v in environ.items() if k not in STEP_SHAPE_VARIABLES and not _is_task_env(k)}
    env.update(task_wrapper.task_env_chunks(TASK_ENV, json.dumps(task_doc, separators=(",", ":"))))
    return env


def _is_task_env(name: str) -> bool:
    """``PSLAUNCH_TASK`` or one of its continuations (``PSLAUNCH_TASK_1``)."""
    return name == TASK_ENV or (name.startswith(TASK_ENV + "_") and name[len(TASK_ENV) + 1:].isdigit())


def scancel_command(ids: Sequence[str], scancel: Optional[str]) -> Optional[list[str]]:
    """What the watchdog runs if the launcher is killed: ``scancel`` on steps or the allocation."""
    return [scancel, *ids] if scancel and ids else None


def exit_code_of_status(text: str) -> Optional[int]:
    """srun's word for how a task ended -> its exit code: ``Exited with exit code 7`` -> 7,
    ``Segmentation fault`` -> 139, ``Killed`` -> 137 (128+N); None if unknown."""
    text = text.strip()
    m = re.fullmatch(r"Exited with exit code (\d+)", text)
    if m:
        return int(m.group(1))
    text = text.replace(" (core dumped)", "")
    sig = _SIGNALS_BY_TEXT.get(text)
    return 128 + sig if sig else None


@dataclass(frozen=True)
class SrunLine:
    """What one line of srun's stderr says (:func:`parse_srun_line`).

    ``kind``: ``status`` (tasks ``tasks`` on ``node`` ended with ``code``, srun's ``text``),
    ``node_failure`` (Slurm declared ``node`` failed), ``cancelled`` (slurmstepd: the step or
    job was cancelled, ``text`` the cause or ""), or ``other``.
    """

    kind: str
    node: str = ""
    tasks: tuple[int, ...] = ()
    code: Optional[int] = None
    text: str = ""


def parse_srun_line(line: str) -> SrunLine:
    """One line of srun's stderr (a task's label already removed).

    >>> parse_srun_line("srun: error: sn1: tasks 0-1,3: Exited with exit code 7")
    SrunLine(kind='status', node='sn1', tasks=(0, 1, 3), code=7, text='Exited with exit code 7')
    >>> parse_srun_line("srun: error: Node failure on sn2").node
    'sn2'
    """
    m = _TASK_STATUS.match(line)
    if m:
        try:
            tasks = tuple(expand_ids(m.group(2).strip("[]")))
        except ValueError:
            tasks = ()
        return SrunLine("status", node=m.group(1), tasks=tasks, code=exit_code_of_status(m.group(3)),
                        text=m.group(3).strip())
    m = _NODE_FAILURE.match(line)
    if m:
        return SrunLine("node_failure", node=m.group(1).rstrip(".,"))
    m = _CANCELLED.search(line)
    if m:
        return SrunLine("cancelled", node=m.group(2), text=(m.group(3) or "").strip())
    return SrunLine("other", text=line)


def down_nodes(sinfo_output: str) -> list[str]:
    """Nodes that Slurm has lost, from ``sinfo -h -N -o '%N %t'`` (``down*``, ``fail``, ...;
    a trailing ``*`` alone, not responding, counts too)."""
    out = []
    for line in sinfo_output.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            state = parts[1].lower()
            if state.endswith("*") or state.rstrip("*~#!%$@^-").startswith(_LOST_STATES):
                out.append(parts[0])
    return out


# --- running Slurm's commands -------------------------------------------------------------


def _which(name: str, path: Optional[str] = None) -> Optional[str]:
    return shutil.which(name, path=path)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def hostnames(hostlist: str) -> list[str]:
    """Slurm's compressed host list expanded in order, by Slurm itself (``scontrol show
    hostnames``, which reads slurm.conf but asks no daemon): ``sn[0-2,5],gpu1`` -> ``sn0 sn1 sn2
    sn5 gpu1``, zero padding kept (``n[08-10]`` -> ``n08 n09 n10``).

    Raises:
        LaunchError: scontrol is missing or failed (:class:`~launcher.external.CommandError`), or
            the list is not one Slurm reads (scontrol then prints nothing but its complaint).
    """
    r = external.call(["scontrol", "show", "hostnames", hostlist], timeout=HOSTNAMES_TIMEOUT)
    names = r.stdout.split()
    if not names:
        raise LaunchError(f"Slurm cannot read the host list {hostlist!r}: {_one_line(r.stderr) or 'no host names'}")
    return names


# --- the handle -----------------------------------------------------------------------------


class SlurmTask(BatchTask):
    """One task of a role's step."""

    backend: SlurmBackend

    def __init__(self, proc: ProcSpec, output: ProcOutput, backend: SlurmBackend, step: Step, index: int,
                 node_name: str, ident: Optional[int] = None) -> None:
        super().__init__(proc, output, backend, host=node_name, ident=ident)
        self.step = step
        self.index = index
        self.node = node_name
        self.state = "starting"
        self.signalled = False            # the launcher asked it to stop
        self.wrapper_error = ""           # the wrapper's own one-line error, if it printed one
        self.local_procs: Optional[int] = None  # PSLAUNCH_LOCAL_PROCS its wrapper was told, if any

    def where(self) -> str:
        return f"Slurm step {self.step.step_id or self.step.job_id + '.?'} task {self.index}"

    def on_start(self, info: dict[str, Any]) -> None:
        step_id = str(info.get("step") or "")
        if step_id and not self.step.step_id:
            self.step.step_id = step_id
            self.backend._guard_step(step_id)
        super().on_start(info)

    def on_exit(self, code: int) -> None:
        if code > 128 and not self.signalled and self.code is None:
            # killed by a signal nobody here sent: let Slurm say why first (see HOLD)
            with self.backend.lock:
                self.backend._held.setdefault(self.ident, (code, time.time()))
            return
        super().on_exit(code)


@dataclass
class Step:
    """One role's ``srun`` and what it has said."""

    role: Role
    job_id: str
    argv: list[str]
    tasks: list[SlurmTask] = field(default_factory=list)
    proc: Optional[subprocess.Popen] = None
    step_id: str = ""
    open_streams: int = 0
    exited_at: Optional[float] = None
    done: bool = False
    killed: bool = False
    statuses: dict[int, tuple[int, str]] = field(default_factory=dict)
    messages: deque = field(default_factory=lambda: deque(maxlen=8))

    def last_message(self) -> str:
        """srun's last error (else its last message), without its ``srun: error:`` prefix."""
        found = next((m for m in reversed(self.messages) if "error" in m), self.messages[-1] if self.messages else "")
        return re.sub(r"^srun: (?:error: )?", "", found)


class _StepStream:
    """One of srun's output pipes, cut into lines (see :meth:`SlurmBackend._step_line`)."""

    def __init__(self, backend: SlurmBackend, step: Step, err: bool) -> None:
        self.backend, self.step, self.err = backend, step, err
        self.buf = b""

    def feed(self, data: bytes) -> None:
        *lines, self.buf = (self.buf + data).split(b"\n")
        for line in lines:
            self.backend._step_line(self.step, self.err, line)

    def closed(self) -> None:
        if self.buf:
            self.backend._step_line(self.step, self.err, self.buf)
            self.buf = b""
        self.backend._stream_closed(self.step)


# --- the backend ------------------------------------------------------------------------------


class SlurmBackend(BatchBackend):
    """Slurm, one job step per role. See the module docstring."""

    name = "slurm"
    can_replace = True
    index_source = "slurm"
    elsewhere = "the Slurm nodes"
    poll_every = 0.1
    close_wait = 20.0
    Options = SlurmOptions
    options = (
        BackendOption(("--slurm-account",), "account", "account to charge the allocation pslaunch makes (salloc -A).",
                      metavar="NAME"),
        BackendOption(("--slurm-nodes",), "nodes", "nodes to spread the job over (salloc -N; in an existing "
                      "allocation: its first N nodes).", kind="int", metavar="N"),
        BackendOption(("--slurm-args",), "args", "more salloc options for the allocation pslaunch makes, "
                      "e.g. '--constraint=ib --qos=high'.", metavar="TEXT"),
        BackendOption(("--slurm-srun-args",), "srun_args", "more srun options for every job step, "
                      "e.g. '--gpus-per-task=1'.", metavar="TEXT"),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.alloc: Optional[Allocation] = None
        self.steps: list[Step] = []
        self.hosts: tuple[Host, ...] = ()
        self._salloc: Optional[subprocess.Popen] = None
        self._salloc_lines: deque = deque(maxlen=20)
        self._salloc_job = ""
        self._salloc_pending = False
        self._scancel = _which("scancel") or "scancel"
        self._held: dict[int, tuple[int, float]] = {}
        self._node_failures: dict[str, float] = {}
        self._cause = ""                   # why Slurm cancelled steps (NODE FAILURE, TIME LIMIT, ...)
        self._released = False
        self._abandon_steps: set[str] = set()
        self.version: Optional[tuple[int, int]] = None

    # -- what the rest of the launcher asks of the class ----------------------------------------

    @classmethod
    def check_spec(cls, spec: JobSpec) -> None:
        super().check_spec(spec)
        partition_of(spec.queue)

    @classmethod
    def where(cls, spec: JobSpec, plan: Plan) -> str:
        job = spec.environ_dict().get(SLURM_JOB_ID, "")
        return f"the nodes of Slurm allocation {job}" if job else "a new Slurm allocation"

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        environ = spec.environ_dict()
        job = environ.get(SLURM_JOB_ID, "")
        opts: SlurmOptions = spec.options or SlurmOptions()
        wrapper = node.command("task")
        out = []
        if job:
            nodes = environ.get(SLURM_JOB_NODELIST, "")
            out.append(f"Slurm: inside allocation {job} (SLURM_JOB_ID; nodes {nodes or 'unknown'}); "
                       "one job step per role, servers first:")
            try:
                alloc = Allocation(job_id=job, state="RUNNING", nodes=tuple(hostnames(nodes) if nodes else ()))
                where = place_on(spec, placement_hosts(alloc, opts.nodes)) if alloc.nodes else {}
            except (ValueError, LaunchError):
                where = {}
        else:
            out.append("Slurm: a new allocation, released at the end (salloc returns once Slurm grants it):")
            out.append("  " + shlex.join(build_salloc(spec)))
            out.append("then one job step per role in it, servers first:")
            where = {}
        for role in (Role.SERVER, Role.WORKER):
            members = role_procs(plan.procs, role)
            if not members:
                continue
            nodes_of = [where.get((role, p.rank), f"<node of {role} {p.rank}>") for p in members]
            argv = build_srun(spec, role, nodes_of, job_id=job or "<allocation>", wrapper=wrapper,
                              in_allocation=bool(job))
            out.append(f"  {role}s: " + shlex.join(argv))
        if not job:
            out.append("  (the nodes are the allocation's: servers first, round-robin, at most as many per node as "
                       "Slurm allocated tasks there)")
        doc = build_task_file(spec, plan.procs)
        out.append(f"srun's environment: the launcher's, plus {TASK_ENV} (the task document, with the job secret; "
                   "never on a command line, never in scontrol show job):")
        for role, r in doc["roles"].items():
            out.append(f"  {role}: DMLC_TASK_ID = {r['first_task_id']} + SLURM_PROCID, {len(r['env'])} variables")
        out.append(agent_line())
        return out

    @classmethod
    def doctor(cls, environ: Mapping[str, str], *, queue: Optional[str] = None,
               options: Optional[SlurmOptions] = None, job: Optional[Mapping[str, Any]] = None,
               ) -> list[tuple[str, bool, str]]:
        """``pslaunch doctor --launcher slurm``: ``(check, passed, detail)`` rows (see :func:`doctor_rows`)."""
        return doctor_rows(environ, queue=queue, options=options)

    # -- set-up ---------------------------------------------------------------------------------

    def check(self) -> None:
        environ = self.spec.environ_dict()
        path = environ.get(pc.PATH)
        inside = bool(environ.get(SLURM_JOB_ID, "").strip())
        for tool in (*COMMANDS, *(() if inside else ("salloc",))):
            if _which(tool, path=path) is None:
                raise BackendUnavailableError(
                    f"--launcher slurm needs Slurm's {tool} on PATH (install Slurm's client commands, e.g. "
                    "Debian's slurm-client, or load your site's slurm module); pslaunch doctor --launcher slurm "
                    "checks the rest")

    def prepare(self) -> Mapping[Any, str]:
        """Find or make the allocation; its nodes become the placement's hosts. Node addresses
        are worked out by the wrapper on each node."""
        opts: SlurmOptions = self.spec.options or SlurmOptions()
        try:
            self.version = parse_version(external.call([_which("srun") or "srun", "--version"], timeout=20,
                                                       check=False).stdout)
        except external.CommandError:
            self.version = None
        job = self.spec.environ_dict().get(SLURM_JOB_ID, "").strip()
        if job:
            alloc = self._show_job(job)
            if alloc.state not in ("RUNNING", "CONFIGURING"):
                raise LaunchError(f"SLURM_JOB_ID={job} is not a running allocation (JobState={alloc.state or '?'}"
                                  f"{', Reason=' + alloc.reason if alloc.reason else ''}); unset SLURM_JOB_ID to "
                                  "let pslaunch make one, or run pslaunch inside a live salloc/sbatch")
            log.info("running in Slurm allocation %s (%d node%s: %s)", job, len(alloc.nodes),
                     "" if len(alloc.nodes) == 1 else "s", alloc.nodelist)
        else:
            alloc = self._allocate()
        if not alloc.nodes:
            raise LaunchError(f"Slurm allocation {alloc.job_id} has no nodes (scontrol show job {alloc.job_id})")
        self.alloc = alloc
        self.hosts = placement_hosts(alloc, opts.nodes, self.spec.num_procs)
        return {}

    def _show_job(self, job: str) -> Allocation:
        try:
            r = external.call(["scontrol", "show", "job", "-d", job], timeout=30)
        except external.CommandError as e:
            if e.returncode is None:
                raise LaunchError(str(e)) from None
            raise LaunchError(f"scontrol show job {job} failed: {_one_line(e.stderr or e.stdout)}") from None
        return parse_job(r.stdout, job)

    def helper_pids(self) -> set[int]:
        return {self._salloc.pid} if self._salloc is not None else set()

    def _allocate(self) -> Allocation:
        """``salloc --no-shell``; wait (at most ``--start-timeout``) until Slurm grants it."""
        argv = build_salloc(self.spec, _which("salloc") or "salloc")
        log.debug("asking Slurm for an allocation: %s", shlex.join(argv))
        with spawn_guard():  # a Ctrl-C is raised once the process is registered (close() stops it)
            child = spawn(argv, merge_stderr=True, death_signal=signal.SIGTERM)
            self._salloc = child.popen
        reader = threading.Thread(target=self._read_salloc, args=(child.stdout,), name="pslaunch-salloc",
                                  daemon=True)
        reader.start()
        timeout = max(self.spec.start_timeout, 1.0)
        deadline = time.monotonic() + timeout
        told = False
        while self._salloc.poll() is None:
            if time.monotonic() > deadline:
                why = self._pending_reason()
                self._stop_salloc()
                job = f" {self._salloc_job}" if self._salloc_job else ""
                raise LaunchError(f"Slurm has not granted the allocation{job}"
                                  f" within --start-timeout {timeout:g}s{why}; raise --start-timeout, or ask for "
                                  "less (-n, --*-cores, --*-memory, --queue)")
            if self._salloc_pending and not told:
                told = True
                log.info("waiting for Slurm to grant allocation %s%s", self._salloc_job, self._pending_reason())
            time.sleep(0.02)
        reader.join(2.0)
        code = self._salloc.returncode
        job = self._salloc_job
        if code != 0 or not job:
            text = "; ".join(x for x in self._salloc_lines if x) or f"exit code {code}"
            raise LaunchError(f"Slurm refused the allocation ({shlex.join(argv[1:])}): {text}")
        alloc = self._show_job(job)
        alloc = Allocation(job_id=alloc.job_id, state=alloc.state, reason=alloc.reason, nodes=alloc.nodes,
                           cpus=alloc.cpus, cpus_per_task=alloc.cpus_per_task, made_here=True)
        log.info("Slurm granted allocation %s: %s (released when the job ends)", job, alloc.nodelist)
        return alloc

    def _read_salloc(self, fd: int) -> None:
        with open(fd, "rb") as out:
            for raw in out:
                line = raw.decode("utf-8", "replace").rstrip()
                log.debug("%s", line)
                if _PENDING.search(line):
                    self._salloc_pending = True
                m = _PENDING.search(line) or _GRANTED.search(line)
                if m and not self._salloc_job:
                    self._salloc_job = m.group(1)
                    if self.watchdog is not None:  # a pending request is withdrawn by salloc's death
                        cmd = scancel_command([self._salloc_job], self._scancel)  # signal; a granted one needs this
                        if cmd:
                            self.watchdog.on_abandon(cmd)
                elif line.startswith("salloc: error:") or not line.startswith("salloc:"):
                    self._salloc_lines.append(line.removeprefix("salloc: error: "))
                elif "queued and waiting" not in line and "has been allocated" not in line:
                    self._salloc_lines.append(line.removeprefix("salloc: "))

    def _pending_reason(self) -> str:
        if not self._salloc_job:
            return ""
        try:
            r = external.call(["squeue", "-h", "-j", self._salloc_job, "-o", "%T %r"], timeout=10, check=False)
        except external.CommandError:
            return ""
        text = r.stdout.strip()
        return f" (squeue: {text.replace(' ', ', Reason=', 1)})" if text else ""

    def _stop_salloc(self) -> None:
        """salloc still waiting: SIGTERM withdraws the request; whatever it got is cancelled."""
        proc = self._salloc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._salloc_job and self.alloc is None:  # (a granted one is released by release())
            self._scancel_ids([self._salloc_job])

    # -- submitting -------------------------------------------------------------------------------

    def submit(self, procs: Sequence[ProcSpec], hub: Optional[tuple[str, int]]) -> list[BatchTask]:
        assert self.alloc is not None
        spec = self.spec
        alloc = self.alloc
        where = place_on(spec, self.hosts)
        per_node: dict[str, int] = {}
        for n in where.values():
            per_node[n] = per_node.get(n, 0) + 1
        roles = task_roles(procs)
        for role, r in roles.items():
            members = role_procs(procs, Role(role))
            r["local_procs"] = [per_node[where[(Role(role), p.rank)]] for p in members]
        doc = build_task_file(spec, procs, hub=hub, roles=roles)
        wrapper = node.command("task")
        srun = _which("srun") or "srun"
        log.info("placement: %s", ", ".join(f"{p.label} @ {where[(p.role, p.rank)]}" for p in procs))
        for role in (Role.SERVER, Role.WORKER):
            members = role_procs(procs, role)
            if not members:
                continue
            nodes = [where[(role, p.rank)] for p in members]
            argv = build_srun(spec, role, nodes, job_id=alloc.job_id, wrapper=wrapper,
                              in_allocation=not alloc.made_here, srun=srun,
                              overlap=self.version is None or self.version >= OVERLAP_SINCE)
            step = Step(role=role, job_id=alloc.job_id, argv=argv)
            with spawn_guard():  # a Ctrl-C now is raised only once every task has a handle
                for i, (p, n) in enumerate(zip(members, nodes)):
                    out = self.console.proc(p.name, f"{p.label} @ {n}", str(p.role))
                    t = SlurmTask(p, out, self, step, i, n)
                    t.local_procs = per_node[n]
                    step.tasks.append(t)
                    self.add_task(t)
                self.steps.append(step)
                # (each step's document holds its own role only: half the size for a large environment)
                self._spawn(step, step_environment(os.environ, {**doc, "roles": {str(role): roles[str(role)]}}))
            log.debug("%s step: %s", role, shlex.join(argv))
        return self.tasks

    def submit_replacement(self, proc: ProcSpec, lost: BatchTask, ident: int) -> BatchTask:
        """A step of one task on the lost task's node (``--overlap``, like the roles' steps), whose
        task document gives the wrapper ``proc``'s variables (its task id, its process marker, the
        lost task's ``PSLAUNCH_LOCAL_PROCS``) and the id ``ident`` its agent connects as; its output
        is labelled like the lost task's.

        Raises:
            LaunchError: srun cannot be started (the task is recorded as failed).
        """
        assert self.alloc is not None and isinstance(lost, SlurmTask) and self.hub is not None
        node_name = lost.node
        roles = task_roles([proc])
        part = roles[str(proc.role)]
        part["idents"] = [ident]
        if pc.PROCESS in proc.env:
            part["processes"] = [proc.env[pc.PROCESS]]
        if lost.local_procs is not None:
            part["local_procs"] = [lost.local_procs]
        doc = build_task_file(self.spec, [proc], hub=self.hub.address, roles=roles)
        argv = build_srun(self.spec, proc.role, [node_name], job_id=self.alloc.job_id, wrapper=node.command("task"),
                          in_allocation=not self.alloc.made_here, srun=_which("srun") or "srun",
                          overlap=self.version is None or self.version >= OVERLAP_SINCE)
        step = Step(role=proc.role, job_id=self.alloc.job_id, argv=argv)
        with spawn_guard():
            out = self.console.proc(proc.name, f"{proc.label} @ {node_name}", str(proc.role))
            t = SlurmTask(proc, out, self, step, 0, node_name, ident=ident)
            t.local_procs = lost.local_procs
            step.tasks.append(t)
            self.add_task(t)
            self.steps.append(step)
            try:
                self._spawn(step, step_environment(os.environ, doc))
            except OSError as e:
                t.failure = f"cannot run srun: {e.strerror or e}"
                self.set_code(t, 127 if isinstance(e, FileNotFoundError) else 126, "")
                raise LaunchError(f"{proc.label}'s replacement on {node_name}: {t.failure}") from None
        log.debug("%s's replacement step: %s", proc.label, shlex.join(argv))
        return t

    def describe_replacement_pending(self, t: BatchTask) -> str:
        assert isinstance(t, SlurmTask)
        said = t.step.last_message()
        return (f"was not running on {t.node} (srun says {said!r})" if said else f"was not running on {t.node}")

    def _spawn(self, step: Step, env: Mapping[str, str]) -> None:
        child = spawn(step.argv, env, self.spec.workdir, death_signal=signal.SIGKILL)
        step.proc = child.popen
        step.open_streams = 2
        assert self.pump is not None
        assert child.stderr is not None  # (not merged into stdout: a pipe of its own)
        for fd, err in ((child.stdout, False), (child.stderr, True)):
            stream = _StepStream(self, step, err)
            self.pump.add(fd, stream.feed, stream.closed)

    def describe_pending(self, pending: Sequence[BatchTask], timeout: float) -> str:
        steps = {t.step.role: t.step for t in pending if isinstance(t, SlurmTask)}
        said = "; ".join(f"{role}s' step: srun says {s.last_message()!r}" for role, s in steps.items()
                         if s.last_message())
        return (f"{len(pending)} of {len(self.tasks)} tasks not running after --start-timeout {timeout:g}s "
                f"in Slurm allocation {self.alloc.job_id if self.alloc else '?'}"
                f"{' (' + said + ')' if said else ''}; squeue -s -j {self.alloc.job_id if self.alloc else ''} "
                "shows the steps")

    # -- what srun says (on the pump's thread) -----------------------------------------------------

    def _step_line(self, step: Step, err: bool, raw: bytes) -> None:
        m = _LABEL.match(raw.decode("utf-8", "replace"))
        if m is None:
            self._srun_says(step, raw.decode("utf-8", "replace").rstrip("\r"))
            return
        index, text = int(m.group(1)), m.group(2)
        t = step.tasks[index] if index < len(step.tasks) else None
        payload = raw[raw.index(b":") + 1:]
        payload = payload[1:] if payload.startswith(b" ") else payload
        frame = unwrap(payload)
        if frame is not None and t is not None and frame[1] == t.ident:
            t.frame(frame[0], frame[2])  # in-band: its agent could not connect
            return
        said = parse_srun_line(text) if "slurmstepd" in text else None
        if said is not None and said.kind == "cancelled":
            self._slurm_cancelled(step, said, text)
            return
        if t is None:
            self._srun_says(step, text)
            return
        if text.startswith("pslaunch task: error: "):
            t.wrapper_error = text.removeprefix("pslaunch task: error: ").strip()
        (t.output.stderr if err else t.output.stdout).feed(payload + b"\n")

    def _srun_says(self, step: Step, line: str) -> None:
        if not line.strip():
            return
        log.debug("%ss' srun: %s", step.role, line)
        said = parse_srun_line(line)
        if said.kind == "status":
            for i in said.tasks:
                if said.code is not None:
                    step.statuses[i] = (said.code, said.text)
        elif said.kind == "node_failure":
            with self.lock:
                self._node_failures.setdefault(said.node, time.time())
            log.error("Slurm declared node %s failed (NODE_FAIL) and is ending allocation %s", said.node,
                      step.job_id)
        elif said.kind == "cancelled":
            self._slurm_cancelled(step, said, line)
        else:
            step.messages.append(line)

    def _slurm_cancelled(self, step: Step, said: SrunLine, line: str) -> None:
        with self.lock:
            if not self._cause or self._cause == "CANCELLED":
                self._cause = said.text or "CANCELLED"  # (scancel by someone: no "DUE TO")
        log.debug("%ss' step: %s", step.role, line.strip())

    def _stream_closed(self, step: Step) -> None:
        step.open_streams -= 1

    def _guard_step(self, step_id: str) -> None:
        """If the launcher is killed, the watchdog cancels the step (srun's death does too)."""
        if self.watchdog is not None and step_id not in self._abandon_steps and not (
                self.alloc is not None and self.alloc.made_here):  # (scancel of the allocation covers it)
            self._abandon_steps.add(step_id)
            cmd = scancel_command([step_id], self._scancel)
            if cmd:
                self.watchdog.on_abandon(cmd)

    # -- the follower ------------------------------------------------------------------------------

    def poll_once(self) -> None:
        now = time.time()
        with self.lock:
            held = dict(self._held)
            failures = dict(self._node_failures)
            cause = self._cause
        if held and (failures or cause == "NODE FAILURE"):
            self._blame_lost_nodes(failures, held)
            with self.lock:
                failures = dict(self._node_failures)
        for ident, (code, at) in held.items():
            if not (failures or cause) and now - at < HOLD:
                continue
            t = self._by_ident.get(ident)
            with self.lock:
                self._held.pop(ident, None)
            if t is not None:
                self.set_code(t, code, self._stop_reason(failures, cause), ended_at=at)
        for step in self.steps:
            self._check_step(step)

    def _stop_reason(self, failures: Mapping[str, float], cause: str) -> str:
        if failures:
            return f"stopped by Slurm: node {', '.join(sorted(failures))} failed"
        if cause:
            return f"stopped by Slurm: {cause.lower()}"
        return ""

    def _blame_lost_nodes(self, failures: dict[str, float], held: Mapping[int, tuple[int, float]]) -> None:
        """Slurm lost a node and stopped the steps: the lost node's processes are the first
        failure (they never said anything: their node's slurmd is gone), before those Slurm
        stopped because of it."""
        if not failures:
            failures = {n: time.time() for n in self._lost_nodes()}
            with self.lock:
                for n, at in failures.items():
                    self._node_failures.setdefault(n, at)
        first = min((self._ended(ident, at) for ident, (_, at) in held.items()), default=time.time())
        for t in self.tasks:
            if not isinstance(t, SlurmTask) or t.code is not None or t.node not in failures:
                continue
            with self.lock:
                self._held.pop(t.ident, None)
            # (the process's reason, not its `failure`: that one means it could not start at all,
            # which no restart helps; --max-restarts places the next attempt on the nodes left)
            self.set_code(t, 1, f"Slurm lost its node {t.node} (NODE_FAIL: the node's slurmd stopped answering) and "
                          f"ended allocation {t.step.job_id}; see sinfo -R and slurmctld's log",
                          ended_at=min(first, failures[t.node]) - 0.001)
            if self.hub is not None:
                self.hub.send(t.ident, "TERM")  # it may still run there: nothing of Slurm's can stop it now

    def _ended(self, ident: int, held_at: float) -> float:
        """When the held task ``ident`` ended: by its node's clock where its agent said (its exit
        frame's time, which counts before the launcher's: ProcessHandle.poll), else when held."""
        t = self._by_ident.get(ident)
        node_ended = t.node_ended_at if t is not None else None
        return held_at if node_ended is None else min(held_at, node_ended)

    def _lost_nodes(self) -> list[str]:
        if self.alloc is None:
            return []
        try:
            r = external.call(["sinfo", "-h", "-N", "-n", self.alloc.nodelist, "-o", "%N %t"], timeout=10,
                              check=False)
        except external.CommandError:
            return []
        return down_nodes(r.stdout)

    def _check_step(self, step: Step) -> None:
        """A step whose srun has exited: every task it holds that has no exit code gets one."""
        if step.done or step.proc is None:
            return
        code = step.proc.poll()
        if code is None:
            return
        if step.exited_at is None:
            step.exited_at = time.monotonic()
        if step.open_streams > 0 and time.monotonic() - step.exited_at < 2.0:
            return  # its last lines (the task statuses) are still on their way
        with self.lock:
            if any(t.ident in self._held for t in step.tasks):
                return  # decided by poll_once first
        step.done = True
        last = step.last_message()
        for t in step.tasks:
            if t.code is not None:
                continue
            if t.index in step.statuses:
                c, text = step.statuses[t.index]
                reason = "" if text.startswith("Exited") else text
                if step.killed or t.signalled:
                    reason = "cancelled by the launcher"
                self.set_code(t, c, reason)
            elif t.wrapper_error:
                t.failure = t.wrapper_error
                self.set_code(t, code or 1, "")
            elif code == 0:
                self.set_code(t, 0, "")
            elif not t.ran:
                t.failure = (f"srun could not start the {step.role}s' step: {last or f'exit code {code}'}"
                             if not step.killed else "cancelled by the launcher before it started")
                self.set_code(t, code if code > 0 else 1, "")
            else:
                self.set_code(t, 128 + signal.SIGKILL if step.killed else (code if code > 0 else 1),
                              "cancelled by the launcher" if step.killed else last)

    def settled(self) -> bool:
        return all(s.done or s.proc is None for s in self.steps) and all(t.code is not None for t in self.tasks)

    # -- signals and stopping --------------------------------------------------------------------

    def signal_task(self, t: BatchTask, command: str) -> None:
        """Through the agent; without one, ``scancel --signal`` to the whole step (srun has no
        way to signal one task: every process of the step gets it, the agent too, which passes a
        stack dump's SIGABRT on), and a KILL always cancels the step too."""
        assert isinstance(t, SlurmTask)
        if t.code is not None:
            return
        if command in ("TERM", "KILL"):
            t.signalled = True
        sent = self.hub is not None and self.hub.send(t.ident, command)
        if command == "KILL":
            self.cancel([t])
        elif not sent and t.step.step_id:
            if command in ("TERM", "ABRT", "USR1", "USR2"):
                self._scancel_ids([t.step.step_id], command)
        elif not sent and command == "TERM":
            self.cancel([t])

    def cancel(self, tasks: Sequence[BatchTask]) -> None:
        """Cancel the steps holding ``tasks``: ``scancel J.S`` (SIGKILL to every task) and
        SIGKILL to srun (whose shepherd cancels a step that has no id here yet). Idempotent."""
        for step in {id(t.step): t.step for t in tasks if isinstance(t, SlurmTask)}.values():
            if step.killed or step.done or step.proc is None:
                continue
            step.killed = True
            for t in step.tasks:
                t.terminated = True
            if step.step_id:
                self._scancel_ids([step.step_id])
            if step.proc.poll() is None:
                try:
                    step.proc.kill()
                except OSError:
                    pass
            log.debug("cancelled the %ss' step %s", step.role, step.step_id or "(no id yet)")

    def _scancel_ids(self, ids: Sequence[str], sig: Optional[str] = None) -> None:
        argv = [self._scancel, *([f"--signal={sig}"] if sig else []), *ids]
        try:
            external.call(argv, timeout=20)
        except external.CommandError as e:
            if e.returncode is None:
                log.warning("%s", e)
            elif "already completing or completed" not in e.stderr and "Invalid job id" not in e.stderr:
                log.debug("%s: %s", shlex.join(argv), _one_line(e.stderr))

    def close(self) -> None:
        try:
            self._stop_salloc()
            # a process whose node Slurm lost may still run there, its agent connected: stop it
            if self.hub is not None:
                for t in self.tasks:
                    if t.channel == "open":
                        self.hub.send(t.ident, "KILL" if t.terminated else "TERM")
        finally:
            super().close()

    def release(self) -> None:
        """Cancel the allocation pslaunch made and wait until ``squeue`` no longer lists it."""
        for step in self.steps:
            if step.proc is not None and step.proc.poll() is None:
                step.proc.kill()
                try:
                    step.proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
        alloc = self.alloc
        if alloc is None or not alloc.made_here or self._released:
            return
        self._released = True
        self._scancel_ids([alloc.job_id])
        deadline = time.monotonic() + RELEASE_WAIT
        state = ""
        while time.monotonic() < deadline:
            try:
                state = external.call(["squeue", "-h", "-j", alloc.job_id, "-o", "%T"], timeout=10,
                                      check=False).stdout.strip()
            except external.CommandError:
                state = "?"
            if not state:
                log.debug("Slurm allocation %s released", alloc.job_id)
                return
            time.sleep(0.2)
        log.warning("Slurm still lists allocation %s (%s) %gs after pslaunch cancelled it; check squeue -j %s",
                    alloc.job_id, state, RELEASE_WAIT, alloc.job_id)


# --- doctor ------------------------------------------------------------------------------------


def _slurm_conf(environ: Mapping[str, str]) -> dict[str, str]:
    """``Key=Value`` settings of slurm.conf (``SLURM_CONF`` or ``/etc/slurm/slurm.conf``); {} if unreadable."""
    path = environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return {}
    conf: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        key, sep, value = line.partition("=")
        if sep and " " not in key:
            conf.setdefault(key.strip().lower(), value.strip())
    return conf


def munge_socket(conf: Mapping[str, str]) -> str:
    """The munge socket Slurm uses: ``AuthInfo=socket=PATH``, else munge's default."""
    for item in conf.get("authinfo", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "socket" and value.strip():
            return value.strip()
    return "/run/munge/munge.socket.2"


def doctor_rows(environ: Mapping[str, str], *, queue: Optional[str] = None,
                options: Optional[SlurmOptions] = None) -> list[tuple[str, bool, str]]:
    """What a Slurm job needs on this host, one ``(check, passed, detail)`` row each: the client
    commands, munge (when Slurm authenticates with it), slurmctld, the partition, free nodes
    (or, inside an allocation, that it runs). A check that cannot run after an earlier failure
    says so.

    Raises:
        LaunchError: a command did not answer (:class:`~launcher.external.CommandError`).
    """

    def run(argv: Sequence[str]) -> external.Result:
        return external.call(argv, timeout=30, check=False)

    path = environ.get(pc.PATH, os.defpath)
    rows: list[tuple[str, bool, str]] = []
    inside = environ.get(SLURM_JOB_ID, "").strip()
    needed = ["srun", "scontrol", "scancel", "sinfo", "squeue", *(() if inside else ("salloc",))]
    missing = [t for t in needed if _which(t, path=path) is None]
    if missing:
        rows.append(("commands", False, f"{', '.join(missing)} not found on PATH: install Slurm's client commands "
                     "(Debian: slurm-client) or load your site's slurm module"))
    else:
        rows.append(("commands", True, f"srun at {_which('srun', path=path)}"))
    conf = _slurm_conf(environ)
    auth = conf.get("authtype", "auth/munge")
    if auth != "auth/munge":
        rows.append(("munge", True, f"not used (AuthType={auth})"))
    else:
        sock = munge_socket(conf)
        munge = _which("munge", path=path)
        if not os.path.exists(sock):
            rows.append(("munge", False, f"no munge socket at {sock}: start munged (systemctl start munge) with "
                         "the cluster's key in /etc/munge/munge.key"))
        elif munge:
            r = run([munge, "-n", "-S", sock])
            rows.append(("munge", r.returncode == 0, f"munged answers on {sock}" if r.returncode == 0 else
                         f"munge -n fails: {_one_line(r.stderr) or r.returncode} (is munged running, with the "
                         "cluster's key?)"))
        else:
            rows.append(("munge", True, f"socket {sock} exists (no munge command here to test it)"))
    if missing:
        return rows  # (nothing below can run without them)
    r = run(["scontrol", "ping"])
    up = r.returncode == 0 and "UP" in r.stdout
    rows.append(("controller", up, _one_line(r.stdout) if up else
                 f"scontrol ping: {_one_line(r.stdout + ' ' + r.stderr)} (is slurmctld running and SLURM_CONF right?)"))
    if not up:
        return rows
    if inside:
        r = run(["squeue", "-h", "-j", inside, "-o", "%T %N"])
        state = r.stdout.strip()
        ok = state.startswith(("RUNNING", "CONFIGURING"))
        rows.append(("allocation", ok, f"SLURM_JOB_ID={inside}: {state}" if ok else
                     f"SLURM_JOB_ID={inside} is not a running allocation ({state or _one_line(r.stderr) or 'gone'}); "
                     "unset it to let pslaunch make one"))
        return rows
    try:
        partition = partition_of(queue)
    except ConfigError as e:
        rows.append(("partition", False, str(e)))
        return rows
    r = run(["sinfo", "-h", "-o", "%P %a"])
    parts = dict(line.split()[:2] for line in r.stdout.splitlines() if len(line.split()) >= 2)
    default = next((p.rstrip("*") for p in parts if p.endswith("*")), None)
    name = partition or default
    available = {p.rstrip("*"): a for p, a in parts.items()}
    if name is None:
        rows.append(("partition", False, "no default partition: give one with --queue "
                     f"({', '.join(sorted(available)) or 'sinfo lists none'})"))
        return rows
    if name not in available:
        listed = ", ".join(sorted(available)) or "none"
        rows.append(("partition", False, f"no partition {name!r} (sinfo lists {listed}); give another with --queue"))
        return rows
    if available[name] != "up":
        rows.append(("partition", False, f"partition {name} is {available[name]}: ask the admins, or --queue another"))
        return rows
    rows.append(("partition", True, f"{name}{' (the default)' if partition is None else ''} is up"))
    r = run(["sinfo", "-h", "-N", "-p", name, "-o", "%N %t %C"])
    free, cpus, total = [], 0, 0
    for line in r.stdout.splitlines():
        parts_ = line.split()
        if len(parts_) < 3:
            continue
        total += 1
        state = parts_[1].rstrip("*~#!%$@^-")
        alloc_idle = parts_[2].split("/")
        if (state in ("idle", "mix") and not parts_[1].endswith("*")
                and len(alloc_idle) >= 2 and alloc_idle[1].isdigit()):
            free.append(parts_[0])
            cpus += int(alloc_idle[1])
    opts = options or SlurmOptions()
    if not free:
        rows.append(("free nodes", False, f"no free nodes in partition {name} (0 of {total} idle or mixed); the job "
                     "would wait in the queue (squeue -p " + name + ")"))
    else:
        want = f"; --slurm-nodes {opts.nodes} asks for more" if opts.nodes and opts.nodes > len(free) else ""
        rows.append(("free nodes", not want, f"{len(free)} of {total} nodes, {cpus} idle CPUs{want}"))
    return rows


__all__ = ["SlurmBackend", "SlurmOptions", "SlurmTask", "build_salloc", "build_srun", "hostnames",
           "parse_job", "parse_srun_line"]
