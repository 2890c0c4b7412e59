"""pslaunch's own ps-lite scheduler (``pslaunch --scheduler builtin``), standard library only.

A ps-lite program (MXNet's ``dist_*`` kvstores, ps-lite's own apps) runs its scheduler role as
one more copy of the program: for MXNet that is a whole ``import mxnet`` (about 1.5 s of CPU)
to run a loop that only registers nodes and counts barriers, on the cores the servers and
workers need for their own imports. This module is that loop, speaking the protocol of dmlc
ps-lite's ZeroMQ van as MXNet 1.9 and ps-lite master build it:

* ZMTP 3.1 (ZeroMQ's wire protocol, NULL security) over TCP: the scheduler listens as a
  ROUTER on ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT`` and reaches every node's ROUTER through a
  DEALER connection of its own, whose identity is ``ps1`` (ps-lite's scheduler id);
* every message is a protobuf ``PBMeta`` frame (ps-lite ``src/meta.proto``), then data frames;
* control commands (``Control::Command``): ``ADD_NODE`` (a node registers; once all
  ``DMLC_NUM_SERVER + DMLC_NUM_WORKER`` have, they are sorted as ps-lite sorts them, numbered
  as ps-lite numbers them: server rank r is node 8 + 2r, worker rank r is 9 + 2r, and every
  node gets the whole list), ``BARRIER`` (counted per group, answered to the group when all its
  members arrived), ``HEARTBEAT`` (answered, as ps-lite's scheduler does);
* the scheduler itself takes part in the two barriers of every node (``ps::Start`` and
  ``ps::Finalize``, group scheduler + servers + workers) and exits with 0 after the second.

BytePS's fork of ps-lite sends raw C structs instead of protobuf, ps-lite's other vans
(``ibverbs``; ``DMLC_LOCAL``'s ipc) do not speak TCP ZMTP, and ``PS_RESEND`` wants every message
acknowledged: those jobs keep ``--scheduler command`` (the default), and both refuse them.
Neither does it replace a node that died (ps-lite's recovery): pslaunch stops the job instead.
A node that registers at an address the scheduler cannot connect to ends the job with a one-line
error, where ps-lite's scheduler retries for ever and the job hangs.
Nothing here unpickles or executes anything from the network; a frame that does not parse ends
the connection that sent it with a one-line warning.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Dict, Iterator, List, Mapping, Optional, Tuple

#: ps-lite's ``Meta::kEmpty`` / ``Node::kEmpty`` (``std::numeric_limits<int>::max()``)
EMPTY = 2 ** 31 - 1
#: ``Node::Role``
SERVER, WORKER, SCHEDULER = 0, 1, 2
ROLE_NAMES = {SERVER: "server", WORKER: "worker", SCHEDULER: "scheduler"}
#: ``Control::Command``
CMD_EMPTY, TERMINATE, ADD_NODE, BARRIER, ACK, HEARTBEAT = range(6)
#: node groups (``ps/base.h``) and the scheduler's node id
SCHEDULER_GROUP, SERVER_GROUP, WORKER_GROUP = 1, 2, 4
ALL_GROUPS = SCHEDULER_GROUP + SERVER_GROUP + WORKER_GROUP
SCHEDULER_ID = 1
#: the largest frame accepted: control messages are a few hundred bytes per node
MAX_FRAME = 16 << 20


class WireError(Exception):
    """Bytes from a peer that are not what ps-lite's ZeroMQ van sends."""


class Unreachable(Exception):
    """A node registered at an address that the scheduler cannot connect to: the job cannot start."""


# --- protobuf (proto2) of ps-lite's meta.proto: only what the scheduler reads and writes ---------


def _varint(value: int) -> bytes:
    if value < 0:  # int32 fields: ten bytes, two's complement (protobuf's rule)
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, i: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise WireError("a protobuf varint runs past the end of the frame")
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7
        if shift >= 70:
            raise WireError("a protobuf varint longer than ten bytes")


def _int32(value: int) -> int:
    value &= (1 << 32) - 1
    return value - (1 << 32) if value >= 1 << 31 else value


def _fields(buf: bytes) -> Iterator[Tuple[int, int, object]]:
    """``(field number, wire type, value)`` of a protobuf message: an int, or bytes."""
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("a protobuf field numbered 0")
        if wire == 0:
            value, i = _read_varint(buf, i)
            yield number, wire, value
        elif wire == 2:
            size, i = _read_varint(buf, i)
            if i + size > len(buf):
                raise WireError("a protobuf field runs past the end of the frame")
            yield number, wire, buf[i:i + size]
            i += size
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            if i + width > len(buf):
                raise WireError("a protobuf field runs past the end of the frame")
            yield number, wire, int.from_bytes(buf[i:i + width], "little")
            i += width
        else:
            raise WireError(f"protobuf wire type {wire} (groups) is not in ps-lite's meta.proto")


def _int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _blob(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


#: the int32 fields the scheduler reads, by field number (booleans become ``bool``)
_NODE_INTS = {1: "role", 2: "id", 4: "port", 5: "is_recovery", 10: "customer_id"}
_META_INTS = {4: "request", 7: "app_id", 8: "timestamp", 10: "customer_id"}
_BOOLS = ("is_recovery", "request")


def _read_int(obj: object, fields: Dict[int, str], number: int, value: int) -> None:
    """Set the attribute of ``obj`` that varint field ``number`` holds, if it is one in ``fields``."""
    attr = fields.get(number)
    if attr is not None:
        v = _int32(value)
        setattr(obj, attr, bool(v) if attr in _BOOLS else v)


class Node:
    """``PBNode``: a process of the job as ps-lite names it."""

    __slots__ = ("role", "id", "hostname", "port", "is_recovery", "customer_id")

    def __init__(self, role: int, id: int = EMPTY, hostname: str = "", port: int = EMPTY,
                 is_recovery: bool = False, customer_id: int = 0) -> None:
        self.role, self.id, self.hostname, self.port = role, id, hostname, port
        self.is_recovery, self.customer_id = is_recovery, customer_id

    def encode(self) -> bytes:  # as ps-lite's Van::PackMeta writes one
        return (_int(1, self.role) + _int(2, self.id) + _blob(3, self.hostname.encode())
                + _int(4, self.port) + _int(5, int(self.is_recovery)) + _int(10, self.customer_id))

    @classmethod
    def decode(cls, buf: bytes) -> Node:
        node = cls(role=-1)
        for number, wire, value in _fields(buf):
            if number == 3 and wire == 2:
                try:
                    node.hostname = bytes(value).decode()  # type: ignore[arg-type]
                except UnicodeDecodeError:
                    raise WireError("a node's hostname is not UTF-8") from None
            elif wire == 0:
                _read_int(node, _NODE_INTS, number, value)  # type: ignore[arg-type]
        if node.role not in ROLE_NAMES:
            raise WireError("a node without a valid role")
        return node

    @property
    def address(self) -> str:
        return f"{self.hostname}:{self.port}"

    def describe(self) -> str:
        ident = "" if self.id == EMPTY else f", id={self.id}"
        return f"role={ROLE_NAMES.get(self.role, '?')}{ident}, ip={self.hostname}, port={self.port}"


class Meta:
    """``PBMeta`` with its ``PBControl``: what one message says (its data frames aside)."""

    __slots__ = ("head", "app_id", "timestamp", "request", "customer_id", "cmd", "nodes",
                 "barrier_group", "sender")

    def __init__(self, cmd: int = CMD_EMPTY, nodes: Optional[List[Node]] = None, request: bool = False,
                 app_id: int = EMPTY, customer_id: int = EMPTY, timestamp: int = EMPTY,
                 barrier_group: int = 0) -> None:
        self.head, self.app_id, self.timestamp, self.request = EMPTY, app_id, timestamp, request
        self.customer_id, self.cmd, self.nodes = customer_id, cmd, list(nodes or ())
        self.barrier_group, self.sender = barrier_group, EMPTY

    def encode(self) -> bytes:
        """As ps-lite's ``Van::PackMeta`` serializes a control message (of the kinds a scheduler sends)."""
        out = _int(1, self.head)
        if self.cmd != CMD_EMPTY:
            ctrl = _int(1, self.cmd) + b"".join(_blob(2, n.encode()) for n in self.nodes)
            if self.cmd == BARRIER:
                ctrl += _int(3, self.barrier_group)
            out += _blob(3, ctrl)
        out += _int(4, int(self.request)) + _int(5, 0) + _int(6, 0)
        if self.app_id != EMPTY:
            out += _int(7, self.app_id)
        if self.timestamp != EMPTY:
            out += _int(8, self.timestamp)
        return out + _int(10, self.customer_id) + _int(12, 0) + _int(13, 0)

    @classmethod
    def decode(cls, buf: bytes) -> Meta:
        meta = cls()
        meta.customer_id = 0  # (proto2's default of a field a sender left out)
        for number, wire, value in _fields(buf):
            if number == 3 and wire == 2:
                meta.cmd = -1
                for n2, w2, v2 in _fields(value):  # type: ignore[arg-type]
                    if n2 == 1 and w2 == 0:
                        meta.cmd = _int32(v2)  # type: ignore[arg-type]
                    elif n2 == 2 and w2 == 2:
                        meta.nodes.append(Node.decode(v2))  # type: ignore[arg-type]
                    elif n2 == 3 and w2 == 0:
                        meta.barrier_group = _int32(v2)  # type: ignore[arg-type]
                if meta.cmd < 0:
                    raise WireError("a control message without its command")
            elif wire == 0:
                _read_int(meta, _META_INTS, number, value)  # type: ignore[arg-type]
        return meta


def sort_nodes(nodes: List[Node]) -> List[Node]:
    """The order in which ps-lite's scheduler numbers the nodes: host names in descending
    order (its comparator is ``(a.hostname.compare(b.hostname) | (a.port < b.port)) > 0``), the
    nodes of one host by ascending port."""
    by_port = sorted(nodes, key=lambda n: n.port)
    return sorted(by_port, key=lambda n: n.hostname.encode(), reverse=True)


def assign_ids(nodes: List[Node]) -> List[Node]:
    """ps-lite's numbering, in place and returned: server rank r is 8 + 2r, worker rank r 9 + 2r."""
    ranks = {SERVER: 0, WORKER: 0}
    for node in nodes:
        node.id = (8 if node.role == SERVER else 9) + 2 * ranks[node.role]
        ranks[node.role] += 1
    return nodes


def group_ids(group: int, num_servers: int, num_workers: int) -> List[int]:
    """The node ids of a barrier group (``Postoffice::GetNodeIDs``), the scheduler's included."""
    ids = [SCHEDULER_ID] if group & SCHEDULER_GROUP else []
    if group & SERVER_GROUP:
        ids += [8 + 2 * r for r in range(num_servers)]
    if group & WORKER_GROUP:
        ids += [9 + 2 * r for r in range(num_workers)]
    return ids


# --- ZMTP 3.0 with the NULL mechanism (rfc.zeromq.org/spec/23) -----------------------------------

#: signature, version 3.1, mechanism NULL, as-server 0, filler
GREETING = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
MORE, LONG, COMMAND = 1, 2, 4


def frame(body: bytes, flags: int = 0) -> bytes:
    if len(body) > 255:
        return bytes([flags | LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


def ready(socket_type: bytes, identity: Optional[bytes] = None) -> bytes:
    props = b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    if identity is not None:
        props += b"\x08Identity" + struct.pack(">I", len(identity)) + identity
    return frame(b"\x05READY" + props, COMMAND)


def command_properties(body: bytes) -> Dict[str, bytes]:
    """The properties of a READY command's body (after its name)."""
    props, i = {}, 0
    while i < len(body):
        size = body[i]
        name = body[i + 1:i + 1 + size]
        if len(name) != size or i + 5 + size > len(body):
            raise WireError("a ZMTP READY command cut short")
        (vsize,) = struct.unpack(">I", body[i + 1 + size:i + 5 + size])
        start = i + 5 + size
        if start + vsize > len(body):
            raise WireError("a ZMTP READY property runs past the command")
        props[name.decode("ascii", "replace").lower()] = body[start:start + vsize]
        i = start + vsize
    return props


class Peer:
    """One ZMTP connection: the bytes read so far, parsed into commands and messages.

    The greeting goes first, alone; this side's READY command, and any message, only once the
    peer's READY came: libzmq (4.3) reads past the end of a greeting that arrives together with
    what follows it, and then drops the connection ("unexpected command"). A peer sends READY
    only after it has read the whole greeting.
    """

    def __init__(self, sock: socket.socket, name: str, outgoing: bool, hello: bytes = b"") -> None:
        self.sock, self.name, self.outgoing, self.hello = sock, name, outgoing, hello
        self.buf = bytearray()  # (appended to and cut from the front: no copy of the whole per read)
        self.greeted = self.ready = False
        self.identity = b""
        self.frames: List[bytes] = []
        self.pending: List[bytes] = []  # messages to send once the handshake is over

    def send(self, data: bytes) -> None:
        if self.ready:
            self.sock.sendall(data)
        else:
            self.pending.append(data)

    def feed(self, data: bytes) -> List[List[bytes]]:
        """Take bytes read from the socket: the complete messages (lists of frames) they end."""
        self.buf += data
        done: List[List[bytes]] = []
        if not self.greeted:
            if self.buf[:1] and self.buf[:1] != b"\xff":
                raise WireError("not a ZeroMQ peer (no ZMTP signature)")
            if len(self.buf) < 64:
                return done
            greeting = bytes(self.buf[:64])
            del self.buf[:64]
            if greeting[9] & 1 != 1 or greeting[10] < 3:
                raise WireError("a ZeroMQ peer older than ZMTP 3.0 (libzmq < 4)")
            if greeting[12:32].rstrip(b"\0") != b"NULL":
                mechanism = greeting[12:32].rstrip(b"\0").decode("ascii", "replace")
                raise WireError(f"ZMTP security mechanism {mechanism!r}; ps-lite uses NULL")
            self.greeted = True
        while True:
            if len(self.buf) < 2:
                return done
            flags = self.buf[0]
            if flags & LONG:
                if len(self.buf) < 9:
                    return done
                (size,) = struct.unpack(">Q", self.buf[1:9])
                start = 9
            else:
                size, start = self.buf[1], 2
            if size > MAX_FRAME:
                raise WireError(f"a frame of {size} bytes (at most {MAX_FRAME} here)")
            if len(self.buf) < start + size:
                return done
            body = bytes(self.buf[start:start + size])
            del self.buf[:start + size]
            if flags & COMMAND:
                self._command(body)
            else:
                if not self.ready:
                    raise WireError("a message before the ZMTP handshake ended")
                self.frames.append(body)
                if not flags & MORE:
                    done.append(self.frames)
                    self.frames = []

    def _command(self, body: bytes) -> None:
        size = body[0] if body else 0
        name = body[1:1 + size]
        if name == b"READY":
            props = command_properties(body[1 + size:])
            self.identity = props.get("identity", b"")
            if not self.ready:
                self.ready = True
                self.sock.sendall(self.hello + b"".join(self.pending))
                self.pending = []
        elif name == b"ERROR":
            reason = body[2 + size:2 + size + body[1 + size]] if len(body) > 1 + size else b""
            raise WireError("the peer refused the connection: " + reason.decode("utf-8", "replace"))
        elif name == b"PING":  # (ZMTP 3.1 heartbeats: answered with their context)
            self.sock.sendall(frame(b"\x04PONG" + body[1 + size + 2:], COMMAND))


def node_id(identity: bytes) -> int:
    """ps-lite's ``ZMQVan::GetNodeID``: ``ps9`` is node 9; anything else is nobody yet."""
    digits = identity[2:]
    if len(identity) > 2 and identity[:2] == b"ps" and digits.isdigit():
        return int(digits)
    return EMPTY


# --- the scheduler ------------------------------------------------------------------------------


class Scheduler:
    """ps-lite's scheduler van and postoffice, for one job."""

    def __init__(self, host: str, port: int, num_servers: int, num_workers: int, verbose: int = 0) -> None:
        self.host, self.port = host, port
        self.num_servers, self.num_workers, self.verbose = num_servers, num_workers, verbose
        self.sel = selectors.DefaultSelector()
        self.listener: Optional[socket.socket] = None
        self.registered: List[Node] = []
        self.nodes: List[Node] = []  # numbered, once everyone registered
        self.senders: Dict[int, Peer] = {}
        self.counts: Dict[int, int] = {}
        self.timestamp = 0
        self.barriers_passed = 0  # of the scheduler's own two (start, finalize)
        self.me = Node(SCHEDULER, SCHEDULER_ID, host, port)
        self.warned: set = set()

    def bind(self) -> None:
        family, kind, proto, _, addr = socket.getaddrinfo(self.host, self.port, 0, socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as libzmq's listener)
        try:
            sock.bind(addr)
        except OSError:
            sock.close()
            raise
        sock.listen(128)
        sock.setblocking(False)
        self.listener = sock
        self.sel.register(sock, selectors.EVENT_READ, None)

    def run(self) -> int:
        """Serve until the job's last barrier: 0."""
        if self.listener is None:
            self.bind()
        while self.barriers_passed < 2:
            for key, _ in self.sel.select():
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.data)
        self.close()
        return 0

    def close(self) -> None:
        for peer in list(self.senders.values()):
            self._drop(peer)
        if self.listener is not None:
            self.sel.unregister(self.listener)
            self.listener.close()
            self.listener = None
        for key in list(self.sel.get_map().values()):
            self._drop(key.data)
        self.sel.close()

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            sock, addr = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(30.0)  # (a send to a peer that reads nothing for this long: it is gone)
        peer = Peer(sock, f"{addr[0]}:{addr[1]}", outgoing=False, hello=ready(b"ROUTER"))
        try:
            sock.sendall(GREETING)
        except OSError:
            sock.close()
            return
        self.sel.register(sock, selectors.EVENT_READ, peer)

    def _drop(self, peer: Peer) -> None:
        try:
            self.sel.unregister(peer.sock)
        except (KeyError, ValueError):
            pass
        peer.sock.close()

    def _read(self, peer: Peer) -> None:
        try:
            data = peer.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        try:
            messages = peer.feed(data)
            for frames in messages:
                if not peer.outgoing:
                    self._handle(peer, frames)
        except (WireError, OSError) as e:
            self._warn(f"dropped the connection {'to' if peer.outgoing else 'from'} {peer.name}: {e}")
            self._drop(peer)

    def _warn(self, text: str) -> None:
        sys.stderr.write(f"pslaunch scheduler: warning: {text}\n")

    def _vlog(self, text: str) -> None:
        if self.verbose >= 1:
            sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {text}\n")

    def _send(self, recver: int, meta: Meta) -> None:
        peer = self.senders.get(recver)
        if peer is None:
            self._warn(f"there is no connection to node {recver}")
            return
        meta.timestamp = self.timestamp
        self.timestamp += 1
        try:
            peer.send(frame(meta.encode()))
        except OSError as e:
            self._warn(f"cannot send to node {recver} at {peer.name}: {e}")

    def _handle(self, peer: Peer, frames: List[bytes]) -> None:
        meta = Meta.decode(frames[0])
        meta.sender = node_id(peer.identity)
        if meta.cmd == ADD_NODE:
            self._add_node(meta)
        elif meta.cmd == BARRIER and meta.request:
            if not 1 <= meta.barrier_group <= ALL_GROUPS:
                raise WireError(f"a barrier of node group {meta.barrier_group} (ps-lite's groups are 1 to 7)")
            self._barrier(meta.barrier_group, meta.app_id, meta.customer_id)
        elif meta.cmd == HEARTBEAT:
            for node in meta.nodes:
                if node.id in self.senders:
                    self._send(node.id, Meta(HEARTBEAT, [self.me]))
        elif meta.cmd == CMD_EMPTY:
            self._warn_once("data", f"ignored a data message from {peer.name}: a ps-lite scheduler serves no "
                            "application")
        elif meta.cmd != TERMINATE:
            self._warn_once(f"cmd{meta.cmd}", f"ignored control command {meta.cmd} from {peer.name}")

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            self._warn(text)

    def _add_node(self, meta: Meta) -> None:
        if len(meta.nodes) != 1 or meta.sender != EMPTY:
            sender = "?" if meta.sender == EMPTY else meta.sender
            raise WireError(f"an ADD_NODE request names {len(meta.nodes)} nodes from node {sender}; ps-lite sends "
                            "one, before it has an id")
        node = meta.nodes[0]
        if node.role == SCHEDULER:
            raise WireError(f"a second scheduler ({node.address}) registered with this one")
        expected, role = self.num_servers + self.num_workers, ROLE_NAMES[node.role]
        if self.nodes:
            self._warn(f"ignored a {role} at {node.address}: all {expected} servers and workers of this job have "
                       "registered (DMLC_NUM_SERVER, DMLC_NUM_WORKER)")
            return
        if any(n.address == node.address for n in self.registered):
            self._warn(f"ignored a second registration from {node.address} ({role}): a ps-lite process registers "
                       "once")
            return
        counts = {SERVER: self.num_servers, WORKER: self.num_workers}
        if sum(1 for n in self.registered if n.role == node.role) >= counts[node.role]:
            self._warn(f"ignored a {role} at {node.address}: this job has {counts[node.role]} {role}s "
                       f"(DMLC_NUM_{role.upper()})")
            return
        self.registered.append(node)
        if len(self.registered) < expected:
            return
        self.nodes = assign_ids(sort_nodes(self.registered))
        for n in self.nodes:
            self._vlog(f"assign rank={n.id} to node {n.describe()}")
            self._connect(n)
        for n in self.nodes:
            self._send(n.id, Meta(ADD_NODE, self.nodes + [self.me]))
        self._vlog(f"the scheduler is connected to {self.num_workers} workers and {self.num_servers} servers")
        self._barrier(ALL_GROUPS, 0, 0)  # the scheduler's own ps::Start barrier

    def _connect(self, node: Node) -> None:
        """A DEALER connection to the node's ROUTER, as ``ZMQVan::Connect`` makes one. A node that
        registered but cannot be reached ends the job (:class:`Unreachable`): ps-lite's scheduler
        would retry for ever, and the job would hang waiting for that node's ADD_NODE."""
        try:
            sock = socket.create_connection((node.hostname, node.port), timeout=30.0)
        except OSError as e:
            raise Unreachable(
                f"cannot reach {ROLE_NAMES[node.role]} {node.address}, the address it registered: "
                f"{e.strerror or e}; the scheduler must reach every node there (check DMLC_INTERFACE or "
                "DMLC_NODE_HOST and the firewall)") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(GREETING)
        except OSError as e:
            sock.close()
            raise Unreachable(f"lost {ROLE_NAMES[node.role]} {node.address} while connecting: {e.strerror or e}") \
                from None
        peer = Peer(sock, node.address, outgoing=True, hello=ready(b"DEALER", b"ps" + str(SCHEDULER_ID).encode()))
        self.senders[node.id] = peer
        self.sel.register(sock, selectors.EVENT_READ, peer)

    def _barrier(self, group: int, app_id: int, customer_id: int) -> None:
        members = group_ids(group, self.num_servers, self.num_workers)
        self.counts[group] = self.counts.get(group, 0) + 1
        if self.verbose >= 1:
            self._vlog(f"Barrier count for {group} : {self.counts[group]}")
        if self.counts[group] < len(members):
            return
        self.counts[group] = 0
        for r in members:
            if r != SCHEDULER_ID:
                self._send(r, Meta(BARRIER, request=False, app_id=app_id, customer_id=customer_id,
                                   barrier_group=group))
        if group & SCHEDULER_GROUP:
            self.barriers_passed += 1
            if self.barriers_passed == 1:
                self._barrier(ALL_GROUPS, 0, 0)  # straight on to ps::Finalize's barrier


def refusal(env: Mapping[str, str], who: str = "the builtin scheduler") -> Optional[str]:
    """Why the builtin scheduler cannot serve a job whose processes get ``env``, or None: the spec
    (``who`` is then the option) and the program itself ask the same."""
    def setting(name: str, default: str) -> str:
        value = (env.get(name) or default).strip() or default
        return value if len(value) <= 30 else value[:30] + "..."

    van, local, resend = setting("DMLC_PS_VAN_TYPE", "zmq"), setting("DMLC_LOCAL", "0"), setting("PS_RESEND", "0")
    if van not in ("zmq", "p3"):
        return f"DMLC_PS_VAN_TYPE={van}: {who} speaks ps-lite's zmq van only; use --scheduler command"
    if local != "0":
        return (f"DMLC_LOCAL={local} (ipc sockets): {who} speaks TCP only; unset DMLC_LOCAL or use "
                "--scheduler command")
    if resend != "0":
        return (f"PS_RESEND={resend}: {who} does not acknowledge messages (ps-lite would send them again); "
                "unset PS_RESEND or use --scheduler command")
    return None


def _fail(text: str) -> int:
    sys.stderr.write(f"pslaunch scheduler: error: {text}\n")
    return 1


def main() -> int:
    """Serve the job that ``DMLC_*`` describes; its exit code."""
    env = os.environ
    if env.get("DMLC_ROLE", "scheduler") != "scheduler":
        return _fail(f"DMLC_ROLE is {env.get('DMLC_ROLE')!r}: this program is the scheduler only")
    why = refusal(env)
    if why:
        return _fail(why)
    try:
        host = env["DMLC_PS_ROOT_URI"]
        port = int(env["DMLC_PS_ROOT_PORT"])
        servers, workers = int(env["DMLC_NUM_SERVER"]), int(env["DMLC_NUM_WORKER"])
        verbose = int(env.get("PS_VERBOSE", "0").strip() or 0)
    except KeyError as e:
        return _fail(f"{e.args[0]} is not set: run this under pslaunch --scheduler builtin")
    except ValueError as e:
        return _fail(f"a DMLC_* variable is not a number: {e}")
    scheduler = Scheduler(host, port, servers, workers, verbose)
    try:
        scheduler.bind()
    except OSError as e:
        return _fail(f"cannot listen on {host}:{port}: {e.strerror or e}")
    try:
        return scheduler.run()
    except Unreachable as e:
        scheduler.close()
        return _fail(str(e))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
