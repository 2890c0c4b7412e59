"""What the launcher tells the user about a job: the result, the failure report, ``--summary-json``,
and the dry run's plan. Pure functions of data, except the two that write (log and file).
"""

from __future__ import annotations

import json
import logging
import random
import re
import shlex
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

from pscontract import CAUSE_PREFIX, NODE_HOST

from ..node import safefiles
from ..runtime.handle import ProcessHandle, ProcRecord, describe_exit, signal_name
from ..spec import env as jobenv
from ..spec.job import JobSpec
from ..spec.plan import Plan

log = logging.getLogger(__name__)

#: Why a job ended.
REASONS = ("success", "failure", "signal", "timeout")


@dataclass(frozen=True)
class JobResult:
    """The outcome: ``exit_code`` is what the launcher exits with; ``cause`` what a process of the
    job said stopped it (``{"process", "reason", "reported_by"}``), if one did."""

    exit_code: int
    reason: str  # one of REASONS
    first_failure: Optional[ProcRecord]
    records: tuple[ProcRecord, ...]
    start_time: float
    end_time: float
    message: str = ""
    cause: Optional[dict] = None
    #: lines that did not reach their ``--log-dir`` file (``Console.log_errors``), if any did not
    log_errors: Optional[dict] = None
    #: every attempt of the job, the last included (``--max-restarts``)
    attempts: tuple[AttemptRecord, ...] = ()
    #: the job page's address, without its token (``--ui``), if it was served
    ui: Optional[str] = None
    #: every worker replaced in place (``--restart-scope process``): :func:`replacement_record`
    replacements: tuple[dict, ...] = ()


def redactor(plan: Optional[Plan], also: Sequence[str] = ()) -> jobenv.Redactor:
    """What hides the job's secrets: the values of secret-named variables (:func:`jobenv.is_secret`)
    of every process of ``plan`` (the job secret, ``--env API_TOKEN``, an inherited
    ``AWS_SECRET_ACCESS_KEY``, ...), and the values ``also`` (an earlier attempt's secret)."""
    if plan is None:
        return jobenv.Redactor(also)
    names: set[str] = set()
    for p in plan.all:
        names.update(p.env)  # (the processes share most names: each is judged once)
    secret = [k for k in names if jobenv.is_secret(k)]
    return jobenv.Redactor([*also, *(p.env[k] for p in plan.all for k in secret if k in p.env)])


# --- restarts (--max-restarts) ---------------------------------------------------------------------

#: the longest wait before a restart (unless --restart-delay asks for a longer first one)
MAX_RESTART_DELAY = 60.0
#: each delay is its nominal value times a random factor within 1 +- this
RESTART_JITTER = 0.1
#: the lines of a failed process's output an attempt's cause keeps
CAUSE_LINES = 5


class RestartBudget:
    """The job's one restart budget (``--max-restarts``), its delays and its window.

    The launcher alone counts it, for the whole job: a process that fails again and again spends
    the same budget as any other (torchrun counts per node, pytorch/pytorch#108158). Each delay
    is twice the last (from ``first_delay``, at most :data:`MAX_RESTART_DELAY`) with
    :data:`RESTART_JITTER`; an attempt that ran ``window`` seconds or more before it failed gives
    the budget back and the delays start again.
    """

    def __init__(self, limit: int, first_delay: float, window: Optional[float],
                 rand: Callable[[float, float], float] = random.uniform) -> None:
        self.limit = limit
        self.first_delay = first_delay
        self.window = window
        self.used = 0
        self._delay: Optional[float] = None
        self._rand = rand

    def may_restart(self, ran: float) -> bool:
        """After an attempt that ran ``ran`` seconds and failed: is there a restart left?"""
        if self.window is not None and ran >= self.window and (self.used or self._delay is not None):
            log.info("the attempt ran %s without failing (--restart-window): the restart budget is back "
                     "(0/%d used)", _seconds(ran), self.limit)
            self.used, self._delay = 0, None
        return self.used < self.limit

    def next_delay(self) -> float:
        """Spend one restart: the wait before it, in seconds."""
        nominal = self.first_delay if self._delay is None else min(self._delay * 2,
                                                                   max(MAX_RESTART_DELAY, self.first_delay))
        self._delay = nominal
        self.used += 1
        return nominal * self._rand(1 - RESTART_JITTER, 1 + RESTART_JITTER)


@dataclass(frozen=True)
class AttemptRecord:
    """One attempt of the job, as ``--summary-json``'s ``attempts`` lists it: ``attempt`` is its
    ``PSLAUNCH_ATTEMPT``; ``cause`` the failed process (:func:`attempt_cause`), if one of the job's
    processes failed; ``delay`` the wait before the next attempt (None: none followed); ``hosts``
    the hosts it ran on when they were not the hostfile's (``hosthealth.Layout.to_dict``: the hosts
    left out and why, the spares in their places, the workers), else None."""

    attempt: int
    start_time: float
    end_time: float
    reason: str
    exit_code: int
    cause: Optional[dict] = None
    delay: Optional[float] = None
    hosts: Optional[dict] = None

    def to_dict(self) -> dict:
        return asdict(self)


def attempt_cause(h: ProcessHandle, redact: jobenv.Redactor) -> dict:
    """Who failed an attempt: its role, rank, host, pid, exit code or signal, the first lines of
    what it wrote to its error file (torch's ``@record``: the message, then the traceback's end),
    if it wrote one, and the last lines of its output."""
    return {"process": h.name, "role": str(h.proc.role), "rank": h.proc.rank, "host": h.host, "pid": h.pid,
            "exit_code": h.exit_code, "signal": signal_name(h.exit_code), "end_time": h.end_time,
            "error": [redact(line) for line in h.describe_error(CAUSE_LINES)],
            "last_lines": [redact(line) for line in h.output.lines()[-CAUSE_LINES:]]}


def replacement_record(lost: ProcessHandle, attempt: int, k: int, delay: float) -> dict:
    """What ``--summary-json``'s ``replacements`` says of the ``k``-th replacement of worker
    ``lost`` in ``attempt``: the lost process (host, pid, exit code or signal, when it ended) and
    the wait before its replacement started; :func:`replacement_started` adds the new one."""
    return {"process": lost.name, "rank": lost.proc.rank, "attempt": attempt, "replacement": k,
            "host": lost.host, "pid": lost.pid, "exit_code": lost.exit_code, "signal": signal_name(lost.exit_code),
            "lost_at": lost.end_time, "delay": round(delay, 3), "started_at": None, "new_host": None, "new_pid": None,
            "error": None}


def replacement_started(record: dict, new: ProcessHandle) -> None:
    """The replacement in ``record`` (:func:`replacement_record`) started as ``new``."""
    record.update(started_at=new.start_time, new_host=new.host, new_pid=new.pid)


def describe_cause(cause: dict) -> str:
    """``worker 2 on h2 (pid 4121) killed by SIGKILL``; for an attempt whose hosts did not answer
    (role ``host``), the launcher's line about them."""
    if cause["role"] == "host":
        return f"its start failed: {cause['error'][0]}"
    who = "scheduler" if cause["role"] == "scheduler" else f"{cause['role']} {cause['rank']}"
    pid = f" (pid {cause['pid']})" if cause.get("pid") else ""
    how = f"killed by {cause['signal']}" if cause.get("signal") else f"exited with code {cause['exit_code']}"
    said = f": {cause['error'][0]}" if cause.get("error") else ""
    return f"{who} on {cause['host']}{pid} {how}{said}"


def log_attempt_failed(n: int, record: AttemptRecord, budget: RestartBudget, cause: Optional[dict]) -> str:
    """The line about the ``n``-th attempt of this launcher, failed (logged): the restart to come
    and its delay, or the budget used up; out of as many attempts as the budget allows.
    ``attempt 3/3 failed: worker 2 on h2 (pid 4121) killed by SIGKILL; 2/2 restarts used``."""
    total = n + budget.limit - budget.used + (record.delay is not None)
    what = describe_cause(cause) if cause is not None else "a process could not start (a restart would not help)"
    if record.delay is not None:
        line = (f"attempt {n}/{total} failed: {what}; restarting every process in {record.delay:.1f}s "
                f"(restart {budget.used}/{budget.limit})")
        log.warning("%s", line)
    else:
        line = f"attempt {n}/{total} failed: {what}; {budget.used}/{budget.limit} restarts used"
        log.error("%s", line)
    return line


def restart_policy(spec: JobSpec) -> str:
    """The dry run's line about restarts (``--max-restarts``, ``--restart-delay``, ``--restart-window``)."""
    if not spec.max_restarts:
        return "restarts: none (--max-restarts 0): the first failure ends the job"
    cap = max(MAX_RESTART_DELAY, spec.restart_delay)
    window = (f"; an attempt that runs {_seconds(spec.restart_window)} without failing gives the budget back"
              if spec.restart_window else "")
    hosts = ""
    if spec.hosts and spec.host_cooldown[0] > 0:
        lower, upper = spec.host_cooldown
        hosts = (f"; a host that is lost, or whose processes fail first in 2 attempts in a row, is left out for "
                 f"{_seconds(lower)} doubling up to {_seconds(upper)} (--host-cooldown)")
    if spec.replaces_workers:
        return (f"restarts: up to {spec.max_restarts} for the whole job; a lost worker is replaced in place "
                "(--restart-scope process: its rank, at once, then after doubling delays if it is lost again) "
                f"while the others run on; a lost server or the scheduler restarts every role after "
                f"{_seconds(spec.restart_delay)} doubling each time up to {_seconds(cap)} (+-{RESTART_JITTER:.0%})"
                f"{window}; never after Ctrl-C, --timeout or a process that could not start{hosts}")
    return (f"restarts: up to {spec.max_restarts} for the whole job, every role at once, after "
            f"{_seconds(spec.restart_delay)} doubling each time up to {_seconds(cap)} "
            f"(+-{RESTART_JITTER:.0%}){window}; never after Ctrl-C, --timeout or a process that could not start"
            f"{hosts}")


def _seconds(value: float) -> str:
    return f"{value / 3600:.1f}h" if value >= 3600 else f"{value / 60:.1f}m" if value >= 60 else f"{value:.1f}s"


@dataclass(frozen=True)
class Cause:
    """Why the job stopped, as a process of the job said (``pslaunch-cause:``; see
    :func:`pscontract.cause_line`): the process at fault (None: none of the job's), the reason,
    and who said so."""

    culprit: Optional[ProcessHandle]
    reason: str
    reporter: ProcessHandle


def find_cause(first: ProcessHandle, handles: Sequence[ProcessHandle]) -> Optional[Cause]:
    """The cause the first failing process gave, else the one given by the earliest to end; none
    when the first said nothing of a cause but failed in words of its own (:func:`own_error`) that
    do not tell the same story: the first to fail is to blame, not whom a process that ended after
    it blamed (a server that lost the scheduler after a worker's ``--gpus 0`` error stopped the job)."""
    said = [h for h in handles if h.output.cause is not None]
    if not said:
        return None
    reporter = first if first in said else min(said, key=lambda h: h.end_time or float("inf"))
    cause = reporter.output.cause
    assert cause is not None  # (the reporter is one of those that said)
    role, rank, reason = cause
    own = own_error(first) if reporter is not first else None
    if own is not None and reason not in own:
        return None
    culprit = None
    if role is not None:
        culprit = next((h for h in handles if str(h.proc.role) == role and (rank is None or h.proc.rank == rank)),
                       None)
    return Cause(culprit, reason, reporter)


#: what torch.distributed's ``env://`` rendezvous says when no launcher gave it its variables
_TORCH_UNSET = re.compile(r"environment variable (\w+) expected, but not set")
#: a tracker's reason that names the job type to use (the rabit tracker to an XGBoost 2.1+ worker)
_TRACKER_NAMED = re.compile(r"--tracker (\w+)")
#: the line that ends a program's failure in its own words: a Python exception, ``prog: error: ...``
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\b|\berror\b", re.IGNORECASE)
#: C++ stack frames (XGBoost's ``[bt] (3) .../libxgboost.so(+0x1bf337) [0x7fc4...]``): noise in a report
_BACKTRACE = re.compile(r"\s*(\[bt\] \(\d+\) |Stack trace:\s*$)")
#: what libstdc++ says when ``std::terminate`` ends a process with no exception in flight
_TERMINATE = "terminate called without an active exception"
#: faulthandler's header of one thread's stack, and what follows it when the thread runs no Python
_STACK_HEAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+( \[[^\]]*\])? \(most recent call first\):$")
_NO_FRAME = "<no Python frame>"
#: the one line a report gives an abort at the interpreter's exit (:func:`exit_abort`)
EXIT_ABORT = ("it aborted after its program had returned, while Python shut down (terminate called without an "
              "active exception): with torch's gloo backend, a race of torch's that torchrun's jobs meet too; see "
              "\"A rank aborts at exit\" in docs/collective.md")
#: how many lines of process output may follow a tail that the console showed, for it to be
#: "just above" the report (not shown again)
ABOVE = 40


def rerun_with_tracker(spec: JobSpec, tracker: str) -> str:
    """``pslaunch -n 2 --tracker torch python ddp.py``: the job again, as a collective job."""
    return shlex.join(["pslaunch", "-n", str(spec.num_workers), "--tracker", tracker, *spec.command])


def job_type_hint(spec: JobSpec, lines: Sequence[str], tracker_failure: Optional[str] = None) -> Optional[str]:
    """What to say first when the job was started as the wrong type, else None: a torch.distributed
    program run without ``--tracker torch`` (its ``env://`` rendezvous found no ``RANK``), or a
    tracker that said which ``--tracker`` its workers need (XGBoost 2.1+ under ``-s 0``)."""
    named = _TRACKER_NAMED.search(tracker_failure or "")
    if tracker_failure and named and named.group(1) != spec.tracker:
        return f"{tracker_failure} ({rerun_with_tracker(spec, named.group(1))})"
    if spec.tracker == "torch":
        return None
    for line in reversed(lines):
        unset = _TORCH_UNSET.search(line)
        if unset:
            return (f"torch.distributed found no {unset.group(1)}: this is a collective job; run it with "
                    f"--tracker torch ({rerun_with_tracker(spec, 'torch')})")
    return None


def exit_abort(lines: Sequence[str]) -> bool:
    """Whether a process ended by ``std::terminate`` after its Python program had returned: libstdc++'s
    ``terminate called without an active exception``, then faulthandler's dump (``PYTHONFAULTHANDLER``,
    which the launcher sets) with no Python frame in any thread: the interpreter was shutting down.

    torch 2.x's gloo backend does this at random (torch's race, not the launcher's, see
    tests/bin/gloo_exit_race.py): a ``pt_gloo_runloop`` thread that drops the last reference to a
    finished collective takes the GIL to release its Python objects; CPython (3.11 here) ends a
    thread that waits for the GIL when the finalization begins with ``pthread_exit``, whose unwinding
    meets a ``noexcept`` destructor. Without faulthandler's dump the abort could be anywhere: no."""
    stripped = [line.strip() for line in lines]
    if _TERMINATE not in stripped:
        return False
    after = stripped[stripped.index(_TERMINATE):]
    heads = [i for i, line in enumerate(after) if _STACK_HEAD.match(line)]
    return ("Fatal Python error: Aborted" in after and bool(heads)
            and all(after[i + 1:i + 2] == [_NO_FRAME] for i in heads))


def own_error(h: ProcessHandle) -> Optional[str]:
    """The process's failure in its own one line: the first of its error file (torch's ``@record``),
    else its last line of output where that names an error (a Python exception, ``prog: error:
    ...``)."""
    error = h.describe_error(1)
    if error:
        return error[0]
    last = next((line.strip() for line in reversed(tail_lines(h.output.lines())) if line.strip()), "")
    return last if _ERROR_LINE.search(last) else None


def tail_lines(lines: Sequence[str]) -> list[str]:
    """A process's last lines as a report shows them: no ``pslaunch-cause:`` line (the launcher's
    own protocol, said in the report's first line), no C++ stack frames, no blank lines at the end."""
    kept = [line for line in lines if not line.startswith(CAUSE_PREFIX) and not _BACKTRACE.match(line)]
    while kept and not kept[-1].strip():
        kept.pop()
    return kept


def failure_report(h: ProcessHandle, stopped: int, redact: jobenv.Redactor,
                   cause: Optional[Cause] = None, hint: Optional[str] = None) -> str:
    """Log who failed first, how, and the last lines of its output; returns the first line.

    A process that could not start at all (``h.failure``) is one line: the reason says it all.
    A ``hint`` (:func:`job_type_hint`: the job was started as the wrong type) comes first of all.
    When a process of the job named the cause (:class:`Cause`), the report leads with it: a worker
    that hung is named, not the scheduler that noticed and stopped the job. What the process
    wrote to its error file (torch's ``@record``: its exception, then the traceback's end) comes
    before its last lines: the first line of the report names the exception. The last lines are
    not shown again where the console showed them just above (:meth:`ProcOutput.shown_above`).
    """
    if h.failure is not None:
        head = redact(f"{h.describe()}: {h.failure}")
        log.error("%s", head)
        return head
    exited = f"{describe_exit(h.exit_code or 0)} first"
    error = h.describe_error()  # (what it wrote to its error file: torch's @record)
    own = own_error(h)
    if hint is not None:
        head = f"{h.describe()} {exited}: {hint}"
    elif cause is not None and cause.culprit is not None and cause.culprit is not h:
        by = (f"reported by the {h.label}, which" if cause.reporter is h else
              f"reported by the {cause.reporter.label}; {h.label}")
        head = f"{cause.culprit.describe()}: {cause.reason} ({by} {exited})"
    elif cause is not None:
        head = f"{h.describe()} {exited}: {cause.reason}"
    elif exit_abort(h.output.lines()):
        head = f"{h.describe()} {exited}: {EXIT_ABORT}"
    elif own:
        head = f"{h.describe()} {exited}: {own}"
        error = error[1:]
    else:
        head = f"{h.describe()} {exited}"
    if stopped:  # (processes the launcher stopped; none when the others had ended by themselves)
        head += "; stopped the other processes"
    head = redact(head)
    log.error("%s", head)
    if error:
        log.error("the %s %s wrote to its error file:", "error" if cause is not None else "traceback", h.label)
        for line in error:
            log.error("  ! %s", redact(line))
    lines = tail_lines(h.output.lines())
    if own is not None and own in head and [line.strip() for line in lines] == [own]:
        pass  # (its one line is the first line of the report)
    elif lines and h.output.shown_above(ABOVE):
        log.error("(the last lines of %s are just above)", h.label)
    elif lines:
        log.error("last %d line%s of %s:", len(lines), "" if len(lines) == 1 else "s", h.label)
        for line in lines:
            log.error("  | %s", redact(line))
    return head


def write_summary(path: str, spec: JobSpec, plan: Optional[Plan], result: JobResult) -> None:
    """``--summary-json``: one record per process, written atomically; a write error is logged."""
    doc = {
        "job_id": plan.job_id if plan else None,
        "launcher": spec.launcher,
        "command": list(spec.command),
        "exit_code": result.exit_code,
        "reason": result.reason,
        "first_failure": result.first_failure.name if result.first_failure else None,
        "cause": result.cause,
        "scheduler": f"{plan.root_uri}:{plan.root_port}" if plan and plan.scheduler else None,
        "start_time": result.start_time,
        "end_time": result.end_time,
        "processes": [r.to_dict() for r in result.records],
        "log_errors": result.log_errors,
        "restarts": {"max": spec.max_restarts,
                     "done": max(0, len(result.attempts) - 1) + len(result.replacements),
                     "first_delay": spec.restart_delay, "window": spec.restart_window, "scope": spec.restart_scope},
        "attempts": [a.to_dict() for a in result.attempts],
        "replacements": list(result.replacements),
        "ui": result.ui,
    }

    text = redactor(plan)(json.dumps(doc, indent=2))
    try:
        safefiles.write_atomic(path, (text + "\n").encode("utf-8"))  # (nothing planted beside it is followed)
    except OSError as e:
        log.error("cannot write --summary-json %s: %s", path, e.strerror or e)


def format_dry_run(spec: JobSpec, plan: Plan, extra: Sequence[str] = (), inherits: bool = False,
                   tracker: Sequence[str] = ()) -> str:
    """The plan as text: a table of processes, the command, each process's variables.

    ``inherits``: the processes also get the launcher's own environment beneath these.
    ``tracker``: what the job's tracker is (``launcher.trackers.describe``), for a collective job.
    """
    lo, hi = spec.port_range
    out = [f"pslaunch dry run ({spec.launcher}): 1 scheduler, {spec.num_servers} server(s), "
           f"{spec.num_workers} worker(s); nothing is started" if plan.scheduler else
           f"pslaunch dry run ({spec.launcher}): {spec.num_workers} worker(s) and the {spec.tracker} tracker "
           "(no scheduler, no servers); nothing is started"]
    out.extend(tracker)
    if plan.scheduler:
        out.append(f"scheduler address {plan.root_uri}, port: the first free one of {lo}-{hi} "
                   f"(shown as {plan.root_port})")
    out.append(restart_policy(spec))
    if spec.hosts:
        inline = bool(spec.hosts[0].origin.startswith("-H item"))
        source = "the -H list" if inline else f"hostfile {spec.hostfile}"
        out.append(f"hosts ({len(spec.hosts)}, from {source}): " +
                   ", ".join(h.display + (f" slots={h.slots}" if h.slots else "") +
                             (f" gpus={','.join(map(str, h.gpus))}" if h.gpus is not None else "")
                             for h in spec.hosts[:20]) +
                   (f" and {len(spec.hosts) - 20:,} more" if len(spec.hosts) > 20 else ""))
    if spec.spares:
        out.append(f"spares ({len(spec.spares)}, used only in the place of a host that is left out): " +
                   ", ".join(h.display + (f" slots={h.slots}" if h.slots else "") for h in spec.spares[:20]) +
                   (f" and {len(spec.spares) - 20:,} more" if len(spec.spares) > 20 else ""))
    if spec.min_workers is not None:
        out.append(f"workers: {spec.num_workers} at first; at least {spec.min_workers} when hosts are left out "
                   f"and no spare is left (-n {spec.min_workers}:{spec.num_workers})")
    if spec.gpus_chosen:
        per = f"{spec.gpus_per_process} GPU(s) per worker (--gpus-per-process)" if spec.gpus_per_process else \
            "every listed GPU to each worker of the host"
        out.append(f"GPUs: {per}, from each host's gpus= where the hostfile names them, else counted from 0: "
                   "each worker's CUDA_VISIBLE_DEVICES is below")
    if spec.only:
        out.append("console: only " + ", ".join(map(str, spec.only)) + " (--only; --log-dir files get every line)")
    out.append("")
    rows = [("ROLE", "RANK", "TASK_ID", "HOST", "DMLC_NODE_HOST")]
    for p in plan.all:
        rows.append((str(p.role), str(p.rank) if p.task_id is not None else "-",
                     str(p.task_id) if p.task_id is not None else "-",
                     p.host.display if p.host else "localhost",
                     p.env.get(NODE_HOST, "(found on the node)" if p.task_id is not None else "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    out.append("")
    if plan.scheduler is not None and plan.scheduler.argv != spec.command:
        out.append("command (servers and workers): " + shlex.join(spec.command))
        out.append("scheduler: pslaunch's builtin ps-lite scheduler (--scheduler builtin)")
    else:
        out.append("command (every role): " + shlex.join(spec.command))
    if spec.workdir:
        out.append(f"working directory: {spec.workdir}")
    envs = [jobenv.redact(p.env) for p in plan.all]
    common = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])}
    out.append("environment, all processes" + (" (on top of the launcher's own environment):" if inherits else ":"))
    out.extend(f"  {k}={shlex.quote(v)}" for k, v in sorted(common.items()))
    for p, env in zip(plan.all, envs):
        own = {k: v for k, v in env.items() if k not in common}
        out.append(f"  {p.label}: " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(own.items())))
    if extra:
        out.append("")
        out.extend(extra)
    return "\n".join(out)
