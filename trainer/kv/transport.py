"""ZeroMQ plumbing shared by the scheduler, the servers and the workers.

* :class:`Link`: our end of a connection to a ROUTER (a DEALER socket), with
  the client side of the handshake and a :class:`~trainer.kv.protocol.Session`.
* :class:`Hub`: a bound ROUTER socket, with an :class:`~trainer.kv.protocol.Acceptor`
  and, optionally, a monitor that turns closed TCP connections into "peer gone"
  events (the message's ``SRCFD`` ties a connection to the peer that
  authenticated on it).
* :func:`node_address` and :func:`bind`: ps-lite's bind-address order and
  ports (ephemeral, or from ``PS_PORT_RANGE``).
* :class:`Verbose`: ``PS_VERBOSE`` lines, labelled like ps-lite (``H``,
  ``S[0]``, ``W[1]``), through the ``trainer.kv`` loggers.

Socket discipline: every receive is bounded by a poll timeout, every socket
has an explicit linger, ROUTERs are ``ROUTER_MANDATORY`` so a vanished peer
is an error rather than a silent drop, and high-water marks are off because
the protocol bounds what is in flight (one reply per request).
"""

from __future__ import annotations

import errno
import logging
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any

import zmq

import pscontract as pc
from pscontract import ClusterEnv, netif

from . import protocol as P
from .errors import KVAuthError, KVConfigError, KVTimeoutError

logger = logging.getLogger(__name__)

#: Linger (ms) for sockets closed at the end of a clean run: enough to flush goodbyes.
CLEAN_LINGER_MS = 2000
# Plain ints: pyzmq's enum flags cost microseconds per operation on the hot path.
_SNDMORE, _EVENTS, _POLLIN = int(zmq.SNDMORE), int(zmq.EVENTS), int(zmq.POLLIN)


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

    def sent(self, peer: str, cmd: int, key: int, part: int, nbytes: int) -> None:
        logger.info("%s => %s: cmd=%s key=%d part=%d bytes=%d", self.who, peer,
                    P.COMMAND_NAMES.get(cmd, cmd), key, part, nbytes)

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
    if force or not (logging.getLogger().handlers or kv_logger.handlers):
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
    """Bind ``sock`` on ``host`` to ``port``, a free port of ``port_range``, or an ephemeral one."""
    def attempt(p: int | str) -> None:
        sock.bind(f"tcp://{host}:{p}")

    try:
        if port:
            attempt(port)
            return port
        if port_range is not None:
            lo, hi = port_range
            for p in range(lo, hi + 1):
                try:
                    attempt(p)
                    return p
                except zmq.ZMQError as e:
                    if e.errno != errno.EADDRINUSE:
                        raise
            raise KVConfigError(f"no free port in {pc.PORT_RANGE}={lo}-{hi} on {host} for {what}; "
                                "widen the range")
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


def _tune(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)


class Link:
    """Our authenticated connection to one peer's ROUTER socket (a DEALER).

    Args:
        ctx: the process's context.
        host: the peer's address.
        port: the peer's port.
        secret: the job's HMAC key.
        name: the peer's name for messages, e.g. ``"the scheduler at 10.0.0.1:9091"``.
        mac_payload: MAC tensor payloads we send.
        verbose: ``PS_VERBOSE`` logging.
        monitor: also watch for the connection being closed by the peer.
    """

    def __init__(self, ctx: zmq.Context, host: str, port: int, secret: bytes, name: str,
                 short: str, mac_payload: bool, verbose: Verbose, monitor: bool = False) -> None:
        self.name = name
        self.short = short
        self.endpoint = f"{host}:{port}"
        self._secret = secret
        self._mac_payload = mac_payload
        self._v = verbose
        self.sock = ctx.socket(zmq.DEALER)
        _tune(self.sock)
        self.monitor: zmq.Socket | None = None
        if monitor:
            self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.sock.connect(f"tcp://{host}:{port}")
        self.session: P.Session | None = None
        self.drops = P.DropCounter()

    def handshake(self, deadline: float) -> None:
        """Prove the secret to the peer and check its proof; block until done or ``deadline``.

        Raises:
            KVAuthError: the peer rejected our secret or could not prove its own.
            KVTimeoutError: no answer before ``deadline`` (``time.monotonic()``).
        """
        hs = P.ClientHandshake(self._secret, self._mac_payload)
        self.sock.send_multipart(hs.hello())
        session = None
        while True:
            frames = self._recv_until(deadline, "answer the handshake")
            try:
                if session is None:
                    session = hs.answer(frames)
                    self.sock.send_multipart(hs.auth_frames)
                    continue
                if P.plain_command(frames) == P.AUTH_FAIL:
                    raise P.AuthError("rejected", "the peer rejected our secret")
                msg = session.open(frames)
                if msg.cmd == P.AUTH_OK:
                    self.session = session
                    return
            except P.AuthError as e:
                what = (f"does not know our {pc.SECRET}" if e.reason == "bad-proof"
                        else f"rejected our {pc.SECRET}")
                raise KVAuthError(f"cannot authenticate with {self.name}: it {what}; every "
                                  "process of a job needs the secret its launcher made (is "
                                  f"this the right job, {pc.ROOT_URI}/PORT?)") from None
            except P.ProtocolError as e:
                self.drops.drop(e.reason, self.name)

    def _recv_until(self, deadline: float, what: str) -> list[zmq.Frame]:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTimeoutError(f"{self.name} did not {what} in time: is it running and "
                                     "reachable from this host (firewall, addresses)?")
            if self.sock.poll(min(left, 0.5) * 1000):
                return self.sock.recv_multipart(copy=False)

    def send(self, cmd: int, key: int = 0, part: int = 0, req: int = 0, status: int = 0,
             dtype: int = 0, count: int = 0, flags: int = 0, payload: Sequence[Any] = (),
             digest: bytes | None = None, track: bool = False, copy: bool = False) -> Any:
        """Seal and send one message; tensor payloads go without a copy unless ``copy``.

        Returns the ``zmq.MessageTracker`` of the last frame when ``track``.
        """
        head = self.session.seal(cmd, key, part, req, status, dtype, count, flags,  # type: ignore[union-attr]
                                 payload, digest)
        if self._v.messages:
            self._v.sent(self.short, cmd, key, part, sum(memoryview(p).nbytes for p in payload))
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

    def peer_closed(self) -> bool:
        """True when the monitor reports that the peer closed the connection."""
        if self.monitor is None:
            return False
        return any(e == zmq.EVENT_DISCONNECTED for e, _ in _monitor_events(self.monitor))

    def close(self, linger_ms: int = 0) -> None:
        if self.monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(0)
            self.monitor = None
        self.sock.close(linger_ms)


class Hub:
    """A bound ROUTER socket whose peers must authenticate before anything is served.

    Args:
        ctx: the process's context.
        secret: the job's HMAC key.
        mac_payload: MAC tensor payloads we send.
        verbose: ``PS_VERBOSE`` logging.
        watch: report peers whose TCP connection closed (see :meth:`gone`).
    """

    def __init__(self, ctx: zmq.Context, secret: bytes, mac_payload: bool, verbose: Verbose,
                 watch: bool = False) -> None:
        self._v = verbose
        self.sock = ctx.socket(zmq.ROUTER)
        _tune(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.drops = P.DropCounter(self._report_drop)
        self.acceptor = P.Acceptor(secret, mac_payload, self.drops)
        self.monitor: zmq.Socket | None = None
        if watch:
            self.monitor = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._by_fd: dict[int, P.Peer] = {}

    def _report_drop(self, reason: str, where: str) -> None:
        logger.warning("%s dropped a message from %s (%s); further drops are counted",
                       self._v.who, where, reason)

    def bind(self, host: str, port: int = 0, port_range: tuple[int, int] | None = None,
             what: str = "this node") -> int:
        return bind(self.sock, host, port, port_range, what)

    def receive(self, budget: int = 64) -> list[tuple[P.Peer, P.Message]]:
        """Read up to ``budget`` waiting messages; returns the authenticated ones.

        Handshake replies are sent on the way; peers that just authenticated
        are in ``self.acceptor.new_peers`` (with their fd and address set).
        """
        out: list[tuple[P.Peer, P.Message]] = []
        sock = self.sock
        acceptor = self.acceptor
        peers = acceptor.peers
        verbose = self._v.messages
        events, pollin = _EVENTS, _POLLIN
        for _ in range(budget):
            # EVENTS instead of catching zmq.Again: an exception costs more than a message
            if not sock.getsockopt(events) & pollin:
                break
            frames = sock.recv_multipart(copy=False)
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
            acceptor.receive(rid, frames[1:])
            if acceptor.new_peers:
                for p in acceptor.new_peers:
                    try:
                        p.fd = int(frames[0].get(zmq.SRCFD))
                        p.address = str(frames[0].get("Peer-Address"))
                    except (zmq.ZMQError, ValueError, TypeError):
                        pass
                    if p.fd >= 0:
                        self._by_fd[p.fd] = p
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
             payload: Sequence[Any] = (), digest: bytes | None = None, copy: bool = False) -> bool:
        """Seal and send one message to ``peer``; False when the peer is gone.

        Payload frames go without a copy (pass received ``zmq.Frame`` objects to
        share their buffers), or copied now with ``copy``.
        """
        session = peer.session
        if session is None:
            return False
        head = session.seal(cmd, key, part, req, status, dtype, count, flags, payload, digest)
        if self._v.messages:
            self._v.sent(peer.label, cmd, key, part, sum(memoryview(p).nbytes for p in payload))
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
        """Authenticated peers whose connection has closed since the last call.

        They stay authenticated, so messages they sent before closing can still
        be read; call :meth:`forget` once those are handled.
        """
        out: list[P.Peer] = []
        if self.monitor is None:
            return out
        for event, fd in _monitor_events(self.monitor):
            if event != zmq.EVENT_DISCONNECTED:
                continue
            peer = self._by_fd.pop(fd, None)
            if peer is not None and peer.rid in self.acceptor.peers:
                out.append(peer)
        return out

    def forget(self, peer: P.Peer) -> None:
        """Drop a peer whose connection has closed."""
        self.acceptor.forget(peer.rid)

    def close(self, linger_ms: int = 0) -> None:
        if self.monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.monitor.close(0)
            self.monitor = None
        self.sock.close(linger_ms)


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
