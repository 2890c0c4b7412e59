"""Pure planning: who runs where, with which task id, rank and environment.

:func:`place` is dmlc's placement: for ``i`` in ``0..S+N-1``, process ``i`` is
a server when ``i < S`` and a worker otherwise, on ``hosts[i % len(hosts)]``
(round-robin over hostfile lines, servers first). A line with ``slots=K``
takes at most K processes; full lines are skipped. ``DMLC_TASK_ID`` is dmlc
local's numbering on every backend: workers ``0..N-1``, servers ``N..N+S-1``.

:func:`build_plan` adds each process's environment (:func:`pscontract.contract` under the
launcher's policy, :mod:`.env`).
Nothing here touches the network or the file system.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import pscontract as pc

from .. import node
from ..errors import ConfigError
from . import env as jobenv
from .job import SCHEDULER_PEERS, Host, JobSpec, Role


@dataclass(frozen=True)
class Slot:
    """One process's place: role, rank, task id and host (``None`` = this machine)."""

    role: Role
    rank: int
    task_id: int
    host: Optional[Host]


@dataclass(frozen=True)
class ProcSpec:
    """One process to start. ``env`` is the job's variables for it (see :class:`Plan`).

    ``awaits_placement``: some of its variables depend on which processes share its host, which
    only the nodes can tell (a batch system places them): its node agent reports its host and
    waits for them (:func:`placement_env`) before the command starts.
    """

    role: Role
    rank: int
    task_id: Optional[int]
    host: Optional[Host]
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict, compare=False)
    awaits_placement: bool = False
    #: the ``CUDA_VISIBLE_DEVICES`` pslaunch chose for it (:func:`worker_gpus`); None: none chosen
    gpus: Optional[str] = None

    @property
    def name(self) -> str:
        """``scheduler``, ``server-0``, ``worker-3``: file names and summary keys."""
        return "scheduler" if self.role is Role.SCHEDULER else f"{self.role}-{self.rank}"

    @property
    def label(self) -> str:
        """``[worker 3 @ host]`` without brackets: the console prefix."""
        base = "scheduler" if self.role is Role.SCHEDULER else f"{self.role} {self.rank}"
        return f"{base} @ {self.host.name}" if self.host is not None else base


def place(num_workers: int, num_servers: int, hosts: Sequence[Host] = ()) -> tuple[Slot, ...]:
    """Servers first, round-robin over ``hosts``; slots-aware; pure.

    >>> [(str(s.role), s.rank, s.host.name) for s in place(3, 2, [Host("A"), Host("B"), Host("C")])]
    [('server', 0, 'A'), ('server', 1, 'B'), ('worker', 0, 'C'), ('worker', 1, 'A'), ('worker', 2, 'B')]
    """
    total = num_workers + num_servers
    if hosts and all(h.slots is not None for h in hosts):
        capacity = sum(h.slots or 0 for h in hosts)
        if total > capacity:
            raise ConfigError(
                f"{total} processes ({num_servers} servers + {num_workers} workers) do not fit in the "
                f"hostfile's {capacity} slots; add hosts or raise slots=")
    used: collections.Counter[int] = collections.Counter()
    slots = []
    cursor = 0
    for i in range(total):
        host = None
        if hosts:
            # the next line in round-robin order that still has room
            for _ in range(len(hosts)):
                candidate = cursor % len(hosts)
                cursor += 1
                h = hosts[candidate]
                if h.slots is None or used[candidate] < h.slots:
                    used[candidate] += 1
                    host = h
                    break
        if i < num_servers:
            slots.append(Slot(Role.SERVER, i, num_workers + i, host))
        else:
            slots.append(Slot(Role.WORKER, i - num_servers, i - num_servers, host))
    return tuple(slots)


def worker_gpus(spec: JobSpec, slots: Optional[Sequence[Slot]] = None) -> dict[int, str]:
    """Each worker's ``CUDA_VISIBLE_DEVICES`` (by rank) under ``--gpus-per-process`` and the
    hostfile's ``gpus=``, or {} when neither is given: the workers of one host, in local-rank
    order, get disjoint consecutive slices of its GPUs (:func:`pscontract.gpu_slices`). Servers
    and the scheduler get none (a ps-lite server works on the CPU). Pure: ``build_plan`` and the
    CLI (to refuse a host with too few GPUs before anything starts) ask the same.

    Raises:
        ConfigError: a host whose ``gpus=`` has too few GPUs for its workers.
    """
    if not spec.gpus_chosen:
        return {}
    if slots is None:
        slots = place(spec.num_workers, spec.num_servers, spec.hosts)
        if spec.collective:
            slots = by_host(slots)
    on_host: dict[Optional[Host], list[int]] = {}
    for s in sorted((s for s in slots if s.role is Role.WORKER), key=lambda s: s.rank):
        on_host.setdefault(s.host, []).append(s.rank)
    out: dict[int, str] = {}
    for host, ranks in on_host.items():
        gpus = host.gpus if host is not None else None
        if spec.gpus_per_process is None and gpus is None:
            continue  # (this host's line names no GPUs: its workers see what they see)
        try:
            out.update(zip(ranks, pc.gpu_slices(len(ranks), spec.gpus_per_process, gpus)))
        except ValueError as e:
            assert host is not None
            raise ConfigError(f"{host.origin or host.display}: {host.display}: {e}; lower --gpus-per-process, "
                              "name more GPUs in gpus=, or place fewer workers there (slots=)") from None
    return out


def by_host(slots: Sequence[Slot]) -> tuple[Slot, ...]:
    """The workers of ``slots`` renumbered host by host (hosts in order of their first worker),
    as a collective job wants them: each host's ranks consecutive, so a ring or a tree crosses
    between hosts as little as possible and torch's ``RANK`` is the worker's number. The same
    hosts get the same number of workers as :func:`place` gives them. Servers are not renumbered.

    >>> [(s.rank, s.host.name) for s in by_host(place(4, 0, [Host("A"), Host("B")]))]
    [(0, 'A'), (1, 'A'), (2, 'B'), (3, 'B')]
    """
    workers = [s for s in slots if s.role is Role.WORKER]
    ranks = pc.host_ranks([s.host.name if s.host is not None else "" for s in workers])
    renumbered = sorted(((r.rank, s.host) for r, s in zip(ranks, workers)), key=lambda rh: rh[0])
    return tuple(s for s in slots if s.role is not Role.WORKER) + tuple(
        Slot(Role.WORKER, rank, rank, host) for rank, host in renumbered)


@dataclass(frozen=True)
class Plan:
    """A job ready to start: the scheduler (if any), then servers, then workers.

    ``root_uri``/``root_port`` are where the job's service listens on this host: the ps
    scheduler, or the tracker of a collective job (``spec.tracker``).
    """

    spec: JobSpec
    root_uri: str
    root_port: int
    job_id: str
    scheduler: Optional[ProcSpec]
    procs: tuple[ProcSpec, ...]
    overridden: tuple[str, ...] = ()

    @property
    def all(self) -> tuple[ProcSpec, ...]:
        return ((self.scheduler,) if self.scheduler else ()) + self.procs


def _pairs(items: Sequence[tuple[str, str]]) -> dict[str, str]:
    return dict(items)


def build_plan(
    spec: JobSpec,
    *,
    root_uri: str,
    root_port: int,
    secret: str,
    job_id: str,
    addresses: Mapping[Host, str] = {},
    here: Optional[str] = None,
    inherit_environ: bool,
    scheduler_inherits: bool = True,
    attempt: int = 0,
) -> Plan:
    """Every process with its full job environment.

    Args:
        addresses: ``DMLC_NODE_HOST`` of the hosts whose address the launcher knows before
            the start (ssh); the node agent of any other host works it out there.
        here: when the job's processes all run on this machine, their ``DMLC_NODE_HOST``
            (the scheduler's address); None when the batch system decides where they run
            (then ``PSLAUNCH_LOCAL_PROCS`` is not known either).
        inherit_environ: processes also get the launcher's whole environment (lowest
            precedence), as dmlc local does. The scheduler runs here and inherits it unless
            ``scheduler_inherits`` is false (dry runs show only the job's own variables).
        attempt: which attempt of the job this is (0 first; ``--max-restarts``): every process
            gets :func:`pscontract.attempt_env`, with ``job_id`` as the run id.
    """
    environ = spec.environ_dict()
    owned = pc.owned(spec.tracker or "ps")
    forwarded = jobenv.forwarded(environ, extra_names=(), owned=owned)
    if spec.tracker == "torch":  # (torchrun's defaults, below --env: the user's value wins)
        forwarded = {**pc.torch_defaults(environ), **forwarded}
    if spec.replaces_workers:  # (ps-lite's heartbeats, for its recovery path; the user's values win)
        forwarded = {**pc.replacement_defaults(environ), **forwarded}
    cli_env = _pairs(spec.env)
    if spec.p3:
        cli_env = {pc.PS_VAN_TYPE: "p3", pc.PS_WATER_MARK: "10", **cli_env}
    ps_contract = functools.partial(pc.contract, root_uri=root_uri, root_port=root_port,
                                    num_workers=spec.num_workers, num_servers=spec.num_servers, secret=secret,
                                    start_timeout=spec.start_timeout, job_id=job_id)
    overridden: set[str] = set()

    attempt_env = pc.attempt_env(attempt=attempt, max_restarts=spec.max_restarts, run_id=job_id,
                                 tracker=spec.tracker or "ps")
    if spec.replaces_workers:
        attempt_env[pc.RESTART_SCOPE] = spec.restart_scope

    def env_for(contract: dict[str, str], role_env: Mapping[str, str], inherit: bool) -> dict[str, str]:
        contract = {**contract, **attempt_env}
        if attempt and pc.PROCESS in contract:  # (each attempt's processes a marker of their own)
            contract[pc.PROCESS] = pc.process_marker(job_id, contract[pc.PROCESS].split("/", 1)[1], attempt)
        composed = jobenv.compose(contract, role_env=role_env, cli_env=cli_env, forwarded_env=forwarded,
                                   inherited=environ if inherit else None, owned=owned)
        overridden.update(composed.overridden)
        return jobenv.launcher_defaults(composed.env)

    slots = place(spec.num_workers, spec.num_servers, spec.hosts)
    if spec.collective:
        slots = by_host(slots)
    per_host = collections.Counter(s.host.name if s.host else None for s in slots)
    ranks = pc.host_ranks([s.host.name if s.host else "" for s in slots])
    gpus = worker_gpus(spec, slots)
    if gpus and pc.CUDA_VISIBLE_DEVICES in forwarded:  # (the spec refuses it from --env)
        overridden.add(pc.CUDA_VISIBLE_DEVICES)
    procs = []
    for s, place_ in zip(slots, ranks):
        placed = s.host is not None or here is not None
        node_host = addresses.get(s.host) if s.host is not None else here
        local_procs = per_host[s.host.name if s.host else None] if placed else None
        if spec.collective:
            contract = _collective_contract(spec, s, root_uri, root_port, secret, job_id,
                                            place_ if placed else None, node_host, local_procs)
        else:
            contract = ps_contract(str(s.role), task_id=s.task_id, cluster=spec.launcher, node_host=node_host,
                                   local_procs=local_procs, process=f"{s.role}-{s.rank}")
        if s.role is Role.WORKER and s.rank in gpus:
            contract[pc.CUDA_VISIBLE_DEVICES] = gpus[s.rank]
        role_env = _pairs(spec.env_server if s.role is Role.SERVER else spec.env_worker)
        procs.append(ProcSpec(s.role, s.rank, s.task_id, s.host, spec.command,
                              env_for(contract, role_env, inherit_environ),
                              awaits_placement=spec.tracker == "torch" and not placed,
                              gpus=gpus.get(s.rank) if s.role is Role.WORKER else None))
    scheduler = None
    if spec.has_scheduler:
        contract = ps_contract("scheduler")
        command = tuple(node.command("pslite")) if spec.scheduler == "builtin" else spec.command
        env = env_for(contract, {}, scheduler_inherits)
        # the builtin scheduler lets in the job's hosts only, when the launcher knows the address
        # each host's processes come from: here, or where it worked it out (ssh); a batch
        # system's or mpirun's hosts may come from addresses that their names are not
        known = here is not None or bool(spec.hosts) and all(h in addresses for h in spec.hosts)
        if spec.scheduler == "builtin" and known:
            peers = [h.name for h in spec.hosts] + list(addresses.values()) + ([here] if here else [])
            env.setdefault(SCHEDULER_PEERS, ",".join(dict.fromkeys(peers)))
        scheduler = ProcSpec(Role.SCHEDULER, 0, None, None, command, env)
    return Plan(spec=spec, root_uri=root_uri, root_port=root_port, job_id=job_id, scheduler=scheduler,
                procs=tuple(procs), overridden=tuple(sorted(overridden)))


def _collective_contract(spec: JobSpec, s: Slot, service: str, port: int, secret: str, job_id: str,
                         place_: Optional[pc.HostRank], node_host: Optional[str],
                         local_procs: Optional[int]) -> dict[str, str]:
    """A worker's contract under a tracker: rabit's (``rabit``, ``xgboost``) or torch's."""
    if spec.tracker == "torch":
        return pc.torch_contract(master_addr=service, master_port=port, place=place_, task_id=s.task_id,
                                 num_workers=spec.num_workers, cluster=spec.launcher, secret=secret, job_id=job_id,
                                 start_timeout=spec.start_timeout, node_host=node_host)
    return pc.rabit_contract(tracker_uri=service, tracker_port=port, local_procs=local_procs, task_id=s.task_id,
                             num_workers=spec.num_workers, cluster=spec.launcher, secret=secret, job_id=job_id,
                             start_timeout=spec.start_timeout, node_host=node_host)


def placement_env(procs: Sequence[ProcSpec], hosts: Mapping[int, str]) -> dict[int, dict[str, str]]:
    """The variables that depend on where every process runs, for a job whose processes a batch
    system placed: ``hosts`` maps each task id to the host its node agent reported; the result
    maps each task id to what its agent adds before the command starts.

    Workers are numbered host by host (hosts in order of their lowest task id), as torchrun
    numbers them (:func:`pscontract.host_ranks`): ``RANK`` may then differ from
    ``DMLC_TASK_ID``, the worker's number in the job. Processes that do not await placement
    get nothing.

    Raises:
        ValueError: a process that awaits placement has no host in ``hosts``.
    """
    waiting = sorted(((p.task_id, p) for p in procs if p.awaits_placement and p.task_id is not None),
                     key=lambda w: w[0])
    missing = [p.label for task_id, p in waiting if task_id not in hosts]
    if missing:
        raise ValueError(f"no host reported for {', '.join(missing)}")
    places = pc.host_ranks([hosts[task_id] for task_id, _ in waiting])
    return {task_id: pc.torch_placement(r) for (task_id, _), r in zip(waiting, places)}
