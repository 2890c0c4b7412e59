"""Running a job: the scheduler, the backend, fail-fast and teardown.

:func:`run_job` is the whole lifecycle:

1. open the backend and let it prepare (connect, sync, node addresses);
2. work out the scheduler's address (:mod:`.addresses`) and take the first free port of
   ``--port-range`` that no other pslaunch on this machine has claimed (and claim it);
3. start everything at once: the scheduler here, servers and workers through the backend
   (a ps-lite node retries until the scheduler listens, so nobody waits for its imports);
4. watch every process: the first non-zero exit, a signal, or ``--timeout`` stops the job.
   Until the scheduler listens, a failure is checked for a lost port race: if someone else
   took the port between the probe and the scheduler's bind, every process of this attempt is
   stopped and the whole job starts again on the next port (a fresh backend; nothing of the
   lost attempt is reported or left behind). What the processes print is shown as it comes,
   never held for the port's verdict: when the port was lost, one line says that the lines above
   were the stopped attempt's, and nothing more of it is shown. A scheduler that runs the user's
   command and does not listen after a few seconds gets one hint (``-s 0``, ``--tracker torch``);
   one that never listens within ``--start-timeout`` is an error;
5. always: stop every group gracefully, kill it after ``--kill-grace`` (at once on a second
   signal), sweep leftover process groups, write ``--summary-json`` and report who failed
   first (:mod:`.report`);
6. with ``--max-restarts``, after a failure of a process that ran: wait the restart delay and
   start again at 1 as the next attempt (a fresh secret and port, the same run id), while the
   job's one budget (:class:`.report.RestartBudget`) lasts. A signal, ``--timeout`` and a
   process that could not start end the job. With ``--restart-scope process``, a lost worker of
   a parameter-server job is replaced in place instead, out of the same budget: the job goes on
   while a new worker with its environment (and ``PSLAUNCH_REPLACEMENT``) starts where it ran
   (:meth:`Supervisor._replace_lost`).

A dead-man switch (``launcher.node.watchdog``) kills every local process group if the
launcher itself is killed with SIGKILL. The supervisor never names a backend: it asks the
backend's class.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any, Mapping, Optional

import pscontract as pc

from .. import backends, trackers
from ..backends.base import Backend
from ..errors import ConfigError, LaunchError
from ..node.procgroup import become_subreaper, has_children, kill_children, kill_marked
from ..node.watchdog import Client as Watchdog
from ..runtime.handle import ProcessHandle, ProcGroup, describe_exit
from ..runtime.local import LocalProcess
from ..runtime.output import Console, PipePump, is_terminal
from ..runtime.ports import NoFreePort, PortClaim, claim_free_port
from ..spec.job import Host, JobSpec, Role
from ..spec.plan import Plan, ProcSpec, build_plan
from ..trackers.pslite import require_pyzmq
from . import addresses as addr
from . import hosthealth, report
from .progress import Progress
from .signals import Interrupted, Signals

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.02
# A job whose every process is a child of ours says when one ends (a pidfd, the end of its output)
# and signals wake the loop too: between those, it looks ever less often, up to this.
CALM_POLL_INTERVAL = 0.16
MAX_PORT_ATTEMPTS = 5
LOST_ATTEMPT_GRACE = 1.0  # SIGTERM to SIGKILL for an attempt that lost its port (it did no work yet)
PORT_LOST = "port-lost"  # (an attempt's outcome: the scheduler lost its port; the job starts again)
HINT_AFTER = 5.0  # the user's command as the scheduler, not listening this long: maybe not a ps-lite program
#: how long the scheduler may outlive every server and worker that exited 0: ps-lite's ends with
#: the job's last barrier, before they do; one still running after this waits for nodes that are gone
SCHEDULER_OUTLIVES = 10.0
EXIT_TIMEOUT = 124
EXIT_ABORT = 134  # SIGABRT (128 + 6)
#: how long a process that aborted after its program returned (torch's gloo exit race) leaves the
#: others running to finish their work (rank 0's checkpoint) before the job is stopped as failed
EXIT_RACE_GRACE = 60.0
#: how long the last lines of processes that failed in one look are waited for (their cause lines)
CAUSE_WAIT = 1.0
#: what a command that is not a ps-lite program wants instead of the parameter-server default
NOT_PSLITE = ("run it with -s 0 (workers only: no scheduler, no servers) or, for torch.distributed, "
              "--tracker torch")
DUMP_WAIT = 3.0      # after asking for stack dumps, how long to let them print
KILL_WAIT = 5.0      # after SIGKILL, how long to wait for every process to be gone
ESCAPE_CHECK_WAIT = 0.2  # output open this long after the end: someone that left its group holds it
OUTPUT_WAIT = 2.0    # how long the output pumps may take to deliver the last lines
#: a C++ ps-lite scheduler gives a late node a lost one's id only once the lost one missed its
#: heartbeats for PS_HEARTBEAT_TIMEOUT: its replacement starts this much later still
PSLITE_DEAD_MARGIN = 1.0


class Wakeup:
    """A one-bit wake-up call: :meth:`set` from any thread; :meth:`wait` returns at once when it
    was set, or after ``timeout``, and clears it. A bare lock, where :class:`threading.Event`'s
    Python-level condition took most of the CPU of an idle look at the processes (50 looks a
    second while a job runs, on the cores its processes need)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # set already
            pass

    def wait(self, timeout: float) -> bool:
        """True when it was set (now cleared)."""
        return self._lock.acquire(timeout=timeout)


class Supervisor:
    """Runs one :class:`JobSpec` to the end. Use :func:`run_job`.

    ``backend``, ``clock`` and ``watchdog`` are for tests: a backend class (default: the spec's,
    from the registry), an object with ``time()``, ``monotonic()`` and ``sleep()`` (default:
    the ``time`` module), and whether to start the dead-man switch. ``adopt_orphans`` (the
    command line's launcher, which has no other children) makes this process a child subreaper:
    a job process's descendant that detaches from its group is re-parented here and stopped at
    the end, even when nothing else marks it. ``view`` (a ``launcher.ui.model.JobView``, for
    ``--ui`` and ``--report``) is fed every line, state, attempt and the failure as they happen.
    """

    def __init__(self, spec: JobSpec, console: Optional[Console] = None,
                 backend: Optional[type[Backend]] = None, clock: Any = time, watchdog: bool = True,
                 adopt_orphans: bool = False, view: Any = None) -> None:
        self.spec = spec  # the attempt's: the job's, with the hosts and workers of hosthealth's layout
        self.job_spec = spec
        self.console = console or Console(log_dir=spec.log_dir, log_raw=spec.log_raw, only=spec.only)
        self.view = view
        if view is not None:
            self.console.tap = view.add_line
        self.backend_cls = backend or backends.get(spec.launcher)
        self.clock = clock
        self.handles: list[ProcessHandle] = []
        self.groups: list[ProcGroup] = []
        self.discarded: list[ProcessHandle] = []  # attempts that lost their port; swept at the end
        self.scheduler: Optional[LocalProcess] = None
        self.plan: Optional[Plan] = None
        self.signals = Signals()
        self.watchdog: Optional[Watchdog] = None
        self.use_watchdog = watchdog
        self.adopt_orphans = adopt_orphans
        self.pump: Optional[PipePump] = None
        self.start_time = clock.time()
        self.stopped: set[str] = set()  # processes the launcher stopped (names)
        self.first: Optional[ProcessHandle] = None
        self.tracker: Optional[trackers.TrackerHandle] = None  # a collective job's (--tracker), not a process
        #: a tracker kept for the job's next attempt (``Tracker.restarts``; closed at the job's end)
        self._kept: Optional[trackers.Tracker] = None
        self._ids = (os.urandom(32).hex(), os.urandom(6).hex())  # (secret, job id): secrets.token_hex's way
        self._backend: Optional[Backend] = None  # while an attempt runs
        self._watch: Optional[addr.SchedulerWatch] = None  # while the job starts: who gets the port
        self._claim: Optional[PortClaim] = None  # the attempt's port, against other pslaunch runs here
        self._wake = Wakeup()  # set when a process's output ends: look now, not at the next tick
        self.console.on_stream_end = self._wake.set
        self.signals.on_signal = self._wake.set
        self._interval = POLL_INTERVAL
        self._expected = {"scheduler": int(spec.has_scheduler), "server": spec.num_servers,
                          "worker": spec.num_workers}
        self.progress = _progress(  # the live status line (a terminal only; --no-progress)
            self.console, spec.progress, self._expected, self.start_time)
        #: which attempt of the job runs (``PSLAUNCH_ATTEMPT``): inside a Slurm job that Slurm
        #: requeued, its restart count; each restart adds one
        self.attempt = spec.first_attempt
        self.attempts: list[report.AttemptRecord] = []
        self._restarts: Optional[report.RestartBudget] = None  # a failed job's, when it could restart
        #: the job's one restart budget (whole attempts and, --restart-scope process, replacements)
        self._budget = report.RestartBudget(spec.max_restarts, spec.restart_delay, spec.restart_window)
        self.replaced: list[ProcessHandle] = []  # lost workers that a replacement took over from
        self.replacements: list[dict] = []  # what --summary-json says of each (report.replacement_record)
        #: lost workers waiting for their replacement to start: (the lost handle, when, its record)
        self._pending: list[tuple[ProcessHandle, float, dict]] = []
        self._native_pslite: Optional[bool] = None  # the attempt's scheduler is C++ ps-lite's (asked once)
        self._secrets: list[str] = []  # every attempt's secret values, hidden in all that is shown
        self._hinted = False  # the hint that the command may not be a ps-lite program was given
        self._hosts: list[hosthealth.AttemptHosts] = []  # what each attempt did on its hosts
        self._layout: Optional[hosthealth.Layout] = None  # the attempt's hosts, when they differ
        self._first_counts: dict[Host, int] = {}  # what each host held in the first attempt
        self._cannot: Optional[str] = None  # why the job could not go on (too few hosts left)
        self._start_failed: Optional[dict] = None  # the cause of an attempt whose hosts did not answer
        self._unreached: dict[Host, str] = {}  # ... those hosts, and why

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> report.JobResult:
        spec = self.spec
        outcome: Optional[tuple[str, int]] = None
        self.signals.install()
        if spec.timeout and self.clock is time:
            self.signals.alarm(spec.timeout)
        if self.adopt_orphans:
            become_subreaper()
        try:
            if self.use_watchdog:
                self.watchdog = Watchdog(spec.kill_grace, fork=True)
            outcome = self._attempts()
        finally:
            if self._kept is not None:
                self._kept.close()
            if self.progress is not None:
                self.progress.close()
            if self.pump is not None:
                self.pump.stop()
            if self.watchdog is not None:
                self.watchdog.close(wait=self.adopt_orphans)  # (then a launcher without children is clean)
            self._sweep()
            self.signals.restore()
        assert outcome is not None
        return self._finish(*outcome)

    def _attempts(self) -> tuple[str, int]:
        """Every attempt of the job (``--max-restarts``): after a process of an attempt fails, the
        attempt is torn down like any failed job, and the whole job starts again after a delay,
        while the job's one budget lasts. ``(reason, exit code)`` of the last attempt (or of the
        wait before the next: a signal, ``--timeout``)."""
        spec = self.spec
        restarts = self._budget
        port = spec.port_range[0] - 1
        while True:
            started = self.clock.time()
            self._start_failed = None
            try:
                outcome = self._attempt_on_free_port(port)
            except LaunchError as e:
                if not (e.unreachable and self._hosts and spec.max_restarts):
                    raise
                outcome = self._unreachable(e)
            ended = self.clock.time()
            cause = self._attempt_cause() or self._start_failed
            delay = None
            layout = self._layout
            self._note_hosts(ended)
            if outcome[0] == "failure" and cause is not None and restarts.may_restart(ended - started):
                nxt = self._next_layout(ended)
                if nxt is not None:
                    delay = restarts.next_delay()
            self.attempts.append(report.AttemptRecord(
                attempt=self.attempt, start_time=started, end_time=ended, reason=outcome[0], exit_code=outcome[1],
                cause=cause, delay=delay, hosts=None if layout is None else layout.to_dict()))
            if self.view is not None:
                self.view.set_attempts([a.to_dict() for a in self.attempts])
            if delay is None:
                if outcome[0] == "failure" and spec.max_restarts and self._cannot is None:
                    self._restarts = restarts  # (the last line, after the failure report: _finish)
                return outcome
            if self.first is not None:
                head = report.failure_report(self.first, len(self.stopped), self._redactor(),
                                             report.find_cause(self.first, self.handles), self._hint())
                self._show_failure(head)
            if self.view is not None:
                self.view.set_state("restarting")
            report.log_attempt_failed(len(self.attempts), self.attempts[-1], restarts, cause)
            self._show_layout(nxt)
            waited = self._wait_before_restart(delay)
            if waited is not None:
                return waited
            if self.plan is not None:
                port = self.plan.root_port  # (each attempt on a fresh port: nothing of the last reaches it)
            self._use_layout(nxt)
            self._next_attempt(f"restart {restarts.used}/{restarts.limit}")

    # -- hosts that fail (hosthealth) ---------------------------------------------------------

    def _unreachable(self, e: LaunchError) -> tuple[str, int]:
        """A later attempt could not start because hosts did not answer (down, unplugged, no sshd):
        said in one line, and the attempt counts as failed by those hosts, which the next attempt
        leaves out (:attr:`_start_failed`, the attempt's cause)."""
        log.error("%s", e)
        where = ", ".join(h.display for h in e.unreachable)
        self._start_failed = {"process": None, "role": "host", "rank": None, "host": where, "pid": None,
                              "exit_code": e.exit_code, "signal": None, "end_time": self.clock.time(),
                              "error": [str(e)], "last_lines": [], "unreachable": [h.display for h in e.unreachable]}
        self._unreached = {h: "it did not answer when the attempt started" for h in e.unreachable}
        return "failure", e.exit_code

    def _note_hosts(self, ended: float) -> None:
        """Keep what the attempt that ended did on its hosts: the host of its first failure (the
        root cause) and the hosts pslaunch lost (:meth:`ProcessHandle.host_lost`)."""
        if not self.job_spec.hosts:
            return
        if not self._hosts and not self._first_counts:
            self._first_counts = hosthealth.first_counts([h.proc.host for h in self.handles if h is not self.tracker])
        first = self.first
        failed = None
        if first is not None and first is not self.tracker and first.exit_code not in (None, 0):
            failed = first.proc.host
        lost: dict[Host, str] = dict(self._unreached)
        self._unreached = {}
        lost_here = [h for h in self.replaced if h.proc.env.get(pc.ATTEMPT) == str(self.attempt)]
        for h in [*self.handles, *lost_here]:  # (a worker replaced elsewhere lost its host too)
            why = h.host_lost() if h is not self.tracker else None
            if why and h.proc.host is not None:
                lost.setdefault(h.proc.host, why)
        self._hosts.append(hosthealth.AttemptHosts(self.attempt, ended, self.spec.hosts, failed, tuple(lost.items())))

    def _policy(self) -> hosthealth.Policy:
        spec = self.job_spec
        return hosthealth.Policy(hosts=spec.hosts, spares=spec.spares, num_workers=spec.num_workers,
                                 min_workers=spec.min_workers, num_servers=spec.num_servers,
                                 cooldown=spec.host_cooldown, seed=self._ids[1], first=self._first_counts)

    def _next_layout(self, now: float) -> Optional[hosthealth.Layout]:
        """The next attempt's hosts and workers (the job's when nothing is out); None when too few
        hosts are left for the job (:attr:`_cannot` says why)."""
        if not self.job_spec.hosts:  # (local, or hosts a batch system chose: nothing to leave out)
            return hosthealth.Layout(self.job_spec.hosts, self.job_spec.num_workers)
        try:
            layout = hosthealth.next_layout(self._policy(), self._hosts, now)
            self._spec_for(layout)  # (a spec the smaller job cannot have: --only worker:3 of 3 workers)
        except hosthealth.CannotContinue as e:
            self._cannot = str(e)
            return None
        except ConfigError as e:
            self._cannot = f"cannot go on with {layout.num_workers} workers: {e}"
            return None
        return layout

    def _spec_for(self, layout: hosthealth.Layout) -> JobSpec:
        """The spec of an attempt on ``layout``: the job's, with its hosts and workers."""
        job = self.job_spec
        if layout.hosts == job.hosts and layout.num_workers == job.num_workers:
            return job
        return dataclasses.replace(job, hosts=layout.hosts, num_workers=layout.num_workers)

    def _use_layout(self, layout: Optional[hosthealth.Layout]) -> None:
        """The next attempt runs on ``layout``'s hosts with its workers: a spec of its own (the
        backends see an ordinary spec). Its lines say who is out, which spare took whose place,
        and the size when it shrank."""
        self.spec = self.job_spec if layout is None else self._spec_for(layout)
        changed = layout is not None and (self.spec is not self.job_spec or layout.out or layout.back)
        self._layout = layout if changed else None
        self._expected["worker"] = self.spec.num_workers

    def _show_layout(self, layout: Optional[hosthealth.Layout]) -> None:
        """Say who is left out and why, which spare takes whose place, and the size when it shrinks."""
        if layout is None:
            return
        for line in hosthealth.describe(layout, self.clock.time()):
            log.warning("%s", line)
        job = self.job_spec
        if layout.num_workers != job.num_workers:
            log.warning("the next attempt runs %d of %d workers (-n %s:%d): %s %s out and no spare is left",
                        layout.num_workers, job.num_workers, job.min_workers, job.num_workers,
                        ", ".join(h.display for h in layout.dropped), "is" if len(layout.dropped) == 1 else "are")

    def _attempt_on_free_port(self, after_port: int) -> tuple[str, int]:
        """One attempt of the job, started again on the next port while its scheduler loses the
        race for the port (see :meth:`_attempt`)."""
        outcome: tuple[str, int] = (PORT_LOST, 0)
        port = after_port
        for attempt in range(1, MAX_PORT_ATTEMPTS + 1):
            outcome = self._attempt(attempt, port)
            if outcome[0] != PORT_LOST:
                break
            assert self.plan is not None
            port = self.plan.root_port
        return outcome

    def _attempt_cause(self) -> Optional[dict]:
        """What made this attempt fail, when a restart could help: a process of the job that ran
        and failed (None for one that could not start at all, or a failed tracker)."""
        h = self.first
        if h is None or h.failure is not None or h is self.tracker or h.exit_code in (None, 0):
            return None
        return report.attempt_cause(h, self._redactor())

    def _hint(self) -> Optional[str]:
        """What the first failure says of the job's type (``report.job_type_hint``): a torch
        program without ``--tracker torch``, a tracker that named the one its workers need."""
        assert self.first is not None
        tracker = self.tracker.tracker.failure() if self.tracker is not None else None
        return report.job_type_hint(self.spec, self.first.output.lines(), tracker)

    def _redactor(self) -> Any:
        """What hides every attempt's secrets so far."""
        return report.redactor(None, self._secrets)

    def _wait_before_restart(self, delay: float) -> Optional[tuple[str, int]]:
        """Sleep ``delay`` before the next attempt; a signal or ``--timeout`` ends the job instead
        (their outcome)."""
        end = self.clock.monotonic() + delay
        deadline = self.start_time + self.spec.timeout if self.spec.timeout else None
        while True:
            if self.signals.count:
                return "signal", self.signals.exit_code
            if self.signals.timed_out or deadline is not None and self.clock.time() > deadline:
                return "timeout", EXIT_TIMEOUT
            left = end - self.clock.monotonic()
            if left <= 0:
                return None
            if self.clock is time:
                self._wake.wait(min(left, 0.2))
            else:
                self.clock.sleep(min(left, POLL_INTERVAL))

    def _next_attempt(self, restarts: str) -> None:
        """Forget the attempt that ended (every process of it is gone: :meth:`_shutdown` waited
        for each, and the sweep took what left its group) and get ready for the next: a fresh
        secret and port, the same run id."""
        self._sweep()
        self.attempt += 1
        self.handles, self.groups, self.scheduler, self.first, self.tracker = [], [], None, None, None
        self.stopped.clear()
        self._pending, self._native_pslite = [], None
        self._ids = (os.urandom(32).hex(), self._ids[1])
        self.console.log_banner = f"--- pslaunch: attempt {self.attempt} (PSLAUNCH_ATTEMPT={self.attempt}) ---"
        self.signals.raise_now = True
        self.signals.deferred = None
        if self.spec.timeout and self.clock is time:
            self.signals.alarm(max(0.001, self.start_time + self.spec.timeout - self.clock.time()))
        if self.progress is not None:  # (the attempt's teardown closed it)
            self.progress = _progress(self.console, self.spec.progress, self._expected, self.start_time)
            if self.progress is not None:
                self.progress.restarts = restarts

    def _attempt(self, attempt: int, after_port: int) -> tuple[str, int]:
        """One try at the job, on the first free port after ``after_port``: ``(reason, exit code)``,
        or ``(PORT_LOST, 0)`` when the scheduler lost that port (everything of it is stopped)."""
        spec = self.spec
        outcome: Optional[tuple[str, int]] = None
        with self.backend_cls(spec, self.console, self.watchdog) as backend:
            self._backend = backend
            try:
                backend.check()
                if spec.has_scheduler and spec.scheduler == "builtin":
                    require_pyzmq()
                addr.check_address_given(spec, self.backend_cls)  # (before any connection: at once)
                addr.check_loopback(spec, self.backend_cls)
                addresses = dict(backend.prepare())
                root_uri = addr.scheduler_address(spec, addresses, self.backend_cls)
                self._timing("backend ready")
                plan = self._plan(root_uri, addresses, attempt, after_port)
                if plan.scheduler is not None:
                    self.console.begin_attempt()  # (silenced if it loses the port: _attempt's end)
                    self.scheduler = self._spawn_local(plan.scheduler)
                    self._add(ProcGroup([self.scheduler]))
                    assert self.scheduler.pid is not None  # (a started local process)
                    self._watch = addr.SchedulerWatch(self.scheduler.pid, plan.root_uri, plan.root_port,
                                                     on_verdict=lambda _: self._wake.set()).start()
                    self._timing("scheduler started")
                self.signals.check()
                if plan.procs:
                    try:
                        group = backend.start(plan.procs)
                    except BaseException:
                        self._add(backend.started())  # stopped with the rest, not only removed at close
                        raise
                    self._add(group)
                    self._timing(f"{len(plan.procs)} servers and workers started")
                    self.signals.check()
                outcome = self._monitor()
            except Interrupted as e:
                outcome = ("timeout", EXIT_TIMEOUT) if e.signum == signal.SIGALRM else \
                    ("signal", self.signals.exit_code)
            finally:
                lost = outcome is not None and outcome[0] == PORT_LOST and attempt < MAX_PORT_ATTEMPTS
                if not lost:
                    self.signals.raise_now = False  # first: a --timeout alarm due now must not
                    self.signals.alarm(0)           # interrupt this clean-up (the port watch's stop included)
                if self._watch is not None:
                    self._watch.stop()
                    self._watch = None
                shown = self.console.discard() if lost else 0  # before the stop: what it prints while it ends, too
                stop_at = self.clock.time()
                try:
                    self._shutdown(dump=outcome is not None and outcome[0] == "timeout", quiet=lost)
                finally:
                    if self.tracker is not None:  # only now: a worker may need it until it exits
                        self._end_tracker()
                if outcome is not None and outcome[0] == "failure" and self.first is not None:
                    self.first = self._root_cause(stop_at)
                    outcome = ("failure", self.first.exit_code or 1)
                if lost:
                    self._forget_attempt(shown)
                if self._claim is not None:  # (the job has ended, or its next attempt claims another)
                    self._claim.release()
                    self._claim = None
                self._backend = None
        if outcome[0] == PORT_LOST and not lost:  # the last attempt: report the scheduler's failure
            self.first = self.scheduler
            return "failure", (self.scheduler.exit_code if self.scheduler else None) or 1
        return outcome

    def _root_cause(self, stop_at: float) -> ProcessHandle:
        """The first process to fail, by the time it ended on its host, among all that failed on
        their own before the launcher began to stop the job at ``stop_at``: one whose news came
        after another's failure was acted on (a slower host's frame) is still the root cause when
        it failed first. Those are not counted as stopped by the launcher."""
        assert self.first is not None
        failed = [h for h in self.handles if h.exit_code not in (None, 0) and h.end_time is not None
                  and h.end_time < stop_at]
        for h in failed:
            self.stopped.discard(h.name)
        return self._first_failure([self.first, *(h for h in failed if h is not self.first)])

    def _first_failure(self, failed: list[ProcessHandle]) -> ProcessHandle:
        """The first of ``failed`` to fail: the one that ended first, unless a ``pslaunch-cause:``
        line of it names another of them (the scheduler: ``worker 1 disconnected``), which then
        failed before it whatever the times say: one look of the launcher may see both ended, and a
        local process's end is the time it was seen. The failed processes' last lines are waited
        for (at most :data:`CAUSE_WAIT` seconds): the cause line may still be on its way."""
        if len(failed) > 1:
            until = time.monotonic() + CAUSE_WAIT
            for h in failed:
                for stream in (h.output.stdout, h.output.stderr):
                    stream.done.wait(max(0.0, until - time.monotonic()))
        first = min(failed, key=lambda h: h.end_time or 0.0)
        cause = report.find_cause(first, failed) if len(failed) > 1 else None
        if cause is not None and cause.reporter is first and cause.culprit is not None:
            return cause.culprit
        return first

    def _forget_attempt(self, shown: int) -> None:
        """After a lost port race: what the attempt started is stopped; keep it only to sweep.
        ``shown``: how many lines the attempt's processes printed before (they were shown: the
        warning says whose they were, and the log files mark where the next attempt begins)."""
        assert self.plan is not None
        above = f" (the {shown} line{'' if shown == 1 else 's'} above came from the stopped attempt)" if shown else ""
        log.warning("port %d was taken before the scheduler could bind it; starting the job again on the "
                    "next port%s", self.plan.root_port, above)
        self.console.log_banner = (f"--- pslaunch: port {self.plan.root_port} was taken before the scheduler "
                                   "could bind it; the job starts again on the next port ---")
        self.discarded.extend(self.handles)
        self.handles, self.groups, self.scheduler, self.first = [], [], None, None
        self.stopped.clear()

    def _sweep(self) -> None:
        """What is left of the job on this machine after the teardown: processes that left their
        groups (``setsid()``, double forks).

        As a subreaper (the command line's launcher), each of them is our child by now (their
        parents have ended): nothing to do when we have no child at all, else they are stopped.
        Otherwise they are found by their ``PSLAUNCH_PROCESS`` (a scan of every process here).
        """
        if self.adopt_orphans and not has_children():
            return
        self._stop_escapees()

    def _stop_escapees(self) -> None:
        """Stop every process of the job here that left its group: as a subreaper, each is our
        child (the watchdog excepted); otherwise each is found by its ``PSLAUNCH_PROCESS``."""
        if self.adopt_orphans:
            keep = {self.watchdog.pid} if self.watchdog is not None and self.watchdog.pid else set()
            for tracker in (self._kept, self.tracker.tracker if self.tracker is not None else None):
                if tracker is not None and tracker.pid:
                    keep.add(tracker.pid)  # (closed by its own rules; a kept one serves the next attempt)
            if self._backend is not None:
                keep |= self._backend.helper_pids()  # the launcher's own helpers (skein's driver, salloc)
            n = kill_children(keep=keep)
        elif self.plan is not None:
            n = kill_marked(f"{self.plan.job_id}/")
        else:
            return
        if n:
            log.debug("stopped %d process%s that had left their groups", n, "" if n == 1 else "es")

    def _add(self, group: ProcGroup) -> None:
        self.groups.append(group)
        self.handles.extend(group.handles)

    def _timing(self, what: str) -> None:
        log.debug("%s after %.0f ms", what, (self.clock.time() - self.start_time) * 1000)

    def _log_start(self, plan: Plan) -> None:
        s = self.spec
        sched = f", scheduler at {plan.root_uri}:{plan.root_port}" if plan.scheduler else ""
        if self.tracker is not None:
            sched = f", {self.tracker.label} at {plan.root_uri}:{plan.root_port}"
        servers = f"{s.num_servers} server{'' if s.num_servers == 1 else 's'} and " if s.num_servers else ""
        log.info("starting %s%d worker%s on %s (%s)%s", servers, s.num_workers, "" if s.num_workers == 1 else "s",
                 self.backend_cls.where(s, plan), s.launcher, sched)

    def _plan(self, root_uri: str, addresses: Mapping[Host, str], attempt: int, after_port: int) -> Plan:
        """The plan around the first free port of ``--port-range`` after ``after_port``."""
        spec = self.spec
        secret, job_id = self._ids
        lo, hi = spec.port_range
        here = root_uri if self.backend_cls.all_here(spec) else None
        tracker, kept = None, self._kept
        if spec.collective:
            tracker = kept or trackers.create(spec, self.console, self.watchdog)
        if tracker is not None:  # a collective job: its tracker serves where the scheduler would run
            self._kept = None
            self.tracker = trackers.TrackerHandle(tracker)  # (held before it starts: close() always reaches it)
            tracker.peers = addr.job_peers(spec, addresses, self.backend_cls)
            port = tracker.restart(root_uri) if kept is not None else tracker.start(root_uri)
            self.tracker.pid = tracker.pid
        else:
            try:
                port, self._claim = claim_free_port(lo, hi, after=after_port)
            except NoFreePort as e:
                raise e.for_user("the scheduler") from None
        plan = build_plan(spec, root_uri=root_uri, root_port=port, secret=secret, job_id=job_id,
                          addresses=addresses, here=here, inherit_environ=not self.backend_cls.remote,
                          attempt=self.attempt)
        self.plan = plan
        if self.view is not None:
            self.view.plan(plan.job_id, plan.all, self.attempt)
        redactor = report.redactor(plan, self._secrets)
        self._secrets = list(redactor.values)
        self.console.redact = redactor if redactor else None  # what the processes print, too
        if attempt == 1 and not self.attempts:
            if self.watchdog is not None:
                self.watchdog.mark(f"{job_id}/")  # if the launcher dies, what left its group goes too
            if plan.overridden:
                log.warning("the launcher sets %s itself; the values from your environment or --env "
                            "are ignored", ", ".join(plan.overridden))
            self._log_start(plan)
        return plan

    def _end_tracker(self) -> None:
        """The attempt has ended: close its tracker, or keep it for the next attempt where it can
        serve one (``Tracker.restarts``: the torch store's ``import torch`` then happens once a job);
        :meth:`run` closes a kept one when the job ends."""
        assert self.tracker is not None
        if self.spec.max_restarts and self.tracker.tracker.restarts:
            self._kept = self.tracker.tracker
        else:
            self.tracker.close()

    def _spawn_local(self, proc: ProcSpec) -> LocalProcess:
        if self.pump is None:
            self.pump = PipePump()
        out = self.console.proc(proc.name, proc.label, str(proc.role))
        return LocalProcess(proc, out, self.pump, self.watchdog, proc.env, self.spec.workdir)

    def _monitor(self) -> tuple[str, int]:
        """Watch until the job ends: ``(reason, exit code)``; the first failure is :attr:`first`.

        Until the scheduler listens, :class:`~.addresses.SchedulerWatch` says whether it lost its
        port: then ``(PORT_LOST, 0)``, before any failure the race caused is counted, so that the
        job starts again.
        """
        deadline = self.start_time + self.spec.timeout if self.spec.timeout else None
        starting = self._watch is not None
        listen_by = self.clock.monotonic() + max(self.spec.start_timeout, 1.0)
        hint_at: Optional[float] = None  # (once a job: not again after a lost port race)
        if self.spec.scheduler == "command" and not self._hinted:
            hint_at = self.clock.monotonic() + HINT_AFTER
        for name in self.signals.notices():  # (a program would die of it before it set a handler)
            log.warning("SIG%s arrived before the job's processes started: not passed on", name)
        alone_since: Optional[float] = None  # when the scheduler became the last process running
        while True:
            if self.signals.count:
                return "signal", self.signals.exit_code
            self._pass_notices()
            failed = []
            running = 0
            for h in self.handles:
                code = h.poll()
                if code is None:
                    running += 1
                elif code != 0:
                    failed.append(h)
            if failed and running and all(self._left_after_return(h) for h in failed):
                failed = []  # (torch's exit race: its work was done; the others finish theirs first)
            if starting:
                assert self._watch is not None
                if self.scheduler in failed or failed and self.spec.replaces_workers:
                    self._wait_verdict()  # (on its death: at once; a lost worker is replaced once it listens)
                verdict = self._watch.verdict
                if verdict == "lost":
                    return PORT_LOST, 0
                if verdict is not None:
                    starting = False
                    self._timing(f"scheduler {'listening' if verdict == 'up' else 'ended'}")
                elif not failed and self.clock.monotonic() > listen_by:
                    assert self.plan is not None
                    raise LaunchError(
                        f"the scheduler did not listen on {self.plan.root_uri}:{self.plan.root_port} within "
                        f"--start-timeout {self.spec.start_timeout:g}s; is the command a ps-lite program "
                        f"(MXNet, our trainer)? If not, {NOT_PSLITE}")
                elif hint_at is not None and not failed and self.clock.monotonic() > hint_at:
                    hint_at, self._hinted = None, True
                    if self.scheduler is not None and self.scheduler.pid and not addr.maps_pslite(self.scheduler.pid):
                        self._hint_not_pslite()
            if failed and not starting and self.spec.replaces_workers:
                failed = self._replace_lost(failed)
            if self._pending and not failed:
                failed = self._start_replacements()
            running += len(self._pending)
            if not failed and running and self.tracker is not None and self.tracker.poll() not in (None, 0):
                failed.append(self.tracker)  # the tracker failed and no worker did (see trackers.FAILURE_GRACE)
            if failed:
                self.first = self._first_failure(failed)
                self._show(force=True)  # (the page: at once, not after the teardown)
                self._show_failure(f"{self.first.describe()} {describe_exit(self.first.exit_code or 1)}")
                return "failure", self.first.exit_code or 1
            if running == 0:
                return "success", 0
            if running == 1 and len(self.handles) > 1 and self.scheduler is not None and self.scheduler.poll() is None:
                alone_since = alone_since or self.clock.monotonic()
                if self.clock.monotonic() - alone_since > SCHEDULER_OUTLIVES:
                    self._scheduler_outlived()
                    return "success", 0
            if deadline is not None and self.clock.time() > deadline:
                return "timeout", EXIT_TIMEOUT
            if self.progress is not None:
                self.progress.tick(self.handles, self.clock.time())
            self._pause()

    # -- replacing lost workers (--restart-scope process) ------------------------------------

    def _replace_lost(self, failed: list[ProcessHandle]) -> list[ProcessHandle]:
        """Workers that failed, each to be replaced in place while the rest of the job runs on,
        out of the job's restart budget: they leave :attr:`handles` (kept in :attr:`replaced`)
        and wait in :attr:`_pending` for their replacement's start. Returns what still fails the
        job: all of ``failed`` when any of them is no worker that ran (a server, the scheduler, a
        process that could not start), or when the budget does not cover them all."""
        if any(h.proc.role is not Role.WORKER or h is self.tracker or h.failure is not None for h in failed):
            return failed
        now = self.clock.time()
        if not all(self._budget.may_restart(now - (h.start_time or now)) for h in failed) or \
                self._budget.limit - self._budget.used < len(failed):
            return failed  # (the failure report then says the budget is used up)
        for h in failed:
            k = 1 + sum(1 for r in self.replacements if r["process"] == h.name and r["attempt"] == self.attempt)
            nominal = self._budget.next_delay()
            delay = max(0.0 if k == 1 else nominal, self._pslite_wait(h))
            record = report.replacement_record(h, self.attempt, k, delay)
            self.replacements.append(record)
            self.handles.remove(h)
            self.replaced.append(h)
            self._pending.append((h, self.clock.monotonic() + delay, record))
            when = f" in {delay:.1f}s" if delay >= 0.05 else ""
            log.warning("%s; replacing it in place%s (restart %d/%d)",
                        report.describe_cause(report.attempt_cause(h, self._redactor())), when, self._budget.used,
                        self._budget.limit)
        if self.progress is not None:
            self.progress.restarts = f"restart {self._budget.used}/{self._budget.limit}"
        return []

    def _pslite_wait(self, lost: ProcessHandle) -> float:
        """How long after now a replacement for ``lost`` must wait so that the scheduler sees the
        lost node as dead: C++ ps-lite's scheduler (the user's command with MXNet's or BytePS's
        library, or ``--scheduler builtin``, which follows it) gives a late node a lost one's id
        only once that one's last heartbeat is older than ``PS_HEARTBEAT_TIMEOUT``. 0 for other
        schedulers (pslaunch's KV store takes a replacement's word at once)."""
        if self._native_pslite is None:
            pid = self.scheduler.pid if self.scheduler is not None else None
            self._native_pslite = self.spec.scheduler == "builtin" or \
                (pid is not None and addr.maps_pslite(pid, addr.NATIVE_PSLITE))
        if not self._native_pslite:
            return 0.0
        try:
            timeout = float(lost.proc.env.get(pc.HEARTBEAT_TIMEOUT) or 0)
        except ValueError:
            timeout = 0.0
        since = self.clock.time() - (lost.end_time or self.clock.time())
        return max(0.0, timeout + PSLITE_DEAD_MARGIN - since)

    def _start_replacements(self) -> list[ProcessHandle]:
        """Start every pending replacement that is due, where its lost worker ran; one that cannot
        start fails the job with its lost worker as the cause (returned)."""
        assert self._backend is not None
        now = self.clock.monotonic()
        due = [p for p in self._pending if p[1] <= now]
        for lost, _, record in due:
            self._pending.remove((lost, _, record))
            proc = dataclasses.replace(lost.proc, env=pc.replacement_env(lost.proc.env, record["replacement"]))
            try:
                group = self._backend.replace(proc)
            except (LaunchError, OSError) as e:
                record["error"] = str(e)
                log.error("could not start a replacement for %s: %s", lost.label, e)
                self.replaced.remove(lost)
                self.handles.append(lost)
                return [lost]
            self._add(group)
            for h in group.handles:
                report.replacement_started(record, h)
            log.info("%s replaced: %s", lost.label, ", ".join(h.describe() for h in group.handles))
        return []

    def _left_after_return(self, h: ProcessHandle) -> bool:
        """``h`` aborted after its program had returned (torch's gloo exit race,
        :func:`.report.exit_abort`), less than :data:`EXIT_RACE_GRACE` ago: its work is done, so
        the other processes are not stopped in theirs (rank 0 writing its checkpoint). The job
        fails all the same, with ``h``'s code, once they have ended (or the grace is over)."""
        if h.exit_code != EXIT_ABORT or h.end_time is None or self.clock.time() - h.end_time > EXIT_RACE_GRACE:
            return False
        if not (h.output.stdout.done.is_set() and h.output.stderr.done.is_set()):
            return self.clock.time() - h.end_time < 1.0  # (its last lines are on their way: look again)
        return report.exit_abort(h.output.lines())

    def _scheduler_outlived(self) -> None:
        """Every server and worker exited 0 and the scheduler still runs :data:`SCHEDULER_OUTLIVES`
        later: it waits for nodes that are gone (ps-lite's scheduler ends with the job's last
        barrier, before the nodes do), most likely because they were not ps-lite programs (under
        ``--scheduler builtin``, which never ends by itself without them). Their work is done:
        the scheduler is stopped and the job ends 0, as it would have had the scheduler run the
        same command."""
        log.warning("every server and worker exited 0, and the scheduler still ran %gs later: it waits for nodes "
                    "that are gone, which never spoke ps-lite to it; stopped it. If the command is not a ps-lite "
                    "program, %s", SCHEDULER_OUTLIVES, NOT_PSLITE)

    def _hint_not_pslite(self) -> None:
        """The scheduler runs the user's command and, :data:`HINT_AFTER` seconds after everything
        started, it runs, nobody listens on its port and it has no ps-lite library loaded
        (:func:`.addresses.maps_pslite`): most likely a program that is not a ps-lite program (a
        torch.distributed one, a plain script) run under the parameter-server default, but it
        may be a ps-lite program still importing on a busy machine. Said once, as a hint."""
        assert self.plan is not None
        log.info("hint: nothing listens on the scheduler's port %s:%d after %gs, and the scheduler (your command, "
                 "run with DMLC_ROLE=scheduler) has loaded no ps-lite library (MXNet, ZeroMQ); if the command is not "
                 "a ps-lite program, %s", self.plan.root_uri, self.plan.root_port, HINT_AFTER, NOT_PSLITE)

    def _pass_notices(self) -> None:
        """Pass each SIGUSR1/SIGUSR2 the launcher got on to every process of the job (a batch
        system's notice before a time limit: the processes checkpoint and go on)."""
        for name in self.signals.notices():
            log.info("SIG%s received: passing it on to every process", name)
            for g in self.groups:
                g.forward(name)

    def _pause(self) -> None:
        """Until the next look at the processes: :data:`POLL_INTERVAL`, or less when one's output
        ends. When every process is a local child and no tracker runs, each end, signal and port
        verdict wakes this at once: then the looks back off to :data:`CALM_POLL_INTERVAL` while
        nothing happens (each look costs the cores the job needs about 150 microseconds)."""
        self._show()
        if self.clock is not time:
            self.clock.sleep(POLL_INTERVAL)
            return
        woken = self._wake.wait(self._interval)
        if woken or self.tracker is not None or not all(type(h) is LocalProcess for h in self.handles):
            self._interval = POLL_INTERVAL
        else:
            self._interval = min(self._interval * 2, CALM_POLL_INTERVAL)

    def _show(self, force: bool = False) -> None:
        """Bring the job page's rows up to the handles (its own pace, unless ``force``)."""
        if self.view is not None:
            self.view.sync(self.handles, self.stopped, force=force)

    def _show_failure(self, headline: str) -> None:
        """The first failure on the job page: ``headline`` (the failure report's first line), what
        the process wrote to its error file, and its last lines."""
        if self.view is not None and self.first is not None:
            redact = self._redactor()
            lines = [*self.first.describe_error(), *report.tail_lines(self.first.output.lines())]
            self.view.set_failure(self.first.name, redact(headline), [redact(line) for line in lines])

    def _wait_verdict(self, seconds: float = 1.0) -> None:
        if self._watch is not None and self._watch.judge_now() is not None:
            return
        end = time.monotonic() + seconds
        while self._watch is not None and self._watch.verdict is None and time.monotonic() < end:
            time.sleep(0.005)

    # -- teardown --------------------------------------------------------------------------

    def _wait(self, seconds: float, stop_on_second_signal: bool = False) -> None:
        """Wait until every process has ended, at most ``seconds``."""
        deadline = self.clock.monotonic() + seconds
        while any(h.poll() is None for h in self.handles):
            if self.clock.monotonic() > deadline or (stop_on_second_signal and self.signals.count >= 2):
                return
            self._pause()

    def _shutdown(self, dump: bool = False, quiet: bool = False) -> None:
        """Stop whatever still runs: stack dumps (timeout), SIGTERM, ``--kill-grace``, SIGKILL, sweep groups.

        ``quiet``: an attempt that lost its port, stopped to start again (a short grace)."""
        if self.progress is not None:
            self.progress.close()
        self._show(force=True)
        running = [h for h in self.handles if h.poll() is None]
        if dump and running:
            log.warning("dumping the Python stacks of %d running process%s",
                        len(running), "" if len(running) == 1 else "es")
            for g in self.groups:
                g.dump_stacks()
            self._wait(DUMP_WAIT)
        for g in self.groups:
            self.stopped.update(h.name for h in g.running())
            g.terminate()
        self._wait(min(self.spec.kill_grace, LOST_ATTEMPT_GRACE) if quiet else self.spec.kill_grace,
                   stop_on_second_signal=True)
        for g in self.groups:
            g.kill()
        self._wait(KILL_WAIT)
        for g in self.groups:  # (one killpg(0) per group: no scan of /proc)
            g.cleanup()
        for h in self.discarded:
            h.cleanup()
        # give the output pumps a moment to deliver the last lines; output still open a moment
        # after every process has ended is held by one that left its group: stop those first
        if not self._output_done(ESCAPE_CHECK_WAIT):
            self._stop_escapees()
        end = self.clock.monotonic() + OUTPUT_WAIT
        for h in self.handles:
            for stream in (h.output.stdout, h.output.stderr):
                stream.done.wait(max(0.0, end - self.clock.monotonic()))

    def _output_done(self, seconds: float) -> bool:
        end = self.clock.monotonic() + seconds
        for h in self.handles:
            for stream in (h.output.stdout, h.output.stderr):
                if not stream.done.wait(max(0.0, end - self.clock.monotonic())):
                    return False
        return True

    def _finish(self, reason: str, code: int) -> report.JobResult:
        end_time = self.clock.time()
        elapsed = end_time - self.start_time
        message = ""
        cause = report.find_cause(self.first, self.handles) if self.first is not None else None
        restarts = len(self.attempts) - 1
        after = f" (after {restarts} restart{'' if restarts == 1 else 's'})" if restarts > 0 else ""
        if self.replacements:
            n_replaced = len(self.replacements)
            after += f" ({n_replaced} worker{'' if n_replaced == 1 else 's'} replaced in place)"
        if reason == "success":
            n = len(self.handles) - len(self.stopped)
            log.info("all %d process%s exited 0 in %.1fs%s%s", n, "" if n == 1 else "es", elapsed, after,
                     "; the scheduler was stopped" if self.stopped else "")
        elif reason == "failure" and (self.first is not None or self._start_failed is not None):
            if self.first is not None:
                message = report.failure_report(self.first, len(self.stopped), self._redactor(), cause,
                                                self._hint())
                self._show_failure(message)
            if self._restarts is not None:
                message = report.log_attempt_failed(len(self.attempts), self.attempts[-1], self._restarts,
                                                    self.attempts[-1].cause)
            elif self._cannot is not None:  # (too few hosts left for another attempt: hosthealth)
                message = f"attempt {len(self.attempts)} failed and the job {self._cannot}"
                log.error("%s", message)
        elif reason == "timeout":
            message = f"the job ran longer than --timeout {self.spec.timeout:g}s and was stopped"
            log.error("%s", message)
        elif reason == "signal":
            message = f"stopped by {self.signals.describe()}"
            log.error("%s after %.1fs; every process was terminated", message, elapsed)
        log_errors = self.console.log_errors()
        if log_errors:
            log.warning("%s line%s of output did not reach --log-dir %s (first: %s); the console showed them",
                        f"{log_errors['lines_not_logged']:,}", "" if log_errors["lines_not_logged"] == 1 else "s",
                        self.spec.log_dir, log_errors["first_error"])
        result = report.JobResult(
            exit_code=code, reason=reason, first_failure=self.first.record() if self.first else None,
            records=(*(h.record(replaced=True) for h in self.replaced),
                     *(h.record(h.name in self.stopped) for h in self.handles)),
            start_time=self.start_time, end_time=end_time, message=message, log_errors=log_errors,
            cause=None if cause is None else {"process": cause.culprit.name if cause.culprit else None,
                                              "reason": cause.reason, "reported_by": cause.reporter.name},
            attempts=tuple(self.attempts), ui=getattr(self.view, "address", None),
            replacements=tuple(self.replacements))
        if self.view is not None:
            self.view.finish(reason, code, self.handles, self.stopped)
        if self.spec.summary_json:
            report.write_summary(self.spec.summary_json, self.spec, self.plan, result)
        return result


def _progress(console: Console, enabled: bool, expected: Mapping[str, int], start: float) -> Optional[Progress]:
    """:meth:`.progress.Progress.create`, where a status line can be shown."""
    if not enabled or not is_terminal(console.stdout):
        return None
    return Progress.create(console, enabled, expected, start)


def run_job(spec: JobSpec, console: Optional[Console] = None, adopt_orphans: bool = False,
            view: Any = None) -> report.JobResult:
    """Run ``spec`` to the end and return the result (never raises for a failed process);
    ``view``: the job page's model (``launcher.ui.model.JobView``), fed as the job runs."""
    return Supervisor(spec, console, adopt_orphans=adopt_orphans, view=view).run()


def dry_run_plan(spec: JobSpec, backend: type[Backend]) -> Plan:
    """The plan with placeholders where only a real launch can tell (no network, no ports)."""
    root_uri = addr.dry_run_address(spec, backend)
    if backend.all_here(spec):
        addresses: Mapping[Host, str] = {}
        here: Optional[str] = root_uri
    else:
        addresses, here = backend.dry_run_addresses(spec, spec.interface), None
    return build_plan(spec, root_uri=root_uri, root_port=spec.port_range[0], secret="0" * 64, job_id="dry-run",
                      addresses=addresses, here=here, inherit_environ=False, scheduler_inherits=False)
