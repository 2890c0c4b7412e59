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

import errno
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence, TypeVar

_Held = TypeVar("_Held")

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
# --- restarts (--max-restarts): the same on every role of every attempt -------
#: which attempt of the job this is: 0 for the first, k after k restarts
ATTEMPT = "PSLAUNCH_ATTEMPT"
#: the job's restart budget (--max-restarts)
RESTART_LIMIT = "PSLAUNCH_MAX_RESTARTS"
#: the same for every attempt of one job (``PSLAUNCH_JOB_ID`` is too: it is this run id)
JOB_RUN_ID = "PSLAUNCH_RUN_ID"
#: dmlc's attempt number (its YARN ApplicationMaster's ``DMLC_NUM_ATTEMPT``), as a variable
NUM_ATTEMPT = "DMLC_NUM_ATTEMPT"
#: ``process`` in a parameter-server job run with ``--restart-scope process``: a lost worker is
#: replaced in place, so the scheduler and the servers wait for its replacement (absent otherwise)
RESTART_SCOPE = "PSLAUNCH_RESTART_SCOPE"
#: on a replacement worker only: ``k`` for the k-th replacement of that worker in this attempt; it
#: has the lost worker's whole environment besides, and starts only once that one has ended
REPLACEMENT = "PSLAUNCH_REPLACEMENT"
#: a file of this process's own, where a program may write why it failed (torch's ``@record``
#: writes JSON to ``TORCHELASTIC_ERROR_FILE``): the launcher reads it back after the process ends
ERROR_FILE = "PSLAUNCH_ERROR_FILE"
TORCH_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
PORT_RANGE = "PS_PORT_RANGE"
MAC_PAYLOAD = "PS_MAC_PAYLOAD"

# --- general-purpose variables the launcher touches -------------------------
OMP_NUM_THREADS = "OMP_NUM_THREADS"
# The trainer sets it to PASSIVE (unless set) when its job's threads on the host outnumber the
# cores: spinning OpenMP threads collapse throughput when other processes want the same cores.
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
PYTHONPATH = "PYTHONPATH"
PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
PYTHONFAULTHANDLER = "PYTHONFAULTHANDLER"
SUBMIT_CLUSTER = "DMLC_SUBMIT_CLUSTER"
PATH = "PATH"
#: the GPUs a process sees; set per worker with ``--gpus-per-process`` or a hostfile's ``gpus=``
#: (:func:`gpu_slices`), else forwarded from the launcher's environment
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"

# --- the collective trackers (--tracker rabit, xgboost, torch) ---------------
#: ``--tracker`` values: the ps-lite scheduler (``ps``), dmlc's rabit tracker as XGBoost up to 2.0
#: ships it (``rabit``), XGBoost 2.1+'s own tracker (``xgboost``) and torch.distributed's env://
#: contract with a rendezvous store on the launching host (``torch``).
TRACKERS = ("ps", "rabit", "xgboost", "torch")
# dmlc's rabit contract (XGBoost 2.0's rabit reads both; 2.1+ scripts pass them on)
TRACKER_URI = "DMLC_TRACKER_URI"
TRACKER_PORT = "DMLC_TRACKER_PORT"
# torch.distributed's env:// contract, spelled as torchrun (torch.distributed.run) spells it.
# (RANK above is ps-lite's DMLC_RANK; torch's is TORCH_RANK.)
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
TORCH_RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_RANK = "ROLE_RANK"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
ROLE_NAME = "ROLE_NAME"
RUN_ID = "TORCHELASTIC_RUN_ID"
# "True": every rank, rank 0 included, connects to the store at MASTER_ADDR:MASTER_PORT as a
# client (torch/distributed/rendezvous.py, _create_c10d_store) instead of rank 0 hosting it.
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
#: A torch job's role name (torchrun's default ``--role``).
TORCH_ROLE = "default"
# Two more that torchrun gives every worker, each the launcher's own value when it has one (its
# environment, ``--env``), else torchrun's: the signals a launcher forwards to its workers
# (torch's elastic multiprocessing reads it when a worker starts processes of its own), and
# NCCL's watchdog tearing a process down on a collective's error or timeout instead of hanging
# (torchrun's agent sets it to 1 unless set; only NCCL reads it, a gloo job ignores it).
SIGNALS_TO_HANDLE = "TORCHELASTIC_SIGNALS_TO_HANDLE"
NCCL_ASYNC_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
#: torchrun's ``--signals-to-handle`` default. (pslaunch stops its job on the first three; a SIGQUIT
#: ends the launcher, and its watchdog then stops the job.)
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
# The interface torch's gloo and NCCL bind: by default gloo takes the address the host's name
# resolves to, often 127.0.x.x, and then no other host reaches it.
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"

ROLES = ("scheduler", "server", "worker")

#: Variables the launcher owns. An inherited or ``--env`` value is ignored.
CONTRACT = frozenset(
    {ROLE, ROOT_URI, ROOT_PORT, NUM_WORKER, NUM_SERVER, TASK_ID, JOB_CLUSTER,
     NODE_HOST, SECRET, JOB_ID, PROCESS, LOCAL_PROCS, START_TIMEOUT, TRACKER_URI, TRACKER_PORT,
     ATTEMPT, RESTART_LIMIT, JOB_RUN_ID, NUM_ATTEMPT, ERROR_FILE, TORCH_ERROR_FILE, RESTART_SCOPE, REPLACEMENT}
)
#: What a worker of a ``torch`` job gets on top of the dmlc worker variables; the launcher owns
#: these too in such a job (a ``RANK`` inherited from an outer torchrun would be wrong here).
TORCH_CONTRACT = frozenset(
    {MASTER_ADDR, MASTER_PORT, TORCH_RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
     GROUP_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE, ROLE_NAME, RUN_ID, USE_AGENT_STORE, RESTART_COUNT,
     MAX_RESTARTS}
)


def owned(tracker: str) -> frozenset[str]:
    """The variables the launcher owns in a job of ``tracker`` (``CONTRACT``, plus torch's in a torch job)."""
    if tracker not in TRACKERS:
        raise ValueError(f"unknown tracker {tracker!r}")
    return CONTRACT | TORCH_CONTRACT if tracker == "torch" else CONTRACT


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


def attempt_env(*, attempt: int, max_restarts: int, run_id: str, tracker: str) -> dict[str, str]:
    """What every process of every role learns about the job's restarts (``--max-restarts``):
    ``PSLAUNCH_ATTEMPT`` (0 for the first attempt, k after k restarts), ``PSLAUNCH_MAX_RESTARTS``,
    ``PSLAUNCH_RUN_ID`` (the same for every attempt) and dmlc's ``DMLC_NUM_ATTEMPT`` (= the
    attempt). A ``torch`` job's workers also get torchrun's ``TORCHELASTIC_RESTART_COUNT``,
    ``TORCHELASTIC_MAX_RESTARTS`` and ``TORCHELASTIC_RUN_ID`` with the same values: the job's
    count, never one node's.

    >>> attempt_env(attempt=2, max_restarts=3, run_id="ab12", tracker="torch")["TORCHELASTIC_RESTART_COUNT"]
    '2'
    """
    if attempt < 0 or max_restarts < 0:
        raise ValueError("attempt and max_restarts are 0 or more")
    env = {ATTEMPT: str(attempt), RESTART_LIMIT: str(max_restarts), JOB_RUN_ID: run_id, NUM_ATTEMPT: str(attempt)}
    if tracker == "torch":
        env.update({RESTART_COUNT: str(attempt), MAX_RESTARTS: str(max_restarts), RUN_ID: run_id})
    return env


#: ps-lite's heartbeats where a lost worker is replaced (``--restart-scope process``): its recovery
#: path gives a late node the id of a node of its role silent for longer than the timeout
REPLACEMENT_HEARTBEATS = {HEARTBEAT_INTERVAL: "1", HEARTBEAT_TIMEOUT: "2"}


def replacement_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """What every process of a job whose lost workers are replaced in place gets unless the
    launcher's own environment ``environ`` sets it: ps-lite's heartbeats
    (:data:`REPLACEMENT_HEARTBEATS`). Not owned: ``--env`` overrides them.

    >>> replacement_defaults({"PS_HEARTBEAT_TIMEOUT": "10"})
    {'PS_HEARTBEAT_INTERVAL': '1', 'PS_HEARTBEAT_TIMEOUT': '10'}
    """
    return {name: environ.get(name, value) for name, value in REPLACEMENT_HEARTBEATS.items()}


def replacement_env(env: Mapping[str, str], k: int) -> dict[str, str]:
    """The environment of the ``k``-th replacement (1, 2, ...) of a lost worker whose environment
    was ``env``: the same, with ``PSLAUNCH_REPLACEMENT=k`` and a process marker of its own (so that
    what cleans up after the lost one never stops it).

    >>> e = replacement_env({"PSLAUNCH_PROCESS": "ab/worker-1@2", "DMLC_ROLE": "worker"}, 1)
    >>> e["PSLAUNCH_PROCESS"], e["PSLAUNCH_REPLACEMENT"]
    ('ab/worker-1@2~1', '1')
    """
    if k < 1:
        raise ValueError("a replacement is the first (1) or a later one")
    out = dict(env)
    out[REPLACEMENT] = str(k)
    if PROCESS in out:
        out[PROCESS] = f"{out[PROCESS].split('~', 1)[0]}~{k}"
    return out


def process_marker(job_id: str, process: str, attempt: int = 0) -> str:
    """``PSLAUNCH_PROCESS``'s value for process ``process`` (``worker-1``) of job ``job_id``, in its
    ``attempt`` (``--max-restarts``): ``<job id>/worker-1``, then ``<job id>/worker-1@2``, so that
    nothing that cleans up after one attempt (a killed node agent's watchdog) stops the next."""
    return f"{job_id}/{process}" if not attempt else f"{job_id}/{process}@{attempt}"


def _worker_base(*, task_id: int, num_workers: int, cluster: str, secret: str, job_id: str,
                 start_timeout: float, node_host: str | None, local_procs: int | None) -> dict[str, str]:
    """What every worker of a collective job (no servers) gets, whatever its tracker."""
    env = {
        ROLE: "worker",
        NUM_WORKER: str(num_workers),
        NUM_SERVER: "0",
        TASK_ID: str(task_id),
        JOB_CLUSTER: cluster,
        SECRET: secret,
        JOB_ID: job_id,
        PROCESS: process_marker(job_id, f"worker-{task_id}"),
        START_TIMEOUT: _fmt_seconds(start_timeout),
    }
    if node_host is not None:
        env[NODE_HOST] = node_host
    if local_procs is not None:
        env[LOCAL_PROCS] = str(local_procs)
    return env


def rabit_contract(*, tracker_uri: str, tracker_port: int, task_id: int, num_workers: int, cluster: str,
                   secret: str, job_id: str, start_timeout: float, node_host: str | None = None,
                   local_procs: int | None = None) -> dict[str, str]:
    """A worker of a ``rabit`` or ``xgboost`` job: launch.py's ``-s 0`` contract.

    ``DMLC_TRACKER_URI``, ``DMLC_TRACKER_PORT`` (where the tracker listens), ``DMLC_ROLE=worker``,
    ``DMLC_TASK_ID`` (``0..N-1``), ``DMLC_NUM_WORKER``, ``DMLC_NUM_SERVER=0``,
    ``DMLC_JOB_CLUSTER``, and pslaunch's own (``PSLAUNCH_SECRET``, ``PSLAUNCH_JOB_ID``,
    ``PSLAUNCH_PROCESS``, ``PS_START_TIMEOUT``, ``DMLC_NODE_HOST`` and ``PSLAUNCH_LOCAL_PROCS``
    when known); no
    ``DMLC_PS_ROOT_*``: there is no scheduler. XGBoost 2.0's rabit reads the tracker's address
    and the task id itself (the ``rabit`` tracker then gives it rank ``DMLC_TASK_ID``); an
    XGBoost 2.1+ script passes them to ``CommunicatorContext``.
    """
    env = _worker_base(task_id=task_id, num_workers=num_workers, cluster=cluster, secret=secret, job_id=job_id,
                       start_timeout=start_timeout, node_host=node_host, local_procs=local_procs)
    env[TRACKER_URI] = tracker_uri
    env[TRACKER_PORT] = str(tracker_port)
    return env


@dataclass(frozen=True)
class HostRank:
    """A worker's place in a torch job, numbered host by host as torchrun numbers it."""

    rank: int
    local_rank: int
    local_world_size: int
    group_rank: int
    group_world_size: int


def host_ranks(hosts: Sequence[str]) -> list[HostRank]:
    """``hosts[i]`` is where worker ``i`` runs; each worker's :class:`HostRank`, in the same order.

    As torchrun across nodes: the hosts are the groups, numbered in order of their first worker;
    ranks run through one host's workers (in worker order) before the next host's, so each
    host's ranks are consecutive and ``LOCAL_RANK`` is the index on the host (``cuda:LOCAL_RANK``).

    >>> [(r.rank, r.local_rank, r.group_rank) for r in host_ranks(["a", "b", "a"])]
    [(0, 0, 0), (2, 0, 1), (1, 1, 0)]
    """
    groups: dict[str, list[int]] = {}
    for i, h in enumerate(hosts):
        groups.setdefault(h, []).append(i)
    out: list[HostRank | None] = [None] * len(hosts)
    rank = 0
    for group, members in enumerate(groups.values()):
        for local, i in enumerate(members):
            out[i] = HostRank(rank, local, len(members), group, len(groups))
            rank += 1
    return [r for r in out if r is not None]


def gpu_slices(count: int, per_process: int | None, gpus: Sequence[int] | None = None) -> list[str]:
    """``CUDA_VISIBLE_DEVICES`` of the ``count`` workers of one host, in local-rank order: disjoint
    consecutive slices of ``per_process`` GPUs from ``gpus`` (the host's, as its hostfile line names
    them; None: not known, the indices count up from 0). Without ``per_process`` every worker
    sees all of ``gpus``.

    >>> gpu_slices(2, 2), gpu_slices(2, 1, [0, 2]), gpu_slices(2, None, [5, 7])
    (['0,1', '2,3'], ['0', '2'], ['5,7', '5,7'])

    Raises:
        ValueError: ``gpus`` has fewer than ``count * per_process`` GPUs (the message says so).
    """
    if per_process is None:
        assert gpus is not None
        return [",".join(map(str, gpus))] * count
    need = count * per_process
    if gpus is None:
        gpus = range(need)
    elif len(gpus) < need:
        workers, each = f"worker{'s' if count != 1 else ''}", f"GPU{'s' if per_process != 1 else ''}"
        raise ValueError(f"{count} {workers} x {per_process} {each} need {need} GPUs; gpus= names {len(gpus)} "
                         f"({','.join(map(str, gpus))})")
    return [",".join(map(str, gpus[i * per_process:(i + 1) * per_process])) for i in range(count)]


def torch_placement(place: HostRank, local_procs: bool = True) -> dict[str, str]:
    """The variables of a torch worker that depend on where every worker runs (with
    ``PSLAUNCH_LOCAL_PROCS``, the workers on its host, unless ``local_procs`` is false)."""
    env = {
        TORCH_RANK: str(place.rank),
        ROLE_RANK: str(place.rank),
        LOCAL_RANK: str(place.local_rank),
        LOCAL_WORLD_SIZE: str(place.local_world_size),
        GROUP_RANK: str(place.group_rank),
        GROUP_WORLD_SIZE: str(place.group_world_size),
    }
    if local_procs:
        env[LOCAL_PROCS] = str(place.local_world_size)
    return env


def torch_contract(*, master_addr: str, master_port: int, task_id: int, num_workers: int, cluster: str,
                   secret: str, job_id: str, start_timeout: float, place: HostRank | None,
                   node_host: str | None = None) -> dict[str, str]:
    """A worker of a ``torch`` job: torchrun's env:// contract across hosts, plus the dmlc worker variables.

    ``MASTER_ADDR``/``MASTER_PORT`` (the rendezvous store the launcher hosts),
    ``WORLD_SIZE``/``ROLE_WORLD_SIZE`` (N), ``RANK``/``ROLE_RANK``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the host's index), ``GROUP_WORLD_SIZE`` (hosts),
    ``ROLE_NAME=default`` and
    ``TORCHELASTIC_USE_AGENT_STORE=True``: every rank connects to the store as a client, which
    is what torchrun's workers do with the store its agent hosts. ``place`` is None when a batch
    system decides where the workers run: the rank variables (:func:`torch_placement`) then
    come from the launcher once every task has said where it runs. ``DMLC_TASK_ID`` is the
    worker's number in the job (its label); ``RANK`` equals it whenever the launcher placed the
    workers itself. torchrun's restart variables (``TORCHELASTIC_RUN_ID``, ``..._RESTART_COUNT``,
    ``..._MAX_RESTARTS``) come with every process's :func:`attempt_env`.
    """
    env = _worker_base(task_id=task_id, num_workers=num_workers, cluster=cluster, secret=secret, job_id=job_id,
                       start_timeout=start_timeout, node_host=node_host, local_procs=None)
    env.update({
        MASTER_ADDR: master_addr,
        MASTER_PORT: str(master_port),
        WORLD_SIZE: str(num_workers),
        ROLE_WORLD_SIZE: str(num_workers),
        ROLE_NAME: TORCH_ROLE,
        USE_AGENT_STORE: "True",
    })
    if place is not None:
        env.update(torch_placement(place))
    return env


def torch_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """What a torch job's workers get as torchrun's workers do, unless the launcher's own
    environment ``environ`` sets it: ``TORCHELASTIC_SIGNALS_TO_HANDLE`` (torchrun's default list,
    :data:`TORCHRUN_SIGNALS`) and ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``. Not owned: ``--env``
    overrides them as it overrides any inherited variable.

    >>> torch_defaults({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    '3'
    """
    return {SIGNALS_TO_HANDLE: environ.get(SIGNALS_TO_HANDLE, TORCHRUN_SIGNALS),
            NCCL_ASYNC_ERROR_HANDLING: environ.get(NCCL_ASYNC_ERROR_HANDLING, "1")}


def torch_sockets(environ: Mapping[str, str], interface: str | None) -> dict[str, str]:
    """For a torch worker (``MASTER_ADDR`` set) whose ranks reach each other through ``interface``
    (a name) on its node (:func:`netif.carrier_spec`: the one ``DMLC_INTERFACE`` selects, else the
    one that carries the node's address): ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``
    (``=name``: that interface exactly), each unless already set; so gloo and NCCL use the network
    the other hosts reach this one on, whatever the interface is called on each host. Nothing for
    another job or without an interface."""
    if not interface or not environ.get(MASTER_ADDR):
        return {}
    env = {}
    if not environ.get(GLOO_SOCKET_IFNAME):
        env[GLOO_SOCKET_IFNAME] = interface
    if not environ.get(NCCL_SOCKET_IFNAME):
        env[NCCL_SOCKET_IFNAME] = "=" + interface
    return env


def service_endpoint(environ: Mapping[str, str]) -> tuple[str, int] | None:
    """Where the job's service listens on the launching host, from a process's variables: the
    ps scheduler (``DMLC_PS_ROOT_URI``), the tracker (``DMLC_TRACKER_URI``) or the torch store
    (``MASTER_ADDR``), with its port; None if none is set. Every node reaches that address,
    so the node programs route to it and the launcher's hub listens beside it."""
    for host, port in ((ROOT_URI, ROOT_PORT), (TRACKER_URI, TRACKER_PORT), (MASTER_ADDR, MASTER_PORT)):
        address = (environ.get(host) or "").strip()
        if address:
            try:
                return address, int(environ.get(port) or 0)
            except ValueError:
                return address, 0
    return None


def _fmt_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


# --- the cause of a stop: from a process of the job to the launcher's report ----------------------

#: A process that stops the job (a scheduler that saw a worker die or hang, a node that cannot reach
#: the scheduler) says why in one line of its stderr that starts with this. The launcher finds it in
#: the output and names the culprit in its report, instead of whoever happened to exit first.
CAUSE_PREFIX = "pslaunch-cause: "
_CAUSE_PATTERN = r"pslaunch-cause: (?:(scheduler|server|worker)(?: (\d+))?|-): (.+)"


def cause_line(reason: str, role: str | None = None, rank: int | None = None) -> str:
    """``pslaunch-cause: worker 1: no heartbeat for 10.0s``: the line that names why the job stops.

    ``role``/``rank`` name the process at fault (a scheduler has no rank); ``None``: no process
    of the job is at fault (the reason says what is).
    """
    if role is not None and role not in ROLES:
        raise ValueError(f"unknown role {role!r}")
    who = "-" if role is None else (role if rank is None or role == "scheduler" else f"{role} {rank}")
    return CAUSE_PREFIX + who + ": " + " ".join(reason.split())


#: what a process that was told to stop writes before it says so (:func:`relayed_cause_line`)
_RELAYED = "relayed: "


def relayed_cause_line(reason: str) -> str:
    """``pslaunch-cause: relayed: no heartbeat for 10.0s``: the line a process writes when another
    (the scheduler) told it to stop for ``reason``, before it prints that in its own words.

    It names nobody (:func:`parse_cause` gives None: the process that found the cause blames), and it
    lets the launcher's console know the reason before this process's own line that repeats it,
    whichever process's output it reads first: the reason is shown in full once.
    """
    return CAUSE_PREFIX + _RELAYED + " ".join(reason.split())


def cause_reason(line: str) -> str | None:
    """The reason of a :func:`cause_line` or a :func:`relayed_cause_line`; None for any other line."""
    line = line.strip()
    if line.startswith(CAUSE_PREFIX + _RELAYED):
        return line[len(CAUSE_PREFIX + _RELAYED):] or None
    parsed = parse_cause(line)
    return parsed[2] if parsed is not None else None


def parse_cause(line: str) -> tuple[str | None, int | None, str] | None:
    """``(role, rank, reason)`` of a :func:`cause_line` (``(None, None, reason)`` for ``-``); None for
    any other line."""
    line = line.strip()
    if not line.startswith(CAUSE_PREFIX):
        return None

    m = re.fullmatch(_CAUSE_PATTERN, line)
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


# --- port ranges (--port-range, PS_PORT_RANGE) ---------------------------------
# A port range is LOW-HIGH, both ends included. Whoever listens in one (the launcher's scheduler
# port, hub, torch store and doctor; the trainer's servers) takes the first free port from LOW up,
# by first_free_port; errors of a bind that mean "this port is not free, try the next":
PORT_TAKEN = (errno.EADDRINUSE, errno.EACCES)


def check_port_range(lo: int, hi: int) -> None:
    """The rule of a port range, ``1 <= LOW <= HIGH <= 65535``; raises ValueError saying so."""
    if not 1 <= lo <= hi <= 65535:
        raise ValueError("need 1 <= LOW <= HIGH <= 65535")


def parse_port_range(text: str) -> tuple[int, int]:
    """``"9000-9100"`` -> ``(9000, 9100)``; raises ValueError with the rule on bad input."""
    parts = [p.strip() for p in (text or "").split("-")]  # (LOW-HIGH, spaces allowed: no re needed)
    if len(parts) != 2 or not all(0 < len(p) <= 5 and p.isdecimal() for p in parts):
        raise ValueError(f"bad port range {text!r}: expected LOW-HIGH, for example 9091-9998")
    lo, hi = int(parts[0]), int(parts[1])
    try:
        check_port_range(lo, hi)
    except ValueError as e:
        raise ValueError(f"bad port range {text!r}: {e}") from None
    return lo, hi


def first_free_port(lo: int, hi: int, take: Callable[[int], _Held | None], after: int = 0) -> tuple[int, _Held] | None:
    """The first port of ``lo..hi`` above ``after`` that ``take`` gets, and what it returned.

    ``take(port)`` binds the port (or claims it) and returns what holds it, or None when the port
    is not free (a bind's error in :data:`PORT_TAKEN`); the ports are tried from the lowest up.
    An exception of ``take`` ends the search: another error of a bind (an address that is not
    this host's) would be the same on every port. None when no port of the range was free.
    """
    for port in range(max(lo, after + 1), hi + 1):
        held = take(port)
        if held is not None:
            return port, held
    return None


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
