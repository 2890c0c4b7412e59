"""The backend interface: how servers and workers get started somewhere.

A backend is one module under ``launcher/backends/`` with one :class:`Backend` subclass and
one line in the registry (``launcher/backends/__init__.py``). Everything other modules need to
know about a backend, they ask its class: its capabilities (class attributes), its own
options (:attr:`Backend.options`, turned into CLI options and YAML keys), how to check a spec
(:meth:`Backend.check_spec`), where its processes run (:meth:`Backend.where`,
:meth:`Backend.all_here`) and what a dry run shows (:meth:`Backend.dry_run`). No other module
compares backend names.

The supervisor drives a backend in this order::

    with backend:                        # __enter__/close(): sessions, connections
        backend.check()                  # dependencies present (one-line error otherwise)
        addresses = backend.prepare()    # connect, sync, each host's DMLC_NODE_HOST if known
        ...                              # the supervisor starts the scheduler here
        group = backend.start(procs)     # servers and workers; a ProcGroup of handles
        ...                              # poll the handles, signal the group
        backend.replace(proc)            # maybe: a lost worker's replacement (--restart-scope process)

The CLI imports every backend to build its options: an optional dependency (paramiko,
drmaa, skein) is imported inside the methods that need it. Pure builders of commands and
job templates live in the backend's module, for golden tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional, Sequence

import pscontract as pc

from ..errors import ConfigError
from ..node.watchdog import Client as Watchdog
from ..runtime.handle import ProcGroup
from ..runtime.output import Console
from ..spec import network
from ..spec.job import Host, JobSpec
from ..spec.plan import Plan, ProcSpec


@dataclass(frozen=True)
class BackendOption:
    """One option of a backend, as the CLI and the YAML config know it.

    Attributes:
        flags: the option's names (``("--ssh-user",)``); the first, without dashes, is its
            YAML key and parameter name (``ssh_user``).
        field: the field of the backend's :attr:`Backend.Options` it fills.
        help: the ``--help`` text (the CLI prefixes the backend's name).
        kind: ``str``, ``int``, ``float``, ``flag`` or ``multiple`` (a repeatable string).
        default: the value when the option is not given.
    """

    flags: tuple[str, ...]
    field: str
    help: str
    kind: str = "str"
    default: Any = None
    metavar: Optional[str] = None
    show_default: bool = False

    @property
    def param(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class NoOptions:
    """The options of a backend that has none."""


class Backend:
    """Base class of every backend.

    Class attributes:
        name: the ``--launcher`` value.
        remote: processes run under a node program or on other machines: labels carry
            ``@ host``, and the launcher's environment is not inherited wholesale (only the
            forwarded variables and ``--env`` reach them).
        uses_hostfile: ``-H/--hostfile`` places the processes.
        requires_hostfile: and without one there is nothing to run on.
        supports_sync: ``--sync-dst-dir`` copies the working directory to the hosts.
        needs_scheduler_address: the nodes are unknown before the job runs (a batch system
            places them), so ``DMLC_INTERFACE`` or ``--host-ip`` must say which address of
            this host they can reach.
        node_address_from_launcher: ``DMLC_NODE_HOST`` is decided by the launcher for every
            process of a host alike (this machine's address; each ssh host's address), not on
            the node from the process's own variables: a per-role ``DMLC_INTERFACE``
            (``--env-worker``) cannot change it, and :meth:`notes` says so.
        can_replace: it can start one process into a running job (:meth:`replace`), so
            ``--restart-scope process`` can replace a lost worker in place.
        elsewhere: where a batch system runs the processes when that is never this machine
            (``the Slurm nodes``): a service address on loopback is refused at once.
        Options: the frozen record of the backend's own options (validated in its
            ``__post_init__``); ``JobSpec.options`` holds one.
        options: the CLI options that fill :attr:`Options`.
    """

    name: ClassVar[str] = ""
    remote: ClassVar[bool] = False
    uses_hostfile: ClassVar[bool] = False
    requires_hostfile: ClassVar[bool] = False
    supports_sync: ClassVar[bool] = False
    needs_scheduler_address: ClassVar[bool] = False
    node_address_from_launcher: ClassVar[bool] = False
    can_replace: ClassVar[bool] = False
    elsewhere: ClassVar[str] = ""
    Options: ClassVar[type] = NoOptions
    options: ClassVar[tuple[BackendOption, ...]] = ()

    def __init__(self, spec: JobSpec, console: Console, watchdog: Optional[Watchdog]) -> None:
        self.spec = spec
        self.console = console
        self.watchdog = watchdog

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what the rest of the launcher asks of the class ------------------------------------

    @classmethod
    def make_options(cls, values: Mapping[str, Any]) -> Any:
        """The backend's :attr:`Options` from parsed CLI/YAML values (keyed by :attr:`BackendOption.param`)."""
        given = {o.field: values[o.param] for o in cls.options if values.get(o.param) is not None}
        return cls.Options(**given)

    @classmethod
    def default_options(cls) -> Any:
        return cls.Options()

    @classmethod
    def check_spec(cls, spec: JobSpec) -> None:
        """Refuse (``ConfigError``) what this backend cannot run: the hostfile rules by default."""
        if spec.hosts and not cls.uses_hostfile:
            raise ConfigError(f"--launcher {cls.name} does not use a hostfile; drop -H {spec.hostfile or ''} "
                              "or choose a backend that does (--launcher ssh or mpi)")
        if cls.requires_hostfile and not spec.hosts:
            raise ConfigError(f"--launcher {cls.name} needs hosts: give -H/--hostfile FILE with one host per line")
        if spec.replaces_workers and not cls.can_replace:
            raise ConfigError(f"--launcher {cls.name} cannot start one process into a running job, so it cannot "
                              "replace a lost worker in place: drop --restart-scope process (lost workers then "
                              "restart the whole job), or use --launcher local, ssh, slurm or ray")
        if spec.sync_dst_dir and not cls.supports_sync:
            raise ConfigError(f"--sync-dst-dir copies the working directory to remote hosts over ssh; "
                              f"--launcher {cls.name} has none (drop --sync-dst-dir)")

    @classmethod
    def notes(cls, spec: JobSpec) -> list[str]:
        """Warnings about options this backend accepts but cannot honour (shown before the job
        starts and in the dry run)."""
        out = []
        if cls.node_address_from_launcher:
            for option, pairs in (("--env-server", spec.env_server), ("--env-worker", spec.env_worker)):
                value = dict(pairs).get(pc.INTERFACE)
                if value is not None:
                    where = ("this machine's" if cls.all_here(spec) else "each host's")
                    out.append(f"{option} {pc.INTERFACE}={value} is ignored on --launcher {cls.name}: "
                               f"{where} address is chosen once for every role (from {pc.INTERFACE} in --env "
                               "or this shell, else the default); the processes still see the variable")
        return out

    @classmethod
    def all_here(cls, spec: JobSpec) -> bool:
        """True when every process of ``spec`` runs on this machine (they bind the scheduler's address)."""
        return not cls.remote

    @classmethod
    def where(cls, spec: JobSpec, plan: Plan) -> str:
        """Where the processes run, for the start-up line: ``this machine``, ``3 hosts``, ..."""
        hosts = {p.host.name for p in plan.procs if p.host is not None}
        if hosts:
            return f"{len(hosts)} host{'s' if len(hosts) != 1 else ''}"
        return "this machine" if cls.all_here(spec) else "the cluster's hosts"

    @classmethod
    def machines(cls, spec: JobSpec) -> Optional[Sequence[str]]:
        """The names or addresses of the machines the processes run on, as far as the launcher knows
        before the start: none when they all run here, the hostfile's hosts, else None (a batch
        system decides; :attr:`elsewhere` says whether that is on other machines)."""
        if cls.all_here(spec):
            return ()
        if cls.uses_hostfile and spec.hosts:
            return [h.name for h in spec.hosts]
        return None

    @classmethod
    def dry_run_addresses(cls, spec: JobSpec, interface: str) -> Mapping[Host, str]:
        """``DMLC_NODE_HOST`` per host as a dry run shows it (placeholders where only the host can tell)."""
        return {h: (f"<{h.name} on {interface}>" if interface else h.name) for h in spec.hosts}

    @classmethod
    def dry_run_sockets(cls, spec: JobSpec) -> list[str]:
        """A torch job's ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` as a dry run shows them, with
        where each comes from (:func:`launcher.spec.network.socket_lines`; each node finds its own)."""
        return network.socket_lines(spec, None, cls.all_here(spec))

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        """Extra lines for ``--dry-run`` (commands, job templates); pure, no dependencies needed."""
        return []

    @classmethod
    def doctor(cls, environ: Mapping[str, str], *, queue: Optional[str] = None,
               options: Any = None, job: Optional[Mapping[str, Any]] = None) -> Optional[list[tuple[str, bool, str]]]:
        """``pslaunch doctor --launcher NAME``: what this host lacks for the backend, as
        ``(check, passed, detail)`` rows; ``None`` when the backend has no checks of its own
        (the hostfile backends are checked host by host: ``pslaunch doctor -H``). ``job``: the
        values of the job's own command line (``num_workers``, ``worker_cores``, ...), for a
        backend that can hold them against the cluster's free resources (ray)."""
        return None

    # -- the lifecycle -------------------------------------------------------------------------

    def check(self) -> None:
        """Fail fast (``BackendUnavailableError``) when a dependency is missing; no side effects."""

    def prepare(self) -> Mapping[Host, str]:
        """Get ready to start: connect, sync, and work out the ``DMLC_NODE_HOST`` of the hosts
        whose address only the connection tells (ssh). Other addresses are worked out on the
        nodes, or are the scheduler's (everything on this machine)."""
        return {}

    def start(self, procs: Sequence[ProcSpec]) -> ProcGroup:
        """Start the servers and workers (servers first); a :class:`ProcGroup` of one handle each,
        in the order of ``procs``.

        On an exception (a Ctrl-C while tasks wait in a queue, ``--start-timeout``) the
        supervisor stops what :meth:`started` returns with the rest of the job; a backend must
        clean up whatever else it half-started itself.
        """
        raise NotImplementedError

    def replace(self, proc: ProcSpec) -> ProcGroup:
        """Start ``proc`` while the job runs: the replacement of a lost worker
        (``--restart-scope process``), where that one ran. The default: :meth:`start` again."""
        return self.start([proc])

    def started(self) -> ProcGroup:
        """What :meth:`start` had started when it raised, for the supervisor's staged stop
        (SIGTERM, ``--kill-grace``, SIGKILL). The default: nothing, the backend stopped it."""
        return ProcGroup()

    def helper_pids(self) -> set[int]:
        """The launcher's own helper processes of this backend (skein's driver, salloc): not the
        job's, so the sweep of processes that left their groups leaves them to :meth:`close`."""
        return set()

    def close(self) -> None:
        """Release sessions and connections. Idempotent."""
