"""The mpi backend: one ``mpirun`` starts every server and worker through a rank wrapper.

The scheduler runs on the launching host, as on every backend. The S + N
servers and workers are the ranks of a single ``mpirun`` (Open MPI or
MPICH/Hydra, told apart by ``mpirun --version``). Each rank runs
:mod:`launcher.mpirank`, which finds its MPI rank in the table built here
(:func:`rank_table`), takes that rank's role, task id and environment, and
runs the user command; the command need not be an MPI program.

Placement is the plan's: :func:`rank_layout` groups the plan's processes by
host, and the ranks go to those hosts in that order (Open MPI: a hostfile with
one line per rank and ``--map-by seq``; MPICH: ``-hosts A:2,B:1``). Without
``-H`` every rank runs on this machine.

Environment: the variables every rank shares travel by *name*
(``-x NAME`` / ``-genvlist``), their values in mpirun's own environment, so
no secret appears on a command line; the rest (role, task id, per-role
``--env-*``) is inside the table, itself one environment variable.

Status: each wrapper sends its child's output and its own start and exit
records over its own TCP connection back to this host (:class:`RankChannels`,
authenticated with the job secret; see :mod:`launcher.mpirank`), or, if it
cannot connect, through mpirun's output. This module turns both into one
:class:`MPIRank` handle per server and worker, so the supervisor sees
per-rank output, pids and exit codes, and names the first rank that failed,
as on every other backend. (mpirun's own output is no channel for records:
Open MPI forwards each rank's output in chunks of its own size, and chunks of
different ranks interleave in the middle of lines.)
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import ipaddress
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from .. import envvars, mpirank, netif
from ..errors import BackendUnavailableError, ConfigError, LaunchError
from ..output import Console, PipePump, ProcOutput
from ..plan import Plan, ProcSpec
from ..process import ProcessHandle, Watchdog, group_members, normalize_exitcode, spawn_guard
from ..spec import Host, JobSpec
from .base import Backend

log = logging.getLogger(__name__)

#: The rank wrapper mpirun runs on every node (same path everywhere, as for any MPI program).
WRAPPER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mpirank.py")
# The table is one environment value; stay well under Linux's 128 KiB per string.
MAX_TABLE_CHARS = 100_000
VERSION_TIMEOUT = 15.0
# After mpirun exited, how long to wait for the rest of its output (the last records).
OUTPUT_DRAIN_WAIT = 5.0
# After every rank exited 0, how long mpirun may take to exit before it is stopped.
MPIRUN_EXIT_WAIT = 30.0
# A longer run of mpirun's output without a newline cannot be a record; it is shown as is.
MAX_UNTERMINATED = 64 * 1024
# Rank connections that have not proven the job secret: how many may wait, and how long.
CHANNEL_PENDING_MAX = 64
CHANNEL_HANDSHAKE_WAIT = 15.0
# Open MPI's hostfile is written at start; argv builders and dry runs use this name for it.
_HOSTFILE_PLACEHOLDER = "<tmpdir>/hostfile"


class MPIImpl(str, enum.Enum):
    """The two mpirun families, which differ in every option we use."""

    OPENMPI = "openmpi"
    MPICH = "mpich"

    @property
    def title(self) -> str:
        return "Open MPI" if self is MPIImpl.OPENMPI else "MPICH"


@dataclass(frozen=True)
class MPIInfo:
    """An mpirun found on this machine: its path, family and ``--version`` line."""

    path: str
    impl: MPIImpl
    version: str


# --- implementation detection ----------------------------------------------------------


def detect_implementation(output: str, mpirun: str = "mpirun") -> MPIImpl:
    """Open MPI or MPICH/Hydra from what ``mpirun --version`` printed.

    Raises:
        BackendUnavailableError: anything else, in one line naming what it printed.
    """
    low = output.lower()
    if "open mpi" in low or "openrte" in low or "open-mpi.org" in low:
        return MPIImpl.OPENMPI
    if "hydra" in low or "mpich" in low or "intel(r) mpi" in low:
        return MPIImpl.MPICH
    first = next((line.strip() for line in output.splitlines() if line.strip()), "")
    raise BackendUnavailableError(
        f"{mpirun} is neither Open MPI nor MPICH: '{mpirun} --version' printed "
        f"{first[:120]!r}; give --mpirun PATH of an Open MPI or MPICH mpirun")


def probe_mpirun(mpirun: str) -> MPIInfo:
    """Find ``mpirun`` (a name on PATH or a path) and tell its family.

    Raises:
        BackendUnavailableError: not found, not runnable, or not Open MPI/MPICH.
    """
    path = shutil.which(mpirun)
    if path is None:
        if "/" in mpirun and os.path.exists(mpirun):
            what = "a directory" if os.path.isdir(mpirun) else "not executable"
            raise BackendUnavailableError(f"--launcher mpi: --mpirun {mpirun} is {what}; give the path of an "
                                          "Open MPI or MPICH mpirun")
        where = "no such file" if "/" in mpirun else "not found on PATH"
        raise BackendUnavailableError(
            f"--launcher mpi: {mpirun}: {where}; install Open MPI or MPICH "
            "(apt-get install openmpi-bin, or mpich) or give --mpirun PATH")
    try:
        r = subprocess.run([path, "--version"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=VERSION_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise BackendUnavailableError(f"'{path} --version' did not answer within {VERSION_TIMEOUT:g}s") from None
    except OSError as e:
        raise BackendUnavailableError(f"cannot run {path}: {e.strerror or e}") from None
    text = r.stdout.decode("utf-8", "replace")
    impl = detect_implementation(text, path)
    version = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if impl is MPIImpl.MPICH:  # Hydra's first line is a heading; its version is on a later one
        version = next((" ".join(line.split()) for line in text.splitlines()
                        if line.strip().lower().startswith("version:")), version)
    return MPIInfo(path, impl, version)


# --- placement and the rank table (pure) ----------------------------------------------------


@dataclass(frozen=True)
class RankLayout:
    """MPI rank order and hosts for a plan's servers and workers.

    ``order[r]`` is the index into the plan's processes of MPI rank ``r``;
    ``hosts`` lists ``(host, number of ranks)`` in rank order (consecutive
    ranks share a host), empty when everything runs on this machine.
    """

    order: tuple[int, ...]
    hosts: tuple[tuple[str, int], ...]

    @property
    def rank_hosts(self) -> list[str]:
        """The host of each MPI rank, in rank order."""
        return [name for name, count in self.hosts for _ in range(count)]


def rank_layout(procs: Sequence[ProcSpec]) -> RankLayout:
    """Group the plan's processes by host, hosts in order of first appearance.

    The plan's placement (servers first, round-robin) decides which host each
    process is on; grouping only numbers the MPI ranks so that each host gets
    one block, which both Open MPI and MPICH can express.

    >>> from launcher.spec import Host, Role
    >>> A, B = Host("A"), Host("B")
    >>> ps = [ProcSpec(Role.SERVER, 0, 2, A, ()), ProcSpec(Role.WORKER, 0, 0, B, ()),
    ...       ProcSpec(Role.WORKER, 1, 1, A, ())]
    >>> rank_layout(ps)
    RankLayout(order=(0, 2, 1), hosts=(('A', 2), ('B', 1)))
    """
    groups: dict[Optional[str], list[int]] = {}
    for i, p in enumerate(procs):
        groups.setdefault(p.host.name if p.host is not None else None, []).append(i)
    order = tuple(i for members in groups.values() for i in members)
    hosts = tuple((name, len(members)) for name, members in groups.items() if name is not None)
    return RankLayout(order=order, hosts=hosts)


def rank_table(procs: Sequence[ProcSpec], layout: RankLayout, grace: float,
               extra_common: Mapping[str, str] = {},
               output: Optional[tuple[str, int]] = None) -> tuple[dict[str, str], dict[str, Any]]:
    """Split the plan's environments into what all ranks share and the rank table.

    Returns:
        ``(common, table)``: ``common`` holds the variables whose value is the
        same for every rank (passed by name on mpirun's command line, values in
        its environment); ``table`` has per role the variables shared by that
        role's ranks (``roles``) and per MPI rank ``[role, rank, own variables]``
        (``ranks``), the shared values mpirun may rewrite (``pinned``), the
        kill grace the wrappers give the commands, and the launcher's address
        for the ranks' output connections (``output``, when there is one).
    """
    ordered = [procs[i] for i in layout.order]
    envs = [dict(p.env) for p in ordered]
    common = {k: v for k, v in envs[0].items() if all(e.get(k) == v for e in envs[1:])} if envs else {}
    common.update(extra_common)
    roles: dict[str, dict[str, str]] = {}
    for role in dict.fromkeys(str(p.role) for p in ordered):
        members = [e for p, e in zip(ordered, envs) if str(p.role) == role]
        roles[role] = {k: v for k, v in members[0].items()
                       if k not in common and all(m.get(k) == v for m in members[1:])}
    ranks = []
    for p, env in zip(ordered, envs):
        shared = roles[str(p.role)]
        ranks.append([str(p.role), p.rank, {k: v for k, v in env.items() if k not in common and k not in shared}])
    # mpirun may rewrite some shared values on the way (Open MPI prepends its prefix to
    # LD_LIBRARY_PATH): the wrappers restore the job's own values for the command.
    pinned = {k: common[k] for k in envvars.MPI_REWRITTEN if k in common}
    table: dict[str, Any] = {"grace": grace, "roles": roles, "ranks": ranks, "pinned": pinned}
    if output is not None:
        table["output"] = [output[0], output[1]]
    return common, table


def mpi_interface(impl: MPIImpl, spec: str, ifaces: Sequence[netif.Iface]) -> Optional[str]:
    """``DMLC_INTERFACE`` translated for mpirun's own traffic (None when unset).

    Open MPI's ``btl_tcp_if_include``/``oob_tcp_if_include`` take a name or a
    CIDR: a CIDR or an exact name passes as is; a ps-lite name prefix
    (``eth``), which Open MPI cannot express, becomes the CIDR of the network
    of the interface it selects here, so hosts whose names differ still match.
    MPICH's ``-iface`` takes one exact name: the name of the interface that the
    value selects on this host (mpiexec listens there), so with MPICH every
    host must use that name.

    Raises:
        ConfigError: the value selects no interface here where a name is needed.
    """
    spec = spec.strip()
    if not spec:
        return None
    if impl is MPIImpl.OPENMPI and netif.is_cidr(spec):
        try:
            ipaddress.IPv4Network(spec, strict=False)
        except ValueError:
            raise ConfigError(f"DMLC_INTERFACE={spec!r} is not a valid IPv4 CIDR such as 10.1.0.0/16") from None
        return spec
    if impl is MPIImpl.OPENMPI and any(i.name == spec for i in ifaces):
        return spec
    try:
        chosen = netif.match(spec, ifaces)
    except netif.NetifError as e:
        raise ConfigError(f"--launcher mpi: {e}") from None
    if impl is MPIImpl.OPENMPI:
        return str(chosen.network)
    return chosen.name


def mpich_default_interface(root_uri: str, ifaces: Sequence[netif.Iface]) -> Optional[str]:
    """MPICH with hosts and no ``DMLC_INTERFACE``: the interface that holds the scheduler's address."""
    for i in ifaces:
        if i.address == root_uri and not i.address.startswith("127."):
            return i.name
    return None


def openmpi_hostfile(layout: RankLayout, local_names: frozenset[str] = frozenset(),
                     local_hostname: str = "") -> str:
    """Open MPI's hostfile for ``--map-by seq``: one line per MPI rank, its host.

    Names that mean this machine (``localhost``, its addresses) are written as
    ``local_hostname``: Open MPI files this machine under its hostname and the
    sequential mapper compares names literally.
    """
    lines = [local_hostname if local_hostname and name in local_names else name for name in layout.rank_hosts]
    return "".join(f"{line}\n" for line in lines)


def build_mpirun_argv(
    impl: MPIImpl,
    mpirun: str,
    *,
    nprocs: int,
    layout: RankLayout,
    env_names: Sequence[str],
    command: Sequence[str],
    python: str,
    wrapper: str = WRAPPER,
    hostfile: Optional[str] = None,
    interface: Optional[str] = None,
    is_root: bool = False,
    cores: int = 1,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The mpirun command line for one job; pure, golden-tested for both families.

    Args:
        nprocs: servers plus workers (the scheduler runs outside mpirun).
        layout: from :func:`rank_layout`; no hosts = all ranks on this machine.
        env_names: variables every rank gets from mpirun's environment, by name.
        hostfile: Open MPI with hosts: the file :func:`openmpi_hostfile` wrote.
        interface: :func:`mpi_interface`'s translation of ``DMLC_INTERFACE``.
        is_root: Open MPI refuses to run as root without ``--allow-run-as-root``.
        cores: this machine's cores; Open MPI needs ``--oversubscribe`` for more
            ranks than cores on one machine.
    """
    argv = [mpirun]
    names = sorted(dict.fromkeys(env_names))
    if impl is MPIImpl.OPENMPI:
        if is_root:
            argv.append("--allow-run-as-root")
        argv += ["-n", str(nprocs)]
        if layout.hosts:
            if hostfile is None:
                raise ValueError("Open MPI with hosts needs the hostfile")
            argv += ["--hostfile", hostfile, "--map-by", "seq"]
        elif nprocs > cores:
            argv.append("--oversubscribe")
        # The ranks are wrappers around arbitrary programs: do not pin them to cores.
        argv += ["--bind-to", "none"]
        if interface:
            argv += ["--mca", "btl_tcp_if_include", interface, "--mca", "oob_tcp_if_include", interface]
        for name in names:
            argv += ["-x", name]
    else:
        argv += ["-n", str(nprocs)]
        if layout.hosts:
            argv += ["-hosts", ",".join(f"{name}:{count}" for name, count in layout.hosts)]
        if interface:
            argv += ["-iface", interface]
        if names:
            argv += ["-genvlist", ",".join(names)]
    argv += list(extra_args)
    argv += [python, wrapper, "--", *command]
    return argv


def mpirun_command(spec: JobSpec, info: MPIInfo, procs: Sequence[ProcSpec], layout: RankLayout,
                   *, resolve: bool = True, output: Optional[tuple[str, int]] = None,
                   ) -> tuple[list[str], dict[str, str], Optional[str]]:
    """mpirun's argv, its environment and Open MPI's hostfile text (None without hosts).

    The argv names :data:`_HOSTFILE_PLACEHOLDER` where the hostfile's path goes.
    ``resolve=False`` (dry runs) looks no host name up. ``output`` is where
    :class:`RankChannels` listens for the ranks' records.
    """
    extra: dict[str, str] = {}
    source = spec.environ_dict().get(envvars.MPI_RANK_SOURCE)
    if source:
        extra[envvars.MPI_RANK_SOURCE] = source
    common, table = rank_table(procs, layout, spec.kill_grace, extra, output)
    encoded = mpirank.encode_table(table)
    if len(encoded) > MAX_TABLE_CHARS:
        raise LaunchError(f"the rank table for {len(procs)} ranks is {len(encoded)} characters, more than "
                          "one environment variable may hold; use fewer --env-server/--env-worker values")
    ifaces = netif.interfaces()
    iface = mpi_interface(info.impl, procs[0].env.get(envvars.INTERFACE, ""), ifaces)
    if iface is None and info.impl is MPIImpl.MPICH and layout.hosts:
        # Without DMLC_INTERFACE, Hydra's proxies call mpiexec back at this host's *name*;
        # the scheduler's address is one the hosts reach, so mpiexec listens there.
        iface = mpich_default_interface(procs[0].env.get(envvars.ROOT_URI, ""), ifaces)
    hostfile_text = None
    if info.impl is MPIImpl.OPENMPI and layout.hosts:
        hostfile_text = openmpi_hostfile(layout, local_names(spec.hosts, resolve), socket.gethostname())
    argv = build_mpirun_argv(
        info.impl, info.path, nprocs=len(procs), layout=layout,
        env_names=[*common, envvars.MPI_TABLE], command=spec.command, python=sys.executable,
        hostfile=_HOSTFILE_PLACEHOLDER if hostfile_text is not None else None, interface=iface,
        is_root=os.geteuid() == 0, cores=physical_cores(), extra_args=spec.mpi.extra_args)
    env = {k: v for k, v in spec.environ_dict().items()
           if k not in envvars.CONTRACT and k != envvars.MPI_ENV_END}
    env.update(common)
    env[envvars.MPI_TABLE] = encoded
    # Hydra (MPICH 4.0) loses the last variable of mpiexec's environment on its way to
    # remote ranks: end with one that nobody needs (subprocess keeps the dict's order).
    env[envvars.MPI_ENV_END] = "1"
    return argv, env, hostfile_text


# --- facts about this machine ---------------------------------------------------------------


def physical_cores() -> int:
    """Cores this process may use, counted as Open MPI counts them (not hyperthreads)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
    seen = set()
    for cpu in cpus:
        base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{base}/physical_package_id") as f:
                package = f.read().strip()
            with open(f"{base}/core_id") as f:
                core = f.read().strip()
            seen.add((package, core))
        except OSError:
            seen.add(("cpu", str(cpu)))
    return max(1, len(seen))


def local_names(hosts: Sequence[Host], resolve: bool = True) -> frozenset[str]:
    """The hostfile names that mean this machine (for Open MPI's hostfile)."""
    names = {"localhost", "localhost.localdomain", socket.gethostname()}
    try:
        addresses = {i.address for i in netif.interfaces()}
    except netif.NetifError:
        addresses = set()
    for h in hosts:
        if h.name in names or h.name.startswith("127.") or h.name in addresses:
            names.add(h.name)
        elif resolve:
            try:
                if netif.resolve_ipv4(h.name) in addresses or netif.resolve_ipv4(h.name).startswith("127."):
                    names.add(h.name)
            except netif.NetifError:
                pass
    return frozenset(names)


def _this_machine() -> tuple[Optional[str], Optional[int]]:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        return boot, os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None, None


def _check_hosts(hosts: Sequence[Host]) -> None:
    for h in hosts:
        where = f"{h.origin}: " if h.origin else ""
        if h.user or h.port:
            raise ConfigError(
                f"{where}{h.display}: --launcher mpi cannot pass a user or port to mpirun per host; "
                f"write just {h.name} and set User/Port for it in ~/.ssh/config")
        if ":" in h.name:
            raise ConfigError(f"{where}{h.name}: --launcher mpi needs an IPv4 address or a host name, not IPv6")


# --- the running job --------------------------------------------------------------------------


class MPIRank(ProcessHandle):
    """One server or worker, a rank of the job's single mpirun.

    Its output, pid and exit code come from its wrapper's records. A rank that
    reported 0 counts as finished once mpirun has exited too, so an all-zero
    job ends when mpirun does; a non-zero report counts at once (fail fast).
    """

    def __init__(self, proc: ProcSpec, output: ProcOutput, job: MPIJob, mpi_rank: int) -> None:
        super().__init__(proc, output, proc.host.name if proc.host is not None else "localhost")
        self.job = job
        self.mpi_rank = mpi_rank
        self.reported: Optional[int] = None
        self.reported_at: Optional[float] = None
        self.node: dict[str, Any] = {}
        self.local_pgid: Optional[int] = None
        self.note = ""
        self.channel = "none"  # its wrapper's connection to us: "none", "open" or "closed"

    def started(self, info: dict[str, Any]) -> None:
        """The wrapper's start record: the command's pid, the node, its address."""
        self.node = info
        pid = info.get("pid")
        self.pid = pid if isinstance(pid, int) else None
        log.debug("%s is MPI rank %d (rank from %s) on %s, pid %s, DMLC_NODE_HOST %s", self.label, self.mpi_rank,
                  info.get("source"), info.get("host"), self.pid, info.get("addr"))
        if self.pid is not None and self.job.is_this_machine(info):
            self.local_pgid = self.pid  # the wrapper started it as a group leader
            if self.job.watchdog is not None:
                self.job.watchdog.watch(self.local_pgid)

    def exited(self, code: int) -> None:
        """The wrapper's exit record: the command's exit code (128+N for signal N)."""
        if self.reported is None:
            self.reported = code
            self.reported_at = time.time()

    def _poll(self) -> Optional[int]:
        return self.job.rank_code(self)

    def poll(self) -> Optional[int]:
        code = super().poll()
        if code is not None and self.reported_at is not None:
            self.end_time = self.reported_at  # when the rank ended, not when we looked
        return code

    def terminate(self) -> None:
        self.job.terminate()

    def kill(self) -> None:
        self.job.kill()

    def dump_stacks(self) -> None:
        self.job.dump_stacks()

    def cleanup(self, groups: Optional[Mapping[int, list[int]]] = None) -> None:
        if self.local_pgid is None:
            return
        if group_members(self.local_pgid, groups):
            try:
                os.killpg(self.local_pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.job.watchdog is not None and self.poll() is not None:
            self.job.watchdog.forget(self.local_pgid)

    def describe(self) -> str:
        where = self.node.get("host") or self.host
        text = f"{self.label} (MPI rank {self.mpi_rank} on {where}" + (f", pid {self.pid}" if self.pid else "")
        return text + (f"; {self.note})" if self.note else ")")


class MPIJob:
    """The one mpirun of a job: its process, its output demultiplexed per rank."""

    def __init__(self, ranks: Sequence[MPIRank], mpirun_out: ProcOutput, watchdog: Optional[Watchdog]) -> None:
        self.ranks = list(ranks)
        self.out = mpirun_out
        self.watchdog = watchdog
        self.popen: Optional[subprocess.Popen] = None
        self.code: Optional[int] = None
        self._lock = threading.Lock()
        self._buffers = {False: b"", True: b""}
        self._signalled: set[str] = set()
        self._machine = _this_machine()
        self._all_done_at: Optional[float] = None
        self._lingered = False
        self._out_closed = threading.Event()
        self._mpirun_closed = {False: False, True: False}
        self._exited_at: Optional[float] = None

    def attach(self, ranks: Sequence[MPIRank]) -> None:
        """The rank handles, in MPI rank order (they need the job first, the job needs them)."""
        self.ranks = list(ranks)

    def is_this_machine(self, info: Mapping[str, Any]) -> bool:
        """A pid the rank reported is one of ours if it shares our kernel and pid namespace."""
        boot, pidns = self._machine
        return boot is not None and info.get("boot") == boot and info.get("pidns") == pidns

    # -- mpirun's output --------------------------------------------------------------

    def feed(self, err: bool, data: bytes) -> None:
        """Bytes from mpirun's stdout (``err`` false) or stderr: records go to their rank."""
        with self._lock:
            data = self._buffers[err] + data
            *lines, rest = data.split(b"\n")
            if len(rest) > MAX_UNTERMINATED:  # not a record (those are short): mpirun's own text
                lines.append(rest)
                rest = b""
            self._buffers[err] = rest
        for line in lines:
            self._line(err, line)

    def close(self, err: bool) -> None:
        """mpirun's stdout or stderr reached its end: flush, and close the ranks' streams
        (those of a rank still connected close when its connection does)."""
        with self._lock:
            rest, self._buffers[err] = self._buffers[err], b""
        if rest:
            self._line(err, rest)
        self._mpirun_closed[err] = True
        for r in self.ranks:
            if r.channel != "open":
                (r.output.stderr if err else r.output.stdout).close()
        (self.out.stderr if err else self.out.stdout).close()
        if not err:
            self._out_closed.set()

    # -- the ranks' own connections (RankChannels; called on the pump's thread) --------

    def channel_opened(self, rank: int) -> None:
        self.ranks[rank].channel = "open"

    def channel_line(self, rank: int, line: bytes) -> None:
        parsed = mpirank.parse_record(line)
        if parsed is None or parsed[0] != rank:
            log.debug("rank %d's connection sent a line that is not one of its records: %r", rank, line[:80])
            return
        self._record(self.ranks[rank], parsed[1], parsed[2])

    def channel_closed(self, rank: int) -> None:
        r = self.ranks[rank]
        r.channel = "closed"
        for err, closed in self._mpirun_closed.items():
            if closed:
                (r.output.stderr if err else r.output.stdout).close()

    def _line(self, err: bool, line: bytes) -> None:
        parsed = mpirank.parse_record(line)
        if parsed is None or not 0 <= parsed[0] < len(self.ranks):
            (self.out.stderr if err else self.out.stdout).feed(line + b"\n")
            return
        rank, kind, payload = parsed
        self._record(self.ranks[rank], kind, payload)

    def _record(self, r: MPIRank, kind: str, payload: bytes) -> None:
        if kind == mpirank.STDOUT_LINE:
            r.output.stdout.feed(payload + b"\n")
        elif kind == mpirank.STDOUT_PART:
            r.output.stdout.feed(payload)
        elif kind == mpirank.STDERR_LINE:
            r.output.stderr.feed(payload + b"\n")
        elif kind == mpirank.STDERR_PART:
            r.output.stderr.feed(payload)
        elif kind == mpirank.START:
            try:
                info = json.loads(payload)
            except ValueError:
                info = {}
            r.started(info if isinstance(info, dict) else {})
        elif kind == mpirank.EXIT:
            try:
                r.exited(int(payload))
            except ValueError:
                r.exited(1)

    # -- status ------------------------------------------------------------------------

    def mpirun_code(self) -> Optional[int]:
        """mpirun's exit code (128+N for signal N) once it has exited."""
        if self.code is None and self.popen is not None:
            code = self.popen.poll()
            if code is not None:
                self.code = normalize_exitcode(code)
        return self.code

    def rank_code(self, r: MPIRank) -> Optional[int]:
        """A rank's exit code once it is known (see :class:`MPIRank`)."""
        if r.reported is not None and r.reported != 0:
            return r.reported
        code = self._finished()
        if code is None:
            if r.reported == 0 and self._mpirun_lingers():
                return 0  # every rank is done; close() stops mpirun
            return None
        if r.reported == 0:
            if code != 0 and r is self._blamed_for(code):
                r.note = f"every rank exited 0 but mpirun exited with code {code}"
                return code
            return 0
        if r.node:
            if code == 0:
                # Both families exit non-zero if any rank did: its exit record was lost on the
                # way, and the command exited 0 (the wrapper exits with the command's code).
                log.debug("%s: no exit record, but mpirun exited 0, so it exited 0", r.label)
                return 0
            r.note = "its wrapper ended without reporting"
            return 128 + signal.SIGKILL
        if not r.note:
            r.note = f"mpirun exited with code {code} before this rank started"
            # what mpirun said is this rank's story: put it in the failure report's tail
            r.output.tail.extend(self.out.lines())
        return code or 1

    def _finished(self) -> Optional[int]:
        """mpirun's exit code once it has exited *and* the ranks' records are read (its
        stdout and every rank connection reached their end).

        mpirun can be seen to exit before the pump has read the last records;
        a rank's exit record must not be taken for missing.
        """
        code = self.mpirun_code()
        if code is None:
            return None
        if not self._out_closed.is_set() or any(r.channel == "open" for r in self.ranks):
            if self._exited_at is None:
                self._exited_at = time.monotonic()
            if time.monotonic() - self._exited_at < OUTPUT_DRAIN_WAIT:
                return None  # (a leftover holding the pipe open delays us this long at most)
        return code

    def _mpirun_lingers(self) -> bool:
        """True once every rank has exited 0 and mpirun has not followed within :data:`MPIRUN_EXIT_WAIT`."""
        if self._all_done_at is None:
            if not all(x.reported == 0 for x in self.ranks):
                return False
            self._all_done_at = time.monotonic()
        if time.monotonic() - self._all_done_at < MPIRUN_EXIT_WAIT:
            return False
        if not self._lingered:
            self._lingered = True
            log.warning("every rank exited 0 but mpirun (pid %d) did not exit within %gs; stopping it",
                        self.popen.pid if self.popen else 0, MPIRUN_EXIT_WAIT)
        return True

    def _blamed_for(self, code: int) -> Optional[MPIRank]:
        if all(r.reported == 0 for r in self.ranks):
            return self.ranks[0]
        return None

    # -- signals -----------------------------------------------------------------------

    def _signal_once(self, what: str, sig: int, group: bool = False) -> None:
        if self.popen is None or what in self._signalled or self.mpirun_code() is not None:
            return
        self._signalled.add(what)
        try:
            if group:
                os.killpg(self.popen.pid, sig)
            else:
                os.kill(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        """SIGTERM to mpirun: both families pass it to every rank, whose wrapper stops its command."""
        self._signal_once("term", signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to mpirun's group and to the commands of the ranks on this machine."""
        self._signal_once("kill", signal.SIGKILL, group=True)
        for r in self.ranks:
            if r.local_pgid is not None:
                try:
                    os.killpg(r.local_pgid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def dump_stacks(self) -> None:
        """SIGUSR1 to mpirun: forwarded to every rank, whose wrapper sends SIGABRT (faulthandler)."""
        self._signal_once("usr1", signal.SIGUSR1)

    def stop(self, timeout: float) -> None:
        """The end of the job: make sure mpirun and its group are gone."""
        if self.popen is None:
            return
        deadline = time.monotonic() + timeout
        while self.mpirun_code() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if group_members(self.popen.pid):
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.mpirun_code() is None:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.watchdog is not None:
            self.watchdog.forget(self.popen.pid)
        log.debug("mpirun (pid %d) exited with code %s", self.popen.pid, self.mpirun_code())


class _Conn:
    """One accepted connection: the handshake, then the records of the rank it proved to be."""

    def __init__(self, owner: RankChannels, sock: socket.socket, peer: str) -> None:
        self.owner = owner
        self.sock = sock
        self.peer = peer
        self.nonce = os.urandom(16)
        self.since = time.monotonic()
        self.rank: Optional[int] = None
        self.rejected = False
        self.buf = b""

    def feed(self, data: bytes) -> None:
        if self.rejected:
            return
        self.buf += data
        if self.rank is None:
            line, newline, rest = self.buf.partition(b"\n")
            if not newline:
                if len(self.buf) > mpirank.CHANNEL_LINE_MAX:
                    self.reject("its greeting is too long")
                return
            self.buf = b""
            if not self._handshake(line):
                return
            self.buf = rest
        *lines, self.buf = self.buf.split(b"\n")
        if len(self.buf) > MAX_UNTERMINATED:
            lines.append(self.buf)
            self.buf = b""
        for line in lines:
            self.owner.job.channel_line(self.rank, line)  # type: ignore[arg-type]

    def _handshake(self, line: bytes) -> bool:
        owner = self.owner
        try:
            rank_text, client_hex, mac = line.decode("ascii").split(" ")
            rank, client_nonce = int(rank_text), bytes.fromhex(client_hex)
        except ValueError:
            self.reject("it does not speak the rank wrapper's protocol")
            return False
        expected = mpirank.channel_mac(owner.secret, "client", self.nonce, client_nonce, rank)
        if not hmac.compare_digest(mac, expected):
            self.reject("it does not hold the job's secret")
            return False
        with owner.lock:
            if not 0 <= rank < len(owner.job.ranks) or rank in owner.claimed:
                taken = True
            else:
                taken = False
                owner.claimed.add(rank)
                owner.pending.discard(self)
        if taken:
            self.reject(f"MPI rank {rank} is not in the job or already connected")
            return False
        try:
            proof = mpirank.channel_mac(owner.secret, "server", self.nonce, client_nonce, rank)
            self.sock.send(f"ok {proof}\n".encode())  # a few bytes into an empty buffer
        except OSError:
            pass  # the wrapper sees the connection fail and falls back to mpirun's output
        self.rank = rank
        owner.job.channel_opened(rank)
        return True

    def reject(self, why: str) -> None:
        if not self.rejected:
            self.rejected = True
            self.owner.rejected(self.peer, why)
        with self.owner.lock:
            self.owner.pending.discard(self)  # no longer waited for (the sweep skips it)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the pump reads EOF and lets go of it
        except OSError:
            pass

    def closed(self) -> None:
        """The pump read EOF (and closed its copy of the descriptor)."""
        self.sock.close()
        with self.owner.lock:
            self.owner.pending.discard(self)
        if self.rank is not None:
            if self.buf:
                self.owner.job.channel_line(self.rank, self.buf)
                self.buf = b""
            self.owner.job.channel_closed(self.rank)


class RankChannels:
    """Where the rank wrappers send their records: one TCP connection per rank, to this host.

    A connection serves only after its wrapper proved it holds the job secret
    for a rank of this job that has no connection yet (and this side proved it
    back; see :class:`launcher.mpirank.Channel`). Reading is the job's pump's
    work, so records and mpirun's output are handled on one thread.
    """

    def __init__(self, job: MPIJob, pump: PipePump, secret: str, address: str,
                 ports: Sequence[int] = ()) -> None:
        self.job = job
        self.pump = pump
        self.secret = secret
        self.lock = threading.Lock()
        self.claimed: set[int] = set()
        self.pending: set[_Conn] = set()
        self._warned = False
        self.sock = _bind_first(address, ports)
        self.address = (address, self.sock.getsockname()[1])
        self.sock.listen(128)
        self.sock.settimeout(0.25)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="pslaunch-mpi-output", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            self._sweep()
            try:
                sock, peer = self.sock.accept()
            except OSError:
                continue
            conn = _Conn(self, sock, f"{peer[0]}:{peer[1]}")
            with self.lock:
                full = len(self.pending) >= CHANNEL_PENDING_MAX
                if not full:
                    self.pending.add(conn)
            if full:
                sock.close()
                continue
            try:
                sock.settimeout(5.0)
                sock.sendall(mpirank.CHANNEL_HELLO + conn.nonce.hex().encode() + b"\n")
                fd = os.dup(sock.fileno())
            except OSError:
                with self.lock:
                    self.pending.discard(conn)
                sock.close()
                continue
            self.pump.add(fd, conn.feed, conn.closed)

    def _sweep(self) -> None:
        """Connections that have not proven the secret in time are dropped."""
        now = time.monotonic()
        with self.lock:
            stale = [c for c in self.pending if now - c.since > CHANNEL_HANDSHAKE_WAIT]
        for c in stale:
            c.reject("it did not finish the handshake in time")

    def rejected(self, peer: str, why: str) -> None:
        (log.debug if self._warned else log.warning)(
            "refused a connection to the ranks' output port from %s: %s", peer, why)
        self._warned = True

    def stop(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() at once (Linux)
        except OSError:
            pass
        self._thread.join(2.0)
        self.sock.close()


def _bind_first(address: str, ports: Sequence[int]) -> socket.socket:
    """A TCP socket bound to ``address`` on the first free of ``ports``, else any port."""
    for port in [*ports, 0]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((address, port))
            return sock
        except OSError:
            sock.close()
            if port == 0:
                raise
    raise AssertionError("unreachable")


class MPIBackend(Backend):
    """``--launcher mpi``: servers and workers as the ranks of one mpirun."""

    name = "mpi"
    remote = True  # ranks get the job's variables, not the launcher's whole environment

    def __init__(self, spec: JobSpec, console: Console, watchdog: Optional[Watchdog]) -> None:
        super().__init__(spec, console, watchdog)
        self.info: Optional[MPIInfo] = None
        self.job: Optional[MPIJob] = None
        self.pump: Optional[PipePump] = None
        self.channels: Optional[RankChannels] = None
        self.tmpdir: Optional[str] = None

    def check(self) -> None:
        _check_hosts(self.spec.hosts)
        if self.spec.sync_dst_dir:
            log.warning("--sync-dst-dir is ignored by --launcher mpi (as by dmlc's): mpirun runs the command "
                        "at the same path on every host; copy it there first, or use --launcher ssh")
        self.info = probe_mpirun(self.spec.mpi.mpirun)
        log.debug("mpirun: %s (%s) at %s", self.info.impl.title, self.info.version, self.info.path)
        # a DMLC_INTERFACE that mpirun cannot be told about fails before anything starts
        iface = dict(self.spec.env).get(envvars.INTERFACE) or self.spec.environ_dict().get(envvars.INTERFACE, "")
        mpi_interface(self.info.impl, iface, netif.interfaces())

    def prepare(self) -> Mapping[Optional[Host], Optional[str]]:
        # Each rank's wrapper works out its node's address (DMLC_NODE_HOST) on the node.
        if self.spec.hosts:
            return {h: None for h in self.spec.hosts}
        return {None: None}

    def start(self, procs: Sequence[ProcSpec]) -> list[ProcessHandle]:
        if self.info is None:
            self.check()
        assert self.info is not None
        spec = self.spec
        layout = rank_layout(procs)
        job = MPIJob([], self.console.proc("mpirun", "mpirun", "mpirun"), self.watchdog)
        if self.pump is None:
            self.pump = PipePump()
        self.channels = self._listen(job, procs, layout)
        argv, env, hostfile_text = mpirun_command(spec, self.info, procs, layout,
                                                  output=self.channels.address if self.channels else None)
        if hostfile_text is not None:
            self.tmpdir = tempfile.mkdtemp(prefix="pslaunch-mpi-")
            path = os.path.join(self.tmpdir, "hostfile")
            with open(path, "w", encoding="utf-8") as f:
                f.write(hostfile_text)
            argv = [path if a == _HOSTFILE_PLACEHOLDER else a for a in argv]
        log.debug("mpirun command: %s", shlex.join(argv))
        ranks = [MPIRank(procs[i], self.console.proc(procs[i].name, procs[i].label, str(procs[i].role)), job, r)
                 for r, i in enumerate(layout.order)]
        job.attach(ranks)
        self.job = job
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            with spawn_guard():
                job.popen = subprocess.Popen(argv, env=env, cwd=spec.workdir, stdin=subprocess.DEVNULL,
                                             stdout=out_w, stderr=err_w, start_new_session=True, close_fds=True)
                if self.watchdog is not None:
                    self.watchdog.watch(job.popen.pid)
        except OSError as e:
            for fd in (out_r, err_r):
                os.close(fd)
            raise LaunchError(f"cannot run {argv[0]}: {e.strerror or e}") from None
        finally:
            os.close(out_w)
            os.close(err_w)
        self.pump.add(out_r, lambda data: job.feed(False, data), lambda: job.close(False))
        self.pump.add(err_r, lambda data: job.feed(True, data), lambda: job.close(True))
        log.info("mpirun (%s, pid %d) starts %d ranks%s", self.info.impl.title, job.popen.pid, len(ranks),
                 f" on {len(layout.hosts)} host{'s' if len(layout.hosts) != 1 else ''}" if layout.hosts else "")
        by_proc = {i: ranks[r] for r, i in enumerate(layout.order)}
        return [by_proc[i] for i in range(len(procs))]

    def _listen(self, job: MPIJob, procs: Sequence[ProcSpec], layout: RankLayout) -> Optional[RankChannels]:
        """The port the ranks send their records to: on the scheduler's address (which every
        host reaches; loopback when all ranks run here), in ``--port-range`` if one is free."""
        env = procs[0].env
        secret = env.get(envvars.SECRET, "")
        root = env.get(envvars.ROOT_URI, "")
        if not secret or (layout.hosts and not root):
            return None
        lo, hi = self.spec.port_range
        root_port = int(env.get(envvars.ROOT_PORT, lo) or lo)
        ports = [*range(root_port + 1, hi + 1)][:64] + [*range(lo, root_port)][:16]
        try:
            address = netif.resolve_ipv4(root) if layout.hosts else "127.0.0.1"
            assert self.pump is not None
            channels = RankChannels(job, self.pump, secret, address, ports)
        except (OSError, netif.NetifError) as e:
            log.warning("cannot listen for the ranks' output on %s (%s); it goes through mpirun's output, "
                        "where long lines of different ranks may mix", root or "127.0.0.1", e)
            return None
        log.debug("the ranks send their output to %s:%d", *channels.address)
        return channels

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        """The mpirun command line(s), Open MPI's hostfile and the rank table; no job is started."""
        # With hosts, each wrapper works DMLC_NODE_HOST out on its node (the plan shows a guess).
        procs = [dataclasses.replace(p, env={k: v for k, v in p.env.items() if k != envvars.NODE_HOST})
                 if p.host is not None else p for p in plan.procs]
        if not procs:
            return []
        lines: list[str] = []
        try:
            infos = [probe_mpirun(spec.mpi.mpirun)]
            lines.append(f"mpi: {infos[0].impl.title} ({infos[0].version}) at {infos[0].path}")
        except BackendUnavailableError as e:
            lines.append(f"mpi: {e}; showing the command for both Open MPI and MPICH")
            infos = [MPIInfo(spec.mpi.mpirun, MPIImpl.OPENMPI, ""), MPIInfo(spec.mpi.mpirun, MPIImpl.MPICH, "")]
        layout = rank_layout(procs)
        for info in infos:
            try:
                argv, _env, hostfile_text = mpirun_command(spec, info, procs, layout, resolve=False)
            except (ConfigError, LaunchError) as e:
                lines.append(f"{info.impl.title}: {e}")
                continue
            lines.append(f"mpirun command ({info.impl.title}): the variables all ranks share go by name (values "
                         f"from the environment above), the role's and rank's in {envvars.MPI_TABLE}:")
            lines.append("  " + shlex.join(argv))
            if hostfile_text is not None:
                lines.append(f"{_HOSTFILE_PLACEHOLDER} (one line per MPI rank, --map-by seq):")
                lines.extend(f"  {h}" for h in hostfile_text.splitlines())
        lines.append("MPI ranks:")
        for r, i in enumerate(layout.order):
            p = procs[i]
            lines.append(f"  rank {r}: {p.label} (task id {p.task_id})")
        lo, hi = spec.port_range
        where = procs[0].env.get(envvars.ROOT_URI, "?") if layout.hosts else "127.0.0.1"
        lines.append(f"rank output: each rank connects back to {where}, on a free port of {lo}-{hi} after the "
                     "scheduler's (authenticated with the job secret)")
        return lines

    def close(self) -> None:
        if self.job is not None:
            self.job.stop(timeout=5.0)
        if self.channels is not None:
            self.channels.stop()
            self.channels = None
        if self.pump is not None:
            self.pump.stop()
            self.pump = None
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


__all__ = [
    "MPIBackend", "MPIImpl", "MPIInfo", "MPIJob", "MPIRank", "RankChannels", "RankLayout", "build_mpirun_argv",
    "detect_implementation", "mpi_interface", "mpirun_command", "openmpi_hostfile", "probe_mpirun",
    "rank_layout", "rank_table",
]
