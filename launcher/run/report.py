"""What the launcher tells the user about a job: the result, the failure report, ``--summary-json``,
and the dry run's plan. Pure functions of data, except the two that write (log and file).
"""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import dataclass
from typing import Optional, Sequence

from pscontract import NODE_HOST

from ..node import safefiles
from ..runtime.handle import ProcessHandle, ProcRecord, describe_exit
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


def redactor(plan: Optional[Plan]) -> jobenv.Redactor:
    """What hides the job's secrets: the values of secret-named variables (:func:`jobenv.is_secret`)
    of every process of ``plan`` (the job secret, ``--env API_TOKEN``, an inherited
    ``AWS_SECRET_ACCESS_KEY``, ...)."""
    if plan is None:
        return jobenv.Redactor(())
    names: set[str] = set()
    for p in plan.all:
        names.update(p.env)  # (the processes share most names: each is judged once)
    secret = [k for k in names if jobenv.is_secret(k)]
    return jobenv.Redactor(p.env[k] for p in plan.all for k in secret if k in p.env)


@dataclass(frozen=True)
class Cause:
    """Why the job stopped, as a process of the job said (``pslaunch-cause:``; see
    :func:`pscontract.cause_line`): the process at fault (None: none of the job's), the reason,
    and who said so."""

    culprit: Optional[ProcessHandle]
    reason: str
    reporter: ProcessHandle


def find_cause(first: ProcessHandle, handles: Sequence[ProcessHandle]) -> Optional[Cause]:
    """The cause the first failing process gave, else the one given by the earliest to end."""
    said = [h for h in handles if h.output.cause is not None]
    if not said:
        return None
    reporter = first if first in said else min(said, key=lambda h: h.end_time or float("inf"))
    cause = reporter.output.cause
    assert cause is not None  # (the reporter is one of those that said)
    role, rank, reason = cause
    culprit = None
    if role is not None:
        culprit = next((h for h in handles if str(h.proc.role) == role and (rank is None or h.proc.rank == rank)),
                       None)
    return Cause(culprit, reason, reporter)


def failure_report(h: ProcessHandle, others: int, redact: jobenv.Redactor,
                   cause: Optional[Cause] = None) -> str:
    """Log who failed first, how, and the last lines of its output; returns the first line.

    A process that could not start at all (``h.failure``) is one line: the reason says it all.
    When a process of the job named the cause (:class:`Cause`), the report leads with it: a worker
    that hung is named, not the scheduler that noticed and stopped the job.
    """
    if h.failure is not None:
        head = redact(f"{h.describe()}: {h.failure}")
        log.error("%s", head)
        return head
    exited = f"{describe_exit(h.exit_code or 0)} first"
    if cause is not None and cause.culprit is not None and cause.culprit is not h:
        by = (f"reported by the {h.label}, which" if cause.reporter is h else
              f"reported by the {cause.reporter.label}; {h.label}")
        head = f"{cause.culprit.describe()}: {cause.reason} ({by} {exited})"
    elif cause is not None:
        head = f"{h.describe()} {exited}: {cause.reason}"
    else:
        head = f"{h.describe()} {exited}"
    if others:
        head += "; stopped the other processes"
    head = redact(head)
    log.error("%s", head)
    lines = h.output.lines()
    if lines:
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
    if spec.hosts:
        inline = bool(spec.hosts[0].origin.startswith("-H item"))
        source = "the -H list" if inline else f"hostfile {spec.hostfile}"
        out.append(f"hosts ({len(spec.hosts)}, from {source}): " +
                   ", ".join(h.display + (f" slots={h.slots}" if h.slots else "") for h in spec.hosts[:20]) +
                   (f" and {len(spec.hosts) - 20:,} more" if len(spec.hosts) > 20 else ""))
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
