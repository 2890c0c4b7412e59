"""The sge backend: servers and workers as Grid Engine array jobs, through DRMAA.

The scheduler runs on this machine, as on every backend; its address must be reachable from
the execution hosts, so ``DMLC_INTERFACE`` or ``--host-ip`` is required. Servers, then workers,
are submitted as two bulk jobs (``runBulkJobs``) of one DRMAA session, one job template per role:

* ``jobName`` is ``--jobname``; ``nativeSpecification`` comes from ``--queue`` (``-q``),
  ``--*-cores`` (``-pe <--sge-pe> N``), ``--*-memory`` (``-l h_vmem=``, which Grid Engine
  counts per slot, so the total is split over the cores) and ``--sge-native`` for anything else;
* the working directory is the launcher's, and each task writes
  ``<--sge-log-dir>/<role>.<SGE_TASK_ID>.out`` and ``.err`` (default ``<jobname>.log/``);
* the command is the task wrapper (``launcher.node.task``, under this very interpreter: a
  job's ``PATH`` is Grid Engine's, not ours), which maps the 1-based ``SGE_TASK_ID`` to
  ``DMLC_TASK_ID``, works out ``DMLC_NODE_HOST`` on the execution host, and runs the command
  under the node agent, connected to the launcher's hub (``launcher.backends.batch``): its
  output reaches the console as it is printed, labelled ``[worker 0]``, and the launcher can
  stop it gracefully or make it dump its stacks. A task whose agent cannot connect still runs;
  its output is then tailed from its files.

What Grid Engine's DRMAA does not do, and how this module copes:

* ``jobEnvironment`` values are cut at the first ``=``, the caller's environment is not passed
  without ``-V``, and whatever is in the template shows in ``qstat -j``. So the job's variables
  (contract, ``--env``, the forwarded ones and the launcher's ``PATH``) travel in a task file of
  mode 0600 in the log directory, which must be on a file system the execution hosts share (as
  the working directory already is). The template carries no secret and no ``-V``.
* Jobs outlive the DRMAA session. Every queued or running task is sent ``TERMINATE`` when a
  task fails, on Ctrl-C and whenever the launcher exits, and the launcher waits until Grid
  Engine has dropped them; if the launcher is killed with SIGKILL, its watchdog runs ``qdel``
  on the jobs (and the agents, whose connections end, stop their commands).
* DRMAA can only delete a task (``TERMINATE``, which Grid Engine carries out with SIGKILL):
  graceful stops and stack dumps go through the task's agent.
* libdrmaa must be found (``DRMAA_LIBRARY_PATH``), needs ``SGE_ROOT``, and Debian's build links
  libjemalloc, which only loads into a Python started with
  ``GLIBC_TUNABLES=glibc.rtld.optional_static_tls=8192``. Each missing piece is a one-line error
  that says what to set.

DRMAA calls are serialised by one lock. The follower thread reaps finished tasks with
``wait(JOB_IDS_SESSION_ANY, TIMEOUT_NO_WAIT)`` (answered from libdrmaa's event cache), asks
``jobStatus`` only for tasks not yet seen running, and tails the output files of tasks whose
agent is not connected.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import pscontract as pc

from .. import node
from ..errors import BackendUnavailableError, ConfigError, LaunchError
from ..runtime.output import ProcOutput
from ..runtime.spawn import spawn_guard
from ..spec.job import JobSpec, Role
from ..spec.plan import Plan, ProcSpec
from .base import BackendOption
from .batch import BatchBackend, BatchTask, agent_line, build_task_file, role_procs, write_private_json

log = logging.getLogger(__name__)

# What libdrmaa needs in the launcher's environment (and Grid Engine's own variables).
SGE_ROOT = "SGE_ROOT"
SGE_CELL = "SGE_CELL"
DRMAA_LIBRARY_PATH = "DRMAA_LIBRARY_PATH"
# Debian's libdrmaa links libjemalloc, which needs static TLS that glibc only
# reserves at process start when this tunable asks for it.
GLIBC_TUNABLES = "GLIBC_TUNABLES"

#: DRMAA's placeholder for a bulk job's task index (``JobTemplate.PARAMETRIC_INDEX``).
PARAMETRIC_INDEX = "$drmaa_incr_ph$"
#: Where Debian's gridengine packages put things (used in hints only).
DEBIAN_SGE_ROOT = "/var/lib/gridengine"
DEBIAN_DRMAA_LIBRARY = "/usr/lib/gridengine-drmaa/lib/libdrmaa.so.1.0"
STATIC_TLS_TUNABLE = "glibc.rtld.optional_static_tls=8192"

TICK = 0.2           # output tailing
REAP_EVERY = 0.5     # wait(ANY, NO_WAIT)
STATUS_EVERY = 1.0   # jobStatus of tasks not yet seen running

# DRMAA state -> qstat's letters, for messages
_QSTAT_CODE = {
    "queued_active": "qw", "system_on_hold": "hqw (system hold)", "user_on_hold": "hqw (user hold)",
    "user_system_on_hold": "hqw (user and system hold)", "running": "r", "system_suspended": "S",
    "user_suspended": "s", "user_system_suspended": "s (user and system)", "done": "done",
    "failed": "failed", "undetermined": "unknown",
}
_BAD_NAME = re.compile(r"^\d|[\s/:@\\*?]")


# --- options and pure builders -------------------------------------------------------


@dataclass(frozen=True)
class SGEOptions:
    """``--sge-*``: ``pe`` is the parallel environment that ``--worker-cores``/``--server-cores``
    above 1 request (``-pe PE N``)."""

    native: Optional[str] = None
    log_dir: Optional[str] = None
    pe: str = "smp"



def check_job_name(name: str) -> str:
    """``name`` if Grid Engine accepts it as a job name, else :class:`ConfigError`."""
    if not name or _BAD_NAME.search(name):
        raise ConfigError(f"--jobname {name!r}: Grid Engine job names must not start with a digit or "
                          "contain whitespace or any of / : @ \\ * ?")
    return name


def log_dir_for(spec: JobSpec) -> str:
    """The absolute task output directory: ``--sge-log-dir`` or ``<jobname>.log``."""
    workdir = spec.workdir or os.getcwd()
    return os.path.normpath(os.path.join(workdir, (spec.options or SGEOptions()).log_dir or f"{spec.name}.log"))


def build_native_specification(*, queue: Optional[str], cores: int, memory_mb: Optional[int], pe: str,
                               native: Optional[str]) -> str:
    """The qsub options of one role's job template.

    Args:
        queue: ``-q QUEUE``; ``None`` or ``"default"`` (dmlc's default value)
            leaves the choice to Grid Engine.
        cores: above 1, ``-pe PE CORES``.
        memory_mb: the whole task's memory. Grid Engine applies ``h_vmem``
            per slot, so it is divided by ``cores`` (rounded up).
        pe: the parallel environment for ``cores``.
        native: ``--sge-native``, appended as written (it may override ours:
            with qsub options, the last one wins).

    Example:
        >>> build_native_specification(queue="all.q", cores=2, memory_mb=3000, pe="smp", native="-l h_rt=600")
        '-q all.q -pe smp 2 -l h_vmem=1500M -l h_rt=600'
    """
    parts: list[str] = []
    if queue and queue != "default":
        if re.search(r"\s", queue):
            raise ConfigError(f"--queue {queue!r}: a queue name has no spaces")
        parts += ["-q", queue]
    if cores > 1:
        if not pe or re.search(r"\s", pe):
            raise ConfigError(f"--sge-pe {pe!r}: give the name of a parallel environment (qconf -spl)")
        parts += ["-pe", pe, str(cores)]
    if memory_mb:
        parts += ["-l", f"h_vmem={math.ceil(memory_mb / max(cores, 1))}M"]
    if native and native.strip():
        parts.append(native.strip())
    return " ".join(parts)


@dataclass(frozen=True)
class JobTemplateSpec:
    """One role's DRMAA job template, as plain data (see :func:`build_job_templates`)."""

    role: str
    count: int
    job_name: str
    remote_command: str
    args: tuple[str, ...]
    working_directory: str
    output_path: str
    error_path: str
    native_specification: str
    job_environment: Mapping[str, str] = field(default_factory=dict)

    def attributes(self) -> dict[str, Any]:
        """The DRMAA ``JobTemplate`` attributes, by their drmaa-python names."""
        attrs: dict[str, Any] = {
            "jobName": self.job_name,
            "remoteCommand": self.remote_command,
            "args": list(self.args),
            "workingDirectory": self.working_directory,
            "outputPath": self.output_path,
            "errorPath": self.error_path,
            "joinFiles": False,
            "jobEnvironment": dict(self.job_environment),
        }
        if self.native_specification:
            attrs["nativeSpecification"] = self.native_specification
        return attrs

    def task_files(self, index: int) -> tuple[str, str]:
        """The output and error files of task ``index`` (1-based)."""
        return (self.output_path.lstrip(":").replace(PARAMETRIC_INDEX, str(index)),
                self.error_path.lstrip(":").replace(PARAMETRIC_INDEX, str(index)))


def build_job_templates(spec: JobSpec, procs: Sequence[ProcSpec], *, wrapper: Sequence[str],
                        task_file: str, log_dir: str, job_id: str) -> tuple[JobTemplateSpec, ...]:
    """The job templates, servers first; one bulk job of ``count`` tasks each.

    Nothing secret and no value with ``=`` goes into a template: the job's
    variables are in ``task_file``. ``jobEnvironment`` carries only the
    job's id, so ``qstat -j`` shows which pslaunch job a task belongs to.

    Args:
        wrapper: the argv of the task wrapper (``launcher.node.command("task")``: this very
            interpreter and this installation).
        task_file: the 0600 task file (``launcher.backends.batch.build_task_file``).
        log_dir: absolute directory of the task output files.
        job_id: ``PSLAUNCH_JOB_ID``.
    """
    name = check_job_name(spec.name)
    opts = spec.options or SGEOptions()
    out = []
    for role, cores, memory in ((Role.SERVER, spec.server_cores, spec.server_memory_mb),
                                (Role.WORKER, spec.worker_cores, spec.worker_memory_mb)):
        count = len(role_procs(procs, role))
        if not count:
            continue
        out.append(JobTemplateSpec(
            role=str(role), count=count, job_name=name, remote_command=wrapper[0],
            args=(*wrapper[1:], "--task-file", task_file, "--role", str(role), "--index", "sge",
                  "--report-dir", log_dir),
            working_directory=spec.workdir or os.getcwd(),
            output_path=":" + os.path.join(log_dir, f"{role}.{PARAMETRIC_INDEX}.out"),
            error_path=":" + os.path.join(log_dir, f"{role}.{PARAMETRIC_INDEX}.err"),
            native_specification=build_native_specification(
                queue=spec.queue, cores=cores, memory_mb=memory, pe=opts.pe, native=opts.native),
            job_environment={pc.JOB_ID: job_id},
        ))
    return tuple(out)


def task_file_path(log_dir: str, job_id: str) -> str:
    return os.path.join(log_dir, f".pslaunch-{job_id}.task.json")


def qdel_command(job_numbers: Sequence[str], qdel: Optional[str]) -> Optional[list[str]]:
    """What the watchdog runs if the launcher is killed: ``qdel`` on every job."""
    return [qdel, *job_numbers] if qdel and job_numbers else None


def exit_code_of(*, has_exited: bool, exit_status: int, has_signal: bool, signal_name: str,
                 was_aborted: bool, ran: bool, terminated: bool) -> tuple[int, str]:
    """A finished task's exit code, as the other backends report it, and why.

    * exited: its exit status; killed by a signal: 128+N;
    * aborted (deleted with ``qdel``/``TERMINATE``, which kills with SIGKILL):
      137 if it had started or the launcher deleted it, otherwise 1 - Grid
      Engine could not start it (a bad working directory, output path or
      command; see the task's ``.err`` file and ``qacct -j``).
    """
    if has_signal:
        try:
            signum = int(signal.Signals[signal_name]) if not signal_name.isdigit() else int(signal_name)
        except KeyError:
            signum = int(signal.SIGKILL)
        return 128 + signum, f"killed by {signal_name or 'a signal'}"
    if has_exited and not was_aborted:
        return exit_status, ""
    if terminated:
        return 128 + int(signal.SIGKILL), "deleted by the launcher" + ("" if ran else " before it started")
    if ran:
        return 128 + int(signal.SIGKILL), "deleted while running (qdel?)"
    return 1, "Grid Engine could not start it (see its .err file and qacct -j)"


def environment_problem(environ: Mapping[str, str], exists: Callable[[str], bool] = os.path.exists,
                        isdir: Callable[[str], bool] = os.path.isdir) -> Optional[str]:
    """What keeps libdrmaa from loading or connecting, as one line; ``None`` if nothing.

    Checks ``DRMAA_LIBRARY_PATH`` (set, and a file) and ``SGE_ROOT`` (set, and
    a directory). ``GLIBC_TUNABLES`` is checked by loading the library (see
    :func:`load_drmaa`), since only libraries that link libjemalloc need it.
    """
    lib = environ.get(DRMAA_LIBRARY_PATH, "")
    hint = f" (Debian: {DEBIAN_DRMAA_LIBRARY})" if exists(DEBIAN_DRMAA_LIBRARY) else \
        " (the libdrmaa.so of your Grid Engine, e.g. $SGE_ROOT/lib/<arch>/libdrmaa.so)"
    if not lib:
        return f"{DRMAA_LIBRARY_PATH} is not set: export {DRMAA_LIBRARY_PATH}=<path of libdrmaa.so>{hint}"
    if not exists(lib):
        return f"{DRMAA_LIBRARY_PATH}={lib}: no such file; set it to the path of libdrmaa.so{hint}"
    root = environ.get(SGE_ROOT, "")
    root_hint = f" (Debian: {DEBIAN_SGE_ROOT})" if isdir(DEBIAN_SGE_ROOT) else ""
    if not root:
        return f"{SGE_ROOT} is not set (libdrmaa needs it): export {SGE_ROOT}=<Grid Engine's root>{root_hint}"
    if not isdir(root):
        return f"{SGE_ROOT}={root}: no such directory{root_hint}"
    return None


def load_drmaa(environ: Mapping[str, str] = os.environ) -> Any:
    """Import the ``drmaa`` package, or raise a one-line :class:`BackendUnavailableError`."""
    if importlib.util.find_spec("drmaa") is None:
        raise BackendUnavailableError("the sge backend needs the drmaa package: "
                                      "pip install '.[sge]' in your clone of pslaunch (drmaa==0.7.9)")
    problem = environment_problem(environ)
    if problem:
        raise BackendUnavailableError(problem)
    try:
        return importlib.import_module("drmaa")
    except OSError as e:
        text = str(e)
        if "static TLS" in text:
            raise BackendUnavailableError(
                f"libdrmaa ({environ.get(DRMAA_LIBRARY_PATH)}) pulls in a library that needs static "
                f"TLS, which glibc reserves only at start-up: start pslaunch with "
                f"{GLIBC_TUNABLES}={_with_tunable(environ.get(GLIBC_TUNABLES, ''))}") from None
        raise BackendUnavailableError(
            f"cannot load {DRMAA_LIBRARY_PATH}={environ.get(DRMAA_LIBRARY_PATH)}: {text}") from None
    except AttributeError as e:  # a loadable library that is not libdrmaa: "undefined symbol: drmaa_init"
        raise BackendUnavailableError(
            f"{DRMAA_LIBRARY_PATH}={environ.get(DRMAA_LIBRARY_PATH)} is not a DRMAA library "
            f"({_one_line(e)}); set it to the path of libdrmaa.so") from None
    except RuntimeError as e:  # drmaa's own "Could not find drmaa library"
        raise BackendUnavailableError(f"drmaa: {' '.join(str(e).split())}") from None


def _with_tunable(current: str) -> str:
    return f"{current}:{STATIC_TLS_TUNABLE}" if current else STATIC_TLS_TUNABLE


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# --- the handle --------------------------------------------------------------------------


class SGETask(BatchTask):
    """One array task of a bulk job."""

    def __init__(self, proc: ProcSpec, output: ProcOutput, backend: SGEBackend, job_task_id: str,
                 out_path: str, err_path: str, started_file: str) -> None:
        super().__init__(proc, output, backend, host="(sge)")
        self.job_task_id = job_task_id          # "<job number>.<SGE_TASK_ID>"
        self.out_path = out_path
        self.err_path = err_path
        self.started_file = started_file
        self.state = "queued_active"
        self.reaped = False                     # Grid Engine no longer holds it
        self.files: dict[str, Any] = {}         # output file -> open binary file, once it exists
        self.drained = False                    # its output files were read to the end and closed

    def where(self) -> str:
        return f"SGE task {self.job_task_id}"

    def describe(self) -> str:
        text = super().describe()
        return f"{text[:-1]}; output {self.out_path})"


# --- the backend -------------------------------------------------------------------------


class SGEBackend(BatchBackend):
    """Grid Engine through DRMAA. See the module docstring."""

    name = "sge"
    index_source = "sge"
    Options = SGEOptions
    options = (
        BackendOption(("--sge-native",), "native", "extra native specification (qsub options).", metavar="TEXT"),
        BackendOption(("--sge-log-dir",), "log_dir", "task output files (default: <jobname>.log/).", metavar="DIR"),
        BackendOption(("--sge-pe",), "pe", "parallel environment for --worker-cores/--server-cores above 1.",
                      default="smp", metavar="PE", show_default=True),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._drmaa: Any = None
        self._s: Any = None  # the drmaa.Session (one per process)
        self._session = False
        self._full_scan = False
        self._job_numbers: list[str] = []
        self._next_reap = self._next_status = 0.0

    # -- dry run ------------------------------------------------------------------------

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        log_dir = log_dir_for(spec)
        task_file = task_file_path(log_dir, plan.job_id)
        templates = build_job_templates(spec, plan.procs, wrapper=node.command("task"), task_file=task_file,
                                        log_dir=log_dir, job_id=plan.job_id)
        doc = build_task_file(spec, plan.procs)
        out = ["Grid Engine (DRMAA): one bulk job per role, servers first:"]
        for t in templates:
            out.append(f"  {t.role}s: runBulkJobs(template, 1, {t.count}, 1)")
            for key, value in t.attributes().items():
                out.append(f"    {key}: {json.dumps(value)}")
        out.append(f"task file (mode 0600; the variables above, PATH, the command): {task_file}")
        for role, r in doc["roles"].items():
            out.append(f"  {role}: DMLC_TASK_ID = {r['first_task_id']} + SGE_TASK_ID - 1, "
                       f"{len(r['env'])} variables")
        if doc["env"]:
            out.append(f"  every task: PATH={doc['env'][pc.PATH]}")
        out.append(f"  argv: {json.dumps(doc['argv'])}")
        out.append(agent_line())
        return out

    # -- set-up ---------------------------------------------------------------------------

    def check(self) -> None:
        self._drmaa = load_drmaa(os.environ)

    def prepare(self) -> Mapping[Any, str]:
        """Open the DRMAA session. Node addresses are resolved by the wrapper on each node."""
        drmaa = self._drmaa or load_drmaa(os.environ)
        self._drmaa = drmaa
        self._s = drmaa.Session()
        try:
            self._s.initialize()
        except drmaa.errors.DrmaaException as e:
            raise LaunchError(f"cannot open a DRMAA session with Grid Engine "
                              f"({SGE_ROOT}={os.environ.get(SGE_ROOT)}, "
                              f"{SGE_CELL}={os.environ.get(SGE_CELL, 'default')}): "
                              f"{_one_line(e)}; is sge_qmaster running (qstat)?") from None
        self._session = True
        return {}

    # -- submitting -------------------------------------------------------------------------

    def submit(self, procs: Sequence[ProcSpec], hub: Optional[tuple[str, int]]) -> list[BatchTask]:
        spec = self.spec
        job_id = procs[0].env.get(pc.JOB_ID, "job")
        log_dir = log_dir_for(spec)
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError as e:
            raise LaunchError(f"cannot create --sge-log-dir {log_dir}: {e.strerror or e}") from None
        path = task_file_path(log_dir, job_id)
        templates = build_job_templates(spec, procs, wrapper=node.command("task"), task_file=path, log_dir=log_dir,
                                        job_id=job_id)
        write_private_json(path, build_task_file(spec, procs, hub=hub))
        self.task_file = path
        by_role = {str(r): role_procs(procs, r) for r in (Role.SERVER, Role.WORKER)}
        qdel = shutil.which("qdel")
        if qdel is None:
            log.warning("qdel is not on PATH: if pslaunch is killed with SIGKILL, nothing can delete its "
                        "Grid Engine jobs")
        with spawn_guard():  # a Ctrl-C now is raised only once every submitted task has a handle
            if self.watchdog is not None:
                self.watchdog.on_abandon(["rm", "-f", path])
            for t in templates:
                for i in range(1, t.count + 1):  # Grid Engine appends to existing files
                    for f in (*t.task_files(i), os.path.join(log_dir, f"{t.role}-{i - 1}.started")):
                        _remove(f)
                ids = self._submit(t)
                number = ids[0].split(".")[0]
                self._job_numbers.append(number)
                if self.watchdog is not None:
                    cmd = qdel_command([number], qdel)
                    if cmd:
                        self.watchdog.on_abandon(cmd)
                for i, (job_task_id, proc) in enumerate(zip(ids, by_role[t.role]), start=1):
                    out_path, err_path = t.task_files(i)
                    self.add_task(SGETask(proc, self.console.proc(proc.name, proc.label, str(proc.role)), self,
                                          job_task_id, out_path, err_path,
                                          os.path.join(log_dir, f"{proc.name}.started")))
                log.info("submitted %d %s task%s as Grid Engine job %s (%s)", t.count, t.role,
                         "" if t.count == 1 else "s", number, t.native_specification or "no native options")
        log.info("task output: %s/{server,worker}.<SGE_TASK_ID>.{out,err} (SGE_TASK_ID = rank + 1)", log_dir)
        return self.tasks

    def _submit(self, t: JobTemplateSpec) -> list[str]:
        drmaa = self._drmaa
        with self.lock:
            jt = self._s.createJobTemplate()
            try:
                for key, value in t.attributes().items():
                    setattr(jt, key, value)
                ids = list(self._s.runBulkJobs(jt, 1, t.count, 1))
            except drmaa.errors.DrmaaException as e:
                raise LaunchError(f"Grid Engine refused the {t.role} job: {_one_line(e)} "
                                  f"(native specification: {t.native_specification or 'none'!r})") from None
            finally:
                self._s.deleteJobTemplate(jt)
        if len(ids) != t.count:
            raise LaunchError(f"Grid Engine returned {len(ids)} task ids for {t.count} {t.role} tasks")
        log.debug("%s tasks: %s", t.role, ", ".join(ids))
        return ids

    def describe_pending(self, pending: Sequence[BatchTask], timeout: float) -> str:
        states = "; ".join(f"{t.label}: {t.where()} {t.state} ({_QSTAT_CODE.get(t.state, t.state)})"
                           for t in pending)
        return (f"{len(pending)} of {len(self.tasks)} tasks still queued after --start-timeout {timeout:g}s "
                f"- {states}; `qstat -j {' '.join(self._job_numbers)}` tells why (free slots, queue, "
                "parallel environment, holds)")

    # -- following the tasks -------------------------------------------------------------

    def poll_once(self) -> None:
        now = time.monotonic()
        for t in list(self.tasks):
            assert isinstance(t, SGETask)
            if t.code is None and t.channel == "none":
                self._tail(t)
                self._read_started(t)
        if now >= self._next_reap:
            self._next_reap = now + REAP_EVERY
            self._reap()
        if now >= self._next_status:
            self._next_status = now + STATUS_EVERY
            self._statuses()

    def settled(self) -> bool:
        return all(isinstance(t, SGETask) and t.reaped for t in self.tasks)

    def _tail(self, t: SGETask, final: bool = False) -> None:
        """Feed what the task's output files gained since the last call (kept open once they exist)."""
        for path, stream in ((t.out_path, t.output.stdout), (t.err_path, t.output.stderr)):
            f = t.files.get(path)
            if f is not None and f.closed:
                continue  # the final call was made (the supervisor's and the poller's may race)
            if f is None:
                try:
                    f = t.files[path] = open(path, "rb")  # closed by the final call
                except OSError:
                    f = None  # not created yet: the task is queued
            if f is not None:
                try:
                    while True:
                        chunk = f.read(65536)
                        if not chunk:
                            break
                        stream.feed(chunk)
                except (OSError, ValueError) as e:  # ValueError: closed by a final call meanwhile
                    log.debug("reading %s: %s", path, e)
                if final:
                    f.close()
            if final:
                stream.close()

    def final_output(self, t: BatchTask) -> None:
        assert isinstance(t, SGETask)
        if t.drained:  # (called when the task ends and again when the backend closes)
            return
        t.drained = True
        if t.channel == "none":
            self._tail(t, final=True)  # its output is in its files only
        else:
            for f in t.files.values():
                f.close()
            super().final_output(t)

    def _read_started(self, t: SGETask) -> None:
        if t.pid is not None:
            return
        try:
            with open(t.started_file, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError):
            return
        t.host = str(info.get("host") or t.host)
        t.pid = int(info["pid"]) if info.get("pid") else None
        if not t.ran:
            t.ran = True
            t.start_time = float(info.get("time") or time.time())
            log.debug("%s runs on %s (pid %s, DMLC_NODE_HOST %s)", t.label, t.host, t.pid, info.get("node_host"))

    def _reap(self) -> None:
        """Collect every finished task: wait(ANY, NO_WAIT) until nothing is left."""
        drmaa = self._drmaa
        errors = drmaa.errors
        while True:
            with self.lock:
                if self.settled():
                    return
                try:
                    info = self._s.wait(drmaa.Session.JOB_IDS_SESSION_ANY, drmaa.Session.TIMEOUT_NO_WAIT)
                except (errors.ExitTimeoutException, errors.InvalidJobException):
                    return  # nothing finished / no job left in the session
                except Exception as e:  # noqa: BLE001 - drmaa raises a bare Exception for some codes
                    # code 24 "no usage information" for a task deleted while held or queued: it
                    # is reaped, but its id is lost; jobStatus on every task finds it gone
                    log.debug("wait(ANY): %s; checking every task", _one_line(e))
                    self._full_scan = True
                    return
            self._finish(info.jobId, info)

    def _statuses(self) -> None:
        drmaa = self._drmaa
        errors = drmaa.errors
        with self.lock:
            full = self._full_scan
            self._full_scan = False
            todo = [t for t in self.tasks if isinstance(t, SGETask) and not t.reaped
                    and (full or t.terminated or not t.ran or t.code is not None)]
        for t in todo:
            with self.lock:
                if t.reaped:
                    continue
                try:
                    state = str(self._s.jobStatus(t.job_task_id))
                except errors.InvalidJobException:
                    state = "gone"
                except errors.DrmaaException as e:
                    log.debug("jobStatus(%s): %s", t.job_task_id, _one_line(e))
                    continue
            if state != t.state and t.code is None:
                log.debug("%s (SGE task %s): %s -> %s", t.label, t.job_task_id, t.state, state)
            if state == "running":
                t.ran = True
            if state in ("done", "failed"):
                self._wait_one(t)
            elif state == "gone":
                # reaped elsewhere or forgotten by Grid Engine: no exit status is left
                t.reaped = True
                self.set_code(t, *exit_code_of(has_exited=False, exit_status=0, has_signal=False, signal_name="",
                                               was_aborted=True, ran=t.ran, terminated=t.terminated))
            elif t.code is None:
                t.state = state

    def _wait_one(self, t: SGETask) -> None:
        drmaa = self._drmaa
        errors = drmaa.errors
        with self.lock:
            try:
                info = self._s.wait(t.job_task_id, drmaa.Session.TIMEOUT_NO_WAIT)
            except errors.ExitTimeoutException:
                return
            except Exception as e:  # noqa: BLE001 - drmaa raises a bare Exception for some codes
                # code 24 "no usage information": deleted before it ran (held or queued)
                log.debug("wait(%s): %s", t.job_task_id, _one_line(e))
                info = None
        if info is None:
            t.reaped = True
            self.set_code(t, *exit_code_of(has_exited=False, exit_status=0, has_signal=False, signal_name="",
                                           was_aborted=True, ran=t.ran, terminated=t.terminated))
        else:
            self._finish(info.jobId, info)

    def _finish(self, job_task_id: str, info: Any) -> None:
        task = next((t for t in self.tasks if isinstance(t, SGETask) and t.job_task_id == job_task_id), None)
        if task is None or task.reaped:
            return
        task.reaped = True
        if task.code is not None:
            return  # its agent told us first, and better (when it ended, and how)
        self._read_started(task)
        ran = task.ran or info.hasExited or info.hasSignal
        code, reason = exit_code_of(has_exited=info.hasExited, exit_status=info.exitStatus,
                                    has_signal=info.hasSignal, signal_name=info.terminatedSignal,
                                    was_aborted=info.wasAborted, ran=ran, terminated=task.terminated)
        self.set_code(task, code, reason)

    # -- stopping ----------------------------------------------------------------------------

    def cancel(self, tasks: Sequence[BatchTask]) -> None:
        """``control(TERMINATE)`` every task of ``tasks`` that Grid Engine still holds; idempotent."""
        drmaa = self._drmaa
        for t in tasks:
            assert isinstance(t, SGETask)
            with self.lock:
                if t.reaped or not self._session or t.terminated:
                    continue
                t.terminated = True
                self._full_scan = True
                try:
                    self._s.control(t.job_task_id, drmaa.JobControlAction.TERMINATE)
                except drmaa.errors.InvalidJobException:
                    pass  # already gone; the follower collects it
                except drmaa.errors.DrmaaException as e:
                    log.warning("could not delete SGE task %s: %s", t.job_task_id, _one_line(e))
                    continue
            log.debug("deleted %s (SGE task %s, %s)", t.label, t.job_task_id, t.state)

    def release(self) -> None:
        """End the DRMAA session; remove the task file and the tasks' start reports."""
        if self._session:
            try:
                self._s.exit()
            except Exception as e:  # noqa: BLE001 - the session is being dropped anyway
                log.debug("DRMAA exit: %s", _one_line(e))
            self._session = False
        if self.task_file:
            _remove(self.task_file)
            self.task_file = None
        for t in self.tasks:
            assert isinstance(t, SGETask)
            _remove(t.started_file)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.debug("cannot remove %s: %s", path, e)
