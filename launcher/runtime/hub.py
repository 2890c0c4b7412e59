"""The hub: where node agents connect to report their process, and receive the launcher's frames.

A backend whose processes run under a node agent (``launcher.node.agent``: the mpi rank
wrapper, the batch task wrapper) opens one hub per job, on an address every node reaches and
a free port of ``--port-range``, and tells the agents where it is. Each agent opens one TCP
connection, and both sides prove they hold the job's secret (``launcher.node.protocol``,
transport b). A connection is served only after that, only for a process of this job, and only
once per process; unauthenticated connections are bounded in number and in time, and what they
send before proving anything is bounded in size.

A stranger may hold idle connections open, from the very address the ranks connect from (a local
mpi job's ranks come from 127.0.0.1). So a new connection is never turned away for want of a slot:
it takes the slot of the oldest unauthenticated connection from its own address (beyond
:data:`PENDING_PER_SOURCE` of them), or the oldest of all (beyond :data:`PENDING_MAX`). A rank
proves the secret within milliseconds of its greeting; a stranger's idle connections are always
older, and go first. (Another address's connections are evicted only once the whole hub is
full: a stranger needs several addresses for that.) The whole hub holds :data:`PENDING_MAX`
more than the job has processes: every agent of a job may connect at the same moment (1,000
batch tasks started at once: ``scripts/sim_scale.py``), and a fixed 256 evicted some of the
job's own agents, which then ran without a connection to the launcher (docs/scale.md).

The listen backlog is as long as the job (at least 128, the kernel caps it at
``net.core.somaxconn``): a connection the backlog had no room for is dropped by the kernel and
its agent's SYN is sent again only 1 s later (then 3 s, 7 s). Each connection holds two
descriptors (its socket and the pump's copy), and a log file one more: the hub raises the soft
open-file limit for them (a login's usual 1,024 ran out at about 500 tasks, silently), and an
``accept`` that still runs out says so once and tries again a moment later.

Frames are read on the backend's pump thread (:class:`~launcher.runtime.output.PipePump`) and
handed to the process they are about (:class:`~launcher.runtime.remote.RemoteProcess`); signals
and placements go back on the same connection.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import resource
import socket
import threading
import time
from typing import Iterable, Mapping, Optional

from ..errors import LaunchError
from ..node import protocol
from . import limits
from .output import PipePump
from .remote import RemoteProcess

log = logging.getLogger(__name__)

# Connections that have not proven the job secret: how many may wait, from one source address and
# in all (beyond that the oldest is dropped), and how long.
PENDING_PER_SOURCE = 64  # (as many as the whole hub took before: a local job of 64 ranks connecting at once)
PENDING_MAX = 256  # (beyond the job's own processes: Hub.pending_max)
HANDSHAKE_WAIT = 15.0
#: descriptors the launcher holds per process of a hub: the connection, the pump's copy, a log file
FDS_PER_CONNECTION = 3


class _Conn:
    """One accepted connection: the handshake, then the frames of the process it proved to be."""

    def __init__(self, hub: Hub, sock: socket.socket, peer: tuple) -> None:
        self.hub = hub
        self.sock = sock
        self.source = peer[0]
        self.peer = f"{peer[0]}:{peer[1]}"
        self.nonce = os.urandom(16)
        self.since = time.monotonic()
        self.ident: int | None = None
        self.rejected = False
        self.buf = b""
        self.decoder = protocol.Decoder(protocol.MAX_FROM_NODE)
        self._send_lock = threading.Lock()  # signals and the placement come from different threads

    def feed(self, data: bytes) -> None:
        if self.rejected:
            return
        if self.ident is None:
            self.buf += data
            line, newline, data = self.buf.partition(b"\n")
            if not newline:
                if len(self.buf) > protocol.LINE_MAX:
                    self.reject("its greeting is too long")
                return
            self.buf = b""
            if not self._handshake(line):
                return
        procs = self.hub.procs
        for kind, ident, payload in self.decoder.feed(data):
            proc = procs.get(ident) if ident == self.ident else None
            if proc is None:
                log.debug("process %s's connection sent a frame %r for process %d: dropped", self.ident, kind, ident)
                continue
            proc.frame(kind, payload)

    def _handshake(self, line: bytes) -> bool:
        hub = self.hub
        try:
            ident_text, client_hex, mac = line.decode("ascii").split(" ")
            ident, client_nonce = int(ident_text), bytes.fromhex(client_hex)
        except ValueError:
            self.reject("it does not speak the node agents' protocol")
            return False
        expected = protocol.channel_mac(hub.secret, "client", self.nonce, client_nonce, ident)
        if not hmac.compare_digest(mac, expected):
            self.reject("it does not hold the job's secret")
            return False
        with hub.lock:
            evicted = self not in hub.pending  # (its slot went to a newer connection: it is being closed)
            taken = ident not in hub.idents or ident in hub.conns
            if not (taken or evicted):
                hub.conns[ident] = self
                hub.pending.discard(self)
        if evicted:
            return False
        if taken:
            self.reject(f"process {ident} is not in the job or already connected")
            return False
        self.ident = ident
        proc = hub.procs.get(ident)
        if proc is not None:
            proc.channel_opened()  # before the agent hears "ok" and starts its command
        try:
            proof = protocol.channel_mac(hub.secret, "server", self.nonce, client_nonce, ident)
            self.sock.send(f"ok {proof}\n".encode())  # a few bytes into an empty buffer
        except OSError:
            pass  # the agent sees the connection fail and falls back
        return True

    def send(self, data: bytes) -> bool:
        try:
            with self._send_lock:
                self.sock.sendall(data)
            return True
        except OSError:
            return False

    def reject(self, why: str) -> None:
        if not self.rejected:
            self.rejected = True
            self.hub.rejected(self.peer, why)
        with self.hub.lock:
            self.hub.pending.discard(self)  # no longer waited for (the sweep skips it)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the pump reads EOF and lets go of it
        except OSError:
            pass

    def closed(self) -> None:
        """The pump read EOF (and closed its copy of the descriptor)."""
        self.sock.close()
        with self.hub.lock:
            self.hub.pending.discard(self)
            if self.ident is not None and self.hub.conns.get(self.ident) is self:
                del self.hub.conns[self.ident]
        if self.ident is not None:
            proc = self.hub.procs.get(self.ident)
            if proc is not None:
                proc.channel_closed()


class Hub:
    """One job's hub (see the module docstring).

    Args:
        pump: reads the connections (the backend's pump: frames and its other pipes are
            handled on one thread).
        secret: the job's secret.
        sock: a TCP socket bound where the agents connect, an address of this host that every
            node reaches (a port of ``--port-range``: :func:`launcher.runtime.ports.bind_beside`);
            the hub listens on it, and closes it when it stops.
        idents: the process ids that may connect (:meth:`admit_new` adds one while the job runs).
        procs: the processes by process id, as the backend knows them (it may add to it while the
            agents connect); their frames and their connection's ends go to them.
    """

    def __init__(self, pump: PipePump, secret: str, sock: socket.socket, idents: Iterable[int],
                 procs: Mapping[int, RemoteProcess]) -> None:
        self.pump = pump
        self.secret = secret
        self.idents = set(idents)  # (read and changed with the lock held)
        self.procs = procs
        self.lock = threading.Lock()
        self.conns: dict[int, _Conn] = {}
        self.pending: set[_Conn] = set()
        self._warned = False
        self.sock = sock
        self.address: tuple[str, int] = sock.getsockname()[:2]
        #: unauthenticated connections held at most: every process of the job, and strangers
        self.pending_max = PENDING_MAX + len(self.idents)
        limits.raise_open_files(len(self.idents), per_process=FDS_PER_CONNECTION)
        self.sock.listen(max(128, len(self.idents)))  # (the kernel caps it at net.core.somaxconn)
        self._out_of_fds = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="pslaunch-hub", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self.sock.settimeout(0.25)
        while not self._stop.is_set():
            self._sweep()
            try:
                sock, peer = self.sock.accept()
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    self._no_descriptor(e)
                continue
            conn = _Conn(self, sock, peer)
            with self.lock:
                evicted = self._make_room(conn.source)
                self.pending.add(conn)
            if evicted is not None:
                evicted.reject(f"it was the oldest of {PENDING_PER_SOURCE} connections from its address (or "
                               f"{self.pending_max} in all) that had not proven the job's secret, and a new one came")
            try:
                sock.settimeout(5.0)
                sock.sendall(protocol.HELLO + conn.nonce.hex().encode() + b"\n")
                fd = os.dup(sock.fileno())
            except OSError:
                with self.lock:
                    self.pending.discard(conn)
                sock.close()
                continue
            self.pump.add(fd, conn.feed, conn.closed)

    def _no_descriptor(self, e: OSError) -> None:
        """``accept`` ran out of descriptors: said once (it was silent), and the next try a moment
        later rather than at once (the connection waits in the backlog meanwhile)."""
        if not self._out_of_fds:
            self._out_of_fds = True
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            log.warning("the node agents' port cannot take more connections: %s (open-file limit %d, hard %d; "
                        "raise it with ulimit -n)", e.strerror or e, soft, hard)
        self._stop.wait(0.1)

    def _make_room(self, source: str) -> Optional[_Conn]:
        """With the lock held: the oldest unauthenticated connection from ``source`` when that
        address has its share, else the oldest of all when the hub is full, taken out of the
        pending ones (the caller closes it); None when there is room."""
        same = [c for c in self.pending if c.source == source]
        if len(same) >= PENDING_PER_SOURCE:
            crowd = same
        elif len(self.pending) >= self.pending_max:
            crowd = list(self.pending)
        else:
            return None
        oldest = min(crowd, key=lambda c: c.since)
        self.pending.discard(oldest)
        return oldest

    def _sweep(self) -> None:
        """Connections that have not proven the secret in time are dropped."""
        now = time.monotonic()
        with self.lock:
            stale = [c for c in self.pending if now - c.since > HANDSHAKE_WAIT]
        for c in stale:
            c.reject("it did not finish the handshake in time")

    def rejected(self, peer: str, why: str) -> None:
        (log.debug if self._warned else log.warning)(
            "refused a connection to the node agents' port from %s: %s", peer, why)
        self._warned = True

    def admit_new(self) -> int:
        """A process id that no process of the job has had, admitted from now on: for a process the
        launcher starts while the job runs (a lost worker's replacement), so that nothing can connect
        as it before the launcher has started it, and the lost process's id is never taken over.

        Raises:
            LaunchError: every process id of the frames is taken.
        """
        with self.lock:
            ident = max(self.idents, default=-1) + 1
            if ident >= protocol.NODE:
                raise LaunchError(f"no process id is left for one more process (the frames have {protocol.NODE})")
            self.idents.add(ident)
        return ident

    def send(self, ident: int, signame: str) -> bool:
        """Send process ``ident``'s agent a signal (one of :data:`protocol.SIGNALS`); False if it has no
        connection."""
        return self._send(ident, protocol.signal_frame(ident, signame))

    def connected(self, ident: int) -> bool:
        """Whether process ``ident``'s agent is connected now."""
        with self.lock:
            return ident in self.conns

    def send_env(self, ident: int, env: Mapping[str, str]) -> bool:
        """Send process ``ident``'s agent its placement variables (``E``); False if it has no connection."""
        return self._send(ident, protocol.env_frame(ident, env))

    def _send(self, ident: int, data: bytes) -> bool:
        with self.lock:
            conn = self.conns.get(ident)
        return conn is not None and conn.send(data)

    def stop(self) -> None:
        self._stop.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() at once (Linux)
        except OSError:
            pass
        self._thread.join(2.0)
        self.sock.close()
        with self.lock:
            conns = list(self.conns.values())
        for c in conns:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def stop_all(hub: Optional[Hub], pump: Optional[PipePump]) -> None:
    """A backend's end: its hub stops (no new connection, the open ones shut down), then the pump
    that read them and the backend's other pipes."""
    if hub is not None:
        hub.stop()
    if pump is not None:
        pump.stop()
