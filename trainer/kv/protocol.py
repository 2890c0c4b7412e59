"""Wire format of the parameter-server traffic: frames, MACs, sessions and handshakes.

Every message is a ZeroMQ multipart message ``[header, payload...]`` (a ROUTER
socket sees the peer's routing id in front). The header frame is a fixed
:data:`HEADER` struct followed by a 32-byte MAC::

    offset size field
    0      1    version   (VERSION; anything else is dropped)
    1      1    cmd       (one of the command constants below)
    2      1    flags     (F_MAC, F_PULL, F_ASYNC, F_STEP)
    3      1    dtype     (unused by tensor batches, whose items carry their own; else 0)
    4      4    key       (first item's key id for a batch; the barrier group for BARRIER/RELEASE)
    8      4    part      (first item's part for a batch)
    12     4    req       (request id, echoed in the reply)
    16     4    status    (0, or ST_ERROR in a reply whose payload is the message;
                           a PUSH with F_STEP: the worker's step of its items)
    20     8    seq       (per-session, per-direction sequence number, strictly increasing)
    28     8    count     (number of items of a tensor batch)
    36     32   mac       HMAC-SHA256(direction key, header[0:36] + T(covered frames))

**Tensor batches.** ``INIT``, ``PUSH``, ``PULL`` and ``VALUES`` (the answer
carrying values) move any number of arrays in one message: the first payload
frame is the *index*, ``count`` items of :data:`ITEM` (key id u32, part u32,
elements u32, dtype code u8, 3 bytes zero), and ``INIT``, ``PUSH`` and
``VALUES`` then carry one raw frame per item (``PULL`` carries none). A
worker sends one message per server per step for a small model; an array is
cut into parts of at most :data:`CHUNK_BYTES`, and a message holds at most
about :data:`BATCH_BYTES` of data, so big arrays stream in several messages.
No frame of any message is larger than :data:`MAX_FRAME`, which every socket
enforces (``ZMQ_MAXMSGSIZE``). Other payload frames are one UTF-8 JSON object,
or error text. Nothing is ever pickled.

**What the MAC covers.** The header, always, and the covered payload frames:
all of them for control messages, replies and ``F_MAC`` batches; the index
alone for a batch without ``F_MAC``. ``T`` is the covered frames, each as an
8-byte little-endian length and its bytes, concatenated, or the SHA-256 of
that when it is longer than :data:`MAC_INLINE` bytes. So the structure of every
message (keys, parts, sizes) is authenticated; the tensor bytes too when the
sender asks (``PS_MAC_PAYLOAD=1``). The flag sits in the MAC'd header, so it
cannot be stripped.

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
neither side can be impersonated without the secret. A client repeats
``HELLO`` (with a new nonce) when no challenge comes back, and answers only the
challenge to its latest ``HELLO``; the server keeps one handshake per
connection, a bounded number per source address and in all (the oldest of
the busiest address goes first), each for at most :data:`HANDSHAKE_SECONDS`.

Before all that, ZeroMQ's own PLAIN handshake admits only peers that present
:func:`gate_token` (see :mod:`trainer.kv.transport`): a peer without the
secret cannot make a process buffer more than one :data:`MAX_FRAME`.

**Integrity.** Every header carries the MAC above; it covers the sequence
number, so replays are detected. Anything that fails a check raises
:class:`ProtocolError` from :meth:`Session.open` / :meth:`Acceptor.receive`;
callers drop the message and count it (:class:`DropCounter`). This module is
pure: no sockets, no numpy.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import struct
import time
from collections.abc import Sequence
from typing import Any, Callable

VERSION = 2

HEADER = struct.Struct("<BBBBIIIIQQ")
MAC_SIZE = 32
HEADER_SIZE = HEADER.size + MAC_SIZE
NONCE_SIZE = 32
_ZERO_MAC = bytes(MAC_SIZE)

#: One item of a tensor batch's index: key id, part, elements, dtype code, 3 zero bytes.
ITEM = struct.Struct("<IIIB3x")
#: The largest array part on the wire; bigger arrays are cut into parts of at most this.
CHUNK_BYTES = 1 << 20
#: A worker starts a new message to a server once this much data is in the current one.
BATCH_BYTES = 4 << 20
#: The largest frame any socket accepts (ZMQ_MAXMSGSIZE): a chunk, or a JSON or index frame.
MAX_FRAME = CHUNK_BYTES + (64 << 10)
#: Covered payloads up to this many bytes (framed) enter the MAC as they are; longer ones
#: through their SHA-256 (see the module docstring).
MAC_INLINE = 1024
#: A handshake not completed within this many seconds is forgotten.
HANDSHAKE_SECONDS = 10.0

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
VALUES = 38
#: a replacement worker asks where its rank was (:mod:`trainer.kv.recovery`); REPLY: JSON
STEPS = 39

COMMAND_NAMES = {
    HELLO: "HELLO", CHALLENGE: "CHALLENGE", AUTH: "AUTH", AUTH_FAIL: "AUTH_FAIL",
    AUTH_OK: "AUTH_OK", REGISTER: "REGISTER", READY: "READY", HEARTBEAT: "HEARTBEAT",
    BARRIER: "BARRIER", RELEASE: "RELEASE", FAIL: "FAIL", ABORT: "ABORT",
    FINALIZE: "FINALIZE", DONE: "DONE", INIT: "INIT", PUSH: "PUSH", PULL: "PULL",
    REPLY: "REPLY", SET_OPTIMIZER: "SET_OPTIMIZER", GET_STATES: "GET_STATES",
    SET_STATES: "SET_STATES", STOP: "STOP", VALUES: "VALUES", STEPS: "STEPS",
}
_HANDSHAKE = frozenset({HELLO, CHALLENGE, AUTH, AUTH_FAIL})
#: Tensor batches: an index frame, then (except PULL) one data frame per item.
BATCH_COMMANDS = frozenset({INIT, PUSH, PULL, VALUES})
SEALED_COMMANDS = frozenset(COMMAND_NAMES) - _HANDSHAKE

# --- flags -------------------------------------------------------------------
F_MAC = 1      # the MAC covers every payload frame (a batch without it: the index only)
F_PULL = 2     # PUSH: answer with the updated values (pushpull)
F_ASYNC = 4    # PUSH/PULL: dist_async (apply at once instead of summing a round)
F_STEP = 8     # PUSH: ``status`` holds the worker's step of every item (repeats are ignored)
_KNOWN_FLAGS = F_MAC | F_PULL | F_ASYNC | F_STEP

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

_LABEL_SERVER = b"pslaunch-kv2 server"
_LABEL_CLIENT = b"pslaunch-kv2 client"
_LABEL_SESSION = b"pslaunch-kv2 session"
_LABEL_GATE = b"pslaunch-kv2 gate"

_hmac_digest = hmac.digest
_compare = hmac.compare_digest
_sha256 = hashlib.sha256
_pack = HEADER.pack
_unpack_from = HEADER.unpack_from
_SIZE = struct.Struct("<Q")
_BODY = HEADER.size
_ITEM_SIZE = ITEM.size
_iter_items = ITEM.iter_unpack


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


def gate_token(secret: bytes) -> bytes:
    """The password of ZeroMQ's PLAIN handshake that admits a connection at all.

    Derived from the job secret (64 hex characters), so only the job's processes
    know it; unlike the secret it does cross the wire, in the clear, once per
    connection: it keeps strangers from sending data, while the challenge-response
    above is what proves a peer knows the secret.
    """
    return _hmac_digest(secret, _LABEL_GATE, "sha256").hex().encode()


def payload_digest(frames: Sequence[Any]) -> bytes:
    """SHA-256 over the payload frames (bytes-like), frame boundaries included."""
    h = _sha256()
    for f in frames:
        mv = memoryview(_buf(f))
        h.update(_SIZE.pack(mv.nbytes))
        h.update(mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B"))
    return h.digest()


def mac_input(frames: Sequence[Any]) -> bytes:
    """``T`` of the module docstring: the framed covered frames, or their SHA-256 when
    that is longer than :data:`MAC_INLINE` bytes (a short index or JSON costs no hash)."""
    out = []
    size = 0
    for f in frames:
        if type(f) is bytes:
            data = f
        elif hasattr(f, "buffer"):  # a zmq.Frame: len() is its size
            if len(f) > MAC_INLINE:
                return payload_digest(frames)
            # not .bytes: pyzmq keeps the first copy it made, and a server changes the
            # values it holds in place
            data = f.buffer.tobytes()
        else:
            mv = memoryview(f)
            if mv.nbytes > MAC_INLINE:
                return payload_digest(frames)
            data = mv.tobytes()
        size += len(data) + 8
        if size > MAC_INLINE:
            return payload_digest(frames)
        out.append(_SIZE.pack(len(data)))
        out.append(data)
    return b"".join(out)


def _buf(frame: Any) -> Any:
    """The bytes-like content of a frame (zmq.Frame, bytes, memoryview, numpy array)."""
    b = getattr(frame, "buffer", None)
    return frame if b is None else b


def _nbytes(frame: Any) -> int:
    if type(frame) is bytes or hasattr(frame, "buffer"):  # bytes, or a zmq.Frame
        return len(frame)
    return memoryview(frame).nbytes


def pack_index(items: Sequence[tuple[int, int, int, int]]) -> bytes:
    """The index frame of a tensor batch: ``(key id, part, elements, dtype code)`` per item."""
    pack = ITEM.pack
    return b"".join(pack(k, p, n, c) for k, p, n, c in items)


class Message:
    """One verified message. ``frames`` are the payload frames, as received; for a
    tensor batch ``items`` lists ``(key id, part, elements, dtype code)`` and ``data``
    holds one frame per item (none for PULL)."""

    __slots__ = ("cmd", "flags", "dtype", "key", "part", "req", "status", "seq", "count",
                 "frames", "items")

    def __init__(self, cmd: int, flags: int, dtype: int, key: int, part: int, req: int,
                 status: int, seq: int, count: int, frames: Sequence[Any],
                 items: list[tuple[int, int, int, int]] | None = None) -> None:
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
        self.items = items

    @property
    def data(self) -> Sequence[Any]:
        """The data frames of a tensor batch (one per item)."""
        return self.frames[1:]

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
        items = "" if self.items is None else f" items={len(self.items)}"
        return (f"cmd={COMMAND_NAMES.get(self.cmd, self.cmd)} key={self.key} part={self.part} "
                f"req={self.req} seq={self.seq}{items} bytes={size}")


def check_structure(cmd: int, flags: int, count: int,
                    frames: Sequence[Any]) -> list[tuple[int, int, int, int]] | None:
    """Reject payloads that do not fit their command (after the MAC has been checked);
    returns the items of a tensor batch."""
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError("malformed", "unknown flags")
    n = len(frames)
    if cmd in BATCH_COMMANDS:
        if not n:
            raise ProtocolError("malformed", "a tensor batch needs an index frame")
        index = _buf(frames[0])
        if _nbytes(index) != count * _ITEM_SIZE:
            raise ProtocolError("malformed", "the index does not match the item count")
        items = list(_iter_items(index))
        if cmd == PULL:
            if n != 1:
                raise ProtocolError("malformed", "a pull carries no data")
            return items
        if n != count + 1:
            raise ProtocolError("malformed", "one data frame per item is needed")
        for (_, _, elements, code), frame in zip(items, frames[1:]):
            spec = DTYPES.get(code)
            if spec is None:
                raise ProtocolError("malformed", "unknown dtype")
            if _nbytes(frame) != elements * spec[1]:
                raise ProtocolError("malformed", "payload size does not match count and dtype")
        return items
    if cmd in (STOP, HEARTBEAT, BARRIER, RELEASE, FINALIZE, DONE, AUTH_OK, GET_STATES, STEPS):
        if n:
            raise ProtocolError("malformed", "unexpected payload")
    elif cmd in (REGISTER, READY, FAIL, ABORT, SET_OPTIMIZER):
        if n != 1:
            raise ProtocolError("malformed", "a control message needs one JSON frame")
    # REPLY: an ack (no payload), an error text or JSON (+ state arrays); SET_STATES: a JSON
    # frame plus arrays. Their content is checked where it is used.
    return None


class Session:
    """An authenticated connection: one MAC key and one sequence counter per direction.

    Args:
        send_key: key for the messages this side sends.
        recv_key: key for the messages this side receives.
        mac_payload: also MAC the tensor data this side sends.
    """

    __slots__ = ("_ksend", "_krecv", "_send_seq", "_recv_seq", "mac_payload")

    def __init__(self, send_key: bytes, recv_key: bytes, mac_payload: bool = False) -> None:
        self._ksend = send_key
        self._krecv = recv_key
        self._send_seq = 0
        self._recv_seq = 0
        self.mac_payload = mac_payload

    def seal(self, cmd: int, key: int = 0, part: int = 0, req: int = 0, status: int = 0,
             dtype: int = 0, count: int = 0, flags: int = 0,
             payload: Sequence[Any] = ()) -> bytes:
        """The header frame for a message; bumps the send sequence number.

        A tensor batch's data frames are covered only with ``mac_payload`` (or
        ``F_MAC``); everything else always is.
        """
        self._send_seq += 1
        if cmd in BATCH_COMMANDS and not (self.mac_payload or flags & F_MAC):
            covered = payload[:1]
        else:
            flags |= F_MAC
            covered = payload
        head = _pack(VERSION, cmd, flags, dtype, key, part, req, status, self._send_seq, count)
        return head + _hmac_digest(self._ksend, head + mac_input(covered), "sha256")

    def open(self, frames: Sequence[Any]) -> Message:
        """Verify ``[header, payload...]`` and return the message, or raise ProtocolError.

        The receive sequence number advances only for a message that passes
        every check, so a forged or replayed message cannot disturb the session.
        """
        if not frames:
            raise ProtocolError("malformed", "no frames")
        head = frames[0]
        if type(head) is not bytes:
            head = getattr(head, "bytes", None) or bytes(memoryview(head))
        if len(head) != HEADER_SIZE:
            raise ProtocolError("malformed", "bad header size")
        version, cmd, flags, dtype, key, part, req, status, seq, count = _unpack_from(head)
        if version != VERSION:
            raise ProtocolError("version", f"version {version}, expected {VERSION}")
        payload = frames[1:]
        if flags & F_MAC:
            covered = payload
        elif cmd in BATCH_COMMANDS:
            covered = payload[:1]
        else:
            raise ProtocolError("bad-mac", "payload MAC missing")
        expected = _hmac_digest(self._krecv, head[:_BODY] + mac_input(covered), "sha256")
        if not _compare(expected, head[_BODY:]):
            raise ProtocolError("bad-mac")
        if seq <= self._recv_seq:
            raise ProtocolError("replay", f"sequence {seq} after {self._recv_seq}")
        if cmd not in SEALED_COMMANDS:
            raise ProtocolError("unknown-command", str(cmd))
        items = check_structure(cmd, flags, count, payload)
        self._recv_seq = seq
        return Message(cmd, flags, dtype, key, part, req, status, seq, count, payload, items)


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
            AuthError: the peer answered AUTH_FAIL (reason ``rejected``) or could not
                prove the secret for this HELLO's nonce (``bad-proof``: a wrong secret,
                or the challenge to an earlier HELLO of ours).
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

    def matches(self, frames: Sequence[Any], earlier: Sequence[ClientHandshake]) -> bool:
        """True unless ``frames`` is a challenge answering one of ``earlier`` HELLOs
        (the server answered a HELLO we have since repeated: not a wrong secret)."""
        try:
            data = parse_plain(frames, CHALLENGE, 2 * NONCE_SIZE)
        except ProtocolError:
            return True
        sn, proof = data[:NONCE_SIZE], data[NONCE_SIZE:]
        for hs in earlier:
            if _compare(_proofs(hs._secret, hs._cn, sn)[0], proof):
                return False
        return True


class Peer:
    """A connection seen by an :class:`Acceptor` (one ROUTER routing id)."""

    __slots__ = ("rid", "session", "label", "fd", "address", "_cn", "_sn", "info", "since")

    def __init__(self, rid: bytes, address: str = "?") -> None:
        self.rid = rid
        self.session: Session | None = None
        self.label = "peer"
        self.fd = -1
        self.address = address
        self._cn = b""
        self._sn = b""
        self.info: Any = None
        self.since = 0.0

    def __repr__(self) -> str:
        return f"Peer({self.label!r}, authenticated={self.session is not None})"


class DropCounter:
    """Counts dropped messages (and refused connections) per reason; reports the first
    of each reason."""

    def __init__(self, report: Callable[[str, str], None] | None = None) -> None:
        self.counts: dict[str, int] = {}
        self._report = report

    def drop(self, reason: str, where: str, n: int = 1) -> None:
        total = self.counts.get(reason, 0) + n
        self.counts[reason] = total
        if total == n and self._report is not None:
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

    Handshakes in progress are bounded: one per connection (a repeated HELLO
    replaces it), ``max_per_address`` per source address and ``max_pending`` in
    all. When a bound is reached the oldest handshake of the address with the
    most goes, so a flood from one address evicts its own handshakes first; a
    real peer whose handshake was evicted repeats its HELLO. A handshake older
    than :data:`HANDSHAKE_SECONDS` is forgotten.

    Args:
        secret: the job's HMAC key (:func:`secret_key`).
        mac_payload: also MAC the tensor payloads this side sends.
        drops: where dropped messages are counted.
        max_pending: handshakes in progress kept at most.
        max_per_address: handshakes in progress kept per source address.
    """

    def __init__(self, secret: bytes, mac_payload: bool = False,
                 drops: DropCounter | None = None, max_pending: int = 1024,
                 max_per_address: int = 256,
                 nonce: Callable[[int], bytes] = os.urandom,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._secret = secret
        self._mac_payload = mac_payload
        self.drops = drops if drops is not None else DropCounter()
        self.peers: dict[bytes, Peer] = {}
        self._pending: dict[bytes, Peer] = {}  # in arrival order
        self._by_address: dict[str, dict[bytes, Peer]] = {}
        self._max_pending = max_pending
        self._max_per_address = max_per_address
        self._nonce = nonce
        self._clock = clock
        self.outbox: list[tuple[bytes, list[bytes]]] = []
        #: Peers that just completed the handshake (the owner may inspect and clear).
        self.new_peers: list[Peer] = []

    @property
    def pending(self) -> int:
        """Handshakes in progress."""
        return len(self._pending)

    def receive(self, rid: bytes, frames: Sequence[Any], address: str = "?") -> Message | None:
        peer = self.peers.get(rid)
        if peer is not None:
            try:
                return peer.session.open(frames)  # type: ignore[union-attr]
            except ProtocolError as e:
                self.drops.drop(e.reason, peer.label)
                return None
        try:
            self._handshake(rid, frames, address)
        except ProtocolError as e:
            self.drops.drop("unauthenticated" if e.reason in ("bad-mac", "malformed") else e.reason,
                            "unauthenticated peer")
        return None

    def _unpend(self, rid: bytes) -> Peer | None:
        peer = self._pending.pop(rid, None)
        if peer is not None:
            group = self._by_address.get(peer.address)
            if group is not None:
                group.pop(rid, None)
                if not group:
                    del self._by_address[peer.address]
        return peer

    def _evict(self, address: str | None) -> None:
        """Forget the oldest handshake of ``address`` (None: of the busiest address)."""
        if address is None:
            address = max(self._by_address, key=lambda a: len(self._by_address[a]))
        self._unpend(next(iter(self._by_address[address])))
        self.drops.drop("handshake-evicted", f"handshakes from {address}")

    def expire(self) -> None:
        """Forget handshakes older than :data:`HANDSHAKE_SECONDS`."""
        limit = self._clock() - HANDSHAKE_SECONDS
        while self._pending:
            rid, peer = next(iter(self._pending.items()))
            if peer.since > limit:
                break
            self._unpend(rid)
            self.drops.drop("handshake-expired", f"a handshake from {peer.address}")

    def _handshake(self, rid: bytes, frames: Sequence[Any], address: str) -> None:
        cmd = plain_command(frames)
        if cmd == HELLO:
            cn = parse_plain(frames, HELLO, NONCE_SIZE)
            self.expire()
            self._unpend(rid)
            group = self._by_address.get(address)
            if group is not None and len(group) >= self._max_per_address:
                self._evict(address)
            while len(self._pending) >= self._max_pending:
                self._evict(None)
            peer = Peer(rid, address)
            peer._cn = cn
            peer._sn = self._nonce(NONCE_SIZE)
            peer.since = self._clock()
            self._pending[rid] = peer
            self._by_address.setdefault(address, {})[rid] = peer
            server, _, _, _ = _proofs(self._secret, cn, peer._sn)
            self.outbox.append((rid, plain(CHALLENGE, [peer._sn + server])))
        elif cmd == AUTH:
            peer = self._pending.get(rid)
            if peer is None:
                raise ProtocolError("unauthenticated", "AUTH without HELLO")
            proof = parse_plain(frames, AUTH, MAC_SIZE)
            self._unpend(rid)
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
        self._unpend(rid)
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
