"""The ssh backend: servers and workers on the hostfile's hosts, over paramiko.

Lifecycle (driven by the supervisor, see :mod:`launcher.backends.base`):

1. :meth:`SSHBackend.prepare`: resolve each host that gets a process through
   ``~/.ssh/config`` (:func:`launcher.sshconn.resolve_target`), connect to
   all of them in parallel (bounded fan-out, retries, strict host keys), then
   per host and in parallel: work out ``DMLC_NODE_HOST`` (the interface
   ``DMLC_INTERFACE`` selects on that host, found by sending
   ``launcher/netif.py`` to its ``python3``; without it, the address the
   connection reached) and, with ``--sync-dst-dir``, sync the working
   directory (:mod:`launcher.sync`).
2. :meth:`SSHBackend.start`: one session channel per process on the host's
   connection. The channel runs :func:`wrapper_command` (a few lines of
   Python that read ``ssh_remote.py`` from stdin and run it; nothing is
   installed); the argv, the environment and the working directory follow on
   stdin (:func:`wrapper_payload`), so no value ever appears on a command
   line. The wrapper starts the process in its own process group and reports
   its pid; output comes back framed (:class:`FrameDecoder`).
3. Supervision: the launcher sends a keep-alive byte to every wrapper each
   ``--ssh-keepalive`` seconds and each wrapper answers. A host silent for
   :data:`LOST_FACTOR` intervals is *lost*: its processes count as failed
   (exit code 255) and the job stops; the wrappers there stop their process
   groups on their own when the keep-alives stop reaching them.
4. Teardown: ``kill -s TERM -- -PGID ...`` (one command per host, on the
   same connection), ``KILL`` after ``--kill-grace``; then each channel is
   closed, and a wrapper whose channel closes kills what is left of its
   group. If the launcher dies (``kill -9``), sshd closes the channels and
   the wrappers do the same.

Every remote command line is built by a pure function here
(:func:`wrapper_command`, :func:`kill_command`, :func:`netif_command`,
:func:`prepare_dir_command`) with every argument ``shlex``-quoted.
"""

from __future__ import annotations

import collections
import concurrent.futures
import getpass
import json
import logging
import os
import queue
import shlex
import shutil
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from .. import envvars, netif
from ..errors import ConfigError, LaunchError
from ..output import ProcOutput
from ..plan import Plan, ProcSpec, place
from ..process import ProcessHandle
from ..spec import Host, JobSpec, SSHOptions
from ..sshconn import (
    HostSession,
    Target,
    connect_all,
    require_paramiko,
    resolve_target,
    resolve_targets,
)
from ..sync import SyncStats, parse_rsync_stats, rsync_argv, sftp_sync
from .base import Backend

if TYPE_CHECKING:  # pragma: no cover
    import paramiko

log = logging.getLogger(__name__)

REMOTE_PYTHON = "python3"
LOST_FACTOR = 4  # a host is lost after this many keep-alive intervals without a reply
EXIT_LOST = 255  # ssh's own code for "the connection failed"
FRAME = struct.Struct(">cI")
_HERE = Path(__file__).resolve().parent

# Reads exactly N bytes of wrapper source (N as 10 digits first) from stdin and runs it,
# leaving the rest of stdin (the header, keep-alives) to the wrapper.
BOOTSTRAP = """import os
def r(n):
 b=b""
 while len(b)<n:
  c=os.read(0,n-len(b))
  if not c:os._exit(255)
  b+=c
 return b
exec(compile(r(int(r(10))),"pslaunch-wrapper","exec"))"""


# --- pure builders (golden-tested) -----------------------------------------------------------


def wrapper_source() -> bytes:
    return (_HERE / "ssh_remote.py").read_bytes()


def wrapper_command(python: str = REMOTE_PYTHON) -> str:
    """The remote command of every process channel: the bootstrap, nothing job-specific."""
    return f"exec {shlex.quote(python)} -S -c {shlex.quote(BOOTSTRAP)}"


def wrapper_header(proc: ProcSpec, cwd: Optional[str], keepalive: float, grace: float) -> dict:
    """What the wrapper needs to start ``proc``: sent on stdin, never on a command line."""
    return {"argv": list(proc.argv), "env": dict(proc.env), "cwd": cwd, "keepalive": keepalive,
            "lost_after": LOST_FACTOR * keepalive, "grace": grace}


def wrapper_payload(header: Mapping, source: Optional[bytes] = None) -> bytes:
    """The bytes written to a process channel's stdin: wrapper source, then the header frame."""
    src = wrapper_source() if source is None else source
    body = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return b"%010d" % len(src) + src + FRAME.pack(b"H", len(body)) + body


def kill_command(signame: str, pgids: Sequence[int]) -> str:
    """``kill -s SIG -- -PGID ...`` for every process group; never a pgid below 2.

    ``-1`` would signal every process of the user and ``-0`` the shell's own group.
    """
    if signame not in ("TERM", "KILL", "ABRT", "INT"):
        raise ValueError(f"unexpected signal {signame!r}")
    groups = sorted({int(p) for p in pgids if int(p) > 1})
    if not groups:
        raise ValueError("no process group to signal")
    return f"kill -s {signame} -- {' '.join(f'-{g}' for g in groups)} 2>/dev/null; exit 0"


def netif_command(iface: str, python: str = REMOTE_PYTHON) -> str:
    """Runs ``netif.py`` (sent on stdin) on the host to resolve ``DMLC_INTERFACE`` there."""
    return f"{shlex.quote(python)} -S - {shlex.quote(iface)}"


def prepare_dir_command(path: str) -> str:
    """Create the sync target; print its absolute path and, when present, rsync's path."""
    q = shlex.quote(path)
    return f"mkdir -p -- {q} && cd -- {q} && pwd && {{ command -v rsync || true; }}"


class FrameDecoder:
    """Splits the wrapper's stdout into ``(kind, payload)`` frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self._buf += data
        frames = []
        while len(self._buf) >= FRAME.size:
            kind, length = FRAME.unpack_from(self._buf)
            if len(self._buf) < FRAME.size + length:
                break
            frames.append((kind, bytes(self._buf[FRAME.size:FRAME.size + length])))
            del self._buf[:FRAME.size + length]
        return frames

    @property
    def pending(self) -> int:
        return len(self._buf)


def interface_spec(spec: JobSpec) -> str:
    """``DMLC_INTERFACE`` as the job's processes get it (``--env`` wins over the environment)."""
    return (dict(spec.env).get(envvars.INTERFACE) or spec.environ_dict().get(envvars.INTERFACE) or "").strip()


def hosts_with_processes(spec: JobSpec) -> list[Host]:
    """The hostfile lines that get at least one process, in hostfile order."""
    used = {s.host for s in place(spec.num_workers, spec.num_servers, spec.hosts)}
    return [h for h in spec.hosts if h in used]


def _basic_target(host: Host, opts: SSHOptions) -> Target:
    """A target without ``~/.ssh/config`` (dry runs must not need paramiko)."""
    return Target(host=host, hostname=host.name, port=host.port or opts.port or 22,
                  user=host.user or opts.user or getpass.getuser(),
                  key_files=(opts.key,) if opts.key else ())


# --- one host at run time --------------------------------------------------------------------


class RemoteHost:
    """A connected host: its session, processes, keep-alives and signal queue."""

    def __init__(self, session: HostSession, spec: JobSpec) -> None:
        self.session = session
        self.spec = spec
        self.label = session.label
        self.node_address: Optional[str] = None
        self.workdir: Optional[str] = spec.workdir
        self.procs: list[SSHProcess] = []
        self.last_heard = time.monotonic()
        self.lost = False
        self.lost_reason = ""
        self.interval = max(0.1, spec.ssh.keepalive)
        self.lost_after = LOST_FACTOR * self.interval
        self._stop = threading.Event()
        self._signals: queue.Queue[tuple[str, SSHProcess]] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start_threads(self) -> None:
        if self._threads:
            return
        for target, name in ((self._keepalive_loop, "keepalive"), (self._signal_loop, "signals")):
            t = threading.Thread(target=target, name=f"pslaunch-{name}-{self.label}", daemon=True)
            t.start()
            self._threads.append(t)

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def _keepalive_loop(self) -> None:
        while not self._stop.wait(self.interval):
            open_procs = [p for p in self.procs if p.chan is not None and not p.closed]
            for p in open_procs:
                p.send_keepalive()
            waiting = [p for p in open_procs if p.running]
            silent = time.monotonic() - self.last_heard
            if waiting and silent > self.lost_after and not self.lost:
                self.mark_lost(f"no reply to keep-alives for {silent:.0f}s")

    def mark_lost(self, why: str) -> None:
        with self._lock:
            if self.lost:
                return
            self.lost = True
            self.lost_reason = why
        running = [p for p in self.procs if p.running]
        log.error("host %s is lost: %s (link down, host down or sshd gone); its %d running process%s "
                  "count as failed (exit code %d); the wrappers there stop them once the keep-alives stop",
                  self.label, why, len(running), "" if len(running) == 1 else "es", EXIT_LOST)
        for p in running:
            p.set_lost()

    def signal(self, signame: str, proc: SSHProcess) -> None:
        self._signals.put((signame, proc))

    def _signal_loop(self) -> None:
        while True:
            item = self._signals.get()
            if item is None:  # type: ignore[comparison-overlap]
                return
            batch: dict[str, list[SSHProcess]] = collections.defaultdict(list)
            batch[item[0]].append(item[1])
            time.sleep(0.01)  # the supervisor signals every process in one loop: batch them
            while True:
                try:
                    more = self._signals.get_nowait()
                except queue.Empty:
                    break
                if more is None:  # type: ignore[comparison-overlap]
                    self._signals.put(None)  # type: ignore[arg-type]
                    break
                batch[more[0]].append(more[1])
            for signame, procs in batch.items():
                pgids = [p.pgid for p in procs if p.pgid and not p.closed and p.running]
                if not pgids or self.lost or not self.session.active:
                    continue
                try:
                    r = self.session.exec(kill_command(signame, pgids), timeout=max(5.0, self.lost_after))
                    log.debug("%s: kill -%s %s: exit %d", self.label, signame, pgids, r.code)
                except LaunchError as e:
                    log.debug("%s: kill -%s failed: %s", self.label, signame, e)

    def close(self) -> None:
        """Stop the threads, close every channel (the wrappers then stop their groups), disconnect.

        A kill command still in flight is waited for (briefly): its login shell is left to finish.
        """
        self._stop.set()
        self._signals.put(None)  # type: ignore[arg-type]
        for t in self._threads:
            if t.name.startswith("pslaunch-signals") and not self.lost:
                t.join(5.0)
        for p in self.procs:
            p.close_channel()
        self.session.close()


# --- the process handle --------------------------------------------------------------------


class SSHProcess(ProcessHandle):
    """A server or worker on a remote host, under the wrapper, on one ssh channel."""

    def __init__(self, proc: ProcSpec, output: ProcOutput, host: RemoteHost) -> None:
        super().__init__(proc, output, host.label)
        self.remote = host
        self.chan: Optional[paramiko.Channel] = None
        self.pgid: Optional[int] = None
        self._code: Optional[int] = None
        self.failure: Optional[str] = None
        self.failure_code = 1
        self.lost = False
        self.closed = False
        self.started = threading.Event()
        self.first_output: Optional[float] = None
        self.spawned_at: Optional[float] = None
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=5)
        self._reader: Optional[threading.Thread] = None

    # -- starting -------------------------------------------------------------------------

    def launch(self) -> None:
        """Open the channel, start the wrapper and send it the process (returns at once)."""
        import paramiko

        spec = self.remote.spec
        header = wrapper_header(self.proc, self.remote.workdir, self.remote.interval, spec.kill_grace)
        chan = self.remote.session.open_channel()
        self.chan = chan
        try:
            chan.settimeout(0.5)
            chan.exec_command(wrapper_command())
            chan.sendall(wrapper_payload(header))
        except (paramiko.SSHException, EOFError, OSError) as e:
            self.closed = True
            chan.close()
            raise LaunchError(f"{self.label}: cannot start the remote wrapper on {self.host}: {e}") from None
        self._reader = threading.Thread(target=self._read, name=f"pslaunch-{self.name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        import paramiko

        chan = self.chan
        assert chan is not None
        decoder = FrameDecoder()
        while True:
            self._drain_stderr()
            try:
                data = chan.recv(65536)
            except socket.timeout:
                if self.closed:
                    break
                continue
            except (paramiko.SSHException, EOFError, OSError):
                data = b""
            if not data:
                break
            self.remote.heard()
            for kind, payload in decoder.feed(data):
                self._frame(kind, payload)
        self._drain_stderr()
        if self._code is None:
            status = chan.recv_exit_status() if chan.exit_status_ready() else None
            if self.closed and self.started.is_set():
                pass  # we closed the channel ourselves (teardown, a failed start): no news is expected
            elif not self.lost:
                tail = f": {self._stderr_tail[-1]}" if self._stderr_tail else ""
                if not self.started.is_set():
                    self.failure = (f"the remote wrapper on {self.host} ended before starting the process "
                                    f"(ssh exit status {status}){tail}; the ssh backend needs python3 >= 3.5 "
                                    "on every host")
                    self.failure_code = status if status not in (None, 0) else EXIT_LOST
                else:
                    log.error("%s: the connection to %s ended without an exit code (ssh exit status %s)%s",
                              self.label, self.host, status, tail)
                self._code = status if status not in (None, 0) else EXIT_LOST
        self.closed = True
        self.started.set()
        self.output.close()
        self.remote.session.channel_closed()

    def _frame(self, kind: bytes, payload: bytes) -> None:
        if kind == b"o" or kind == b"e":
            if self.first_output is None:
                self.first_output = time.monotonic()
            (self.output.stdout if kind == b"o" else self.output.stderr).feed(payload)
        elif kind == b"p":
            info = json.loads(payload)
            self.pid, self.pgid = int(info["pid"]), int(info["pgid"])
            self.start_time = time.time()
            self.spawned_at = time.monotonic()
            self.started.set()
        elif kind == b"x":
            self._code = int(json.loads(payload)["code"])
        elif kind == b"f":
            info = json.loads(payload)
            self.failure = str(info.get("error"))
            self.failure_code = int(info.get("code", 1))
            self._code = self.failure_code
            self.started.set()

    def _drain_stderr(self) -> None:
        chan = self.chan
        while chan is not None and chan.recv_stderr_ready():
            data = chan.recv_stderr(65536)
            if not data:
                break
            text = data.decode(errors="replace")
            self._stderr_tail.extend(x for x in text.splitlines() if x.strip())
            self.output.stderr.feed(data)

    # -- the ProcessHandle interface ----------------------------------------------------------

    def _poll(self) -> int | None:
        return self._code

    @property
    def running(self) -> bool:
        """No exit code yet (the reader thread's view; :meth:`poll` is the supervisor's)."""
        return self._code is None

    def set_lost(self) -> None:
        self.lost = True
        if self._code is None:
            self._code = EXIT_LOST
        self.output.close()  # nothing more will come; the supervisor need not wait for it

    def send_keepalive(self) -> None:
        chan = self.chan
        if chan is None or self.closed:
            return
        try:
            chan.send(b"k")
        except Exception:  # noqa: BLE001 - a closed channel: the reader notices
            pass

    def terminate(self) -> None:
        self.remote.signal("TERM", self)

    def kill(self) -> None:
        self.remote.signal("KILL", self)

    def dump_stacks(self) -> None:
        self.remote.signal("ABRT", self)

    def cleanup(self, groups: Optional[Mapping[int, list[int]]] = None) -> None:
        """Tell the wrapper the job is over: it kills what is left of the group and exits.

        ``groups`` (the local process table) does not apply to remote processes.
        """
        chan = self.chan
        if chan is None or self.closed or self.lost or self.remote.lost:
            return
        try:
            chan.shutdown_write()
        except Exception:  # noqa: BLE001
            pass

    def close_channel(self) -> None:
        chan = self.chan
        if chan is not None:
            self.closed = True
            try:
                chan.close()
            except Exception:  # noqa: BLE001
                pass

    def describe(self) -> str:
        where = f"on {self.host}" + (f", pid {self.pid}" if self.pid else "")
        if self.lost:
            where += f"; host lost: {self.remote.lost_reason}"
        return f"{self.label} ({where})"


# --- the backend ----------------------------------------------------------------------------


class SSHBackend(Backend):
    """``--launcher ssh``: see the module docstring."""

    name = "ssh"
    remote = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hosts: dict[tuple, RemoteHost] = {}
        self._adopted: dict[tuple, RemoteHost] = {}
        self.by_line: dict[Host, RemoteHost] = {}
        self.handles: list[SSHProcess] = []
        self.sync_stats: dict[str, SyncStats] = {}
        self.timings: dict[str, float] = {}
        self._rsyncs: set[subprocess.Popen] = set()
        self._closing = False
        self._lock = threading.Lock()

    # -- dry run ---------------------------------------------------------------------------

    @classmethod
    def dry_run(cls, spec: JobSpec, plan: Plan) -> list[str]:
        lines = [f"ssh: one connection per host; every process is one channel running "
                 f"\"exec {REMOTE_PYTHON} -S -c '<bootstrap>'\", which reads pslaunch's remote wrapper, then "
                 "the process's argv, environment and directory from the channel's stdin (never a command line)"]
        per_host: dict[Host, list[str]] = collections.defaultdict(list)
        for p in plan.procs:
            if p.host is not None:
                per_host[p.host].append(p.label.split(" @ ")[0])
        cwd = spec.sync_dst_dir or spec.workdir or "."
        for host, labels in per_host.items():
            t = _basic_target(host, spec.ssh)
            lines.append(f"  {host.display}: {t.address}, cwd {cwd}: {', '.join(labels)}")
        if spec.sync_dst_dir:
            lines.append("sync (rsync when both ends have it, else SFTP):")
            for host in per_host:
                argv = rsync_argv(spec.workdir or ".", spec.sync_dst_dir, _basic_target(host, spec.ssh),
                                  excludes=spec.ssh.sync_exclude, delete=spec.ssh.sync_delete,
                                  connect_timeout=spec.ssh.connect_timeout, config_file=None)
                lines.append("  " + shlex.join(argv))
        iface = interface_spec(spec)
        if iface:
            lines.append(f"DMLC_NODE_HOST: each host's address on DMLC_INTERFACE={iface}, resolved there before launch")
        return lines

    # -- prepare ------------------------------------------------------------------------------

    def check(self) -> None:
        require_paramiko()

    def prepare(self) -> Mapping[Optional[Host], Optional[str]]:
        spec = self.spec
        lines = hosts_with_processes(spec)
        targets = resolve_targets(lines, spec.ssh)
        t0 = time.monotonic()
        sessions = connect_all(targets, spec.ssh, on_connect=self._adopt)
        self.timings["connect"] = time.monotonic() - t0
        ordered = {t.ident: self._adopted[t.ident] for t in targets}  # hostfile order, for messages
        self.hosts = ordered
        for line, target in zip(lines, targets):
            self.by_line[line] = self.hosts[target.ident]
        log.debug("connected to %d host%s in %.2fs", len(sessions), "" if len(sessions) == 1 else "s",
                  self.timings["connect"])
        t1 = time.monotonic()
        self._per_host(self._resolve_address, "resolve")
        self.timings["resolve"] = time.monotonic() - t1
        if spec.sync_dst_dir:
            t2 = time.monotonic()
            self._per_host(self._sync, "sync")
            self.timings["sync"] = time.monotonic() - t2
        else:
            self.timings["sync"] = 0.0
        return {line: self.by_line[line].node_address for line in lines}

    def _adopt(self, session: HostSession) -> None:
        with self._lock:
            if self._closing:
                session.close()
                raise LaunchError(f"{session.label}: the launcher is stopping")
            host = RemoteHost(session, self.spec)
            self._adopted[session.target.ident] = host
            self.hosts[session.target.ident] = host  # close() reaches it from now on

    def _per_host(self, fn: object, what: str) -> None:
        """Run ``fn(host)`` for every host in parallel; raise the first error in hostfile order."""
        hosts = list(self.hosts.values())
        errors: dict[int, BaseException] = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(hosts))),
                                                   thread_name_prefix=f"pslaunch-{what}") as pool:
            futures = {pool.submit(fn, h): i for i, h in enumerate(hosts)}  # type: ignore[arg-type]
            for fut in concurrent.futures.as_completed(futures):
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001 - re-raised below
                    errors[futures[fut]] = e
        if errors:
            first = errors[min(errors)]
            more = len(errors) - 1
            suffix = f" ({more} more host{'s' if more > 1 else ''} failed too)" if more else ""
            if isinstance(first, ConfigError):
                raise ConfigError(f"{first}{suffix}") from None
            if isinstance(first, LaunchError):
                raise LaunchError(f"{first}{suffix}", exit_code=first.exit_code) from None
            raise LaunchError(f"{what}: {first}{suffix}") from None

    def _resolve_address(self, host: RemoteHost) -> None:
        iface = interface_spec(self.spec)
        if not iface:
            address = host.session.peer_address
            for candidate in (address, host.session.target.hostname):
                try:
                    host.node_address = netif.resolve_ipv4(candidate)
                    return
                except netif.NetifError:
                    continue
            raise ConfigError(f"{host.label}: no IPv4 address for DMLC_NODE_HOST (the connection reached "
                              f"{address}; ps-lite needs IPv4): set DMLC_INTERFACE to the host's IPv4 network")
        source = (Path(netif.__file__)).read_bytes()
        r = host.session.exec(netif_command(iface), stdin=source)
        try:
            doc = json.loads(r.stdout.decode(errors="replace").strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise LaunchError(f"{host.label}: cannot resolve DMLC_INTERFACE={iface} there: {REMOTE_PYTHON} "
                              f"failed ({r.err_line}); the ssh backend needs python3 >= 3.7 on every host") from None
        if "error" in doc:
            raise ConfigError(f"{host.label}: {doc['error']}; set DMLC_INTERFACE to a name or CIDR that every "
                              "host has (a CIDR such as 10.1.0.0/16 works when names differ)")
        host.node_address = str(doc["address"])
        log.debug("%s: DMLC_INTERFACE=%s is %s (%s)", host.label, iface, doc.get("interface"), host.node_address)

    def _sync(self, host: RemoteHost) -> None:
        spec = self.spec
        src = spec.workdir or os.getcwd()
        dst = spec.sync_dst_dir or ""
        t0 = time.monotonic()
        r = host.session.exec(prepare_dir_command(dst))
        if r.code != 0:
            raise LaunchError(f"sync to {host.label}:{dst} failed: cannot create the directory: {r.err_line}")
        out = r.stdout.decode(errors="replace").splitlines()
        abs_dst = out[0].strip() if out else dst
        remote_rsync = len(out) > 1 and bool(out[1].strip())
        host.workdir = abs_dst
        local_tools = shutil.which("rsync") is not None and shutil.which("ssh") is not None
        if local_tools and remote_rsync:
            stats = self._rsync(host, src, abs_dst)
        else:
            why = "no rsync here" if not local_tools else "no rsync on the host"
            log.debug("%s: syncing over SFTP (%s)", host.label, why)
            try:
                sftp = host.session.sftp()
                try:
                    stats = sftp_sync(sftp, src, abs_dst, excludes=spec.ssh.sync_exclude,
                                      delete=spec.ssh.sync_delete)
                finally:
                    sftp.close()
            except OSError as e:
                raise LaunchError(f"sync to {host.label}:{abs_dst} failed (SFTP): {e}") from None
        stats.seconds = time.monotonic() - t0
        self.sync_stats[host.label] = stats
        log.info("synced %s to %s:%s with %s: %d file%s, %s sent%s in %.1fs", src, host.label, abs_dst,
                 stats.method, stats.files, "" if stats.files == 1 else "s", _size(stats.bytes),
                 f", {stats.deleted} deleted" if stats.deleted else "", stats.seconds)

    def _rsync(self, host: RemoteHost, src: str, dst: str) -> SyncStats:
        spec = self.spec
        target = host.session.target
        argv = rsync_argv(src, dst, target, excludes=spec.ssh.sync_exclude, delete=spec.ssh.sync_delete,
                          connect_timeout=spec.ssh.connect_timeout, config_file=target.config_file)
        log.debug("%s: %s", host.label, shlex.join(argv))
        with self._lock:
            if self._closing:
                raise LaunchError(f"sync to {host.label}: the launcher is stopping")
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, errors="replace")
            self._rsyncs.add(p)
        try:
            out, err = p.communicate()
        finally:
            with self._lock:
                self._rsyncs.discard(p)
        if p.returncode != 0:
            lines = [x for x in err.splitlines() if x.strip()]
            reason = lines[0] if lines else f"exit code {p.returncode}"
            raise LaunchError(f"sync to {host.label}:{dst} failed: rsync exited with code {p.returncode}: "
                              f"{reason}")
        files, sent = parse_rsync_stats(out)
        return SyncStats("rsync", files=files, bytes=sent)

    # -- start ---------------------------------------------------------------------------

    def start(self, procs: Sequence[ProcSpec]) -> list[ProcessHandle]:
        t0 = time.monotonic()
        handles: list[SSHProcess] = []
        try:
            per_host: dict[int, list[SSHProcess]] = collections.defaultdict(list)
            for p in procs:
                if p.host is None or p.host not in self.by_line:
                    raise LaunchError(f"{p.label}: no connection to its host (internal error)")
                host = self.by_line[p.host]
                h = SSHProcess(p, self.console.proc(p.name, p.label, str(p.role)), host)
                handles.append(h)
                host.procs.append(h)
                per_host[id(host)].append(h)
            self.handles.extend(handles)
            for host in {id(h.remote): h.remote for h in handles}.values():
                host.heard()
                host.start_threads()

            def launch_all(group: list[SSHProcess]) -> None:
                for h in group:
                    h.launch()

            self._run_parallel(launch_all, list(per_host.values()))
            deadline = time.monotonic() + max(self.spec.start_timeout, 1.0)
            for h in handles:
                if not h.started.wait(max(0.0, deadline - time.monotonic())):
                    raise LaunchError(f"{h.label}: the remote wrapper on {h.host} did not start the process "
                                      f"within --start-timeout {self.spec.start_timeout:g}s")
                if h.failure is not None:
                    raise LaunchError(f"{h.label}: {h.failure}", exit_code=h.failure_code)
        except BaseException:
            self._abort(handles)
            raise
        self.timings["spawn"] = time.monotonic() - t0
        log.debug("started %d process%s in %.2fs", len(handles), "" if len(handles) == 1 else "es",
                  self.timings["spawn"])
        return list(handles)

    @staticmethod
    def _run_parallel(fn: object, groups: list) -> None:
        errors: list[BaseException] = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(groups))),
                                                   thread_name_prefix="pslaunch-start") as pool:
            for fut in [pool.submit(fn, g) for g in groups]:  # type: ignore[arg-type]
                try:
                    fut.result()
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
        if errors:
            raise errors[0]

    def _abort(self, handles: Sequence[SSHProcess]) -> None:
        """A start failed or was interrupted: kill everything it started, now, then close the channels
        (a wrapper whose channel closes stops its group too, should the kill not get through)."""
        groups: dict[int, tuple[RemoteHost, list[int]]] = {}
        for h in handles:
            if h.pgid and h.running and not h.remote.lost:
                groups.setdefault(id(h.remote), (h.remote, []))[1].append(h.pgid)
        for host, pgids in groups.values():
            try:
                host.session.exec(kill_command("KILL", pgids), timeout=5.0)
            except (LaunchError, ValueError) as e:
                log.debug("%s: kill after a failed start: %s", host.label, e)
        for h in handles:
            h.close_channel()

    # -- close --------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
            rsyncs = list(self._rsyncs)
        for p in rsyncs:
            p.kill()
        hosts = list(self.hosts.values())
        live = [h for h in hosts if not h.lost]
        for h in live:
            h.close()
        lost = [h for h in hosts if h.lost]
        if lost:  # closing a connection to a lost host may block: do it in the background
            t = threading.Thread(target=lambda: [h.close() for h in lost], daemon=True,
                                 name="pslaunch-close-lost")
            t.start()
            t.join(2.0)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


__all__ = ["SSHBackend", "SSHProcess", "FrameDecoder", "wrapper_command", "wrapper_payload", "wrapper_header",
           "kill_command", "netif_command", "prepare_dir_command", "BOOTSTRAP", "resolve_target"]
