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
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import pscontract as pc

from ..errors import ConfigError
from . import env as jobenv
from .job import Host, JobSpec, Role


@dataclass(frozen=True)
class Slot:
    """One process's place: role, rank, task id and host (``None`` = this machine)."""

    role: Role
    rank: int
    task_id: int
    host: Optional[Host]


@dataclass(frozen=True)
class ProcSpec:
    """One process to start. ``env`` is the job's variables for it (see :class:`Plan`)."""

    role: Role
    rank: int
    task_id: Optional[int]
    host: Optional[Host]
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict, compare=False)

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


@dataclass(frozen=True)
class Plan:
    """A job ready to start: the scheduler (if any), then servers, then workers."""

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
    """
    environ = spec.environ_dict()
    forwarded = jobenv.forwarded(environ, extra_names=())
    cli_env = _pairs(spec.env)
    if spec.p3:
        cli_env = {pc.PS_VAN_TYPE: "p3", pc.PS_WATER_MARK: "10", **cli_env}
    common = dict(root_uri=root_uri, root_port=root_port, num_workers=spec.num_workers,
                  num_servers=spec.num_servers, secret=secret, start_timeout=spec.start_timeout,
                  job_id=job_id)
    overridden: set[str] = set()

    def env_for(contract: dict[str, str], role_env: Mapping[str, str], inherit: bool) -> dict[str, str]:
        composed = jobenv.compose(contract, role_env=role_env, cli_env=cli_env,
                                   forwarded_env=forwarded, inherited=environ if inherit else None)
        overridden.update(composed.overridden)
        return jobenv.launcher_defaults(composed.env)

    slots = place(spec.num_workers, spec.num_servers, spec.hosts)
    per_host = collections.Counter(s.host.name if s.host else None for s in slots)
    procs = []
    for s in slots:
        placed = s.host is not None or here is not None
        contract = pc.contract(
            str(s.role), task_id=s.task_id, cluster=spec.launcher,
            node_host=addresses.get(s.host) if s.host is not None else here,
            local_procs=per_host[s.host.name if s.host else None] if placed else None,
            process=f"{s.role}-{s.rank}", **common)
        role_env = _pairs(spec.env_server if s.role is Role.SERVER else spec.env_worker)
        procs.append(ProcSpec(s.role, s.rank, s.task_id, s.host, spec.command,
                              env_for(contract, role_env, inherit_environ)))
    scheduler = None
    if spec.has_scheduler:
        contract = pc.contract("scheduler", **common)
        scheduler = ProcSpec(Role.SCHEDULER, 0, None, None, spec.command, env_for(contract, {}, scheduler_inherits))
    return Plan(spec=spec, root_uri=root_uri, root_port=root_port, job_id=job_id, scheduler=scheduler,
                procs=tuple(procs), overridden=tuple(sorted(overridden)))
