"""A multi-host testbed on one machine: network namespaces, each with its own sshd.

Used by the ssh backend's tests, by the mpi backend's multi-host tests and by
``scripts/bench_launch.py --launcher ssh``. Needs root, ``ip`` (iproute2),
``unshare``/``nsenter`` (util-linux), ``/usr/sbin/sshd`` and ``ssh-keygen``
(``scripts/deps/30-ssh.sh`` installs them).

What :func:`build` makes, for testbed number ``X`` (the first free one)::

    root namespace (the launching host)
      psbXa  bridge 10.200.X.1/24   ("subnet A": ssh and the hostfile)
      psbXb  bridge 10.201.X.1/24   ("subnet B": a second, data network)
    host i = namespace psbX-hi, sshd on port 22 of both addresses
      A side: 10.200.X.(10+i)/24 on an interface named iface_names(i)[0] (eth0, ens1, ...)
      B side: 10.201.X.(10+i)/24 on an interface named iface_names(i)[1] (data0, ib0, ...)

Host 3's sshd allows one session per connection (``MaxSessions 1``), to
exercise clients that need several. Interface names differ between hosts on purpose (only the CIDR form of
``DMLC_INTERFACE`` selects the same network everywhere). Each host's sshd runs
in a private mount namespace with tmpfs on ``/tmp`` and on :attr:`Testbed.sync_root`,
so a file found there on a host really crossed ssh. :attr:`Testbed.shared`
is visible on every host (it is not under ``/tmp``): let remote test
programs write their results there.

Client side, in :attr:`Testbed.home` (use it as ``HOME``, see :meth:`Testbed.env`):
``.ssh/id_ed25519`` (authorized on every host), ``.ssh/known_hosts`` (every
host's key under both addresses) and ``.ssh/config`` (``Host pstb-hI`` aliases
with ``HostName``, ``User root``, the key and the known_hosts file). OpenSSH's
``ssh`` reads ``~`` from the password database, not ``HOME``: give it
``-F`` :attr:`Testbed.ssh_config` (see :meth:`Testbed.ssh_argv`). A second key,
:attr:`Testbed.protected_key`, needs the passphrase :attr:`Testbed.passphrase`.

:attr:`Testbed.hostfile` lists the hosts' A addresses, one per line. Everything
is removed by :meth:`Testbed.close`; a testbed whose owner died is removed by
the next :func:`build`. Stable interface for other tests: :func:`build`,
:func:`get` (one per pytest session), :class:`Testbed` attributes and methods.

Command line: ``python tests/support/testbed.py up [--hosts N]`` prints the state
directory (the testbed stays up), ``python tests/support/testbed.py down DIR`` removes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from launcher.node import procgroup

STATE_ROOT = Path("/var/tmp")
PREFIX = "pslaunch-testbed-"
IFACES = (("eth0", "data0"), ("ens1", "ib0"), ("enp2s0", "bond0"), ("eno1", "ib1"),
          ("eth1", "data1"), ("ens5", "ib5"), ("enp7s0", "bond7"), ("eno8", "ib8"))
MAX_HOSTS = 64  # (host i's addresses are .10+i of the /24s; the scale benchmarks use 64)


def iface_names(index: int) -> tuple[str, str]:
    """Host ``index``'s A and B interface names: :data:`IFACES` for the first eight (names that
    differ between hosts on purpose), then ``ethI``/``dataI`` for the hosts of the scale benchmarks."""
    return IFACES[index] if index < len(IFACES) else (f"eth{index}", f"data{index}")
SSHD = "/usr/sbin/sshd"
PASSPHRASE = "pslaunch-test-passphrase"
LIMITED_HOST = 3  # this host's sshd allows one session per connection (MaxSessions 1)

_SSHD_CONFIG = """\
Port 22
HostKey {hostkey}
AuthorizedKeysFile {authorized_keys}
StrictModes no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
PidFile none
LogLevel ERROR
Subsystem sftp internal-sftp
"""


class TestbedError(RuntimeError):
    """The testbed cannot be built here (not root, no sshd, no network namespaces)."""


def _run(argv: Sequence[str], check: bool = True, **kw: object) -> subprocess.CompletedProcess:
    r = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if check and r.returncode != 0:
        raise TestbedError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


@dataclasses.dataclass
class TestHost:
    """One namespace host."""

    index: int
    netns: str
    addr_a: str
    addr_b: str
    iface_a: str
    iface_b: str
    alias: str
    sshd_pid: int = 0

    __test__ = False  # not a test class for pytest

    @property
    def name(self) -> str:
        return f"h{self.index}"


@dataclasses.dataclass
class Testbed:
    """A built testbed. See the module docstring for the layout."""

    number: int
    state: Path
    hosts: list[TestHost]
    owner: int = 0

    __test__ = False  # not a test class for pytest

    # -- paths ---------------------------------------------------------------------

    @property
    def subnet_a(self) -> str:
        return f"10.200.{self.number}.0/24"

    @property
    def subnet_b(self) -> str:
        return f"10.201.{self.number}.0/24"

    @property
    def root_a(self) -> str:
        return f"10.200.{self.number}.1"

    @property
    def root_b(self) -> str:
        return f"10.201.{self.number}.1"

    @property
    def bridges(self) -> tuple[str, str]:
        return f"psb{self.number}a", f"psb{self.number}b"

    @property
    def home(self) -> Path:
        return self.state / "home"

    @property
    def key(self) -> Path:
        return self.home / ".ssh" / "id_ed25519"

    @property
    def protected_key(self) -> Path:
        return self.state / "keys" / "protected_ed25519"

    passphrase = PASSPHRASE

    @property
    def known_hosts(self) -> Path:
        return self.home / ".ssh" / "known_hosts"

    @property
    def ssh_config(self) -> Path:
        return self.home / ".ssh" / "config"

    @property
    def authorized_keys(self) -> Path:
        return self.state / "authorized_keys"

    @property
    def hostfile(self) -> Path:
        return self.state / "hosts"

    @property
    def shared(self) -> Path:
        return self.state / "shared"

    @property
    def sync_root(self) -> Path:
        return self.state / "sync"

    # -- helpers for tests -----------------------------------------------------------

    def env(self, base: Optional[dict] = None, **extra: str) -> dict[str, str]:
        """``base`` (default ``os.environ``) with ``HOME`` = :attr:`home` and no ssh-agent."""
        env = dict(os.environ if base is None else base)
        env["HOME"] = str(self.home)
        env.pop("SSH_AUTH_SOCK", None)
        env.update(extra)
        return env

    def write_hostfile(self, path: Path | str, hosts: Optional[Iterable[TestHost]] = None,
                       fmt: str = "{addr_a}") -> Path:
        """A hostfile with one line per host; ``fmt`` may use every :class:`TestHost` field."""
        path = Path(path)
        lines = [fmt.format(**dataclasses.asdict(h)) for h in (self.hosts if hosts is None else hosts)]
        path.write_text("\n".join(lines) + "\n")
        return path

    def nsenter(self, host: TestHost) -> list[str]:
        """Prefix that runs a command inside ``host``'s network and mount namespaces."""
        return ["nsenter", "-t", str(host.sshd_pid), "-n", "-m", "--"]

    def run(self, host: TestHost, argv: Sequence[str], check: bool = False,
            timeout: float = 30) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``host`` (its network and its private /tmp and sync root)."""
        return _run(self.nsenter(host) + list(argv), check=check, timeout=timeout)

    def pids(self, host: TestHost) -> list[int]:
        """Every process in ``host``'s network namespace (sshd included)."""
        r = _run(["ip", "netns", "pids", host.netns], check=False)
        return [int(x) for x in r.stdout.split()]

    def job_pids(self, host: TestHost) -> list[int]:
        """Processes on ``host`` other than sshd (listener and sessions): leftovers of a job."""
        out = []
        for pid in self.pids(host):
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            st = procgroup.stat(pid)
            if comm in ("sshd", "sshd-session") or st is None or not st.alive:
                continue
            out.append(pid)
        return out

    def describe_pids(self, pids: Iterable[int]) -> str:
        parts = []
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                cmd = "?"
            parts.append(f"{pid} {cmd[:120]}")
        return "; ".join(parts)

    def link(self, host: TestHost, up: bool) -> None:
        """Take both of ``host``'s interfaces down (as a pulled cable) or back up."""
        for iface in (host.iface_a, host.iface_b):
            _run(["ip", "-n", host.netns, "link", "set", iface, "up" if up else "down"])

    def ssh_argv(self, host: TestHost, *command: str) -> list[str]:
        """An OpenSSH client command line for ``host`` with the testbed's config."""
        return ["ssh", "-F", str(self.ssh_config), "-o", "BatchMode=yes", host.alias, *command]

    def netns_link(self, host: TestHost) -> str:
        """``net:[INODE]`` as ``readlink /proc/PID/ns/net`` shows it for a process on ``host``."""
        return f"net:[{os.stat(f'/run/netns/{host.netns}').st_ino}]"

    def host_of(self, netns_link: str) -> Optional[TestHost]:
        """The host whose namespace ``netns_link`` (from /proc/PID/ns/net) is; None: the root namespace."""
        for h in self.hosts:
            if self.netns_link(h) == netns_link:
                return h
        return None

    def listeners(self, host: TestHost) -> list[tuple[str, int, str]]:
        """Listening TCP sockets on ``host`` other than sshd's: (address, port, process name)."""
        r = _run(["ip", "netns", "exec", host.netns, "ss", "-H", "-ltnp"], check=False)
        out = []
        for line in r.stdout.splitlines():
            fields = line.split()
            if len(fields) < 5:
                continue
            local = fields[3]
            addr, _, port = local.rpartition(":")
            users = line.split("users:", 1)[1] if "users:" in line else ""
            name = users.split('"')[1] if '"' in users else "?"
            if name in ("sshd", "sshd-session"):
                continue
            out.append((addr.strip("[]"), int(port), name))
        return out

    def host_by_addr(self, addr: str) -> TestHost:
        for h in self.hosts:
            if addr in (h.addr_a, h.addr_b):
                return h
        raise KeyError(addr)

    def describe(self) -> dict:
        return {
            "number": self.number, "state": str(self.state), "owner": self.owner,
            "subnet_a": self.subnet_a, "subnet_b": self.subnet_b, "root_a": self.root_a, "root_b": self.root_b,
            "hostfile": str(self.hostfile), "home": str(self.home), "ssh_config": str(self.ssh_config),
            "shared": str(self.shared), "sync_root": str(self.sync_root),
            "hosts": [dataclasses.asdict(h) for h in self.hosts],
        }

    # -- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Kill everything in the namespaces, remove them, the bridges and the state."""
        teardown(self.number, self.state)


def _proc_title(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _proc_start(pid: int) -> str:
    st = procgroup.stat(pid)
    return str(st.start) if st is not None else ""


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def teardown(number: int, state: Optional[Path] = None, grace: float = 5.0) -> None:
    """Remove testbed ``number`` (idempotent, never raises).

    The sshd listeners go first; then whatever still runs in the namespaces
    gets ``grace`` seconds to finish before SIGKILL. A login shell killed in
    the middle of its rc files can leave damage behind on this machine (for
    example pyenv's rehash lock, which makes every later shell wait 60 s).
    """
    r = _run(["ip", "netns", "list"], check=False)
    mine = [line.split()[0] for line in r.stdout.splitlines() if line.startswith(f"psb{number}-h")]

    def pids() -> list[int]:
        out = []
        for ns in mine:
            out += [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]
        return out

    def comm(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return ""

    everything = pids()
    _signal([p for p in everything if b"[listener]" in _proc_title(p)], signal.SIGTERM)  # no new sessions
    end = time.monotonic() + grace
    while time.monotonic() < end:
        left = [p for p in pids() if comm(p) not in ("sshd", "sshd-session", "")]
        if not left:
            break
        time.sleep(0.1)
    _signal(pids(), signal.SIGKILL)
    for ns in mine:
        _run(["ip", "netns", "del", ns], check=False)
    for br in (f"psb{number}a", f"psb{number}b"):
        _run(["ip", "link", "del", br], check=False)
    if state is None:
        state = STATE_ROOT / f"{PREFIX}{number}"
    shutil.rmtree(state, ignore_errors=True)


def _remove_stale() -> None:
    """Remove testbeds whose owner process is gone (a killed test session)."""
    for state in STATE_ROOT.glob(PREFIX + "*"):
        info = state / "testbed.json"
        try:
            doc = json.loads(info.read_text())
        except (OSError, ValueError):
            continue
        owner, start = doc.get("owner", 0), doc.get("owner_start", "")
        if owner and _proc_start(owner) != start:
            teardown(int(doc["number"]), state)


def _claim_number() -> int:
    """The first testbed number whose bridges and subnets are free; claims it by creating bridge A."""
    addrs = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    for n in range(1, 250):
        if f"10.200.{n}." in addrs or f"10.201.{n}." in addrs:
            continue
        r = _run(["ip", "link", "add", "name", f"psb{n}a", "type", "bridge"], check=False)
        if r.returncode == 0:
            return n
    raise TestbedError("no free testbed number (10.200.N.0/24 for N in 1..249 all in use)")


def _keygen(path: Path, comment: str, passphrase: str = "") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-C", comment, "-f", str(path)])
    return (path.with_suffix(path.suffix + ".pub") if path.suffix else Path(str(path) + ".pub")).read_text().strip()


def _wait_port(addr: str, port: int, timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=0.5) as s:
                if s.recv(4).startswith(b"SSH-"):
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            raise TestbedError(f"sshd on {addr}:{port} did not come up within {timeout}s")
        time.sleep(0.05)


class NamespaceSSHDs:
    """An sshd in each of some network namespaces that another testbed built (the Slurm and Ray
    testbeds' nodes, for the benchmarks that put ssh beside them), and a client ``HOME`` whose
    ``.ssh`` has the key they accept, their host keys and ``User root`` for ``host_pattern``.

    ``nodes``: ``(name, netns, address)`` of each; ``root``: a new directory for their files."""

    def __init__(self, nodes: Sequence[tuple[str, str, str]], root: Path, host_pattern: str) -> None:
        root.mkdir()
        self.home = root / "home"
        client = _keygen(self.home / ".ssh" / "id_ed25519", "bench-client")
        (root / "authorized_keys").write_text(client + "\n")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        known = []
        try:
            for name, netns, addr in nodes:
                d = root / name
                d.mkdir()
                pub = _keygen(d / "hostkey", f"bench-{name}")
                known.append(f"{addr} {' '.join(pub.split()[:2])}")
                cfg = d / "sshd_config"
                cfg.write_text(_SSHD_CONFIG.format(hostkey=d / "hostkey", authorized_keys=root / "authorized_keys")
                               + f"ListenAddress {addr}\n")
                with open(d / "sshd.log", "wb") as log:
                    self.procs.append(subprocess.Popen(["ip", "netns", "exec", netns, SSHD, "-D", "-e", "-f", str(cfg)],
                                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                       stderr=log, start_new_session=True))
            (self.home / ".ssh" / "known_hosts").write_text("\n".join(known) + "\n")
            (self.home / ".ssh" / "config").write_text(
                f"Host {host_pattern}\n    User root\n    StrictHostKeyChecking yes\n")
            for _, _, addr in nodes:
                _wait_port(addr, 22, 15)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise TestbedError("the ssh testbed needs root (network namespaces)")
    for tool in ("ip", "unshare", "nsenter", "ssh-keygen"):
        if shutil.which(tool) is None:
            raise TestbedError(f"{tool} not found: run scripts/deps/30-ssh.sh")
    if not os.access(SSHD, os.X_OK):
        raise TestbedError(f"{SSHD} not found: run scripts/deps/30-ssh.sh")


def build(num_hosts: int = 3, owner: Optional[int] = None) -> Testbed:
    """Build a testbed with ``num_hosts`` namespace hosts (at most :data:`MAX_HOSTS`).

    ``owner`` is the pid whose death makes the testbed stale (default: this
    process; 0: never stale, for ``testbed.py up``).
    """
    check_prerequisites()
    if not 1 <= num_hosts <= MAX_HOSTS:
        raise TestbedError(f"num_hosts must be 1..{MAX_HOSTS}")
    _remove_stale()
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    n = _claim_number()
    state = STATE_ROOT / f"{PREFIX}{n}"
    owner = os.getpid() if owner is None else owner
    hosts = [TestHost(index=i, netns=f"psb{n}-h{i}", addr_a=f"10.200.{n}.{10 + i}", addr_b=f"10.201.{n}.{10 + i}",
                      iface_a=iface_names(i)[0], iface_b=iface_names(i)[1], alias=f"pstb-h{i}")
             for i in range(num_hosts)]
    tb = Testbed(number=n, state=state, hosts=hosts, owner=owner)
    try:
        shutil.rmtree(state, ignore_errors=True)
        for d in (state, tb.shared, tb.sync_root, tb.home / ".ssh", state / "keys"):
            d.mkdir(parents=True, exist_ok=True)
        tb.shared.chmod(0o1777)
        (state / "testbed.json").write_text(json.dumps({"number": n, "owner": owner,
                                                        "owner_start": _proc_start(owner) if owner else ""}))
        _network(tb)
        _keys(tb)
        for h in hosts:
            _start_sshd(tb, h)
        for h in hosts:
            _wait_port(h.addr_a, 22, 15)
        owner_start = _proc_start(owner) if owner else ""
        (state / "testbed.json").write_text(json.dumps({**tb.describe(), "owner_start": owner_start}))
    except BaseException:
        teardown(n, state)
        raise
    return tb


def _network(tb: Testbed) -> None:
    br_a, br_b = tb.bridges
    _run(["ip", "link", "add", "name", br_b, "type", "bridge"])
    for br, addr in ((br_a, tb.root_a), (br_b, tb.root_b)):
        _run(["ip", "addr", "add", f"{addr}/24", "dev", br])
        _run(["ip", "link", "set", br, "up"])
    for h in tb.hosts:
        _run(["ip", "netns", "add", h.netns])
        _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
        for side, br, iface, addr in (("a", br_a, h.iface_a, h.addr_a), ("b", br_b, h.iface_b, h.addr_b)):
            outer, tmp = f"psb{tb.number}h{h.index}{side}", f"psbt{tb.number}h{h.index}{side}"
            _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", tmp])
            _run(["ip", "link", "set", tmp, "netns", h.netns])
            _run(["ip", "-n", h.netns, "link", "set", tmp, "name", iface])
            _run(["ip", "link", "set", outer, "master", br, "up"])
            _run(["ip", "-n", h.netns, "addr", "add", f"{addr}/24", "dev", iface])
            _run(["ip", "-n", h.netns, "link", "set", iface, "up"])


def _keys(tb: Testbed) -> None:
    client = _keygen(tb.key, "pslaunch-testbed-client")
    protected = _keygen(tb.protected_key, "pslaunch-testbed-protected", PASSPHRASE)
    tb.authorized_keys.write_text(f"{client}\n{protected}\n")
    known, config = [], ["# written by tests/support/testbed.py", ""]
    for h in tb.hosts:
        hostkey = tb.state / h.name / "ssh_host_ed25519_key"
        pub = _keygen(hostkey, f"pslaunch-testbed-{h.name}")
        keytype, blob = pub.split()[:2]
        known.append(f"{h.addr_a},{h.addr_b} {keytype} {blob}")
        config += [f"Host {h.alias}", f"    HostName {h.addr_a}", ""]
    config += ["Host pstb-* 10.200.*.* 10.201.*.*", "    User root", f"    IdentityFile {tb.key}",
               f"    UserKnownHostsFile {tb.known_hosts}", "    StrictHostKeyChecking yes", ""]
    tb.known_hosts.write_text("\n".join(known) + "\n")
    tb.ssh_config.write_text("\n".join(config))
    tb.ssh_config.chmod(0o600)
    tb.write_hostfile(tb.hostfile)


def _kept_through_tmp() -> list[Path]:
    """What the test hosts must see under ``/tmp``, where each has a private tmpfs: the checkout
    and the targets of its ``.venv*`` links, where they lie under ``/tmp`` (outermost first, and
    none inside another)."""
    repo = Path(__file__).resolve().parents[2]  # (tests/support/testbed.py)
    paths = [repo, *(link.resolve() for link in sorted(repo.glob(".venv*")) if link.is_symlink())]
    kept: list[Path] = []
    for path in sorted({p for p in paths if Path("/tmp") in p.parents}, key=lambda p: len(p.parts)):
        if not any(k == path or k in path.parents for k in kept):
            kept.append(path)
    return kept


def _start_sshd(tb: Testbed, h: TestHost) -> None:
    hostdir = tb.state / h.name
    cfg = hostdir / "sshd_config"
    extra = "MaxSessions 1\n" if h.index == LIMITED_HOST else ""
    cfg.write_text(_SSHD_CONFIG.format(hostkey=hostdir / "ssh_host_ed25519_key",
                                       authorized_keys=tb.authorized_keys) + extra)
    tmp_mount = "mount -t tmpfs -o mode=1777 tmpfs /tmp"
    q = shlex.quote
    for i, path in enumerate(_kept_through_tmp()):
        # A checkout under /tmp (a CI clone, say), or the test venvs its .venv-* links point to (a
        # fresh HOME made with mktemp -d), stays visible through the host's private /tmp: the job
        # runs the checkout's venvs in the checkout's directory on every host.
        keep = hostdir / f"keep-{i}"
        keep.mkdir(exist_ok=True)
        tmp_mount = (f"mount --bind {q(str(path))} {q(str(keep))} && {tmp_mount} && "
                     f"mkdir -p {q(str(path))} && mount --bind {q(str(keep))} {q(str(path))}")
    script = (f"{tmp_mount} && mount -t tmpfs -o mode=0755 tmpfs {tb.sync_root} "
              f"&& exec {SSHD} -D -e -f {cfg}")
    log = open(hostdir / "sshd.log", "ab")
    try:
        # ip netns exec, unshare and sh all exec: the pid we get is sshd's.
        p = subprocess.Popen(["ip", "netns", "exec", h.netns, "unshare", "-m", "--propagation", "private",
                              "sh", "-c", script], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                             start_new_session=True)
    finally:
        log.close()
    h.sshd_pid = p.pid


# --- one testbed per pytest session ---------------------------------------------------

_SESSION: Optional[Testbed] = None
_SESSION_ERROR: Optional[str] = None


def get(num_hosts: int = 4) -> Testbed:
    """The session's testbed (built on first use, removed at exit); raises TestbedError."""
    global _SESSION, _SESSION_ERROR
    if _SESSION is None:
        if _SESSION_ERROR is not None:
            raise TestbedError(_SESSION_ERROR)
        try:
            _SESSION = build(num_hosts)
        except TestbedError as e:
            _SESSION_ERROR = str(e)
            raise
        import atexit
        atexit.register(_SESSION.close)
    return _SESSION


def close_session() -> None:
    global _SESSION
    if _SESSION is not None:
        _SESSION.close()
        _SESSION = None


try:  # pytest fixtures (conftest.py registers them for every test)
    import pytest

    @pytest.fixture(scope="session")
    def testbed(request: pytest.FixtureRequest) -> Testbed:
        """The session's namespace testbed (4 hosts); skipped (a failure under CI=true) when it cannot be built."""
        try:
            tb = get()
        except TestbedError as e:
            pytest.skip(f"ssh testbed unavailable: {e}")
        request.config.add_cleanup(close_session)
        return tb

    @pytest.fixture
    def shared_out(testbed: Testbed) -> Iterator[Path]:
        """A fresh directory of the testbed's shared folder that every host can write (a job's
        results), removed after the test."""
        import uuid

        d = testbed.shared / uuid.uuid4().hex[:10]
        d.mkdir(mode=0o777)
        yield d
        shutil.rmtree(d, ignore_errors=True)
except ImportError:  # pragma: no cover - the command line works without pytest
    pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="build a testbed and leave it up; prints its description as JSON")
    up.add_argument("--hosts", type=int, default=3)
    down = sub.add_parser("down", help="remove a testbed (its state directory or number)")
    down.add_argument("which")
    a = ap.parse_args(argv)
    if a.cmd == "up":
        tb = build(a.hosts, owner=0)
        print(json.dumps(tb.describe(), indent=2))
        return 0
    which = a.which
    if which.isdigit():
        teardown(int(which))
    else:
        doc = json.loads((Path(which) / "testbed.json").read_text())
        teardown(int(doc["number"]), Path(which))
    return 0


if __name__ == "__main__":
    sys.exit(main())
