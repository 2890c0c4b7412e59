"""ZeroMQ plumbing shared by the scheduler, the servers and the workers.

* :class:`Link`: our end of a connection to a ROUTER (a DEALER socket), with
  the client side of the handshake and a :class:`~trainer.kv.protocol.Session`.
* :class:`Hub`: a bound ROUTER socket, with an :class:`~trainer.kv.protocol.Acceptor`,
  its gate and its connection table (below).
* :func:`node_address` and :func:`bind`: ps-lite's bind-address order and
  ports (ephemeral, or from ``PS_PORT_RANGE``).
* :class:`Verbose`: ``PS_VERBOSE`` lines, labelled like ps-lite (``H``,
  ``S[0]``, ``W[1]``), through the ``trainer.kv`` loggers.

**Before authentication** a peer can cost a process only a bounded amount of
memory, whoever it is:

1. *The gate.* Every ROUTER runs ZeroMQ's PLAIN mechanism and answers its ZAP
   requests itself (:meth:`Hub.service`): a connection is admitted only with the
   password :func:`~trainer.kv.protocol.gate_token`, derived from the job secret.
   Until then libzmq passes nothing to the application and buffers at most one
   handshake frame. Without the gate a peer could send one endless multipart
   message, which libzmq holds until it completes, whatever the size limits.
2. *Frame size.* No socket accepts a frame over
   :data:`~trainer.kv.protocol.MAX_FRAME` (``ZMQ_MAXMSGSIZE``); arrays travel
   in parts of at most :data:`~trainer.kv.protocol.CHUNK_BYTES`.
3. *Connection count, age and chatter.* The ROUTER's monitor reports every
   accepted connection with its file descriptor; at most
   :data:`MAX_UNAUTHENTICATED` connections that have not completed our
   handshake are kept, none for longer than
   :data:`~trainer.kv.protocol.HANDSHAKE_SECONDS`, and none that sent more than
   :data:`MAX_UNAUTHENTICATED_MESSAGES` messages (a HELLO flood). Over the bound,
   the address with the most such connections loses first, its chattiest, then
   its oldest; real peers reconnect and repeat their HELLO. A connection is
   dropped by ``shutdown()`` of its socket, after checking that the descriptor
   still is that connection; libzmq then closes it as if the peer had.

So a stranger holds at most ``MAX_UNAUTHENTICATED x MAX_FRAME`` (48 MB) of a
process, for seconds. What it cannot do is tell a real peer's pending
connection from its own when both come from one address: then the bounds hold,
and real peers win by retrying.

Socket discipline: every receive is bounded by a poll timeout, every socket
has an explicit linger, ROUTERs are ``ROUTER_MANDATORY`` so a vanished peer
is an error rather than a silent drop, and high-water marks are off because
the protocol bounds what is in flight (one reply per request).
"""

from __future__ import annotations

import errno
import hmac
import logging
import socket
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any

import zmq

import pscontract as pc
from pscontract import ClusterEnv, netif

from ..memory import keep_freed_memory
from . import protocol as P
from .errors import KVAuthError, KVConfigError, KVTimeoutError

logger = logging.getLogger(__name__)

#: Linger (ms) for sockets closed at the end of a clean run: enough to flush goodbyes.
CLEAN_LINGER_MS = 2000
#: Connections that have not completed our handshake, kept at most per ROUTER.
MAX_UNAUTHENTICATED = 32
#: Messages a connection may send before it completes our handshake (a real peer sends a
#: HELLO every 0.25 to 2 s, and one AUTH).
MAX_UNAUTHENTICATED_MESSAGES = 16
#: A client repeats its HELLO after this long without a challenge, doubling up to 2 s.
HELLO_RETRY = 0.25
_PLAIN_USER = b"pslaunch"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
# Plain ints: pyzmq's enum flags cost microseconds per operation on the hot path.
_SNDMORE, _EVENTS, _POLLIN, _NOBLOCK = int(zmq.SNDMORE), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
_E_CONNECTED = int(zmq.EVENT_CONNECTED)
_E_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_E_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_E_HS_OK = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_E_HS_AUTH = int(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# A peer that closes before its handshake (the launcher's "does it listen" probe) fails
# with NO_DETAIL; garbage, the wrong mechanism or an oversized frame with PROTOCOL.
_E_HS_NO_DETAIL = int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_E_HS_FAILED = int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


class Verbose:
    """ps-lite style lifecycle (level 1) and per-message (level 2) log lines.

    Args:
        level: ``PS_VERBOSE``.
        who: the node's short name, ``H`` (scheduler), ``S[r]`` or ``W[r]``;
            updated once the rank is known.
    """

    def __init__(self, level: int, who: str) -> None:
        self.level = level
        self.who = who
        self.messages = level >= 2

    def __call__(self, msg: str, *args: Any) -> None:
        if self.level >= 1:
            logger.info("%s " + msg, self.who, *args)

    def sent(self, peer: str, cmd: int, key: int, part: int, nbytes: int,
             count: int = 0) -> None:
        items = f" items={count}" if cmd in P.BATCH_COMMANDS else ""
        logger.info("%s => %s: cmd=%s key=%d part=%d%s bytes=%d", self.who, peer,
                    P.COMMAND_NAMES.get(cmd, cmd), key, part, items, nbytes)

    def received(self, peer: str, msg: P.Message) -> None:
        logger.info("%s <= %s: %s", self.who, peer, msg.describe())


def setup_logging(verbose: int, *, force: bool = False) -> None:
    """Make ``PS_VERBOSE`` lines and errors visible on stderr.

    With ``force`` (the scheduler and server roles, which own their process)
    a handler is always installed; otherwise (a worker inside the user's
    program) only when the program has configured no logging at all.
    """
    kv_logger = logging.getLogger("trainer.kv")
    if verbose > 0:
        kv_logger.setLevel(logging.INFO)
    if force or not kv_logger.hasHandlers():  # (the trainer's own handler, or the program's)
        if not any(getattr(h, "_pslaunch_kv", False) for h in kv_logger.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
            handler._pslaunch_kv = True  # type: ignore[attr-defined]
            kv_logger.addHandler(handler)
            kv_logger.propagate = False
            if kv_logger.level == logging.NOTSET:
                kv_logger.setLevel(logging.WARNING)


def node_address(env: ClusterEnv) -> str:
    """The IPv4 address this node binds and advertises, in ps-lite's order
    (:func:`pscontract.netif.node_address`: the rule every node of a job follows)."""
    try:
        return netif.node_address(env.interface, env.root_uri, env.node_host)
    except netif.NetifError as e:
        raise KVConfigError(f"cannot work out this node's address: {e}") from None


def scheduler_address(env: ClusterEnv) -> str:
    """``DMLC_PS_ROOT_URI`` as an IPv4 address (zmq binds and connects to addresses)."""
    try:
        return netif.resolve_ipv4(env.root_uri)
    except netif.NetifError as e:
        raise KVConfigError(f"{pc.ROOT_URI}: {e}") from None


def bind(sock: zmq.Socket, host: str, port: int = 0,
         port_range: tuple[int, int] | None = None, what: str = "this node") -> int:
    """Bind ``sock`` on ``host`` to ``port``, the first free port of ``port_range``
    (:func:`pscontract.first_free_port`), or an ephemeral one."""
    def attempt(p: int | str) -> None:
        sock.bind(f"tcp://{host}:{p}")

    def take(p: int) -> bool | None:
        try:
            attempt(p)
            return True
        except zmq.ZMQError as e:
            if e.errno in pc.PORT_TAKEN:
                return None
            raise

    try:
        if port:
            attempt(port)
            return port
        if port_range is not None:
            lo, hi = port_range
            found = pc.first_free_port(lo, hi, take)
            if found is None:
                raise KVConfigError(f"no free port in {pc.PORT_RANGE}={lo}-{hi} on {host} for {what}; "
                                    "widen the range")
            return found[0]
        attempt("*")
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        return int(endpoint.rsplit(":", 1)[1])
    except zmq.ZMQError as e:
        shown = port or "an ephemeral port"
        hint = ("another process holds the port: pick another one"
                if e.errno == errno.EADDRINUSE else
                f"the address must belong to this host (check {pc.NODE_HOST}, {pc.INTERFACE} "
                f"and {pc.ROOT_URI})")
        raise KVConfigError(f"cannot bind {what} to {host}:{shown}: {e.strerror}; {hint}") from None


_MONITOR_EVENT = struct.Struct("=HI")


def _monitor_events(monitor: zmq.Socket) -> list[tuple[int, int]]:
    """``(event, value)`` for every waiting monitor message (value: the fd for
    connection events). Parsed here rather than with ``zmq.utils.monitor``,
    which imports asyncio and slows the start of the scheduler."""
    out = []
    while monitor.poll(0):
        try:
            frames = monitor.recv_multipart(zmq.NOBLOCK)
        except zmq.ZMQError:
            break
        if frames and len(frames[0]) >= _MONITOR_EVENT.size:
            out.append(_MONITOR_EVENT.unpack_from(frames[0]))
    return out


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """One multipart message as frames, without copies: ``recv_multipart(copy=False)`` less
    its ``RCVMORE`` question after every frame (an enum conversion and a call into libzmq
    each): a received frame says itself whether more follow. 3 us less per message."""
    recv = sock.recv
    frame = recv(flags, copy=False)
    frames = [frame]
    while frame.more:
        frame = recv(flags, copy=False)
        frames.append(frame)
    return frames


def bulk_context() -> zmq.Context:
    """A ZeroMQ context for a process that moves arrays (a server, a worker's client).

    Every received part is a fresh ZeroMQ message of up to 1 MB. With glibc's defaults its
    I/O thread's arena hands the freed memory back to the kernel (``madvise``) and the next
    message faults it in again, page by page: 4,096 page faults per 16 MB received, a fifth of
    a core on a 2-core machine at 1.3 GB/s. :func:`trainer.memory.keep_freed_memory` makes
    16 MB push+pull a third faster.
    """
    keep_freed_memory()
    return zmq.Context()


_COPY_BELOW = 128 << 10


def _tune(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(P.HANDSHAKE_SECONDS * 1000))
    # pyzmq sends a frame of 64 KB or more without copying it, through a thread that tracks
    # when ZeroMQ is done with it: 17 us a frame, more than copying 64 KB. Copy below 128 KB
    # (a 64 KB push+pull: 418 -> 356 us, median of 5 interleaved; at 256 KB not copying stays
    # faster).
    sock.copy_threshold = _COPY_BELOW


def describe_connect_error(err: BaseException) -> str:
    """Why a TCP connection failed, in words a user can act on."""
    if isinstance(err, (socket.timeout, TimeoutError)):
        return "timed out (no answer: a firewall, or a host that is down)"
    code = getattr(err, "errno", None)
    if code == errno.ECONNREFUSED:
        return "connection refused (nothing listens on that port)"
    if code in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return f"{'host' if code == errno.EHOSTUNREACH else 'network'} unreachable (no route)"
    if code == errno.ETIMEDOUT:
        return "timed out (no answer: a firewall, or a host that is down)"
    return getattr(err, "strerror", None) or str(err) or type(err).__name__


def probe_tcp(host: str, port: int, timeout: float) -> str | None:
    """Try a plain TCP connection; None when it works, else why it does not."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as e:
        return describe_connect_error(e)


class Link:
    """Our authenticated connection to one peer's ROUTER socket (a DEALER).

    The handshake is driven step by step, so that a caller can wait on several
    links and other sockets at once: :meth:`start`, then :meth:`advance` with
    each received message and :meth:`tick` now and then, until :attr:`session`
    is set. :meth:`handshake` does all of it for one link.

    Args:
        ctx: the process's context.
        host: the peer's address.
        port: the peer's port.
        secret: the job's HMAC key.
        name: the peer's name for messages, e.g. ``"the scheduler at 10.0.0.1:9091"``.
        mac_payload: MAC tensor payloads we send.
        verbose: ``PS_VERBOSE`` logging.
    """

    def __init__(self, ctx: zmq.Context, host: str, port: int, secret: bytes, name: str,
                 short: str, mac_payload: bool, verbose: Verbose) -> None:
        self.name = name
        self.short = short
        self.host, self.port = host, port
        self.endpoint = f"{host}:{port}"
        self._secret = secret
        self._mac_payload = mac_payload
        self._v = verbose
        self.sock = ctx.socket(zmq.DEALER)
        _tune(self.sock)
        self.sock.setsockopt(zmq.PLAIN_USERNAME, _PLAIN_USER)
        self.sock.setsockopt(zmq.PLAIN_PASSWORD, P.gate_token(secret))
        self.monitor: zmq.Socket | None = self.sock.get_monitor_socket(
            _E_CONNECTED | _E_DISCONNECTED | _E_HS_OK | _E_HS_AUTH)
        self.sock.connect(f"tcp://{host}:{port}")
        self.session: P.Session | None = None
        self.drops = P.DropCounter()
        #: TCP connections made to the peer so far, and whether one is open now.
        self.connects = 0
        self.connected = False
        self.gate_passed = False
        self.gate_denied = False
        self.closed_by_peer = False
        self._hs: P.ClientHandshake | None = None
        self._earlier: list[P.ClientHandshake] = []
        self._pending: P.Session | None = None
        self._retry_at = 0.0
        self._retry = HELLO_RETRY

    # --- connection state ---------------------------------------------------------
    def events(self) -> None:
        """Read the monitor: connections made and lost, the gate passed or refused."""
        if self.monitor is None:
            return
        for event, _ in _monitor_events(self.monitor):
            if event == _E_CONNECTED:
                self.connects += 1
                self.connected = True
            elif event == _E_DISCONNECTED:
                self.connected = False
                if self.session is not None:
                    self.closed_by_peer = True
            elif event == _E_HS_OK:
                self.gate_passed = True
            elif event == _E_HS_AUTH:
                self.gate_denied = True

    def peer_closed(self) -> bool:
        """True once the peer closed the connection after our handshake."""
        self.events()
        return self.closed_by_peer

    # --- the handshake ----------------------------------------------------------------
    def start(self) -> None:
        """Send a HELLO (again: a new nonce; the challenge to an older one is ignored)."""
        if self._hs is not None:
            self._earlier = [*self._earlier[-7:], self._hs]
        self._hs = P.ClientHandshake(self._secret, self._mac_payload)
        self._pending = None
        self.sock.send_multipart(self._hs.hello())
        self._retry_at = time.monotonic() + self._retry
        self._retry = min(2.0, self._retry * 2)

    def tick(self, now: float) -> None:
        """Repeat the HELLO when no challenge came back in time; raise KVAuthError
        when the peer's gate refused our token (a wrong secret)."""
        self.events()
        if self.gate_denied:
            self._refused("rejected our")
        if self.session is None and self._hs is not None and now >= self._retry_at:
            self.start()

    def _refused(self, what: str) -> None:
        raise KVAuthError(f"cannot authenticate with {self.name}: it {what} {pc.SECRET}; every "
                          "process of a job needs the secret its launcher made (is this the "
                          f"right job, {pc.ROOT_URI}/PORT?)")

    def advance(self, frames: Sequence[Any]) -> bool:
        """Take one received message during the handshake; True once authenticated.

        Raises:
            KVAuthError: the peer rejected our secret or could not prove its own.
        """
        assert self._hs is not None, "start() first"
        try:
            if self._pending is None:
                if not self._hs.matches(frames, self._earlier):
                    self.drops.drop("stale-challenge", self.name)
                    return False
                self._pending = self._hs.answer(frames)
                self.sock.send_multipart(self._hs.auth_frames)
                self._retry_at = time.monotonic() + self._retry
                return False
            if P.plain_command(frames) == P.AUTH_FAIL:
                raise P.AuthError("rejected", "the peer rejected our secret")
            msg = self._pending.open(frames)
            if msg.cmd == P.AUTH_OK:
                self.session = self._pending
                return True
        except P.AuthError as e:
            self._refused("does not know our" if e.reason == "bad-proof" else "rejected our")
        except P.ProtocolError as e:
            self.drops.drop(e.reason, self.name)
        return False

    def handshake(self, deadline: float) -> None:
        """Authenticate (see the class docstring); block until done or ``deadline``.

        Raises:
            KVAuthError: the peer rejected our secret or could not prove its own.
            KVTimeoutError: no answer before ``deadline`` (``time.monotonic()``).
        """
        self.start()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTimeoutError(f"{self.name} did not answer the handshake in time: is it "
                                     "running and reachable from this host (firewall, addresses)?")
            if self.sock.poll(min(left, 0.05) * 1000):
                if self.advance(self.sock.recv_multipart(copy=False)):
                    return
            self.tick(time.monotonic())

    def send(self, cmd: int, key: int = 0, part: int = 0, req: int = 0, status: int = 0,
             dtype: int = 0, count: int = 0, flags: int = 0, payload: Sequence[Any] = (),
             track: bool = False, copy: bool = False) -> Any:
        """Seal and send one message; tensor payloads go without a copy unless ``copy``.

        Returns the ``zmq.MessageTracker`` of the last frame when ``track``.
        """
        head = self.session.seal(cmd, key, part, req, status, dtype, count, flags,  # type: ignore[union-attr]
                                 payload)
        if self._v.messages:
            self._v.sent(self.short, cmd, key, part, sum(memoryview(p).nbytes for p in payload),
                         count)
        sock = self.sock
        if not payload:
            sock.send(head)
            return None
        sock.send(head, _SNDMORE)
        for p in payload[:-1]:
            sock.send(p, _SNDMORE, copy=copy)
        return sock.send(payload[-1], 0, copy=copy, track=track)

    def send_json(self, cmd: int, obj: Any, key: int = 0, req: int = 0, status: int = 0) -> None:
        self.send(cmd, key=key, req=req, status=status, payload=[P.dumps(obj)])

    def receive(self, frames: Sequence[Any]) -> P.Message | None:
        """Verify received frames; ``None`` (and a counted drop) when they fail."""
        try:
            msg = self.session.open(frames)  # type: ignore[union-attr]
        except P.ProtocolError as e:
            self.drops.drop(e.reason, self.name)
            return None
        if self._v.messages:
            self._v.received(self.short, msg)
        return msg

    def close(self, linger_ms: int = 0) -> None:
        if self.monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(0)
            self.monitor = None
        self.sock.close(linger_ms)


def handshake_all(links: Sequence[Link], deadline: float) -> None:
    """Authenticate several links at once (raises as :meth:`Link.handshake`)."""
    poller = zmq.Poller()
    by_sock = {}
    for link in links:
        link.start()
        poller.register(link.sock, zmq.POLLIN)
        by_sock[link.sock] = link
    waiting = set(links)
    while waiting:
        left = deadline - time.monotonic()
        if left <= 0:
            link = next(iter(waiting))
            raise KVTimeoutError(f"{link.name} did not answer the handshake in time: is it "
                                 "running and reachable from this host (firewall, addresses)?")
        for sock, _ in poller.poll(min(left, 0.05) * 1000):
            link = by_sock[sock]
            while link in waiting and sock.getsockopt(_EVENTS) & _POLLIN:
                if link.advance(sock.recv_multipart(copy=False)):
                    waiting.discard(link)
                    poller.unregister(sock)
        now = time.monotonic()
        for link in list(waiting):
            link.tick(now)


class _Conn:
    """A TCP connection accepted by a :class:`Hub`, as its monitor reported it."""

    __slots__ = ("fd", "since", "address", "host", "peer", "evicted", "messages")

    def __init__(self, fd: int, since: float, address: tuple[str, int] | None) -> None:
        self.fd = fd
        self.since = since
        self.messages = 0
        self.address = address
        self.host = address[0] if address else "?"
        self.peer: P.Peer | None = None
        self.evicted = False


def _peer_of(fd: int) -> tuple[str, int] | None:
    """The remote address of socket ``fd``, without taking ownership of it."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        addr = s.getpeername()
        return (str(addr[0]), int(addr[1]))
    except OSError:
        return None
    finally:
        s.detach()


def _shutdown(fd: int, local_port: int, address: tuple[str, int]) -> bool:
    """Shut down connection ``fd`` if it still is the one accepted on ``local_port`` from
    ``address`` (a descriptor number is reused as soon as libzmq closes it)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if s.type != socket.SOCK_STREAM or s.getsockname()[1] != local_port:
            return False
        peer = s.getpeername()
        if (str(peer[0]), int(peer[1])) != address:
            return False
        s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        s.detach()


class Hub:
    """A bound ROUTER socket whose peers must authenticate before anything is served.

    The owner polls :meth:`sockets` and calls :meth:`service` after every wake-up
    (it answers the gate, reads the monitor and enforces the connection bounds,
    see the module docstring), then :meth:`receive`.

    Args:
        ctx: the process's context (the gate's ZAP endpoint is bound in it).
        secret: the job's HMAC key.
        mac_payload: MAC tensor payloads we send.
        verbose: ``PS_VERBOSE`` logging.
        watch: report authenticated peers whose connection closed (see :meth:`gone`).
    """

    def __init__(self, ctx: zmq.Context, secret: bytes, mac_payload: bool, verbose: Verbose,
                 watch: bool = False) -> None:
        self._v = verbose
        self._watch = watch
        self._token = P.gate_token(secret)
        self.drops = P.DropCounter(self._report_drop)
        # The ZAP handler must exist before the first connection: without one,
        # libzmq's PLAIN server admits everybody.
        self.zap = ctx.socket(zmq.REP)
        self.zap.setsockopt(zmq.LINGER, 0)
        self.zap.bind(_ZAP_ENDPOINT)
        self.sock = ctx.socket(zmq.ROUTER)
        _tune(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.PLAIN_SERVER, 1)
        self.sock.setsockopt(zmq.ZAP_DOMAIN, b"pslaunch-kv")
        self.acceptor = P.Acceptor(secret, mac_payload, self.drops)
        self.monitor: zmq.Socket | None = self.sock.get_monitor_socket(
            _E_ACCEPTED | _E_DISCONNECTED | _E_HS_FAILED | _E_HS_NO_DETAIL)
        self.port = 0
        self._conns: dict[int, _Conn] = {}
        self._gone: list[P.Peer] = []
        #: When :meth:`service` is due even without input (``time.monotonic()``).
        self.next_sweep = 0.0
        #: Connections accepted since the start (a flood shows here and in the drops), and
        #: those that closed during ZeroMQ's handshake (the launcher's probe is one; not
        #: counted as drops, which a user sees at any PS_VERBOSE).
        self.accepted = 0
        self.closed_early = 0

    def _report_drop(self, reason: str, where: str) -> None:
        logger.warning("%s refused or dropped %s (%s); further ones are counted",
                       self._v.who, where, reason)

    def bind(self, host: str, port: int = 0, port_range: tuple[int, int] | None = None,
             what: str = "this node") -> int:
        self.port = bind(self.sock, host, port, port_range, what)
        return self.port

    def sockets(self) -> list[zmq.Socket]:
        """What the owner polls for input."""
        return [s for s in (self.sock, self.zap, self.monitor) if s is not None]

    # --- before authentication ------------------------------------------------------
    def service(self, now: float | None = None) -> None:
        """Answer the gate, follow the connections, drop those over the bounds."""
        now = time.monotonic() if now is None else now
        changed = self._answer_gate()
        changed = self._read_monitor(now) or changed
        if changed or now >= self.next_sweep:
            self._enforce(now)
            self.next_sweep = now + 1.0

    def _answer_gate(self) -> bool:
        zap, token = self.zap, self._token
        served = False
        while zap.poll(0):
            try:
                frames = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            served = True
            # version, request id, domain, address, routing id, mechanism, credentials...
            ok = (len(frames) == 8 and frames[5] == b"PLAIN"
                  and hmac.compare_digest(frames[7], token))
            if not ok:
                where = frames[3].decode(errors="replace") if len(frames) > 3 else "?"
                self.drops.drop("gate-refused", f"a connection from {where} without the "
                                "job's token")
            reply = [frames[0] if frames else b"1.0", frames[1] if len(frames) > 1 else b"",
                     b"200" if ok else b"400", b"OK" if ok else b"not this job", b"", b""]
            try:
                zap.send_multipart(reply)
            except zmq.ZMQError:
                break
        return served

    def _read_monitor(self, now: float) -> bool:
        if self.monitor is None:
            return False
        events = _monitor_events(self.monitor)
        for event, value in events:
            if event == _E_ACCEPTED:
                self.accepted += 1
                self._conns[value] = _Conn(value, now, _peer_of(value))
            elif event == _E_DISCONNECTED:
                conn = self._conns.pop(value, None)
                peer = conn.peer if conn is not None else None
                if (peer is not None and self._watch
                        and peer.rid in self.acceptor.peers):
                    self._gone.append(peer)
            elif event == _E_HS_FAILED:
                self.drops.drop("gate-failed", "a connection that failed ZeroMQ's handshake")
            elif event == _E_HS_NO_DETAIL:
                self.closed_early += 1
        return bool(events)

    def _enforce(self, now: float) -> None:
        waiting = [c for c in self._conns.values() if c.peer is None and not c.evicted]
        late = now - P.HANDSHAKE_SECONDS
        for c in waiting:
            if c.since < late:
                self._evict(c, "connection-expired")
        waiting = [c for c in waiting if not c.evicted]
        excess = len(waiting) - MAX_UNAUTHENTICATED
        if excess <= 0:
            return
        by_host: dict[str, list[_Conn]] = {}
        for c in sorted(waiting, key=lambda c: (-c.messages, c.since)):
            by_host.setdefault(c.host, []).append(c)
        for _ in range(excess):
            busiest = max(by_host.values(), key=len)
            self._evict(busiest.pop(0), "connection-evicted")

    def _evict(self, conn: _Conn, reason: str) -> None:
        conn.evicted = True
        authenticated = {p.fd for p in self.acceptor.peers.values()}
        if (conn.address is not None and conn.fd not in authenticated
                and _shutdown(conn.fd, self.port, conn.address)):
            self.drops.drop(reason, f"connections from {conn.host} that did not authenticate")
        else:  # the descriptor is no longer that connection: it is gone already
            self._conns.pop(conn.fd, None)

    # --- messages ------------------------------------------------------------------
    def receive(self, budget: int = 64, ready: bool = False) -> list[tuple[P.Peer, P.Message]]:
        """Read up to ``budget`` waiting messages; returns the authenticated ones.

        ``ready``: a poll just said the socket has a message, so the first one is read without
        asking ZeroMQ first (at one message a wake-up, that question is a tenth of a server's
        time). Handshake replies are sent on the way; peers that just authenticated are in
        ``self.acceptor.new_peers`` (with their fd and address set).
        """
        out: list[tuple[P.Peer, P.Message]] = []
        sock = self.sock
        acceptor = self.acceptor
        peers = acceptor.peers
        verbose = self._v.messages
        events, pollin = _EVENTS, _POLLIN
        for n in range(budget):
            # EVENTS instead of catching zmq.Again: an exception costs more than a message
            if (n or not ready) and not sock.getsockopt(events) & pollin:
                break
            try:  # (never blocks: EVENTS or the poll said a message waits)
                frames = recv_frames(sock, _NOBLOCK)
            except zmq.Again:
                break
            rid = frames[0].bytes
            peer = peers.get(rid)
            if peer is not None:
                try:
                    msg = peer.session.open(frames[1:])  # type: ignore[union-attr]
                except P.ProtocolError as e:
                    self.drops.drop(e.reason, peer.label)
                    continue
                if verbose:
                    self._v.received(peer.label, msg)
                out.append((peer, msg))
                continue
            try:
                address = str(frames[0].get("Peer-Address"))
                conn = self._conns.get(int(frames[0].get(zmq.SRCFD)))
            except (zmq.ZMQError, ValueError, TypeError):
                address, conn = "?", None
            if conn is not None and conn.peer is None:
                conn.messages += 1
                if conn.messages > MAX_UNAUTHENTICATED_MESSAGES:
                    if not conn.evicted:
                        self._evict(conn, "connection-flooding")
                    self.drops.drop("flood", f"a flood from {address}")
                    continue
            acceptor.receive(rid, frames[1:], address)
            if acceptor.new_peers:
                for p in acceptor.new_peers:
                    try:
                        p.fd = int(frames[0].get(zmq.SRCFD))
                    except (zmq.ZMQError, ValueError, TypeError):
                        pass
                    conn = self._conns.get(p.fd)
                    if conn is None:  # its ACCEPTED event is still in the monitor
                        self._read_monitor(time.monotonic())
                        conn = self._conns.get(p.fd)
                    if conn is not None:
                        conn.peer = p
                acceptor.new_peers.clear()
            self._flush()
        return out

    def _flush(self) -> None:
        outbox = self.acceptor.outbox
        while outbox:
            rid, frames = outbox.pop(0)
            try:
                self.sock.send_multipart([rid, *frames])
            except zmq.ZMQError:
                pass

    def send(self, peer: P.Peer, cmd: int, key: int = 0, part: int = 0, req: int = 0,
             status: int = 0, dtype: int = 0, count: int = 0, flags: int = 0,
             payload: Sequence[Any] = (), copy: bool = False) -> bool:
        """Seal and send one message to ``peer``; False when the peer is gone.

        Payload frames go without a copy (pass received ``zmq.Frame`` objects to
        share their buffers), or copied now with ``copy``.
        """
        session = peer.session
        if session is None:
            return False
        head = session.seal(cmd, key, part, req, status, dtype, count, flags, payload)
        if self._v.messages:
            self._v.sent(peer.label, cmd, key, part, sum(memoryview(p).nbytes for p in payload),
                         count)
        sock = self.sock
        try:
            sock.send(peer.rid, _SNDMORE)
            if not payload:
                sock.send(head)
                return True
            sock.send(head, _SNDMORE)
            for p in payload[:-1]:
                sock.send(p, _SNDMORE, copy=copy)
            sock.send(payload[-1], 0, copy=copy)
            return True
        except zmq.ZMQError as e:
            if e.errno == errno.EHOSTUNREACH:
                return False
            raise

    def send_json(self, peer: P.Peer, cmd: int, obj: Any, key: int = 0, req: int = 0,
                  status: int = 0) -> bool:
        return self.send(peer, cmd, key=key, req=req, status=status, payload=[P.dumps(obj)])

    def gone(self) -> list[P.Peer]:
        """Authenticated peers whose connection has closed since the last call (with
        ``watch``; :meth:`service` notices them).

        They stay authenticated, so messages they sent before closing can still
        be read; call :meth:`forget` once those are handled.
        """
        out, self._gone = self._gone, []
        return out

    def forget(self, peer: P.Peer) -> None:
        """Drop a peer whose connection has closed."""
        self.acceptor.forget(peer.rid)

    def stats(self) -> str:
        """What happened before authentication, for the last line at ``PS_VERBOSE=1``."""
        counts = self.drops.summary()
        return (f"{self.accepted} connections accepted, {len(self.acceptor.peers)} authenticated, "
                f"{self.closed_early} closed during ZeroMQ's handshake"
                + (f"; refused or dropped: {counts}" if counts else ""))

    def close(self, linger_ms: int = 0) -> None:
        if self.monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(0)
            self.monitor = None
        self.sock.close(linger_ms)
        self.zap.close(0)


def check_dist_env(env: ClusterEnv) -> bytes:
    """The job's HMAC key, or KVConfigError when the secret is missing and not waived."""
    if env.secret:
        return P.secret_key(env.secret)
    if env.insecure:
        logger.warning("%s is set: the parameter-server traffic is not "
                       "authenticated; use this only on a trusted host", pc.INSECURE)
        return b""
    raise KVConfigError(f"{pc.SECRET} is not set: start the job with pslaunch, or set "
                        f"{pc.INSECURE}=1 (or pass --insecure) for a manual run on a trusted host")
