"""Wire format of the parameter-server traffic: frames, MACs, sessions and handshakes.

Every message is a ZeroMQ multipart message ``[header, payload...]`` (a ROUTER
socket sees the peer's routing id in front). The header frame is a fixed
:data:`HEADER` struct followed by a 32-byte MAC::

    offset size field
    0      1    version   (VERSION; anything else is dropped)
    1      1    cmd       (one of the command constants below)
    2      1    flags     (F_MAC, F_PULL, F_ASYNC)
    3      1    dtype     (a DTYPES code for tensor payloads, else 0)
    4      4    key       (key id; the barrier group for BARRIER/RELEASE)
    8      4    part      (part of a key split across servers)
    12     4    req       (request id, echoed in the reply)
    16     4    status    (0, or ST_ERROR in a reply whose payload is the message)
    20     8    seq       (per-session, per-direction sequence number, strictly increasing)
    28     8    count     (number of elements of a tensor payload)
    36     32   mac       HMAC-SHA256(direction key, header[0:36] [+ SHA256(payload)])

Payload frames are raw tensor bytes (sent and received with ``copy=False``)
or, for control messages, one UTF-8 JSON object. Nothing is ever pickled.

**Authentication** is a challenge-response per connection, keyed by the job
secret; the secret itself never crosses the wire:

1. client -> server ``HELLO``     payload: client nonce ``cn`` (32 random bytes)
2. server -> client ``CHALLENGE`` payload: server nonce ``sn`` + ``HMAC(secret, "server" cn sn)``
3. client -> server ``AUTH``      payload: ``HMAC(secret, "client" cn sn)``
4. server -> client ``AUTH_OK`` (sealed with the new session), or ``AUTH_FAIL``

Both sides then derive a session key ``HMAC(secret, "session" cn sn)`` and
from it one key per direction, so a message cannot be replayed on another
connection or reflected back to its sender. A peer that has not completed
step 3 is never served. The client checks the server's proof as well, so
neither side can be impersonated without the secret.

**Integrity.** Every header carries the MAC above; it covers the sequence
number, so replays are detected. Control messages (JSON) always carry
``F_MAC`` and their MAC also covers the payload. For tensor payloads that is
the sender's choice (``PS_MAC_PAYLOAD=1``): the payload is hashed once with
SHA-256 and the digest goes into the MAC, so one hash serves every recipient
of a buffer. The flag sits in the MAC'd header, so it cannot be stripped; a
message whose payload is not a tensor is rejected without it.

Anything that fails a check raises :class:`ProtocolError` from
:meth:`Session.open` / :meth:`Acceptor.receive`; callers drop the message and
count it (:class:`DropCounter`). This module is pure: no sockets, no numpy.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
from collections.abc import Sequence
from typing import Any, Callable

VERSION = 1

HEADER = struct.Struct("<BBBBIIIIQQ")
MAC_SIZE = 32
HEADER_SIZE = HEADER.size + MAC_SIZE
NONCE_SIZE = 32
_ZERO_MAC = bytes(MAC_SIZE)

# --- commands ----------------------------------------------------------------
# handshake (unauthenticated frames)
HELLO = 1
CHALLENGE = 2
AUTH = 3
AUTH_FAIL = 4
# sealed replies to the handshake
AUTH_OK = 5
# node <-> scheduler (JSON payloads)
REGISTER = 10
READY = 11
HEARTBEAT = 12
BARRIER = 13
RELEASE = 14
FAIL = 15
ABORT = 16
FINALIZE = 17
DONE = 18
# worker <-> server
INIT = 30
PUSH = 31
PULL = 32
REPLY = 33
SET_OPTIMIZER = 34
GET_STATES = 35
SET_STATES = 36
STOP = 37

COMMAND_NAMES = {
    HELLO: "HELLO", CHALLENGE: "CHALLENGE", AUTH: "AUTH", AUTH_FAIL: "AUTH_FAIL",
    AUTH_OK: "AUTH_OK", REGISTER: "REGISTER", READY: "READY", HEARTBEAT: "HEARTBEAT",
    BARRIER: "BARRIER", RELEASE: "RELEASE", FAIL: "FAIL", ABORT: "ABORT",
    FINALIZE: "FINALIZE", DONE: "DONE", INIT: "INIT", PUSH: "PUSH", PULL: "PULL",
    REPLY: "REPLY", SET_OPTIMIZER: "SET_OPTIMIZER", GET_STATES: "GET_STATES",
    SET_STATES: "SET_STATES", STOP: "STOP",
}
_HANDSHAKE = frozenset({HELLO, CHALLENGE, AUTH, AUTH_FAIL})
#: Sealed commands whose payload may be a bare tensor (payload MAC optional).
TENSOR_COMMANDS = frozenset({INIT, PUSH, REPLY})
SEALED_COMMANDS = frozenset(COMMAND_NAMES) - _HANDSHAKE

# --- flags -------------------------------------------------------------------
F_MAC = 1      # the MAC covers the payload frames too
F_PULL = 2     # PUSH: reply with the updated value (pushpull)
F_ASYNC = 4    # PUSH: apply at once (dist_async) instead of summing a round
_KNOWN_FLAGS = F_MAC | F_PULL | F_ASYNC

# --- reply status --------------------------------------------------------------
ST_OK = 0
ST_ERROR = 1

# --- barrier groups (ps-lite's numbering) ---------------------------------------
GROUP_SERVERS = 2
GROUP_WORKERS = 4
GROUP_ALL = 6
GROUP_NAMES = {GROUP_SERVERS: "servers", GROUP_WORKERS: "workers", GROUP_ALL: "all"}

# --- tensor dtypes: code -> (numpy dtype string, itemsize) -----------------------
DTYPES: dict[int, tuple[str, int]] = {
    1: ("<f4", 4), 2: ("<f8", 8), 3: ("<f2", 2), 4: ("<i4", 4),
    5: ("<i8", 8), 6: ("<i2", 2), 7: ("|i1", 1), 8: ("|u1", 1),
}
DTYPE_CODES = {name: code for code, (name, _) in DTYPES.items()}

_LABEL_SERVER = b"pslaunch-kv1 server"
_LABEL_CLIENT = b"pslaunch-kv1 client"
_LABEL_SESSION = b"pslaunch-kv1 session"

_hmac_digest = hmac.digest
_compare = hmac.compare_digest
_sha256 = hashlib.sha256
_pack = HEADER.pack
_unpack_from = HEADER.unpack_from
_SIZE = struct.Struct("<Q")
_BODY = HEADER.size


class ProtocolError(Exception):
    """A message failed a check; ``reason`` is a short counter name such as ``bad-mac``."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class AuthError(ProtocolError):
    """The peer could not prove that it knows the job secret (or rejected ours)."""


def secret_key(secret: str | None) -> bytes:
    """The HMAC key for a job secret: the bytes of a hex string, else its UTF-8 bytes.

    ``None`` (insecure mode) gives the empty key: the protocol is unchanged,
    but anyone can compute the MACs.
    """
    if not secret:
        return b""
    text = secret.strip()
    if len(text) % 2 == 0:
        try:
            return bytes.fromhex(text)
        except ValueError:
            pass
    return text.encode()


def payload_digest(frames: Sequence[Any]) -> bytes:
    """SHA-256 over the payload frames (bytes-like), frame boundaries included."""
    h = _sha256()
    for f in frames:
        mv = memoryview(f)
        h.update(_SIZE.pack(mv.nbytes))
        h.update(mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B"))
    return h.digest()


def _buf(frame: Any) -> Any:
    """The bytes-like content of a frame (zmq.Frame, bytes, memoryview, numpy array)."""
    b = getattr(frame, "buffer", None)
    return frame if b is None else b


def _nbytes(frame: Any) -> int:
    b = _buf(frame)
    return len(b) if isinstance(b, bytes) else memoryview(b).nbytes


class Message:
    """One verified message. ``frames`` are the payload frames, as received."""

    __slots__ = ("cmd", "flags", "dtype", "key", "part", "req", "status", "seq", "count", "frames")

    def __init__(self, cmd: int, flags: int, dtype: int, key: int, part: int, req: int,
                 status: int, seq: int, count: int, frames: Sequence[Any]) -> None:
        self.cmd = cmd
        self.flags = flags
        self.dtype = dtype
        self.key = key
        self.part = part
        self.req = req
        self.status = status
        self.seq = seq
        self.count = count
        self.frames = frames

    def json(self) -> Any:
        """The JSON object in the first payload frame (raises ProtocolError if there is none)."""
        if not self.frames:
            raise ProtocolError("malformed", f"{COMMAND_NAMES.get(self.cmd)} has no JSON frame")
        return load_json(self.frames[0])

    def text(self) -> str:
        """The payload of an error reply, as text."""
        if not self.frames:
            return ""
        return bytes(_buf(self.frames[0])).decode("utf-8", "replace")

    def describe(self) -> str:
        """One line for ``PS_VERBOSE=2``."""
        size = sum(_nbytes(f) for f in self.frames)
        return (f"cmd={COMMAND_NAMES.get(self.cmd, self.cmd)} key={self.key} part={self.part} "
                f"req={self.req} seq={self.seq} bytes={size}")


def check_structure(cmd: int, flags: int, dtype: int, count: int, frames: Sequence[Any]) -> None:
    """Reject payloads that do not fit their command (after the MAC has been checked)."""
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError("malformed", "unknown flags")
    n = len(frames)
    if cmd in (INIT, PUSH):
        if n != 1:
            raise ProtocolError("malformed", "a tensor message needs one payload frame")
        spec = DTYPES.get(dtype)
        if spec is None:
            raise ProtocolError("malformed", "unknown dtype")
        if _nbytes(frames[0]) != count * spec[1]:
            raise ProtocolError("malformed", "payload size does not match count and dtype")
    elif cmd == REPLY:
        # An ack (no payload), a tensor (dtype set), an error text or JSON + tensors.
        if dtype:
            spec = DTYPES.get(dtype)
            if spec is None or n != 1 or _nbytes(frames[0]) != count * spec[1]:
                raise ProtocolError("malformed", "bad tensor reply")
    elif cmd in (PULL, STOP, HEARTBEAT, BARRIER, RELEASE, FINALIZE, DONE, AUTH_OK, GET_STATES):
        if n > 1:
            raise ProtocolError("malformed", "unexpected payload")
    elif cmd in (REGISTER, READY, FAIL, ABORT, SET_OPTIMIZER):
        if n != 1:
            raise ProtocolError("malformed", "a control message needs one JSON frame")
    # SET_STATES: a JSON frame plus tensor frames; checked by the server.


class Session:
    """An authenticated connection: one MAC key and one sequence counter per direction.

    Args:
        send_key: key for the messages this side sends.
        recv_key: key for the messages this side receives.
        mac_payload: also MAC the tensor payloads we send (control payloads always are).
    """

    __slots__ = ("_ksend", "_krecv", "_send_seq", "_recv_seq", "mac_payload")

    def __init__(self, send_key: bytes, recv_key: bytes, mac_payload: bool = False) -> None:
        self._ksend = send_key
        self._krecv = recv_key
        self._send_seq = 0
        self._recv_seq = 0
        self.mac_payload = mac_payload

    def seal(self, cmd: int, key: int = 0, part: int = 0, req: int = 0, status: int = 0,
             dtype: int = 0, count: int = 0, flags: int = 0, payload: Sequence[Any] = (),
             digest: bytes | None = None) -> bytes:
        """The header frame for a message; bumps the send sequence number.

        Control messages, replies carrying text or JSON, and every message when
        ``mac_payload`` is on get a payload MAC; pass ``digest``
        (:func:`payload_digest`) to reuse a payload hash computed once for
        several recipients.
        """
        self._send_seq += 1
        if (cmd not in TENSOR_COMMANDS or self.mac_payload or flags & F_MAC
                or (payload and not dtype)):
            flags |= F_MAC
            if digest is None:
                digest = payload_digest(payload)
            head = _pack(VERSION, cmd, flags, dtype, key, part, req, status, self._send_seq, count)
            return head + _hmac_digest(self._ksend, head + digest, "sha256")
        head = _pack(VERSION, cmd, flags, dtype, key, part, req, status, self._send_seq, count)
        return head + _hmac_digest(self._ksend, head, "sha256")

    def open(self, frames: Sequence[Any]) -> Message:
        """Verify ``[header, payload...]`` and return the message, or raise ProtocolError.

        The receive sequence number advances only for a message that passes
        every check, so a forged or replayed message cannot disturb the session.
        """
        if not frames:
            raise ProtocolError("malformed", "no frames")
        head = _buf(frames[0])
        if len(head) != HEADER_SIZE:
            raise ProtocolError("malformed", "bad header size")
        version, cmd, flags, dtype, key, part, req, status, seq, count = _unpack_from(head)
        if version != VERSION:
            raise ProtocolError("version", f"version {version}, expected {VERSION}")
        body = head[:_BODY]
        payload = frames[1:]
        if flags & F_MAC:
            expected = _hmac_digest(self._krecv, bytes(body) + payload_digest(
                [_buf(f) for f in payload]), "sha256")
        elif cmd in TENSOR_COMMANDS and (dtype or not payload):
            expected = _hmac_digest(self._krecv, body, "sha256")
        else:
            raise ProtocolError("bad-mac", "payload MAC missing")
        if not _compare(expected, head[_BODY:]):
            raise ProtocolError("bad-mac")
        if seq <= self._recv_seq:
            raise ProtocolError("replay", f"sequence {seq} after {self._recv_seq}")
        if cmd not in SEALED_COMMANDS:
            raise ProtocolError("unknown-command", str(cmd))
        check_structure(cmd, flags, dtype, count, payload)
        self._recv_seq = seq
        return Message(cmd, flags, dtype, key, part, req, status, seq, count, payload)


def plain(cmd: int, payload: Sequence[bytes] = ()) -> list[bytes]:
    """An unauthenticated handshake message (zero MAC, sequence 0)."""
    return [_pack(VERSION, cmd, 0, 0, 0, 0, 0, 0, 0, 0) + _ZERO_MAC, *payload]


def parse_plain(frames: Sequence[Any], cmd: int, size: int) -> bytes:
    """The payload of handshake message ``cmd`` of exactly ``size`` bytes, or ProtocolError."""
    if len(frames) != (2 if size else 1):
        raise ProtocolError("handshake", "wrong number of frames")
    head = _buf(frames[0])
    if len(head) != HEADER_SIZE:
        raise ProtocolError("handshake", "bad header size")
    fields = _unpack_from(head)
    if fields[0] != VERSION:
        raise ProtocolError("version", f"version {fields[0]}, expected {VERSION}")
    if fields[1] != cmd:
        raise ProtocolError("handshake", f"expected {COMMAND_NAMES[cmd]}")
    if not size:
        return b""
    data = bytes(_buf(frames[1]))
    if len(data) != size:
        raise ProtocolError("handshake", "bad payload size")
    return data


def plain_command(frames: Sequence[Any]) -> int:
    """The command byte of a message, or -1 when the header cannot be read."""
    if not frames:
        return -1
    head = _buf(frames[0])
    if len(head) != HEADER_SIZE or head[0] != VERSION:
        return -1
    return head[1]


def _proofs(secret: bytes, cn: bytes, sn: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    server = _hmac_digest(secret, _LABEL_SERVER + cn + sn, "sha256")
    client = _hmac_digest(secret, _LABEL_CLIENT + cn + sn, "sha256")
    session = _hmac_digest(secret, _LABEL_SESSION + cn + sn, "sha256")
    c2s = _hmac_digest(session, b"c2s", "sha256")
    s2c = _hmac_digest(session, b"s2c", "sha256")
    return server, client, c2s, s2c


class ClientHandshake:
    """The connecting side of the handshake (a DEALER).

    Example:
        >>> hs = ClientHandshake(secret_key("00" * 32))
        >>> frames = hs.hello()            # send these
        >>> # session = hs.answer(challenge_frames) -> send hs.auth_frames, then await AUTH_OK
    """

    def __init__(self, secret: bytes, mac_payload: bool = False,
                 nonce: Callable[[int], bytes] = os.urandom) -> None:
        self._secret = secret
        self._mac_payload = mac_payload
        self._cn = nonce(NONCE_SIZE)
        self.auth_frames: list[bytes] = []

    def hello(self) -> list[bytes]:
        return plain(HELLO, [self._cn])

    def answer(self, frames: Sequence[Any]) -> Session:
        """Check the server's CHALLENGE; return the session and set :attr:`auth_frames`.

        Raises:
            AuthError: the peer answered AUTH_FAIL or could not prove the secret.
            ProtocolError: the frames are not a challenge.
        """
        if plain_command(frames) == AUTH_FAIL:
            raise AuthError("rejected", "the peer rejected our secret")
        data = parse_plain(frames, CHALLENGE, 2 * NONCE_SIZE)
        sn, proof = data[:NONCE_SIZE], data[NONCE_SIZE:]
        server, client, c2s, s2c = _proofs(self._secret, self._cn, sn)
        if not _compare(server, proof):
            raise AuthError("bad-proof", "the peer does not know the job secret")
        self.auth_frames = plain(AUTH, [client])
        return Session(c2s, s2c, self._mac_payload)


class Peer:
    """A connection seen by an :class:`Acceptor` (one ROUTER routing id)."""

    __slots__ = ("rid", "session", "label", "fd", "address", "_cn", "_sn", "info")

    def __init__(self, rid: bytes) -> None:
        self.rid = rid
        self.session: Session | None = None
        self.label = "peer"
        self.fd = -1
        self.address = "?"
        self._cn = b""
        self._sn = b""
        self.info: Any = None

    def __repr__(self) -> str:
        return f"Peer({self.label!r}, authenticated={self.session is not None})"


class DropCounter:
    """Counts dropped messages per reason; reports the first of each reason."""

    def __init__(self, report: Callable[[str, str], None] | None = None) -> None:
        self.counts: dict[str, int] = {}
        self._report = report

    def drop(self, reason: str, where: str) -> None:
        n = self.counts.get(reason, 0) + 1
        self.counts[reason] = n
        if n == 1 and self._report is not None:
            self._report(reason, where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.counts.items()))


class Acceptor:
    """The accepting side of the handshake and the session table of a ROUTER socket.

    :meth:`receive` takes ``(routing id, frames)`` and returns a verified
    :class:`Message` of an authenticated peer, or ``None`` when the frames were
    a handshake step or were dropped. Handshake replies are appended to
    :attr:`outbox` as ``(routing id, frames)``; the owner sends them.

    Args:
        secret: the job's HMAC key (:func:`secret_key`).
        mac_payload: also MAC the tensor payloads this side sends.
        drops: where dropped messages are counted.
        max_pending: handshakes in progress kept at most (oldest forgotten first).
    """

    def __init__(self, secret: bytes, mac_payload: bool = False,
                 drops: DropCounter | None = None, max_pending: int = 256,
                 nonce: Callable[[int], bytes] = os.urandom) -> None:
        self._secret = secret
        self._mac_payload = mac_payload
        self.drops = drops if drops is not None else DropCounter()
        self.peers: dict[bytes, Peer] = {}
        self._pending: dict[bytes, Peer] = {}
        self._max_pending = max_pending
        self._nonce = nonce
        self.outbox: list[tuple[bytes, list[bytes]]] = []
        #: Peers that just completed the handshake (the owner may inspect and clear).
        self.new_peers: list[Peer] = []

    def receive(self, rid: bytes, frames: Sequence[Any]) -> Message | None:
        peer = self.peers.get(rid)
        if peer is not None:
            try:
                return peer.session.open(frames)  # type: ignore[union-attr]
            except ProtocolError as e:
                self.drops.drop(e.reason, peer.label)
                return None
        try:
            self._handshake(rid, frames)
        except ProtocolError as e:
            self.drops.drop("unauthenticated" if e.reason in ("bad-mac", "malformed") else e.reason,
                            "unauthenticated peer")
        return None

    def _handshake(self, rid: bytes, frames: Sequence[Any]) -> None:
        cmd = plain_command(frames)
        if cmd == HELLO:
            cn = parse_plain(frames, HELLO, NONCE_SIZE)
            peer = Peer(rid)
            peer._cn = cn
            peer._sn = self._nonce(NONCE_SIZE)
            self._pending.pop(rid, None)
            while len(self._pending) >= self._max_pending:
                self._pending.pop(next(iter(self._pending)))
            self._pending[rid] = peer
            server, _, _, _ = _proofs(self._secret, cn, peer._sn)
            self.outbox.append((rid, plain(CHALLENGE, [peer._sn + server])))
        elif cmd == AUTH:
            peer = self._pending.get(rid)
            if peer is None:
                raise ProtocolError("unauthenticated", "AUTH without HELLO")
            proof = parse_plain(frames, AUTH, MAC_SIZE)
            del self._pending[rid]
            _, client, c2s, s2c = _proofs(self._secret, peer._cn, peer._sn)
            if not _compare(client, proof):
                self.outbox.append((rid, plain(AUTH_FAIL)))
                raise AuthError("auth-failed", "wrong secret")
            peer.session = Session(s2c, c2s, self._mac_payload)
            self.peers[rid] = peer
            self.new_peers.append(peer)
            self.outbox.append((rid, [peer.session.seal(AUTH_OK)]))
        else:
            raise ProtocolError("unauthenticated", "message before the handshake")

    def forget(self, rid: bytes) -> Peer | None:
        """Drop a peer (its connection closed); returns it if it was authenticated."""
        self._pending.pop(rid, None)
        return self.peers.pop(rid, None)


def load_json(frame: Any) -> Any:
    """Parse a JSON frame; ProtocolError unless it is a JSON object."""
    try:
        obj = json.loads(bytes(_buf(frame)))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ProtocolError("malformed", "payload is not JSON") from None
    if not isinstance(obj, dict):
        raise ProtocolError("malformed", "payload is not a JSON object")
    return obj


def dumps(obj: Any) -> bytes:
    """JSON payload bytes (compact)."""
    return json.dumps(obj, separators=(",", ":")).encode()
