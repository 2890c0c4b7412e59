"""Running a job: addresses, the scheduler, the backend, fail-fast and teardown.

:func:`run_job` is the whole lifecycle:

1. open the backend and let it prepare (connect, sync, node addresses);
2. work out the scheduler's address and take the first free port of
   ``--port-range``; start the scheduler here and wait until it listens
   (if it lost the port to someone else in between, try the next port);
3. start servers, then workers, through the backend;
4. watch every process: the first non-zero exit, a signal, or ``--timeout``
   stops the job;
5. always: SIGTERM everything, SIGKILL after ``--kill-grace``, sweep leftover
   process groups, write ``--summary-json`` and report who failed first.

A dead-man switch (:mod:`launcher.watchdog`) kills every local process group
if the launcher itself is killed with SIGKILL.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from . import backends, envvars, netif
from .errors import ConfigError, LaunchError
from .output import Console, PipePump
from .plan import Plan, ProcSpec, build_plan
from .process import (
    LocalProcess,
    ProcessHandle,
    ProcRecord,
    Watchdog,
    describe_exit,
    group_members,
    scan_groups,
    spawning,
)
from .spec import Host, JobSpec

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.02
MAX_PORT_ATTEMPTS = 5
EXIT_TIMEOUT = 124
_SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


class Interrupted(Exception):
    """A signal arrived while the job was starting."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class JobResult:
    """The outcome: ``exit_code`` is what the launcher exits with."""

    exit_code: int
    reason: str  # success | failure | signal | timeout | launch-error
    first_failure: Optional[ProcRecord] = None
    records: list[ProcRecord] = field(default_factory=list)
    start_time: float = 0.0
    end_time: float = 0.0
    message: str = ""


# --- addresses and ports -----------------------------------------------------


def _is_literal_host_ip(value: Optional[str]) -> bool:
    return bool(value) and value not in ("auto", "ip", "dns")


def scheduler_address(spec: JobSpec, node_hosts: Mapping[Optional[Host], Optional[str]],
                      remote: bool, needs_address: bool) -> str:
    """``DMLC_PS_ROOT_URI``: the launching host's address the nodes can reach.

    In order: this host's address on ``DMLC_INTERFACE``; ``--host-ip`` (an
    address, or dmlc's guesses ``ip``/``dns``); 127.0.0.1 when everything
    runs on this machine; else the address that routes to the first host.
    A ``DMLC_INTERFACE`` that this host does not have is an error, unless
    ``--host-ip`` gives an address (launching from a machine whose interfaces
    differ from the nodes', such as a login node).
    """
    environ = spec.environ_dict()
    iface = (dict(spec.env).get(envvars.INTERFACE) or environ.get(envvars.INTERFACE, "")).strip()
    try:
        if iface:
            address = _interface_address_or_none(iface, spec.host_ip)
            if address is not None:
                return address
        if _is_literal_host_ip(spec.host_ip):
            return netif.resolve_ipv4(spec.host_ip or "")
        if spec.host_ip in ("ip", "dns"):
            return netif.resolve_ipv4(netif.guess_host_ip(spec.host_ip))
        if needs_address:
            raise ConfigError(
                f"--launcher {spec.launcher} cannot tell which address of this host its nodes reach: "
                "set DMLC_INTERFACE (a name or a CIDR such as 10.1.0.0/16) or --host-ip ADDRESS")
        if not remote or not spec.hosts:
            return "127.0.0.1"
        first = spec.hosts[0]
        dest = node_hosts.get(first) or netif.resolve_ipv4(first.name)
        return netif.route_source(dest)
    except netif.NetifError as e:
        raise ConfigError(str(e)) from None


def _interface_address_or_none(iface: str, host_ip: Optional[str]) -> Optional[str]:
    """This host's address on ``iface``; None if it has none there and a literal ``--host-ip`` stands in."""
    try:
        return netif.interface_address(iface)
    except netif.NetifError as e:
        if not _is_literal_host_ip(host_ip):
            raise
        log.info("DMLC_INTERFACE=%s selects no address on this host (%s); the scheduler listens on "
                 "--host-ip %s", iface, e, host_ip)
        return None


def port_is_free(port: int) -> bool:
    """True when nothing holds ``port`` on any address (a plain bind succeeds)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def first_free_port(lo: int, hi: int, after: int = 0) -> int:
    for port in range(max(lo, after + 1), hi + 1):
        if port_is_free(port):
            return port
    raise LaunchError(f"no free port in --port-range {lo}-{hi} for the scheduler; "
                      "free one or give another range")


def is_listening(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _listen_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP ``port`` (from /proc/net), or None without /proc."""
    inodes: set[str] = set()
    found_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)
                found_table = True
                for line in f:
                    fields = line.split()
                    # local_address is HEXIP:HEXPORT, st 0A is LISTEN, inode is field 9
                    if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            continue
    return inodes if found_table else None


def listener_is_in_group(pgid: int, port: int) -> bool:
    """True when a process of group ``pgid`` holds the socket listening on ``port``.

    Someone else may hold the port (it was taken between our probe and the
    scheduler's bind); a successful connect alone would not tell us.
    """
    inodes = _listen_inodes(port)
    if inodes is None:
        return True  # no /proc: trust the connect
    targets = {f"socket:[{i}]" for i in inodes}
    for pid in group_members(pgid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    return True
            except OSError:
                continue
    return False


# --- signals -------------------------------------------------------------------


class _Signals:
    """First SIGINT/SIGTERM/SIGHUP: stop gracefully. Second: kill at once."""

    def __init__(self) -> None:
        self.count = 0
        self.first: Optional[int] = None
        self.raise_now = True
        self.deferred: Optional[int] = None
        self._old: dict[int, object] = {}

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.debug("not on the main thread: signals are not handled")
            return
        for sig in _SIGNAL_EXIT:
            self._old[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old.clear()

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        if self.first is None:
            self.first = signum
        if self.count == 1:
            log.warning("%s received: stopping every process (again to kill at once)",
                        signal.Signals(signum).name)
        elif self.count == 2:
            log.warning("%s received again: killing every process", signal.Signals(signum).name)
        if self.raise_now:
            if spawning():
                self.deferred = signum  # raised by check() once the child is registered
                return
            self.raise_now = False
            raise Interrupted(signum)

    def check(self) -> None:
        """Raise a signal that arrived while a child was being spawned."""
        if self.deferred is not None and self.raise_now:
            self.raise_now = False
            raise Interrupted(self.deferred)


# --- the supervisor -------------------------------------------------------------


class Supervisor:
    """Runs one :class:`JobSpec` to the end. Use :func:`run_job`."""

    def __init__(self, spec: JobSpec, console: Optional[Console] = None) -> None:
        self.spec = spec
        self.console = console or Console(log_dir=spec.log_dir)
        self.handles: list[ProcessHandle] = []
        self.discarded: list[ProcessHandle] = []  # schedulers that lost their port; swept at the end
        self.scheduler: Optional[LocalProcess] = None
        self.plan: Optional[Plan] = None
        self.signals = _Signals()
        self.watchdog: Optional[Watchdog] = None
        self.pump: Optional[PipePump] = None
        self.start_time = time.time()
        self._stopped = False

    # -- lifecycle ------------------------------------------------------------

    def run(self) -> JobResult:
        spec = self.spec
        backend_cls = backends.get(spec.launcher)
        result: Optional[JobResult] = None
        self.signals.install()
        try:
            self.watchdog = Watchdog(spec.kill_grace)
            with backend_cls(spec, self.console, self.watchdog) as backend:
                try:
                    backend.check()
                    node_hosts = dict(backend.prepare())
                    root_uri = scheduler_address(spec, node_hosts, backend.remote,
                                                 backend.needs_scheduler_address)
                    if None in node_hosts and node_hosts[None] is None:
                        node_hosts[None] = root_uri  # local nodes bind the scheduler's address
                    self._timing("backend ready")
                    plan = self._start_scheduler(root_uri, node_hosts, backend.remote)
                    self._timing("scheduler listening" if self.scheduler else "no scheduler")
                    self.signals.check()
                    if plan.procs and (self.scheduler is None or self.scheduler.poll() in (None, 0)):
                        self.handles.extend(backend.start(plan.procs))
                        self._timing(f"{len(plan.procs)} servers and workers started")
                        self.signals.check()
                    result = self._monitor()
                except Interrupted as e:
                    result = self._result("signal", _SIGNAL_EXIT.get(e.signum, 130))
                finally:
                    self.signals.raise_now = False
                    self._shutdown(dump=result is not None and result.reason == "timeout")
        finally:
            if self.pump is not None:
                self.pump.stop()
            if self.watchdog is not None:
                self.watchdog.close()
            self.signals.restore()
        assert result is not None
        return self._finish(result)

    def _timing(self, what: str) -> None:
        log.debug("%s after %.0f ms", what, (time.time() - self.start_time) * 1000)

    def _log_start(self, plan: Plan) -> None:
        s = self.spec
        hosts = sorted({p.host.name for p in plan.procs if p.host is not None})
        where = f"{len(hosts)} host{'s' if len(hosts) != 1 else ''}" if hosts else \
            ("the cluster's hosts" if s.launcher in ("sge", "yarn") else "this machine")
        sched = f", scheduler at {plan.root_uri}:{plan.root_port}" if plan.scheduler else ""
        log.info("starting %d server%s and %d worker%s on %s (%s)%s",
                 s.num_servers, "" if s.num_servers == 1 else "s",
                 s.num_workers, "" if s.num_workers == 1 else "s", where, s.launcher, sched)

    def _start_scheduler(self, root_uri: str, node_hosts: Mapping[Optional[Host], Optional[str]],
                         remote: bool) -> Plan:
        """Build the plan around a free port and start the scheduler on it.

        The port is probed free, then the scheduler binds it. If someone else
        takes it in between, the scheduler dies before listening and the port is
        busy: try the next one.
        """
        spec = self.spec
        secret = os.urandom(32).hex()  # what secrets.token_hex does, without its imports
        job_id = os.urandom(6).hex()
        lo, hi = spec.port_range
        port = lo - 1
        for attempt in range(1, MAX_PORT_ATTEMPTS + 1):
            port = first_free_port(lo, hi, after=port)
            plan = build_plan(spec, root_uri=root_uri, root_port=port, secret=secret, job_id=job_id,
                              node_hosts=node_hosts, inherit_environ=not remote)
            self.plan = plan
            if attempt == 1:
                if plan.overridden:
                    log.warning("the launcher sets %s itself; the values from your environment or --env "
                                "are ignored", ", ".join(plan.overridden))
                self._log_start(plan)
            if plan.scheduler is None:
                return plan
            sched = self._spawn_local(plan.scheduler)
            outcome = self._wait_listening(sched, root_uri, port)
            if outcome == "listening" or outcome == "exited-0":
                self.scheduler = sched
                self.handles.append(sched)
                return plan
            # The scheduler died before it listened.
            code = sched.exit_code
            if not port_is_free(port) and attempt < MAX_PORT_ATTEMPTS:
                self.discarded.append(sched)
                log.warning("port %d was taken before the scheduler could bind it; retrying on the next port", port)
                continue
            self.handles.append(sched)
            self.scheduler = sched
            log.debug("scheduler exited with %s before listening", code)
            return plan
        raise AssertionError("unreachable")

    def _spawn_local(self, proc: ProcSpec) -> LocalProcess:
        if self.pump is None:
            self.pump = PipePump()
        out = self.console.proc(proc.name, proc.label, str(proc.role))
        return LocalProcess(proc, out, self.pump, self.watchdog, proc.env, self.spec.workdir)

    def _wait_listening(self, sched: LocalProcess, host: str, port: int) -> str:
        deadline = time.monotonic() + max(self.spec.start_timeout, 1.0)
        while True:
            code = sched.poll()
            if code is not None:
                return "exited-0" if code == 0 else "died"
            if is_listening(host, port) and listener_is_in_group(sched.pgid, port):
                return "listening"
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the scheduler did not listen on {host}:{port} within --start-timeout "
                    f"{self.spec.start_timeout:g}s; is the command a ps-lite program (MXNet, our trainer)?")
            time.sleep(0.01)

    def _monitor(self) -> JobResult:
        deadline = self.start_time + self.spec.timeout if self.spec.timeout else None
        while True:
            if self.signals.count:
                sig = self.signals.first or signal.SIGINT
                return self._result("signal", _SIGNAL_EXIT.get(sig, 130))
            failed = []
            running = 0
            for h in self.handles:
                code = h.poll()
                if code is None:
                    running += 1
                elif code != 0:
                    failed.append(h)
            if failed:
                first = min(failed, key=lambda h: h.end_time or 0.0)
                return self._result("failure", first.exit_code or 1, first)
            if running == 0:
                return self._result("success", 0)
            if deadline is not None and time.time() > deadline:
                return self._result("timeout", EXIT_TIMEOUT)
            time.sleep(POLL_INTERVAL)

    def _result(self, reason: str, code: int, first: Optional[ProcessHandle] = None) -> JobResult:
        result = JobResult(exit_code=code, reason=reason, start_time=self.start_time)
        result.first_failure = first.record() if first is not None else None
        self._first_handle = first
        return result

    # -- teardown ---------------------------------------------------------------

    def _shutdown(self, dump: bool = False) -> None:
        """Stop whatever still runs: SIGTERM, ``--kill-grace``, SIGKILL, sweep groups."""
        running = [h for h in self.handles if h.poll() is None]
        if dump and running:
            log.warning("dumping the Python stacks of %d running process%s",
                        len(running), "" if len(running) == 1 else "es")
            for h in running:
                h.dump_stacks()
            end = time.monotonic() + 3.0
            while time.monotonic() < end and any(h.poll() is None for h in running):
                time.sleep(POLL_INTERVAL)
        for h in self.handles:
            if h.poll() is None:
                h.stopped_by_launcher = True
                h.terminate()
        deadline = time.monotonic() + self.spec.kill_grace
        while any(h.poll() is None for h in self.handles):
            if time.monotonic() > deadline or self.signals.count >= 2:
                break
            time.sleep(POLL_INTERVAL)
        for h in self.handles:
            if h.poll() is None:
                h.kill()
        end = time.monotonic() + 5.0
        while any(h.poll() is None for h in self.handles) and time.monotonic() < end:
            time.sleep(POLL_INTERVAL)
        groups = scan_groups()
        for h in self.handles + self.discarded:
            h.cleanup(groups)
        # give the output pumps a moment to deliver the last lines
        end = time.monotonic() + 2.0
        for h in self.handles:
            for stream in (h.output.stdout, h.output.stderr):
                stream.done.wait(max(0.0, end - time.monotonic()))

    def _finish(self, result: JobResult) -> JobResult:
        result.end_time = time.time()
        result.records = [h.record() for h in self.handles]
        first = getattr(self, "_first_handle", None)
        if first is not None:
            result.first_failure = first.record()
        elapsed = result.end_time - result.start_time
        if result.reason == "success":
            n = len(self.handles)
            log.info("all %d process%s exited 0 in %.1fs", n, "" if n == 1 else "es", elapsed)
        elif result.reason == "failure" and first is not None:
            result.message = self._failure_report(first)
        elif result.reason == "timeout":
            result.message = f"the job ran longer than --timeout {self.spec.timeout:g}s and was stopped"
            log.error("%s", result.message)
        elif result.reason == "signal":
            result.message = "stopped by a signal"
            log.error("stopped by a signal after %.1fs; every process was terminated", elapsed)
        if self.spec.summary_json:
            self._write_summary(result)
        return result

    def _secret_env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        if self.plan is not None:
            for p in self.plan.all:
                env.update(p.env)
        return env

    def _failure_report(self, h: ProcessHandle) -> str:
        lines = h.output.lines()
        env = self._secret_env()
        head = f"{h.describe()} {describe_exit(h.exit_code or 0)} first; stopped the other processes"
        log.error("%s", envvars.redact_text(head, env))
        if lines:
            log.error("last %d line%s of %s:", len(lines), "" if len(lines) == 1 else "s", h.label)
            for line in lines:
                log.error("  | %s", envvars.redact_text(line, env))
        return head

    def _write_summary(self, result: JobResult) -> None:
        plan = self.plan
        doc = {
            "job_id": plan.job_id if plan else None,
            "launcher": self.spec.launcher,
            "command": list(self.spec.command),
            "exit_code": result.exit_code,
            "reason": result.reason,
            "first_failure": result.first_failure.name if result.first_failure else None,
            "scheduler": f"{plan.root_uri}:{plan.root_port}" if plan and plan.scheduler else None,
            "start_time": result.start_time,
            "end_time": result.end_time,
            "processes": [r.to_dict() for r in result.records],
        }
        text = envvars.redact_text(json.dumps(doc, indent=2), self._secret_env())
        path = self.spec.summary_json or ""
        tmp = f"{path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text + "\n")
            os.replace(tmp, path)
        except OSError as e:
            log.error("cannot write --summary-json %s: %s", path, e.strerror or e)


def run_job(spec: JobSpec, console: Optional[Console] = None) -> JobResult:
    """Run ``spec`` to the end and return the result (never raises for a failed process)."""
    return Supervisor(spec, console).run()


# --- dry run ---------------------------------------------------------------------


def dry_run_plan(spec: JobSpec) -> Plan:
    """The plan with placeholders where only a real launch can tell (no network, no ports)."""
    environ = spec.environ_dict()
    remote = spec.launcher != "local"
    iface = (dict(spec.env).get(envvars.INTERFACE) or environ.get(envvars.INTERFACE, "")).strip()
    try:
        root_uri = _interface_address_or_none(iface, spec.host_ip) if iface else None
        if root_uri is None:
            if _is_literal_host_ip(spec.host_ip):
                root_uri = spec.host_ip or ""
            elif not remote or not spec.hosts:
                root_uri = "127.0.0.1" if spec.launcher in ("local", "mpi", "ssh") else "<DMLC_INTERFACE or --host-ip>"
            else:
                root_uri = "<this host's address toward the hosts>"
    except netif.NetifError as e:
        raise ConfigError(str(e)) from None
    if spec.launcher == "local" or (spec.launcher == "mpi" and not spec.hosts):
        # everything on this machine: nodes bind the scheduler's address
        node_hosts: dict[Optional[Host], Optional[str]] = {None: root_uri}
    else:
        node_hosts = {h: (f"<{h.name} on {iface}>" if iface else h.name) for h in spec.hosts}
    return build_plan(spec, root_uri=root_uri, root_port=spec.port_range[0], secret="0" * 64,
                      job_id="dry-run", node_hosts=node_hosts, inherit_environ=False,
                      scheduler_inherits=False)


def format_dry_run(spec: JobSpec, plan: Plan, extra: Sequence[str] = ()) -> str:
    """The plan as text: a table of processes, the command, each process's variables."""
    lo, hi = spec.port_range
    out = [f"pslaunch dry run ({spec.launcher}): 1 scheduler, {spec.num_servers} server(s), "
           f"{spec.num_workers} worker(s); nothing is started" if plan.scheduler else
           f"pslaunch dry run ({spec.launcher}): {spec.num_workers} worker(s), no servers and no "
           "scheduler (-s 0); nothing is started"]
    if plan.scheduler:
        out.append(f"scheduler address {plan.root_uri}, port: the first free one of {lo}-{hi} "
                   f"(shown as {plan.root_port})")
    out.append("")
    rows = [("ROLE", "RANK", "TASK_ID", "HOST", "DMLC_NODE_HOST")]
    for p in plan.all:
        rows.append((str(p.role), str(p.rank) if p.task_id is not None else "-",
                     str(p.task_id) if p.task_id is not None else "-",
                     p.host.display if p.host else "localhost",
                     p.env.get(envvars.NODE_HOST, "(found on the node)" if p.task_id is not None else "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    out.append("")
    out.append("command (every role): " + shlex.join(spec.command))
    if spec.workdir:
        out.append(f"working directory: {spec.workdir}")
    envs = [envvars.redact(p.env) for p in plan.all]
    common = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}
    out.append("environment, all processes" + (" (on top of the launcher's own environment):"
                                               if spec.launcher == "local" else ":"))
    out.extend(f"  {k}={shlex.quote(v)}" for k, v in sorted(common.items()))
    for p, env in zip(plan.all, envs):
        own = {k: v for k, v in env.items() if k not in common}
        out.append(f"  {p.label}: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(own.items())))
    if extra:
        out.append("")
        out.extend(extra)
    return "\n".join(out)
