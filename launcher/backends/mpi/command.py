"""The mpi backend's pure side: finding mpirun, placing ranks, the rank table, the command line.

Placement is the plan's: :func:`rank_layout` groups the plan's processes by host, and the
ranks go to those hosts in that order (Open MPI: a hostfile with one line per rank and
``--map-by seq``; MPICH: ``-hosts A:2,B:1``). Without ``-H`` every rank runs on this machine.

Environment: the variables every rank shares travel by *name* (``-x NAME`` / ``-genvlist``),
their values in mpirun's own environment, so no secret appears on a command line; the rest
(role, task id, per-role ``--env-*``) is inside the rank table (``launcher.node.mpi_wire``),
itself one environment variable. Everything here but :func:`probe_mpirun` and the facts about
this machine is pure and golden-tested, for both mpirun families.
"""

from __future__ import annotations

import enum
import glob
import ipaddress
import os
import shutil
import socket
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import pscontract as pc
from pscontract import netif

from ... import external, node
from ...errors import BackendUnavailableError, ConfigError, LaunchError
from ...node import mpi_wire, protocol
from ...spec.job import Host, JobSpec
from ...spec.plan import ProcSpec

# The table is one environment value; stay well under Linux's 128 KiB per string.
MAX_TABLE_CHARS = 100_000
VERSION_TIMEOUT = 15.0
# Open MPI's hostfile is written at start; argv builders and dry runs use this name for it.
HOSTFILE_PLACEHOLDER = "<tmpdir>/hostfile"


class MPIImpl(str, enum.Enum):
    """The two mpirun families, which differ in every option we use."""

    OPENMPI = "openmpi"
    MPICH = "mpich"

    @property
    def label(self) -> str:  # (not title: that is str.title)
        return "Open MPI" if self is MPIImpl.OPENMPI else "MPICH"


#: The signals mpirun passes on to every rank (measured: Open MPI 4.1 forwards these and more;
#: MPICH's hydra forwards SIGUSR1 only, and SIGUSR2 or SIGABRT end it).
MPIRUN_FORWARDS: dict[MPIImpl, tuple[str, ...]] = {
    MPIImpl.OPENMPI: ("USR1", "USR2", "ABRT"),
    MPIImpl.MPICH: ("USR1",),
}


@dataclass(frozen=True)
class MPIInfo:
    """An mpirun found on this machine: its path, family and ``--version`` line."""

    path: str
    impl: MPIImpl
    version: str


def openmpi_session_dirs(pid: int, env: Mapping[str, str], uid: int) -> tuple[str, str]:
    """Glob patterns of the session directory Open MPI's mpirun ``pid`` keeps on this machine
    (4.x ``ompi.HOST.UID/pid.PID``, 5.x ``prte.HOST.UID/dvm.PID``, under the ``TMPDIR`` it runs
    with). mpirun removes it when it exits, not when it is killed.

    >>> openmpi_session_dirs(42, {"TMPDIR": "/scratch"}, 1000)
    ('/scratch/ompi.*.1000/pid.42', '/scratch/prte.*.1000/dvm.42')
    """
    base = glob.escape(env.get("TMPDIR") or env.get("TEMP") or env.get("TMP") or "/tmp")
    return (os.path.join(base, f"ompi.*.{uid}", f"pid.{pid}"), os.path.join(base, f"prte.*.{uid}", f"dvm.{pid}"))


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
        r = external.call([path, "--version"], timeout=VERSION_TIMEOUT, check=False)
    except external.CommandError as e:
        raise BackendUnavailableError(f"'{path} --version' did not answer within {VERSION_TIMEOUT:g}s" if e.timed_out
                                      else str(e)) from None
    text = "\n".join((r.stdout, r.stderr))  # (stdout's last line may lack its newline)
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
               hub: Optional[tuple[str, int]] = None, usage: bool = False) -> tuple[dict[str, str], dict[str, Any]]:
    """Split the plan's environments into what all ranks share and the rank table.

    Returns:
        ``(common, table)``: ``common`` holds the variables whose value is the
        same for every rank (passed by name on mpirun's command line, values in
        its environment); ``table`` has per role the variables shared by that
        role's ranks (``roles``) and per MPI rank ``[role, rank, own variables]``
        (``ranks``), the shared values mpirun may rewrite (``pinned``), the
        kill grace the wrappers give the commands, and the launcher's address
        for the rank wrappers' connections (``hub``, when there is one); with ``usage``, how
        often the wrappers report each rank's CPU and RSS (``u`` frames).
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
    pinned = {k: common[k] for k in mpi_wire.REWRITTEN if k in common}
    table: dict[str, Any] = {"grace": grace, "roles": roles, "ranks": ranks, "pinned": pinned}
    if hub is not None:
        table["hub"] = [hub[0], hub[1]]
    if usage:
        table["usage"] = protocol.USAGE_INTERVAL
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
    wrapper: Sequence[str],
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
        wrapper: the argv of the rank wrapper (``launcher.node.command("mpirank")``).
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
    argv += [*wrapper, "--", *command]
    return argv


def mpirun_command(spec: JobSpec, info: MPIInfo, procs: Sequence[ProcSpec], layout: RankLayout,
                   *, resolve: bool = True, hub: Optional[tuple[str, int]] = None,
                   ) -> tuple[list[str], dict[str, str], Optional[str]]:
    """mpirun's argv, its environment and Open MPI's hostfile text (None without hosts).

    The argv names :data:`HOSTFILE_PLACEHOLDER` where the hostfile's path goes.
    ``resolve=False`` (dry runs) looks no host name up. ``hub`` is where
    the job's hub (``launcher.runtime.hub``) listens for the rank wrappers.
    """
    extra: dict[str, str] = {}
    source = spec.environ_dict().get(mpi_wire.RANK_SOURCE)
    if source:
        extra[mpi_wire.RANK_SOURCE] = source
    common, table = rank_table(procs, layout, spec.kill_grace, extra, hub, usage=spec.wants_usage)
    encoded = mpi_wire.encode_table(table)
    if len(encoded) > MAX_TABLE_CHARS:
        raise LaunchError(f"the rank table for {len(procs)} ranks is {len(encoded)} characters, more than "
                          "one environment variable may hold; use fewer --env-server/--env-worker values")
    ifaces = netif.interfaces()
    iface = mpi_interface(info.impl, procs[0].env.get(pc.INTERFACE, ""), ifaces)
    if iface is None and info.impl is MPIImpl.MPICH and layout.hosts:
        # Without DMLC_INTERFACE, Hydra's proxies call mpiexec back at this host's *name*;
        # the scheduler's address is one the hosts reach, so mpiexec listens there.
        iface = mpich_default_interface((pc.service_endpoint(procs[0].env) or ("", 0))[0], ifaces)
    hostfile_text = None
    if info.impl is MPIImpl.OPENMPI and layout.hosts:
        hostfile_text = openmpi_hostfile(layout, local_names(spec.hosts, resolve), socket.gethostname())
    argv = build_mpirun_argv(
        info.impl, info.path, nprocs=len(procs), layout=layout,
        env_names=[*common, mpi_wire.TABLE], command=spec.command, wrapper=node.command("mpirank"),
        hostfile=HOSTFILE_PLACEHOLDER if hostfile_text is not None else None, interface=iface,
        is_root=os.geteuid() == 0, cores=physical_cores(), extra_args=spec.options.extra_args)
    env = {k: v for k, v in spec.environ_dict().items()
           if k not in pc.CONTRACT and k != mpi_wire.ENV_END}
    env.update(common)
    env[mpi_wire.TABLE] = encoded
    # Hydra (MPICH 4.0) loses the last variable of mpiexec's environment on its way to
    # remote ranks: end with one that nobody needs (subprocess keeps the dict's order).
    env[mpi_wire.ENV_END] = "1"
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


def check_hosts(hosts: Sequence[Host]) -> None:
    """Refuse hostfile lines mpirun cannot express (a user or port per host, IPv6)."""
    for h in hosts:
        where = f"{h.origin}: " if h.origin else ""
        if h.user or h.port:
            raise ConfigError(
                f"{where}{h.display}: --launcher mpi cannot pass a user or port to mpirun per host; "
                f"write just {h.name} and set User/Port for it in ~/.ssh/config")
        if ":" in h.name:
            raise ConfigError(f"{where}{h.name}: --launcher mpi needs an IPv4 address or a host name, not IPv6")


