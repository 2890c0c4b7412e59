"""The environment contract of a pslaunch job: the one module that names its variables.

Every process of a job learns its place from environment variables, exactly as
dmlc-core's tracker and ps-lite define them (``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``,
...), plus a few of pslaunch's own (``PSLAUNCH_SECRET``, ``PS_START_TIMEOUT``, ...).
Three parties share this contract and all import it from here:

* the launcher writes it (:func:`contract` gives one process's variables);
* the node-side programs (``launcher/node/``) fill in what only a node knows
  (``DMLC_TASK_ID`` of a batch task, ``DMLC_NODE_HOST``: :mod:`pscontract.netif`);
* the trainer's KVStore and any other ps-lite program read it (:class:`ClusterEnv`).

So a name is spelled in exactly one place. Standard library only, and importing it
pulls in nothing else of pslaunch (the trainer imports it before torch; node
programs run it on hosts where only Python is installed). Names private to one
backend (Grid Engine's, skein's, MPI's) live with the code that uses them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

# --- the dmlc / ps-lite contract -------------------------------------------
ROLE = "DMLC_ROLE"
ROOT_URI = "DMLC_PS_ROOT_URI"
ROOT_PORT = "DMLC_PS_ROOT_PORT"
NUM_WORKER = "DMLC_NUM_WORKER"
NUM_SERVER = "DMLC_NUM_SERVER"
TASK_ID = "DMLC_TASK_ID"
JOB_CLUSTER = "DMLC_JOB_CLUSTER"
NODE_HOST = "DMLC_NODE_HOST"
INTERFACE = "DMLC_INTERFACE"
# Written by ps-lite inside a process once it has a rank; never set by us.
RANK = "DMLC_RANK"
# launch.py --p3
PS_VAN_TYPE = "DMLC_PS_VAN_TYPE"
PS_WATER_MARK = "DMLC_PS_WATER_MARK"

# --- ps-lite knobs that our KVStore honours too ---------------------------
VERBOSE = "PS_VERBOSE"
HEARTBEAT_INTERVAL = "PS_HEARTBEAT_INTERVAL"
HEARTBEAT_TIMEOUT = "PS_HEARTBEAT_TIMEOUT"
BIGARRAY_BOUND = "MXNET_KVSTORE_BIGARRAY_BOUND"

# --- ours -------------------------------------------------------------------
SECRET = "PSLAUNCH_SECRET"
INSECURE = "PSLAUNCH_INSECURE"
JOB_ID = "PSLAUNCH_JOB_ID"
# "<job id>/<process>" (``worker-1``): every process of a job has it, and so has whatever it starts,
# however it detaches (setsid, a double fork): the launcher and the node programs find and stop
# those by it when the job ends or their parent is killed.
PROCESS = "PSLAUNCH_PROCESS"
# Number of this job's servers and workers on the process's host; the trainer
# divides the host's cores by it for its default thread count.
LOCAL_PROCS = "PSLAUNCH_LOCAL_PROCS"
START_TIMEOUT = "PS_START_TIMEOUT"
PORT_RANGE = "PS_PORT_RANGE"
MAC_PAYLOAD = "PS_MAC_PAYLOAD"

# --- general-purpose variables the launcher touches -------------------------
OMP_NUM_THREADS = "OMP_NUM_THREADS"
# The trainer sets it to PASSIVE (unless set) when it runs several torch threads: spinning
# OpenMP threads collapse throughput when other processes share the cores.
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
PYTHONPATH = "PYTHONPATH"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
PYTHONFAULTHANDLER = "PYTHONFAULTHANDLER"
SUBMIT_CLUSTER = "DMLC_SUBMIT_CLUSTER"
PATH = "PATH"

ROLES = ("scheduler", "server", "worker")

#: Variables the launcher owns. An inherited or ``--env`` value is ignored.
CONTRACT = frozenset(
    {ROLE, ROOT_URI, ROOT_PORT, NUM_WORKER, NUM_SERVER, TASK_ID, JOB_CLUSTER,
     NODE_HOST, SECRET, JOB_ID, PROCESS, LOCAL_PROCS, START_TIMEOUT}
)


def contract(
    role: str,
    *,
    root_uri: str,
    root_port: int,
    num_workers: int,
    num_servers: int,
    secret: str,
    start_timeout: float,
    job_id: str,
    task_id: int | None = None,
    cluster: str | None = None,
    node_host: str | None = None,
    local_procs: int | None = None,
    process: str | None = None,
) -> dict[str, str]:
    """The contract variables of one process.

    All roles get ``DMLC_ROLE``, ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``,
    ``DMLC_NUM_WORKER``, ``DMLC_NUM_SERVER``, ``PSLAUNCH_SECRET``,
    ``PSLAUNCH_JOB_ID``, ``PSLAUNCH_PROCESS`` (``process``, the process's name such as
    ``worker-1``: :func:`process_marker`) and ``PS_START_TIMEOUT``. Servers and workers also get
    ``DMLC_TASK_ID`` (workers ``0..N-1``, servers ``N..N+S-1``),
    ``DMLC_JOB_CLUSTER`` and, when known, ``DMLC_NODE_HOST`` and
    ``PSLAUNCH_LOCAL_PROCS``. A backend whose node address is only known on the
    node (mpi, sge, yarn) passes ``node_host=None``; its wrapper fills it in.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    env = {
        ROLE: role,
        ROOT_URI: root_uri,
        ROOT_PORT: str(root_port),
        NUM_WORKER: str(num_workers),
        NUM_SERVER: str(num_servers),
        SECRET: secret,
        JOB_ID: job_id,
        PROCESS: process_marker(job_id, process or role),
        START_TIMEOUT: _fmt_seconds(start_timeout),
    }
    if role != "scheduler":
        if task_id is None or cluster is None:
            raise ValueError(f"a {role} needs a task id and a cluster name")
        env[TASK_ID] = str(task_id)
        env[JOB_CLUSTER] = cluster
        if node_host is not None:
            env[NODE_HOST] = node_host
        if local_procs is not None:
            env[LOCAL_PROCS] = str(local_procs)
    return env


def process_marker(job_id: str, process: str) -> str:
    """``PSLAUNCH_PROCESS``'s value for process ``process`` (``worker-1``) of job ``job_id``."""
    return f"{job_id}/{process}"


def _fmt_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


# --- the cause of a stop: from a process of the job to the launcher's report ----------------------

#: A process that stops the job (a scheduler that saw a worker die or hang, a node that cannot reach
#: the scheduler) says why in one line of its stderr that starts with this. The launcher finds it in
#: the output and names the culprit in its report, instead of whoever happened to exit first.
CAUSE_PREFIX = "pslaunch-cause: "
_CAUSE_RE = re.compile(r"pslaunch-cause: (?:(scheduler|server|worker)(?: (\d+))?|-): (.+)")


def cause_line(reason: str, role: str | None = None, rank: int | None = None) -> str:
    """``pslaunch-cause: worker 1: no heartbeat for 10.0s``: the line that names why the job stops.

    ``role``/``rank`` name the process at fault (a scheduler has no rank); ``None``: no process
    of the job is at fault (the reason says what is).
    """
    if role is not None and role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    who = "-" if role is None else (role if rank is None or role == "scheduler" else f"{role} {rank}")
    return CAUSE_PREFIX + who + ": " + " ".join(reason.split())


def parse_cause(line: str) -> tuple[str | None, int | None, str] | None:
    """``(role, rank, reason)`` of a :func:`cause_line` (``(None, None, reason)`` for ``-``); None for
    any other line."""
    m = _CAUSE_RE.fullmatch(line.strip())
    if not m:
        return None
    return m.group(1), (int(m.group(2)) if m.group(2) else None), m.group(3)


# --- the reading side: what a process of a job sees --------------------------


class ClusterEnvError(ValueError):
    """The contract variables are missing or malformed."""


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def seconds_from(environ: Mapping[str, str], name: str, default: float) -> float:
    """A non-negative number of seconds from ``environ[name]`` (``default`` when unset);
    raises :class:`ClusterEnvError` naming the variable."""
    value = environ.get(name)
    if value is None or not value.strip():
        return default
    try:
        x = float(value)
    except ValueError:
        raise ClusterEnvError(f"{name}={value!r} is not a number of seconds") from None
    if not x >= 0 or x == float("inf"):
        raise ClusterEnvError(f"{name}={value!r} must be a finite number of seconds, not negative")
    return x


def heartbeat_settings(environ: Mapping[str, str]) -> tuple[float, float]:
    """``(interval, timeout)`` from ``PS_HEARTBEAT_INTERVAL``/``PS_HEARTBEAT_TIMEOUT`` (1 s and
    10 s by default; 0 turns heartbeats or the check off). A timeout not longer than the
    interval would declare every node dead between two heartbeats: :class:`ClusterEnvError`."""
    interval = seconds_from(environ, HEARTBEAT_INTERVAL, 1.0)
    timeout = seconds_from(environ, HEARTBEAT_TIMEOUT, 10.0)
    if interval > 0 and 0 < timeout <= interval:
        raise ClusterEnvError(
            f"{HEARTBEAT_TIMEOUT}={timeout:g} must be longer than {HEARTBEAT_INTERVAL}={interval:g} (a node "
            "would count as dead between two heartbeats); use several intervals, such as 10 and 1, "
            "or 0 to turn the check off")
    return interval, timeout


def parse_port_range(text: str) -> tuple[int, int]:
    """``"9000-9100"`` -> ``(9000, 9100)``; raises ValueError with the rule on bad input."""
    m = re.fullmatch(r"\s*(\d{1,5})\s*-\s*(\d{1,5})\s*", text or "")
    if not m:
        raise ValueError(f"bad port range {text!r}: expected LOW-HIGH, for example 9091-9998")
    lo, hi = int(m.group(1)), int(m.group(2))
    if not (1 <= lo <= hi <= 65535):
        raise ValueError(f"bad port range {text!r}: need 1 <= LOW <= HIGH <= 65535")
    return lo, hi


@dataclass(frozen=True)
class ClusterEnv:
    """The contract as one process reads it. Built by :meth:`from_environ`."""

    role: str
    root_uri: str
    root_port: int
    num_workers: int
    num_servers: int
    task_id: int | None = None
    node_host: str | None = None
    interface: str | None = None
    secret: str | None = field(default=None, repr=False)  # never in a log or traceback
    insecure: bool = False
    job_id: str | None = None
    cluster: str | None = None
    start_timeout: float = 60.0
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 10.0
    port_range: tuple[int, int] | None = None
    mac_payload: bool = False
    verbose: int = 0
    bigarray_bound: int = 1_000_000
    local_procs: int | None = None

    @property
    def is_worker(self) -> bool:
        return self.role == "worker"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ClusterEnv:
        """Parse the contract; raise :class:`ClusterEnvError` naming the bad variable.

        As in MXNet, a missing ``DMLC_ROLE`` means worker.
        """
        role = environ.get(ROLE, "worker").strip().lower()
        if role not in ROLES:
            raise ClusterEnvError(f"{ROLE}={role!r} is not one of scheduler, server, worker")

        def need(name: str) -> str:
            value = environ.get(name)
            if value is None or not value.strip():
                raise ClusterEnvError(
                    f"{name} is not set; start this program with pslaunch (or set the dmlc variables by hand)")
            return value.strip()

        def integer(name: str, value: str, minimum: int = 0) -> int:
            try:
                n = int(value)
            except ValueError:
                raise ClusterEnvError(f"{name}={value!r} is not an integer") from None
            if n < minimum:
                raise ClusterEnvError(f"{name}={n} must be at least {minimum}")
            return n

        port_range = None
        if environ.get(PORT_RANGE, "").strip():
            try:
                port_range = parse_port_range(environ[PORT_RANGE])
            except ValueError as e:
                raise ClusterEnvError(f"{PORT_RANGE}: {e}") from None
        heartbeat = heartbeat_settings(environ)
        task = environ.get(TASK_ID, "").strip()
        local = environ.get(LOCAL_PROCS, "").strip()
        verbose = environ.get(VERBOSE, "").strip() or "0"
        return cls(
            role=role,
            root_uri=need(ROOT_URI),
            root_port=integer(ROOT_PORT, need(ROOT_PORT), 1),
            num_workers=integer(NUM_WORKER, need(NUM_WORKER)),
            num_servers=integer(NUM_SERVER, need(NUM_SERVER)),
            task_id=integer(TASK_ID, task) if task else None,
            node_host=environ.get(NODE_HOST, "").strip() or None,
            interface=environ.get(INTERFACE, "").strip() or None,
            secret=environ.get(SECRET) or None,
            insecure=_truthy(environ.get(INSECURE)),
            job_id=environ.get(JOB_ID) or None,
            cluster=environ.get(JOB_CLUSTER) or None,
            start_timeout=seconds_from(environ, START_TIMEOUT, 60.0),
            heartbeat_interval=heartbeat[0],
            heartbeat_timeout=heartbeat[1],
            port_range=port_range,
            mac_payload=_truthy(environ.get(MAC_PAYLOAD)),
            verbose=integer(VERBOSE, verbose),
            bigarray_bound=integer(BIGARRAY_BOUND, environ.get(BIGARRAY_BOUND, "") or "1000000", 1),
            local_procs=integer(LOCAL_PROCS, local, 1) if local else None,
        )
