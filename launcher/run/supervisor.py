"""Running a job: the scheduler, the backend, fail-fast and teardown.

:func:`run_job` is the whole lifecycle:

1. open the backend and let it prepare (connect, sync, node addresses);
2. work out the scheduler's address (:mod:`.addresses`) and take the first free port of
   ``--port-range``; start the scheduler here and wait until it listens (if it lost the port
   to someone else in between, try the next one);
3. start servers, then workers, through the backend;
4. watch every process: the first non-zero exit, a signal, or ``--timeout`` stops the job;
5. always: stop every group gracefully, kill it after ``--kill-grace`` (at once on a second
   signal), sweep leftover process groups, write ``--summary-json`` and report who failed
   first (:mod:`.report`).

A dead-man switch (``launcher.node.watchdog``) kills every local process group if the
launcher itself is killed with SIGKILL. The supervisor never names a backend: it asks the
backend's class.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping, Optional

from .. import backends, trackers
from ..backends.base import Backend
from ..errors import LaunchError
from ..node.watchdog import Client as Watchdog
from ..runtime.handle import ProcessHandle, ProcGroup, scan_groups
from ..runtime.local import LocalProcess
from ..runtime.output import Console, PipePump
from ..spec.job import Host, JobSpec
from ..spec.plan import Plan, ProcSpec, build_plan
from . import addresses as addr
from . import report
from .signals import Interrupted, Signals

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.02
MAX_PORT_ATTEMPTS = 5
EXIT_TIMEOUT = 124
DUMP_WAIT = 3.0      # after asking for stack dumps, how long to let them print
KILL_WAIT = 5.0      # after SIGKILL, how long to wait for every process to be gone
OUTPUT_WAIT = 2.0    # how long the output pumps may take to deliver the last lines


class Supervisor:
    """Runs one :class:`JobSpec` to the end. Use :func:`run_job`.

    ``backend``, ``clock`` and ``watchdog`` are for tests: a backend class (default: the spec's,
    from the registry), an object with ``time()``, ``monotonic()`` and ``sleep()`` (default:
    the ``time`` module), and whether to start the dead-man switch.
    """

    def __init__(self, spec: JobSpec, console: Optional[Console] = None,
                 backend: Optional[type[Backend]] = None, clock: Any = time, watchdog: bool = True) -> None:
        self.spec = spec
        self.console = console or Console(log_dir=spec.log_dir)
        self.backend_cls = backend or backends.get(spec.launcher)
        self.clock = clock
        self.handles: list[ProcessHandle] = []
        self.groups: list[ProcGroup] = []
        self.discarded: list[ProcessHandle] = []  # schedulers that lost their port; swept at the end
        self.scheduler: Optional[LocalProcess] = None
        self.plan: Optional[Plan] = None
        self.signals = Signals()
        self.watchdog: Optional[Watchdog] = None
        self.use_watchdog = watchdog
        self.pump: Optional[PipePump] = None
        self.start_time = clock.time()
        self.stopped: set[str] = set()  # processes the launcher stopped (names)
        self.first: Optional[ProcessHandle] = None
        self.tracker: Optional[trackers.TrackerHandle] = None  # a collective job's (--tracker), not a process

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> report.JobResult:
        spec = self.spec
        outcome: Optional[tuple[str, int]] = None
        self.signals.install()
        try:
            if self.use_watchdog:
                self.watchdog = Watchdog(spec.kill_grace)
            with self.backend_cls(spec, self.console, self.watchdog) as backend:
                try:
                    backend.check()
                    addresses = dict(backend.prepare())
                    root_uri = addr.scheduler_address(spec, addresses, self.backend_cls)
                    self._timing("backend ready")
                    plan = self._start_scheduler(root_uri, addresses)
                    self._timing("scheduler listening" if self.scheduler else "no scheduler")
                    self.signals.check()
                    if plan.procs and (self.scheduler is None or self.scheduler.poll() in (None, 0)):
                        self._add(backend.start(plan.procs))
                        self._timing(f"{len(plan.procs)} servers and workers started")
                        self.signals.check()
                    outcome = self._monitor()
                except Interrupted:
                    outcome = ("signal", self.signals.exit_code)
                finally:
                    self.signals.raise_now = False
                    try:
                        self._shutdown(dump=outcome is not None and outcome[0] == "timeout")
                    finally:
                        if self.tracker is not None:
                            self.tracker.close()  # only now: a worker may need it until it exits
        finally:
            if self.pump is not None:
                self.pump.stop()
            if self.watchdog is not None:
                self.watchdog.close()
            self.signals.restore()
        assert outcome is not None
        return self._finish(*outcome)

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

    def _start_scheduler(self, root_uri: str, addresses: Mapping[Host, str]) -> Plan:
        """Build the plan around a free port and start the scheduler on it.

        The port is probed free, then the scheduler binds it. If someone else takes it in
        between, the scheduler dies before listening and the port is busy: try the next one.
        """
        spec = self.spec
        secret = os.urandom(32).hex()  # what secrets.token_hex does, without its imports
        job_id = os.urandom(6).hex()
        lo, hi = spec.port_range
        here = root_uri if self.backend_cls.all_here(spec) else None
        tracker = trackers.create(spec, self.console, self.watchdog)
        if tracker is not None:  # a collective job: its tracker serves where the scheduler would run
            self.tracker = trackers.TrackerHandle(tracker)  # (held before it starts: close() always reaches it)
            port = tracker.start(root_uri)
            self.tracker.pid = tracker.pid
            self.plan = plan = build_plan(spec, root_uri=root_uri, root_port=port, secret=secret, job_id=job_id,
                                          addresses=addresses, here=here, inherit_environ=not self.backend_cls.remote)
            if plan.overridden:
                log.warning("the launcher sets %s itself; the values from your environment or --env are ignored",
                            ", ".join(plan.overridden))
            self._log_start(plan)
            return plan
        port = lo - 1
        for attempt in range(1, MAX_PORT_ATTEMPTS + 1):
            port = addr.first_free_port(lo, hi, after=port)
            plan = build_plan(spec, root_uri=root_uri, root_port=port, secret=secret, job_id=job_id,
                              addresses=addresses, here=here, inherit_environ=not self.backend_cls.remote)
            self.plan = plan
            if attempt == 1:
                if plan.overridden:
                    log.warning("the launcher sets %s itself; the values from your environment or --env "
                                "are ignored", ", ".join(plan.overridden))
                self._log_start(plan)
            if plan.scheduler is None:
                return plan
            sched = self._spawn_local(plan.scheduler)
            try:
                outcome = self._wait_listening(sched, root_uri, port)
            except BaseException:  # (a signal, or it never listened): the teardown stops it
                self.scheduler = sched
                self._add(ProcGroup([sched]))
                raise
            if outcome in ("listening", "exited-0"):
                break
            # The scheduler died before it listened.
            if not addr.port_is_free(port) and attempt < MAX_PORT_ATTEMPTS:
                self.discarded.append(sched)
                log.warning("port %d was taken before the scheduler could bind it; retrying on the next port", port)
                continue
            log.debug("scheduler exited with %s before listening", sched.exit_code)
            break
        self.scheduler = sched
        self._add(ProcGroup([sched]))
        return plan

    def _spawn_local(self, proc: ProcSpec) -> LocalProcess:
        if self.pump is None:
            self.pump = PipePump()
        out = self.console.proc(proc.name, proc.label, str(proc.role))
        return LocalProcess(proc, out, self.pump, self.watchdog, proc.env, self.spec.workdir)

    def _wait_listening(self, sched: LocalProcess, host: str, port: int) -> str:
        deadline = self.clock.monotonic() + max(self.spec.start_timeout, 1.0)
        while True:
            code = sched.poll()
            if code is not None:
                return "exited-0" if code == 0 else "died"
            if addr.is_listening(host, port) and addr.listener_is_in_group(sched.pgid, port):
                return "listening"
            if self.clock.monotonic() > deadline:
                raise LaunchError(
                    f"the scheduler did not listen on {host}:{port} within --start-timeout "
                    f"{self.spec.start_timeout:g}s; is the command a ps-lite program (MXNet, our trainer)?")
            self.clock.sleep(0.01)

    def _monitor(self) -> tuple[str, int]:
        """Watch until the job ends: ``(reason, exit code)``; the first failure is :attr:`first`."""
        deadline = self.start_time + self.spec.timeout if self.spec.timeout else None
        while True:
            if self.signals.count:
                return "signal", self.signals.exit_code
            failed = []
            running = 0
            for h in self.handles:
                code = h.poll()
                if code is None:
                    running += 1
                elif code != 0:
                    failed.append(h)
            if not failed and running and self.tracker is not None and self.tracker.poll() not in (None, 0):
                failed.append(self.tracker)  # the tracker failed and no worker did (see trackers.FAILURE_GRACE)
            if failed:
                self.first = min(failed, key=lambda h: h.end_time or 0.0)
                return "failure", self.first.exit_code or 1
            if running == 0:
                return "success", 0
            if deadline is not None and self.clock.time() > deadline:
                return "timeout", EXIT_TIMEOUT
            self.clock.sleep(POLL_INTERVAL)

    # -- teardown --------------------------------------------------------------------------

    def _wait(self, seconds: float, stop_on_second_signal: bool = False) -> None:
        """Wait until every process has ended, at most ``seconds``."""
        deadline = self.clock.monotonic() + seconds
        while any(h.poll() is None for h in self.handles):
            if self.clock.monotonic() > deadline or (stop_on_second_signal and self.signals.count >= 2):
                return
            self.clock.sleep(POLL_INTERVAL)

    def _shutdown(self, dump: bool = False) -> None:
        """Stop whatever still runs: stack dumps (timeout), SIGTERM, ``--kill-grace``, SIGKILL, sweep groups."""
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
        self._wait(self.spec.kill_grace, stop_on_second_signal=True)
        for g in self.groups:
            g.kill()
        self._wait(KILL_WAIT)
        groups = scan_groups()
        for g in self.groups:
            g.cleanup(groups)
        for h in self.discarded:
            h.cleanup(groups)
        # give the output pumps a moment to deliver the last lines
        end = self.clock.monotonic() + OUTPUT_WAIT
        for h in self.handles:
            for stream in (h.output.stdout, h.output.stderr):
                stream.done.wait(max(0.0, end - self.clock.monotonic()))

    def _finish(self, reason: str, code: int) -> report.JobResult:
        end_time = self.clock.time()
        elapsed = end_time - self.start_time
        env = report.secret_env(self.plan)
        message = ""
        if reason == "success":
            n = len(self.handles)
            log.info("all %d process%s exited 0 in %.1fs", n, "" if n == 1 else "es", elapsed)
        elif reason == "failure" and self.first is not None:
            message = report.failure_report(self.first, len(self.handles) - 1, env)
        elif reason == "timeout":
            message = f"the job ran longer than --timeout {self.spec.timeout:g}s and was stopped"
            log.error("%s", message)
        elif reason == "signal":
            message = "stopped by a signal"
            log.error("stopped by a signal after %.1fs; every process was terminated", elapsed)
        result = report.JobResult(
            exit_code=code, reason=reason, first_failure=self.first.record() if self.first else None,
            records=tuple(h.record(h.name in self.stopped) for h in self.handles),
            start_time=self.start_time, end_time=end_time, message=message)
        if self.spec.summary_json:
            report.write_summary(self.spec.summary_json, self.spec, self.plan, result)
        return result


def run_job(spec: JobSpec, console: Optional[Console] = None) -> report.JobResult:
    """Run ``spec`` to the end and return the result (never raises for a failed process)."""
    return Supervisor(spec, console).run()


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
