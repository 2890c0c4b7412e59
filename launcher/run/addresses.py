"""The scheduler's address and port, as the nodes will see them; used by the supervisor and doctor.

``DMLC_PS_ROOT_URI`` is, in order: this host's address on ``DMLC_INTERFACE``; ``--host-ip``
(an address, or dmlc's guesses ``ip``/``dns``); 127.0.0.1 when everything runs on this
machine; else the address that routes to the first host. The port is the first free one of
``--port-range`` that no other pslaunch on this machine has claimed
(:func:`launcher.runtime.ports.claim_free_port`); whether the scheduler really listens on it is
checked against the listening sockets of ``/proc/net/tcp*`` and the processes' descriptors
(another program may take the port between the check and the scheduler's bind).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Callable, Mapping, Optional, Sequence

from pscontract import netif

from ..backends.base import Backend
from ..errors import ConfigError
from ..runtime.handle import group_members
from ..runtime.ports import port_is_free
from ..spec import network
from ..spec.job import Host, JobSpec

log = logging.getLogger(__name__)


def is_literal_host_ip(value: Optional[str]) -> bool:
    return bool(value) and value not in ("auto", "ip", "dns")


def interface_address_or_none(iface: str, host_ip: Optional[str]) -> Optional[str]:
    """This host's address on ``iface``; None if it has none there and a literal ``--host-ip`` stands in."""
    try:
        return netif.interface_address(iface)
    except netif.NetifError as e:
        if not is_literal_host_ip(host_ip):
            raise
        log.info("DMLC_INTERFACE=%s selects no address on this host (%s); the scheduler listens on "
                 "--host-ip %s", iface, e, host_ip)
        return None


def scheduler_address(spec: JobSpec, addresses: Mapping[Host, str], backend: type[Backend]) -> str:
    """``DMLC_PS_ROOT_URI``: the launching host's address the nodes can reach (see the module docstring).

    A ``DMLC_INTERFACE`` that this host does not have is an error, unless ``--host-ip`` gives
    an address (launching from a machine whose interfaces differ from the nodes', such as a
    login node).
    """
    iface = spec.interface
    try:
        if iface:
            address = interface_address_or_none(iface, spec.host_ip)
            if address is not None:
                return address
        if is_literal_host_ip(spec.host_ip):
            return netif.resolve_ipv4(spec.host_ip or "")
        if spec.host_ip in ("ip", "dns"):
            return netif.resolve_ipv4(netif.guess_host_ip(spec.host_ip))
        if backend.needs_scheduler_address:
            raise ConfigError(_no_address(spec))
        if backend.all_here(spec) or not spec.hosts:
            return "127.0.0.1"
        # toward the first host that is not this machine's loopback (a hostfile may start with localhost)
        known = [addresses[h] for h in spec.hosts if h in addresses] or [netif.resolve_ipv4(spec.hosts[0].name)]
        return netif.route_source(next((a for a in known if not network.is_loopback(a)), known[0]))
    except netif.NetifError as e:
        raise ConfigError(str(e)) from None


def early_address(spec: JobSpec) -> tuple[Optional[str], str]:
    """The service's address where it needs no connection to a host, and what chose it:
    ``("127.0.0.1", "DMLC_INTERFACE=lo")``, ``("10.0.0.1", "--host-ip 10.0.0.1")``; ``(None, "")``
    when only the hosts can tell (the route to them) or this host lacks the interface."""
    iface = spec.interface
    if iface:
        try:
            address = interface_address_or_none(iface, spec.host_ip)
        except netif.NetifError:
            return None, ""  # (the real run says so, in scheduler_address)
        if address is not None:
            return address, f"DMLC_INTERFACE={iface}"
    if is_literal_host_ip(spec.host_ip):
        return spec.host_ip, f"--host-ip {spec.host_ip}"
    return None, ""


def other_machines(names: Sequence[str], local: Optional[set[str]] = None) -> list[str]:
    """The names among ``names`` that are not this machine: one that resolves to a loopback
    address or to an address of this machine's interfaces is this machine; one that does not
    resolve counts as another (ssh may still reach it)."""
    if local is None:
        try:
            local = {i.address for i in netif.interfaces()}
        except netif.NetifError:
            local = set()
    found = []
    for name in names:
        try:
            address = netif.resolve_ipv4(name)
        except netif.NetifError:
            found.append(name)
            continue
        if not network.is_loopback(address) and address not in local:
            found.append(name)
    return list(dict.fromkeys(found))


def _no_address(spec: JobSpec) -> str:
    return (f"--launcher {spec.launcher} cannot tell which address of this host its nodes reach: "
            "set DMLC_INTERFACE (a name or a CIDR such as 10.1.0.0/16) or --host-ip ADDRESS")


def check_address_given(spec: JobSpec, backend: type[Backend]) -> None:
    """Refuse at once (``ConfigError``, exit 2) a job on a backend whose nodes' route to this host
    cannot be known (a batch system's) without ``DMLC_INTERFACE`` or ``--host-ip``: before an
    allocation is asked for, not after it is granted (:func:`scheduler_address`)."""
    if backend.needs_scheduler_address and not spec.interface and not spec.host_ip:
        raise ConfigError(_no_address(spec))


def check_loopback(spec: JobSpec, backend: type[Backend]) -> None:
    """Refuse at once (``ConfigError``, exit 2), before any connection, a service address on
    loopback while processes run on other machines (:func:`launcher.spec.network.loopback_refusal`):
    from ``DMLC_INTERFACE`` or ``--host-ip`` with a hostfile's hosts that are not this machine,
    from ``DMLC_INTERFACE`` on Slurm's nodes. Without either, the address is the route to the
    first host that is not on loopback (:func:`scheduler_address`)."""
    address, source = early_address(spec)
    if not network.is_loopback(address):
        return
    machines = backend.machines(spec)
    if machines is None:  # a batch system's nodes: known to be elsewhere only by the backend. There a
        # literal --host-ip is the user's word (a cluster whose nodes include this machine; the tests'
        # way to keep agents from connecting), DMLC_INTERFACE=lo a network name taken for the nodes'
        elsewhere = [backend.elsewhere] if backend.elsewhere and source.startswith("DMLC_INTERFACE") else []
    else:
        elsewhere = other_machines(machines)
    why = network.loopback_refusal(spec, address, source, elsewhere, routed=not backend.needs_scheduler_address)
    if why:
        raise ConfigError(why)


def dry_run_address(spec: JobSpec, backend: type[Backend]) -> str:
    """The scheduler's address as a dry run shows it: real where it needs no network, else a placeholder."""
    iface = spec.interface
    try:
        address = interface_address_or_none(iface, spec.host_ip) if iface else None
    except netif.NetifError as e:
        raise ConfigError(str(e)) from None
    if address is not None:
        return address
    if is_literal_host_ip(spec.host_ip):
        return spec.host_ip or ""
    if backend.needs_scheduler_address:
        return "<DMLC_INTERFACE or --host-ip>"
    if backend.all_here(spec) or not spec.hosts:
        return "127.0.0.1"
    return "<this host's address toward the hosts>"


def job_peers(spec: JobSpec, addresses: Mapping[Host, str], backend: type[Backend]) -> Optional[tuple[str, ...]]:
    """The addresses the job's processes connect to its tracker from, as far as the launcher
    knows them: ``("local",)`` (any of this machine's) when they all run here; else every address
    of each host's name and the one the backend found for it (``DMLC_NODE_HOST``); None when a
    batch system places them, a host's name has no address here (an ssh alias, say), or
    ``--host-ip`` without ``DMLC_INTERFACE`` puts the tracker on a network where the hosts'
    addresses are not known (a data network beside the one ssh reaches them on)."""
    if backend.all_here(spec):
        return ("local",)
    if backend.needs_scheduler_address or not spec.hosts or (spec.host_ip and not spec.interface):
        return None
    found: set[str] = set()
    for host in spec.hosts:
        names = [host.name, *([addresses[host]] if host in addresses else [])]
        mine: set[str] = set()
        for name in names:
            try:
                mine |= {str(info[4][0]) for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
            except (OSError, UnicodeError):
                continue
        if not mine:
            log.debug("%s has no address here: the tracker takes connections from any address", host)
            return None
        found |= mine
    return tuple(sorted(found))


def is_listening(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _listen_inodes(port: int, host: str = "") -> Optional[set[str]]:
    """Socket inodes listening on TCP ``port`` where a bind of ``host`` would collide with them
    (the same address, or either side a wildcard; any address when ``host`` is empty); None
    without /proc. A listener on another address of the port is no rival."""
    listeners = _proc_listeners()
    if listeners is None:
        return None
    return {inode for ip, p, inode in listeners if p == port and _collides(ip, host)}


def _proc_listeners() -> Optional[list[tuple[str, int, str]]]:
    """(address, port, inode) of every TCP listener of this network namespace, from
    /proc/net/tcp and tcp6; None without /proc.

    The kernel lists the listening sockets first (before Linux 4.4 each followed by its half-open
    connections, SYN_RECV), then walks its whole connection hash table for the rest: reading stops
    at the first line in another state, in small reads, so that a look costs 0.2-0.6 ms of CPU
    instead of 5 ms a table (measured with 262,144 hash buckets, a common size).
    """
    found: list[tuple[str, int, str]] = []
    found_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, "rb", buffering=512) as f:
                next(f, None)
                found_table = True
                for line in f:
                    fields = line.split()
                    # local_address is HEXIP:HEXPORT; st 0A is LISTEN, 03 SYN_RECV; inode is field 9
                    if len(fields) <= 9:
                        continue
                    if fields[3] not in (b"0A", b"03"):
                        break
                    if fields[3] == b"0A":
                        hexip, hexport = fields[1].decode("ascii").rsplit(":", 1)
                        found.append((_proc_ip(hexip), int(hexport, 16), fields[9].decode("ascii")))
        except OSError:
            continue
    return found if found_table else None


def _proc_ip(hexip: str) -> str:
    """/proc/net/tcp's address (IPv4: one little-endian word; IPv6: four), as text; an IPv6
    address that maps an IPv4 one (``::ffff:a.b.c.d``) as the IPv4 address."""
    raw = bytes.fromhex(hexip)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 16 and raw[:12] == bytes(10) + b"\xff\xff":
        raw = raw[12:]
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def _collides(listening: str, host: str) -> bool:
    return not host or listening in (host, "0.0.0.0", "::") or host in ("0.0.0.0", "::")


def listener(pgid: int, host: str, port: int) -> str:
    """Who listens on TCP ``port``: ``"ours"`` (a process of group ``pgid``, the scheduler's),
    ``"foreign"`` (another process holds it: the port was taken between our probe and the
    scheduler's bind; a successful connect alone would not tell us), or ``"none"``.

    Reads the listening sockets from ``/proc/net/tcp*`` and, only when something listens, the
    group leader's descriptors (then its group's): cheap enough to ask every few milliseconds
    while a job starts. Without /proc, a connect decides between ``"ours"`` and ``"none"``.
    """
    inodes = _listen_inodes(port, host)
    if inodes is None:
        return "ours" if is_listening(host, port) else "none"
    if not inodes:
        return "none"
    targets = {f"socket:[{i}]" for i in inodes}
    if _holds(pgid, targets):  # the leader first: usually the one that listens
        return "ours"
    if any(_holds(pid, targets) for pid in group_members(pgid) if pid != pgid):
        return "ours"
    # a rival holds it: a process we can see. A listener that no process holds is one being
    # closed (it was seen in the table a moment before its owner let go); a rival we may not
    # look at (another user's) is judged when the scheduler fails to bind (see SchedulerWatch)
    if not any(_holds(int(d), targets) for d in os.listdir("/proc") if d.isdigit()):
        return "none"
    return "foreign"


def _holds(pid: int, targets: set[str]) -> bool:
    """True when process ``pid`` has one of ``targets`` (``socket:[inode]``) open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                return True
        except OSError:
            continue
    return False


#: what a ps-lite program maps while it starts: MXNet's library (ps-lite is inside it, loaded in
#: the first second of an import that takes 7 s on 2 cores), libzmq (pyzmq: our trainer, the
#: builtin scheduler), BytePS's
PSLITE_LIBRARIES = ("mxnet", "zmq", "byteps", "pslite", "ps-lite")
#: the libraries that hold C++ ps-lite itself (not ZeroMQ alone, which pyzmq maps too)
NATIVE_PSLITE = ("mxnet", "byteps", "pslite", "ps-lite")


def maps_pslite(pgid: int, libraries: Sequence[str] = PSLITE_LIBRARIES) -> bool:
    """True when a process of group ``pgid`` (the scheduler's) has a ps-lite library mapped
    (``libraries``, by default :data:`PSLITE_LIBRARIES`: a scheduler that does not listen yet is
    most likely importing; :data:`NATIVE_PSLITE`: it is C++ ps-lite's). False where ``/proc``
    cannot tell."""
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                names = {line.rsplit(b"/", 1)[-1] for line in f if b"/" in line}
        except OSError:
            continue
        if any(key.encode() in name for name in names for key in libraries):
            return True
    return False


class SchedulerWatch:
    """While a job starts, who gets the scheduler's port: ``verdict`` becomes ``"up"`` (the
    scheduler listens on it, or ended with 0 without needing to), ``"lost"`` (another process
    holds it: taken between our probe and the scheduler's bind) or ``"died"`` (the scheduler
    ended with an error, and the port is free: not a race).

    A thread looks whatever the launcher is busy with (a backend's ``start`` may take seconds):
    first after ``interval`` seconds, then ever less often, up to every ``max_interval``. A look
    costs a few hundred microseconds of CPU, and a ps-lite scheduler may import for seconds
    before it listens, on cores its own job's processes need: every 10 ms, that was 110 ms of CPU
    in 3 s. A rival that took the port is usually there from the start, and seen at the first
    looks; a scheduler that dies is judged at once by :meth:`judge_now` (the supervisor calls it
    when it sees the death), while the port's new holder still has it. It peeks at the
    scheduler's exit with ``waitid(WNOWAIT)``, leaving the exit status to whoever polls the process.
    """

    def __init__(self, pid: int, host: str, port: int, interval: float = 0.01,
                 max_interval: float = 0.16, on_verdict: Optional[Callable[[str], None]] = None) -> None:
        self.pid, self.host, self.port = pid, host, port
        self.interval, self.max_interval = interval, max(interval, max_interval)
        self.on_verdict = on_verdict  # called once with the verdict, from whichever thread reached it
        self.verdict: Optional[str] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pslaunch-port-watch", daemon=True)

    def start(self) -> SchedulerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(1.0)

    def _run(self) -> None:
        interval = self.interval
        while not self._stop.is_set():
            if self._reach(self.check()):
                return
            self._stop.wait(interval)
            interval = min(interval * 2, self.max_interval)

    def judge_now(self) -> Optional[str]:
        """Look now, in the caller's thread (the scheduler has just ended: its verdict is due);
        the verdict, which ends the watch."""
        if self.verdict is None:
            self._reach(self.check())
        return self.verdict

    def _reach(self, verdict: Optional[str]) -> bool:
        """Record ``verdict`` (the first one stands), end the watch and tell ``on_verdict``; True
        when there is a verdict."""
        if verdict is None:
            return False
        with self._lock:
            first = self.verdict is None
            if first:
                self.verdict = verdict
        self._stop.set()
        if first and self.on_verdict is not None:
            self.on_verdict(verdict)
        return True

    def check(self) -> Optional[str]:
        """One look: the verdict, or None while the scheduler runs and nobody listens yet."""
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already: someone polled it; judge by the port alone
            info = None
            ended, code = True, None
        else:
            ended = info is not None and info.si_pid == self.pid
            code = None
            if info is not None and ended:
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if ended and code == 0:
            return "up"
        who = listener(self.pid, self.host, self.port)
        if who == "ours" and not ended:
            return "up"
        if who == "foreign" or (ended and not port_is_free(self.port)):
            return "lost"
        return "died" if ended else None
