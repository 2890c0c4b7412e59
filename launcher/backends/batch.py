"""What the batch-system backends (sge, yarn, slurm) share: tasks, the task file, the hub, the follower.

A batch system decides where and when the tasks run. The launcher writes one task file (mode
0600: the job's variables, the secret among them, never go into the job's description), submits
the tasks through the system's API, and then learns about them two ways:

* from each task's node agent (``launcher.node.task``), over its connection to the job's hub
  (``launcher.runtime.hub``): where it runs, its output, its exit code, as soon as each
  happens; and the launcher can stop a task gracefully or make it dump its stacks, which no
  batch system's own controls can;
* from the batch system itself, which a follower thread polls (:meth:`BatchBackend.poll_once`):
  queued or running, and the end of a task whose agent never connected.

A subclass provides the system's part: :meth:`~BatchBackend.submit`,
:meth:`~BatchBackend.poll_once`, :meth:`~BatchBackend.cancel`, :meth:`~BatchBackend.release`
and what its tasks look like (:meth:`~BatchBackend.describe_pending`); the rest (task file,
hub, the agents' frames, the wait until every task runs, signals, teardown) is here.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Any, ClassVar, Mapping, Optional, Sequence

import pscontract as pc

from ..errors import LaunchError
from ..node import protocol
from ..node.procgroup import resolve_program
from ..runtime.handle import ProcGroup
from ..runtime.hub import Hub, stop_all
from ..runtime.output import PipePump, ProcOutput
from ..runtime.ports import bind_beside
from ..runtime.remote import RemoteProcess
from ..spec.job import JobSpec, Role
from ..spec.plan import ProcSpec, placement_env
from .base import Backend

log = logging.getLogger(__name__)

TASK_FILE_VERSION = 2
#: How much longer than ``--start-timeout`` an agent waits for its placement variables.
PLACEMENT_WAIT = 60.0
#: A task whose agent's connection ended without an exit frame, and which got no exit code (from the
#: batch system, or in-band) within this many seconds, failed when the connection ended: its agent
#: was killed (an agent reports before it closes, and signals make it report).
AGENT_GONE_WAIT = 5.0
# Set per task by the wrapper, or meaningless on a cluster whose hosts are unknown here.
_PER_TASK = (pc.TASK_ID, pc.NODE_HOST, pc.LOCAL_PROCS, pc.PROCESS)


# --- pure builders --------------------------------------------------------------------------


def agent_line(what: str = "task") -> str:
    """The dry run's line on what each ``what``'s node agent does once it runs."""
    return (f"each {what}'s agent connects back to the scheduler's address on a free port of --port-range "
            "(authenticated with the job secret): output as it is printed, graceful stops, stack dumps")


def role_procs(procs: Sequence[ProcSpec], role: Role) -> list[ProcSpec]:
    return sorted((p for p in procs if p.role is role), key=lambda p: p.rank)


def task_roles(procs: Sequence[ProcSpec]) -> dict[str, Any]:
    """Each role's part of a task file: ``{"first_task_id", "count", "env"}``.

    The per-task variables (``DMLC_TASK_ID``, ``DMLC_NODE_HOST``) are left to the wrapper;
    ``PSLAUNCH_LOCAL_PROCS`` is dropped because nobody here knows which tasks share a host.

    Raises:
        LaunchError: the tasks of a role differ in more than their task ids, or their ids are
            not consecutive (a bulk job cannot express that).
    """
    roles: dict[str, Any] = {}
    for role in (Role.SERVER, Role.WORKER):
        members = role_procs(procs, role)
        if not members:
            continue
        envs = [{k: v for k, v in p.env.items() if k not in _PER_TASK} for p in members]
        if any(e != envs[0] for e in envs[1:]):
            raise LaunchError(f"the {role}s' environments differ beyond their task ids; "
                              "a bulk job gives every task the same variables")
        task_ids = [p.task_id for p in members]
        first = min(t for t in task_ids if t is not None)
        if task_ids != list(range(first, first + len(members))):
            raise LaunchError(f"the {role}s' task ids {task_ids} are not consecutive")
        roles[str(role)] = {"first_task_id": first, "count": len(members), "env": envs[0]}
    return roles


def build_task_file(spec: JobSpec, procs: Sequence[ProcSpec], *, hub: Optional[tuple[str, int]] = None,
                    roles: Optional[Mapping[str, Any]] = None, with_path: bool = True) -> dict[str, Any]:
    """The task file (see ``launcher.node.task``): each role's variables, the command, ``PATH``.

    Args:
        hub: where the task agents connect (None: they do not).
        roles: each role's part (default :func:`task_roles`; a backend may move some
            variables elsewhere).
        with_path: carry the launcher's ``PATH``, so the command resolves as it does here (a
            task's own ``PATH`` is the batch system's); a program in the working directory
            becomes ``./prog`` as on the local backend.
    """
    environ = spec.environ_dict()
    common = {pc.PATH: environ[pc.PATH]} if with_path and environ.get(pc.PATH) else {}
    argv = list(spec.command)
    argv[0] = resolve_program(argv[0], {pc.PATH: common.get(pc.PATH, os.defpath)}, spec.workdir)
    doc: dict[str, Any] = {"version": TASK_FILE_VERSION, "argv": argv, "env": common,
                           "roles": dict(roles) if roles is not None else task_roles(procs),
                           "grace": spec.kill_grace}
    if hub is not None:
        doc["hub"] = [hub[0], hub[1]]
    if spec.wants_usage:  # (the agents report each task's CPU and RSS: u frames)
        doc["usage"] = protocol.USAGE_INTERVAL
    if any(p.awaits_placement for p in procs):
        # the agents wait for the placement; the launcher gives up on the tasks after --start-timeout
        doc["placement"] = {"timeout": PLACEMENT_WAIT + max(spec.start_timeout, 1.0)}
    return doc


def write_private_json(path: str, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` to a new file of mode 0600 (it holds the job's secret)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f)
    except OSError as e:
        raise LaunchError(f"cannot write the task file {path}: {e.strerror or e}") from None


# --- the handle ------------------------------------------------------------------------------


class BatchTask(RemoteProcess):
    """One task of a batch job. Its state is kept by its backend: frames from its agent, and the
    batch system's view from the follower thread.

    Attributes:
        state: the batch system's word for it (``queued_active``, ``RUNNING``, ...).
        ran: it has started (its agent said so, or the batch system did).
        terminated: the launcher asked the batch system to remove it.
        channel: its agent's connection: ``none`` (not yet, or never), ``open``, ``closed``.
        reason: why it ended, when the exit code alone does not say.
    """

    def __init__(self, proc: ProcSpec, output: ProcOutput, backend: BatchBackend, host: str,
                 ident: Optional[int] = None) -> None:
        assert proc.task_id is not None
        super().__init__(proc, output, host, proc.task_id if ident is None else ident)
        self.backend = backend
        self.state = "submitted"
        self.ran = False
        self.terminated = False
        self.reason = ""
        self.code: Optional[int] = None
        self.gone_at: Optional[float] = None  # its agent's connection ended without an exit frame

    # -- what its agent says (on the pump's thread) -------------------------------------------------

    def on_start(self, info: dict[str, Any]) -> None:
        with self.backend.lock:
            super().on_start(info)
            self.ran = True
            self.host = str(info.get("host") or self.host)
            self.start_time = time.time()
        log.debug("%s runs on %s (pid %s, DMLC_NODE_HOST %s)", self.label, self.host, self.pid, info.get("addr"))

    def on_exit(self, code: int) -> None:
        self.backend.set_code(self, code, "", ended_at=time.time())

    def on_failed(self, error: str, code: int, info: dict[str, Any]) -> None:
        self.failure = error
        self.host = str(info.get("host") or self.host)
        self.backend.set_code(self, code, "", ended_at=time.time())

    def on_here(self, info: dict[str, Any]) -> None:
        self.backend.placed(self, str(info["host"]) if "host" in info else self.host)

    def channel_closed(self) -> None:
        if self.code is None and not self.terminated and not self.backend._stop.is_set():
            self.gone_at = time.time()  # (see BatchBackend._agents_gone)
        super().channel_closed()
        self.output.close()

    def _poll(self) -> Optional[int]:
        return self.code

    def terminate(self) -> None:
        self.backend.signal_task(self, "TERM")

    def kill(self) -> None:
        self.backend.signal_task(self, "KILL")

    def dump_stacks(self) -> None:
        self.backend.signal_task(self, "ABRT")

    def forward(self, signame: str) -> None:
        self.backend.signal_task(self, signame)

    def where(self) -> str:
        """The task in the batch system's words (``SGE task 12.3``)."""
        return "task"

    def describe(self) -> str:
        where = self.where() + (f" on {self.host}" if not self.host.startswith("(") else "")
        if self.pid:
            where += f", pid {self.pid}"
        why = f"; {self.reason}" if self.reason else ""
        return f"{self.label} ({where}{why})"


# --- the backend -----------------------------------------------------------------------------


class BatchBackend(Backend):
    """Base class of the batch-system backends (see the module docstring)."""

    remote = True
    needs_scheduler_address = True
    #: how the task wrapper learns its index (``launcher.node.task`` ``--index``)
    index_source: ClassVar[str] = ""
    #: seconds between two polls of the batch system
    poll_every: ClassVar[float] = 0.5
    #: how long :meth:`close` waits for the batch system to drop the tasks it cancelled
    close_wait: ClassVar[float] = 20.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tasks: list[BatchTask] = []
        self.lock = threading.RLock()
        self.hub: Optional[Hub] = None
        self.pump: Optional[PipePump] = None
        self.task_file: Optional[str] = None
        self._thread: Optional[threading.Thread] = None
        self._following = False  # the follower runs (set and cleared with the lock held)
        self._stop = threading.Event()
        self._by_ident: dict[int, BatchTask] = {}
        self._procs: Sequence[ProcSpec] = ()
        self._placed: dict[int, str] = {}  # task id -> the host its agent reported (placement)

    # -- what a subclass provides ---------------------------------------------------------------

    def submit(self, procs: Sequence[ProcSpec], hub: Optional[tuple[str, int]]) -> list[BatchTask]:
        """Write the task file (:func:`build_task_file`, with the ``hub`` address the agents
        connect to) and submit the tasks of ``procs``; one :class:`BatchTask` each, registered
        with :meth:`add_task` as soon as it exists (a signal during the submission then finds it)."""
        raise NotImplementedError

    def poll_once(self) -> None:
        """Ask the batch system about the tasks once (on the follower thread)."""

    def cancel(self, tasks: Sequence[BatchTask]) -> None:
        """Remove ``tasks`` from the batch system (queued or running); idempotent."""
        raise NotImplementedError

    def release(self) -> None:
        """The job is over: drop sessions and clients, remove files (called once, by :meth:`close`)."""

    def settled(self) -> bool:
        """True once the batch system holds none of the job's tasks any more (polled by the
        follower; :meth:`close` waits for it, so nothing is left queued when the launcher exits)."""
        return all(t.code is not None for t in self.tasks)

    def describe_pending(self, pending: Sequence[BatchTask], timeout: float) -> str:
        """The one-line error for tasks still not running after ``--start-timeout``."""
        states = ", ".join(f"{t.label}: {t.state}" for t in pending)
        return f"{len(pending)} of {len(self.tasks)} tasks not running after --start-timeout {timeout:g}s ({states})"

    # -- starting -----------------------------------------------------------------------------

    def start(self, procs: Sequence[ProcSpec]) -> ProcGroup:
        if not procs:
            return ProcGroup()
        self.pump = PipePump()
        self._procs = procs
        self.hub = self._listen(procs)
        if self.hub is None and any(p.awaits_placement for p in procs):
            raise LaunchError(f"the tasks must tell the launcher where they run (which share a host decides their "
                              f"RANK and LOCAL_RANK), but it cannot listen for them on --launcher {self.name}; see the "
                              "warning above")
        self.submit(procs, self.hub.address if self.hub else None)
        self._follow_again()
        self._wait_started()
        order = {(p.role, p.rank): i for i, p in enumerate(procs)}
        return ProcGroup(sorted(self.tasks, key=lambda t: order[(t.proc.role, t.proc.rank)]))

    def replace(self, proc: ProcSpec) -> ProcGroup:
        """A lost worker's replacement while the job runs (``--restart-scope process``): one task
        where the lost one ran (:meth:`submit_replacement`), whose agent connects to the job's hub
        under an id the hub admits for it alone (:meth:`Hub.admit_new`; the lost task keeps its own
        id and its record). Returns once it runs.

        Raises:
            LaunchError: the backend cannot, or the task did not start within ``--start-timeout``
                (it is cancelled first: nothing of it is left).
        """
        lost = self._last_task(proc)
        if self.pump is None or self.hub is None or lost is None:
            why = "the job has not started" if lost is None else "the tasks have no connection to the launcher"
            raise LaunchError(f"--launcher {self.name} cannot start {proc.label}'s replacement: {why}")
        if proc.awaits_placement:
            raise LaunchError(f"{proc.label}'s replacement would wait for a placement that the job made at its start")
        t = self.submit_replacement(proc, lost, self.hub.admit_new())
        self._follow_again()
        try:
            self._wait_replacement(t, lost)
        except BaseException:
            self.cancel([t])
            raise
        return ProcGroup([t])

    def submit_replacement(self, proc: ProcSpec, lost: BatchTask, ident: int) -> BatchTask:
        """Submit one task that runs ``proc`` where ``lost`` ran, its agent connecting as ``ident``,
        registered with :meth:`add_task`; the default: this backend cannot (a ``LaunchError``)."""
        raise LaunchError(f"--launcher {self.name} cannot start a replacement while the job runs; "
                          "use --restart-scope job")

    def _last_task(self, proc: ProcSpec) -> Optional[BatchTask]:
        """The latest task that ran ``proc``'s role and rank (the lost one, for a replacement)."""
        with self.lock:
            found = [t for t in self.tasks if t.proc.role is proc.role and t.proc.rank == proc.rank]
        return found[-1] if found else None

    def _follow_again(self) -> None:
        """Start the follower unless it runs: it stops once every task has ended, and a task
        added later (a replacement, registered before this call) needs it again."""
        with self.lock:
            if not self._following:  # (decided with the lock held: see _follow)
                self._following = True
                self._thread = threading.Thread(target=self._follow, name=f"pslaunch-{self.name}", daemon=True)
                self._thread.start()

    def _wait_replacement(self, t: BatchTask, lost: BatchTask) -> None:
        """Block until the replacement ``t`` runs; one that ended first, or still pending after
        ``--start-timeout``, is a one-line ``LaunchError``."""
        timeout = max(self.spec.start_timeout, 1.0)
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                ran, code = t.ran, t.code
            if ran:
                log.info("%s's replacement runs on %s (pid %s)", lost.label, t.host, t.pid)
                return
            if code is not None:
                why = t.failure or t.reason or f"exit code {code}"
                raise LaunchError(f"{t.label}'s replacement ({t.where()}) did not start: {why}")
            if time.monotonic() > deadline:
                raise LaunchError(f"{t.label}'s replacement ({t.where()}) {self.describe_replacement_pending(t)} "
                                  f"after --start-timeout {timeout:g}s")
            time.sleep(0.02)

    def describe_replacement_pending(self, t: BatchTask) -> str:
        """What a replacement that does not run yet waits for, in the batch system's words."""
        return f"was not running ({t.state})"

    def started(self) -> ProcGroup:
        """The tasks submitted so far: a task whose agent is connected is stopped through it (a
        graceful stop, then a kill), the others through the batch system."""
        with self.lock:
            return ProcGroup(list(self.tasks))

    def add_task(self, task: BatchTask) -> None:
        with self.lock:
            self.tasks.append(task)
            self._by_ident[task.ident] = task

    def _listen(self, procs: Sequence[ProcSpec]) -> Optional[Hub]:
        """The hub on the scheduler's address (every node reaches it: that is what
        ``needs_scheduler_address`` asked for), on a free port of ``--port-range``."""
        env = procs[0].env
        service, secret = pc.service_endpoint(env), env.get(pc.SECRET, "")  # the scheduler's or the tracker's
        if service is None or not secret:
            return None

        root = service[0]
        lo, hi = self.spec.port_range
        assert self.pump is not None
        try:
            hub = Hub(self.pump, secret, bind_beside(root, lo, hi, service[1] or lo),
                      [p.task_id for p in procs if p.task_id is not None], self._by_ident)
        except OSError as e:
            log.warning("cannot listen for the tasks on %s (%s): they run without a connection to the launcher "
                        "(output from their files, no graceful stop, no stack dumps)", root, e)
            return None
        log.debug("the task agents connect to %s:%d", *hub.address)
        return hub

    def _wait_started(self) -> None:
        """Block until every task has started (or ended); a task still pending after
        ``--start-timeout`` fails the launch, in the batch system's words."""
        timeout = max(self.spec.start_timeout, 1.0)
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                pending = [t for t in self.tasks if not t.ran and t.code is None]
                failed = any(t.code not in (None, 0) for t in self.tasks)
            if failed or not pending:
                if not pending:
                    log.info("all %d tasks started", len(self.tasks))
                return
            if time.monotonic() > deadline:
                raise LaunchError(self.describe_pending(pending, timeout))
            time.sleep(0.05)

    def placed(self, t: BatchTask, host: str) -> None:
        """``t``'s agent awaits its placement on ``host``: once every such task has said where it
        runs, send each its variables (``launcher.spec.plan.placement_env``; on the pump's thread)."""
        waiting = [p for p in self._procs if p.awaits_placement]
        with self.lock:
            t.ran = True
            t.host = host
            t.state = "placing"
            self._placed[t.ident] = host
            if len(self._placed) < len(waiting) or not all(p.task_id in self._placed for p in waiting):
                return
            placed = dict(self._placed)
        envs = placement_env(waiting, placed)
        hosts = len(set(placed.values()))
        log.info("all %d tasks said where they run (%d host%s); sending each its rank", len(placed), hosts,
                 "" if hosts == 1 else "s")
        for ident, env in envs.items():
            if self.hub is None or not self.hub.send_env(ident, env):
                log.warning("cannot send task %d its placement: its connection is gone", ident)

    # -- the follower ----------------------------------------------------------------------------

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
                self._agents_gone()
            except Exception as e:  # noqa: BLE001 - never let the follower die: the job would hang
                log.error("following the %s tasks: %s", self.name, " ".join(str(e).split()), exc_info=True)
            with self.lock:  # (a task added from now on finds the follower gone: _follow_again)
                if self.settled():
                    self._following = False
                    return
            self._stop.wait(self.poll_every)

    def _agents_gone(self) -> None:
        """Tasks whose agent was killed (:data:`AGENT_GONE_WAIT`) fail, killed, when it ended: at once,
        not when the batch system gets round to it (a Slurm step's task: 61 s)."""
        now = time.time()
        for t in self.tasks:
            if t.code is None and t.gone_at is not None and not t.terminated and now - t.gone_at >= AGENT_GONE_WAIT:
                self.agent_killed(t)

    def agent_killed(self, t: BatchTask) -> None:
        """``t``'s agent was killed (its connection ended without an exit frame): it failed then, killed."""
        assert t.gone_at is not None
        self.set_code(t, 128 + signal.SIGKILL, "its task wrapper was killed: its connection to the launcher ended "
                      "without an exit code", ended_at=t.gone_at)

    def set_code(self, t: BatchTask, code: int, reason: str, ended_at: Optional[float] = None) -> None:
        """``t`` has ended with ``code`` (the first report wins: an agent's, else the batch system's)."""
        with self.lock:
            if t.code is not None:
                return
            if t.gone_at is not None and (ended_at is None or t.gone_at < ended_at):
                ended_at = t.gone_at  # (it ended no later than its agent's connection did)
            self.final_output(t)  # the last lines first: the failure report shows them
            t.state = "done" if code == 0 else ("aborted" if reason else "failed")
            t.reason = reason
            t.ended_at = ended_at
            t.code = code
        log.debug("%s (%s) ended: exit code %d%s", t.label, t.where(), code, f" ({reason})" if reason else "")

    def final_output(self, t: BatchTask) -> None:
        """Deliver what is left of ``t``'s output (a backend that reads files reads the rest)."""
        if t.channel != "open":
            t.output.close()

    # -- signals -------------------------------------------------------------------------------------

    def signal_task(self, t: BatchTask, command: str) -> None:
        """``TERM``/``KILL``/``ABRT``/``USR1``/``USR2`` to one task: through its agent, else through the
        batch system (which can only remove it: there is no graceful stop, no stack dump and no
        notice without an agent)."""
        if t.code is not None:
            return
        sent = self.hub is not None and self.hub.send(t.ident, command)
        if command in ("TERM", "KILL") and not sent:
            self.cancel([t])
        # (a KILL the agent got is not also sent to the batch system at once: removing the task
        # there may kill the agent before it kills the command, and a command that outlives its
        # agent is stopped only after the job's grace; a stuck agent's task is removed by close())

    # -- the end ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel every task still queued or running, wait until the batch system has dropped them,
        release the system's session and remove the task file. Idempotent."""
        try:
            left = [t for t in self.tasks if t.code is None]
            if left:
                self.cancel(left)
            deadline = time.monotonic() + self.close_wait
            while self.tasks and not self.settled() and time.monotonic() < deadline:
                if self._thread is None or not self._thread.is_alive():
                    try:
                        self.poll_once()
                    except Exception as e:  # noqa: BLE001 - the warning below says what is left
                        log.debug("polling %s: %s", self.name, e)
                        break
                time.sleep(0.1)
            if self.tasks and not self.settled():
                left = [t for t in self.tasks if t.code is None] or self.tasks
                log.warning("%s has not dropped %s yet; check the batch system and remove them by hand",
                            self.name, ", ".join(t.where() for t in left))
        finally:
            self._stop.set()
            if self._thread is not None:
                self._thread.join(5)
                self._thread = None
            for t in self.tasks:
                self.final_output(t)
                t.output.close()
            stop_all(self.hub, self.pump)
            self.hub = self.pump = None
            self.release()
