"""pslaunch's own ps-lite scheduler (``pslaunch --scheduler builtin``): ps-lite's rules over pyzmq.

A ps-lite program (MXNet's ``dist_*`` kvstores, ps-lite's own apps) runs its scheduler role as
one more copy of the program: for MXNet a whole ``import mxnet`` (about 1.5 s of CPU) to run a
loop that only registers nodes and counts barriers. This program is that loop, with the sockets
of dmlc ps-lite's ``ZMQVan`` (MXNet 1.9, ps-lite master), through pyzmq (the ``pslite`` extra):

* a ROUTER bound on ``DMLC_PS_ROOT_URI:DMLC_PS_ROOT_PORT`` receives from every node's DEALER;
  the first frame is the sender's identity (``ps<id>`` once the node has an id); the scheduler
  reaches each node's ROUTER through a DEALER of its own, whose identity is ``ps1``;
* every message is a protobuf ``PBMeta`` frame (ps-lite ``src/meta.proto``), then data frames;
* control commands (``Control::Command``): ``ADD_NODE`` (a node registers; once all
  ``DMLC_NUM_SERVER + DMLC_NUM_WORKER`` have, they are sorted as ps-lite sorts them, numbered
  as ps-lite numbers them: server rank r is node 8 + 2r, worker rank r is 9 + 2r, and every
  node gets the whole list), ``BARRIER`` (counted per group, answered to the group when all its
  members arrived), ``HEARTBEAT`` (answered, as ps-lite's scheduler does, and the time noted);
* ps-lite's recovery (``Van::UpdateLocalID``, ``ProcessAddNodeCommandAtScheduler``): with
  ``PS_HEARTBEAT_TIMEOUT`` set (and the nodes' ``PS_HEARTBEAT_INTERVAL``), a node that registers
  after the job is ready takes the id of a dead node of its role (one whose last heartbeat, or
  its registration before any, is older than the timeout: ``Postoffice::GetDeadNodes``), and
  gets ``is_recovery`` and the whole list; the other live nodes get an ``ADD_NODE`` with it
  alone, and connect to its new address. MXNet's workers skip the start barrier then
  (apache/mxnet PR #2671): a lost worker is replaced in place (``--restart-scope process``);
* the scheduler itself takes part in the two barriers of every node (``ps::Start`` and
  ``ps::Finalize``, group scheduler + servers + workers) and exits with 0 after the second.

BytePS's fork of ps-lite (raw C structs instead of protobuf), ps-lite's other vans (``ibverbs``;
``DMLC_LOCAL``'s ipc) and ``PS_RESEND`` (every message acknowledged) keep ``--scheduler command``:
the spec and this program refuse them (:func:`launcher.spec.job.builtin_scheduler_refusal`).
A late node with no dead node of its role to replace (or heartbeats off) is refused with one
warning, and hears nothing, as under ps-lite's scheduler. A node that registers an address the
scheduler cannot connect to at the start ends the job with a one-line error, where ps-lite's
scheduler retries for ever and the job hangs; a replacement that does so is refused with a warning.

Nothing from the network is unpickled or executed, and nothing from it ends the scheduler but
the unreachable address above (one line): a message that does not parse is ignored with a
one-line warning. What a stranger can cost is bounded by libzmq's options, not by code here:

* who: pslaunch names the job's hosts in :data:`PEERS`; a ZAP handler (libzmq's authentication
  hook, asked for every connection once ``ZMQ_ZAP_DOMAIN`` is set, even with no security
  mechanism) refuses any other address before the connection carries a message (one warning
  per address). Without :data:`PEERS` (batch systems and mpirun: pslaunch does not know where
  their hosts' processes connect from) anyone may connect;
* time and descriptors: a connection that has not finished ZeroMQ's greeting in
  :data:`HANDSHAKE` seconds is closed, the soft open-file limit is raised to the hard one, and
  the sockets to the nodes are made at the start (libzmq retries what ``EMFILE`` fails);
* memory: one frame is at most :data:`MAX_MESSAGE` bytes (a node's control messages are a few
  hundred); libzmq keeps a message until its last frame and has no bound on the frames of one
  message, so a peer the gate lets in can still make it hold one unbounded message;
* sends never block: libzmq queues up to :data:`SEND_HWM` messages and :data:`SEND_BUFFER`
  bytes of the kernel's for a node that reads nothing, then they are dropped with a warning;
  a HEARTBEAT is answered once per node it names;
* a BARRIER counts only from a member of its group (the sender's identity ``ps<id>``, which
  libzmq lets one connection hold at a time), once per barrier.
"""

from __future__ import annotations

import errno
import importlib.util
import ipaddress
import os
import resource
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Optional, cast

import pscontract as pc

from ..errors import BackendUnavailableError
from ..spec.job import SCHEDULER_PEERS, builtin_scheduler_refusal

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
#: the largest frame accepted (libzmq drops the connection of a peer that sends more): a node
#: sends the scheduler control messages of one node at most, a few hundred bytes
MAX_MESSAGE = 64 << 10
#: messages queued for one node before more are dropped (control messages: a few per node)
SEND_HWM = 1000
#: the kernel's send buffer for one node, in bytes (unset, Linux lets it grow to megabytes)
SEND_BUFFER = 64 << 10
#: seconds a connection may take to finish ZeroMQ's greeting (libzmq's default is 30)
HANDSHAKE = 10.0
#: the variable that names the job's hosts, whose connections alone are accepted
PEERS = SCHEDULER_PEERS
#: refused addresses named in a warning each (a stranger on loopback has 16 million)
MAX_REFUSED = 20
#: how long the last messages may take to leave at the end, in seconds
LINGER = 5.0
#: how long a connection to a node may take to open, in seconds
CONNECT_TIMEOUT = 30.0
#: the same for a replacement mid-job (the other nodes' barriers and heartbeats wait meanwhile)
RECOVERY_CONNECT_TIMEOUT = 5.0
#: what to install for this program
INSTALL = "pip install '.[pslite]' in your clone of pslaunch (or pip install pyzmq)"


class WireError(Exception):
    """A message that is not what a ps-lite node sends."""


class Unreachable(Exception):
    """A node registered at an address that the scheduler cannot connect to: the job cannot start."""


def require_pyzmq() -> None:
    """Raise a one-line error when this Python lacks pyzmq (``--scheduler builtin`` runs with it)."""
    if importlib.util.find_spec("zmq") is None:
        raise BackendUnavailableError(f"--scheduler builtin needs pyzmq: {INSTALL}")


# --- protobuf (proto2) of ps-lite's meta.proto: only what the scheduler reads and writes ---------


def _varint(value: int) -> bytes:
    if value < 0:  # int32 fields: ten bytes, two's complement (protobuf's rule)
        value += 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
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


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
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
            continue
        if wire == 2:
            size, i = _read_varint(buf, i)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
        else:
            raise WireError(f"protobuf wire type {wire} (groups) is not in ps-lite's meta.proto")
        if i + size > len(buf):
            raise WireError("a protobuf field runs past the end of the frame")
        data = buf[i:i + size]
        yield number, wire, data if wire == 2 else int.from_bytes(data, "little")
        i += size


def _int(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _blob(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


#: the int32 fields the scheduler reads, by field number (booleans become ``bool``)
_NODE_INTS = {1: "role", 2: "id", 4: "port", 5: "is_recovery", 10: "customer_id"}
_META_INTS = {4: "request", 7: "app_id", 8: "timestamp", 10: "customer_id"}
_BOOLS = ("is_recovery", "request")


def _read_int(obj: object, fields: dict[int, str], number: int, value: int) -> None:
    """Set the attribute of ``obj`` that varint field ``number`` holds, if it is one in ``fields``."""
    attr = fields.get(number)
    if attr is not None:
        v = _int32(value)
        setattr(obj, attr, bool(v) if attr in _BOOLS else v)


@dataclass
class Node:
    """``PBNode``: a process of the job as ps-lite names it."""

    role: int
    id: int = EMPTY
    hostname: str = ""
    port: int = EMPTY
    is_recovery: bool = False
    customer_id: int = 0

    def encode(self) -> bytes:  # as ps-lite's Van::PackMeta writes one
        return (_int(1, self.role) + _int(2, self.id) + _blob(3, self.hostname.encode())
                + _int(4, self.port) + _int(5, int(self.is_recovery)) + _int(10, self.customer_id))

    @classmethod
    def decode(cls, buf: bytes) -> Node:
        node = cls(role=-1)
        for number, wire, value in _fields(buf):
            if number == 3 and wire == 2:
                try:
                    node.hostname = value.decode()
                except UnicodeDecodeError:
                    raise WireError("a node's hostname is not UTF-8") from None
            elif wire == 0:
                _read_int(node, _NODE_INTS, number, value)
        if node.role not in ROLE_NAMES:
            raise WireError("a node without a valid role")
        return node

    @property
    def address(self) -> str:
        return f"{self.hostname}:{self.port}"

    def describe(self) -> str:
        ident = "" if self.id == EMPTY else f", id={self.id}"
        recovery = ", is_recovery=1" if self.is_recovery else ""
        return f"role={ROLE_NAMES.get(self.role, '?')}{ident}, ip={self.hostname}, port={self.port}{recovery}"


@dataclass
class Meta:
    """``PBMeta`` with its ``PBControl``: what one message says (its data frames aside)."""

    cmd: int = CMD_EMPTY
    nodes: list[Node] = field(default_factory=list)
    request: bool = False
    app_id: int = EMPTY
    customer_id: int = EMPTY
    timestamp: int = EMPTY
    barrier_group: int = 0
    head: int = EMPTY

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
        meta = cls(customer_id=0)  # (proto2's default of a field a sender left out)
        for number, wire, value in _fields(buf):
            if number == 3 and wire == 2:
                meta.cmd = -1
                for n2, w2, v2 in _fields(value):
                    if n2 == 1 and w2 == 0:
                        meta.cmd = _int32(v2)
                    elif n2 == 2 and w2 == 2:
                        meta.nodes.append(Node.decode(v2))
                    elif n2 == 3 and w2 == 0:
                        meta.barrier_group = _int32(v2)
                if meta.cmd < 0:
                    raise WireError("a control message without its command")
            elif wire == 0:
                _read_int(meta, _META_INTS, number, value)
        return meta


def sort_nodes(nodes: list[Node]) -> list[Node]:
    """The order in which ps-lite's scheduler numbers the nodes: host names in descending
    order (its comparator is ``(a.hostname.compare(b.hostname) | (a.port < b.port)) > 0``), the
    nodes of one host by ascending port."""
    by_port = sorted(nodes, key=lambda n: n.port)
    return sorted(by_port, key=lambda n: n.hostname.encode(), reverse=True)


def assign_ids(nodes: list[Node]) -> list[Node]:
    """ps-lite's numbering, in place and returned: server rank r is 8 + 2r, worker rank r 9 + 2r."""
    ranks = {SERVER: 0, WORKER: 0}
    for node in nodes:
        node.id = (8 if node.role == SERVER else 9) + 2 * ranks[node.role]
        ranks[node.role] += 1
    return nodes


def group_ids(group: int, num_servers: int, num_workers: int) -> list[int]:
    """The node ids of a barrier group (``Postoffice::GetNodeIDs``), the scheduler's included."""
    ids = [SCHEDULER_ID] if group & SCHEDULER_GROUP else []
    if group & SERVER_GROUP:
        ids += [8 + 2 * r for r in range(num_servers)]
    if group & WORKER_GROUP:
        ids += [9 + 2 * r for r in range(num_workers)]
    return ids


def node_id(identity: bytes) -> int:
    """ps-lite's ``ZMQVan::GetNodeID``: ``ps9`` is node 9; anything else is nobody yet (a
    DEALER without an identity gets one from libzmq, which begins with a zero byte)."""
    digits = identity[2:]
    if len(identity) > 2 and identity[:2] == b"ps" and digits.isdigit():
        if len(digits) > 10:  # (ZMTP 3's READY carries identities of any length: int() refuses 4,301 digits)
            raise WireError(f"its identity ps<{len(digits)} digits> is no ps-lite node's")
        return int(digits)
    return EMPTY


def host_problem(node: Node) -> Optional[str]:
    """Why ``node``'s address is none a TCP connection can be made to, or None (the warning's end)."""
    name = node.hostname
    if not name or not name.isascii() or not name.isprintable() or " " in name or not _idna(name):
        return f"its host name {name[:60]!r} is no host name or address"
    if not 1 <= node.port <= 65535:
        return f"its port {node.port} is not from 1 to 65535"
    return None


def _idna(name: str) -> bool:
    """True when ``name`` passes the resolver's check (labels of 1 to 63 characters)."""
    try:
        name.encode("idna")
        return True
    except UnicodeError:
        return False


def resolve_peers(names: Iterable[str], root: str) -> tuple[frozenset[str], list[str]]:
    """The addresses of ``names`` (host names or addresses), and the names that resolve to none.
    With a loopback address among them, ``root``'s too: a process of this machine that connects
    to the scheduler's address comes from it."""
    found: set[str] = set()
    unknown = []
    for name in names:
        try:
            found |= _addresses(name)
        except (OSError, UnicodeError):
            unknown.append(name)
    if any(ipaddress.ip_address(a).is_loopback for a in found):
        try:
            found |= _addresses(root)
        except (OSError, UnicodeError):
            pass
    return frozenset(found), unknown


def _addresses(name: str) -> set[str]:
    return {_ip(str(info[4][0])) for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}


def _ip(text: str) -> str:
    """An address as ZAP and getaddrinfo both give it (an IPv4-mapped IPv6 address as IPv4)."""
    ip = ipaddress.ip_address(text.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def _raise_open_files() -> None:
    """The soft open-file limit up to the hard one: a stranger must hold that many connections."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ValueError, OSError):
        pass


# --- the scheduler ------------------------------------------------------------------------------


class Scheduler:
    """ps-lite's scheduler van and postoffice, for one job."""

    def __init__(self, host: str, port: int, num_servers: int, num_workers: int, verbose: int = 0,
                 peers: Optional[frozenset[str]] = None, heartbeat_timeout: float = 0.0) -> None:
        import zmq

        self.host, self.port = host, port
        self.heartbeat_timeout = heartbeat_timeout  # PS_HEARTBEAT_TIMEOUT; 0: no node is ever dead
        self.num_servers, self.num_workers, self.verbose = num_servers, num_workers, verbose
        _raise_open_files()  # (libzmq holds three files per node: two sockets' and a mailbox)
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 65536)  # (as ps-lite's ZMQVan: libzmq's default is 1,023)
        self.peers = peers  # the addresses let in; None: anyone's
        self.refused: set[str] = set()  # (those warned about)
        self.gate = None
        if peers is not None:  # libzmq asks this socket about every new connection (ZAP, RFC 27)
            self.gate = self.ctx.socket(zmq.REP)
            self.gate.bind("inproc://zeromq.zap.01")
        self.receiver = self.ctx.socket(zmq.ROUTER)
        self.receiver.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self.receiver.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE * 1000))
        if peers is not None:
            self.receiver.setsockopt(zmq.ZAP_DOMAIN, b"pslaunch")
        # the sockets to the nodes, made now: their mailboxes' files are taken before a stranger's
        self.spare = [self.ctx.socket(zmq.DEALER) for _ in range(num_servers + num_workers)]
        self.registered: list[Node] = []
        self.nodes: dict[int, Node] = {}  # by id, once everyone registered
        self.order: list[int] = []  # their ids in the order of the list every node got
        self.last_beat: dict[int, float] = {}  # node id -> when it was last heard of (time.monotonic)
        self.heard_beats = False  # a node sent a heartbeat: the nodes have PS_HEARTBEAT_INTERVAL set
        self.senders: dict[int, Any] = {}  # node id -> a DEALER connected to that node (ZMQVan::Connect)
        self.arrived: dict[int, set[int]] = {}  # barrier group -> the members that asked for it
        self.timestamp = 0
        self.barriers_passed = 0  # of the scheduler's own two (start, finalize)
        self.me = Node(SCHEDULER, SCHEDULER_ID, host, port)
        self.warned: set[str] = set()

    def bind(self) -> None:
        """Listen on the root address (resolved here: libzmq binds addresses, not DNS names)."""
        import zmq

        family, _, _, _, addr = socket.getaddrinfo(self.host, self.port, 0, socket.SOCK_STREAM)[0]
        ip = addr[0]
        if family == socket.AF_INET6:
            self.receiver.setsockopt(zmq.IPV6, 1)
            ip = f"[{ip}]"
        self.receiver.bind(f"tcp://{ip}:{self.port}")

    def run(self) -> int:
        """Serve until the job's last barrier: 0."""
        import zmq

        poller = zmq.Poller()
        poller.register(self.receiver, zmq.POLLIN)
        if self.gate is not None:
            poller.register(self.gate, zmq.POLLIN)
        while self.barriers_passed < 2:
            for sock, _ in poller.poll():
                if sock is self.gate:
                    self._admit()
                    continue
                identity, *frames = self.receiver.recv_multipart(copy=False)
                try:
                    peer = cast(str, identity.get("Peer-Address"))  # (this property is a str)
                except zmq.ZMQError:
                    peer = "?"
                try:
                    self._handle(node_id(identity.bytes), peer, [f.bytes for f in frames])
                except Unreachable:
                    raise
                except Exception as e:  # (nothing from the network ends the scheduler)
                    self._warn(f"ignored a message from {peer}: {e}")
        self.close(LINGER)
        return 0

    def _admit(self) -> None:
        """Answer libzmq's ZAP request (RFC 27) for one new connection: the job's hosts only."""
        assert self.gate is not None and self.peers is not None
        _version, request_id, _domain, address, *_ = self.gate.recv_multipart()
        peer = address.decode("ascii", "replace")
        try:
            ok = _ip(peer) in self.peers
        except ValueError:
            ok = False
        if not ok and peer not in self.refused and len(self.refused) < MAX_REFUSED:
            self.refused.add(peer)
            more = "; more addresses are refused without a word" if len(self.refused) == MAX_REFUSED else ""
            self._warn(f"refused connections from {peer[:60]}: not an address of this job's hosts (if it is one, "
                       f"add it to {PEERS}, or '*' for anyone){more}")
        self.gate.send_multipart([b"1.0", request_id, b"200" if ok else b"400",
                                  b"OK" if ok else b"not one of the job's hosts", b"", b""])

    def close(self, linger: float = 0) -> None:
        """Close every socket; messages not sent yet may take ``linger`` seconds to leave."""
        self.ctx.destroy(linger=int(linger * 1000))

    def _warn(self, text: str) -> None:
        sys.stderr.write(f"pslaunch scheduler: warning: {text}\n")

    def _warn_once(self, key: str, text: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            self._warn(text)

    def _vlog(self, text: str) -> None:
        if self.verbose >= 1:
            sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {text}\n")

    def _send(self, recver: int, meta: Meta) -> None:
        import zmq

        sender = self.senders.get(recver)
        if sender is None:
            self._warn(f"there is no connection to node {recver}")
            return
        meta.timestamp = self.timestamp
        self.timestamp += 1
        try:
            sender.send(meta.encode(), zmq.NOBLOCK)
        except zmq.Again:
            self._warn_once(f"full{recver}", f"cannot send to node {recver} at {self.nodes[recver].address}: "
                            f"{SEND_HWM} messages wait for it already (it reads nothing); dropped")

    def _handle(self, sender: int, peer: str, frames: list[bytes]) -> None:
        if not frames:
            raise WireError("a message of its sender's identity only")
        meta = Meta.decode(frames[0])
        if meta.cmd == ADD_NODE:
            self._add_node(meta, sender)
        elif meta.cmd == BARRIER and meta.request:
            group = meta.barrier_group
            if not 1 <= group <= ALL_GROUPS:
                raise WireError(f"a barrier of node group {group} (ps-lite's groups are 1 to 7)")
            if sender not in self.nodes or sender not in group_ids(group, self.num_servers, self.num_workers):
                raise WireError(f"a barrier of node group {group} from {'nobody' if sender == EMPTY else sender}, "
                                "no member of the group")
            self._barrier(group, meta.app_id, meta.customer_id, sender)
        elif meta.cmd == HEARTBEAT:
            if sender in self.nodes:  # (the sender's identity, which one connection holds: not what it names)
                self.last_beat[sender] = time.monotonic()
                self.heard_beats = True
            for nid in dict.fromkeys(n.id for n in meta.nodes):  # (once per node, however often named)
                if nid in self.senders:
                    self._send(nid, Meta(HEARTBEAT, [self.me]))
        elif meta.cmd == CMD_EMPTY:
            self._warn_once("data", f"ignored a data message from {peer}: a ps-lite scheduler serves no "
                            "application")
        elif meta.cmd != TERMINATE:
            self._warn_once(f"cmd{meta.cmd}", f"ignored control command {meta.cmd} from {peer}")

    def _add_node(self, meta: Meta, sender: int) -> None:
        if len(meta.nodes) != 1 or sender != EMPTY:
            raise WireError(f"an ADD_NODE request names {len(meta.nodes)} nodes from node "
                            f"{'?' if sender == EMPTY else sender}; ps-lite sends one, before it has an id")
        node = meta.nodes[0]
        problem = host_problem(node)  # (first: the address is in the messages below, and goes to a terminal)
        if node.role == SCHEDULER:
            raise WireError(f"a second scheduler ({problem or node.address}) registered with this one")
        expected, role = self.num_servers + self.num_workers, ROLE_NAMES[node.role]
        if problem:
            raise WireError(f"a {role} registered, but {problem}")
        if self.nodes:
            self._recover(node)
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
        nodes = assign_ids(sort_nodes(self.registered))
        self.nodes = {n.id: n for n in nodes}
        self.order = [n.id for n in nodes]
        now = time.monotonic()
        for n in nodes:
            self._vlog(f"assign rank={n.id} to node {n.describe()}")
            self._connect(n)
            self.last_beat[n.id] = now  # (ps-lite's UpdateHeartbeat at registration)
        for n in nodes:
            self._send(n.id, Meta(ADD_NODE, nodes + [self.me]))
        self._vlog(f"the scheduler is connected to {self.num_workers} workers and {self.num_servers} servers")
        self._barrier(ALL_GROUPS, 0, 0, SCHEDULER_ID)  # the scheduler's own ps::Start barrier

    def dead(self, role: int) -> list[int]:
        """The ids of the nodes of ``role`` silent for more than the heartbeat timeout, in the
        list's order (``Postoffice::GetDeadNodes``): none while heartbeats are off."""
        if self.heartbeat_timeout <= 0 or not self.heard_beats:
            return []
        now = time.monotonic()
        return [i for i in self.order
                if self.nodes[i].role == role and now - self.last_beat[i] > self.heartbeat_timeout]

    def _recover(self, node: Node) -> None:
        """A node registered after the job was ready: it takes the id of the first dead node of its
        role (``Van::UpdateLocalID``), gets ``is_recovery`` and the whole list, and the other live
        nodes get it alone, to connect to its address (``ProcessAddNodeCommandAtScheduler``). With
        no dead node of its role it is refused with one warning and hears nothing (ps-lite's
        scheduler ignores it too): the job goes on."""
        role = ROLE_NAMES[node.role]
        expected = self.num_servers + self.num_workers
        if self.heartbeat_timeout <= 0:
            self._warn(f"ignored a {role} at {node.address}: all {expected} servers and workers of this job have "
                       "registered (DMLC_NUM_SERVER, DMLC_NUM_WORKER)")
            return
        dead = self.dead(node.role)
        if not dead:
            why = ("none is silent for more than PS_HEARTBEAT_TIMEOUT=" f"{self.heartbeat_timeout:g} s"
                   if self.heard_beats else "no node has sent a heartbeat (set PS_HEARTBEAT_INTERVAL on the nodes)")
            self._warn(f"ignored a {role} at {node.address}: all {expected} servers and workers of this job have "
                       f"registered, and there is no dead {role} for it to replace: {why}")
            return
        nid = dead[0]
        old, old_sender = self.nodes[nid], self.senders.pop(nid)
        node.id, node.is_recovery = nid, True
        try:
            self._connect(node, RECOVERY_CONNECT_TIMEOUT)
        except Unreachable as e:
            self.senders[nid] = old_sender
            self._warn(f"ignored a {role} that came to replace node {nid}: {e}")
            return
        old_sender.close(linger=0)
        self._vlog(f"replace dead node {old.describe()} by node {node.describe()}")
        self.nodes[nid] = node
        self.last_beat[nid] = time.monotonic()
        everyone = [self.nodes[i] for i in self.order] + [self.me]
        others_dead = set(self.dead(SERVER) + self.dead(WORKER)) - {nid}
        for i in self.order:
            if i not in others_dead:  # (nothing is sent to a dead node)
                self._send(i, Meta(ADD_NODE, everyone if i == nid else [node]))

    def _connect(self, node: Node, timeout: float = CONNECT_TIMEOUT) -> None:
        """A DEALER with identity ``ps1`` connected to the node's ROUTER, as ``ZMQVan::Connect``
        makes one. A node that registered but cannot be reached ends the job
        (:class:`Unreachable`): ps-lite's scheduler (libzmq) would retry for ever, and the job
        would hang waiting for that node's ADD_NODE. libzmq does not say why a connection fails,
        so a plain TCP connection to the address tries first, and its error is the message."""
        import zmq

        try:
            try:
                socket.create_connection((node.hostname, node.port), timeout=timeout).close()
            except OSError as e:
                if e.errno not in (errno.EMFILE, errno.ENFILE):  # (out of files: libzmq retries its own)
                    raise
            dealer = self.spare.pop() if self.spare else self.ctx.socket(zmq.DEALER)  # (a replacement's)
            dealer.setsockopt(zmq.IDENTITY, b"ps%d" % SCHEDULER_ID)
            dealer.setsockopt(zmq.SNDHWM, SEND_HWM)
            dealer.setsockopt(zmq.SNDBUF, SEND_BUFFER)
            dealer.connect(f"tcp://{node.address}")
        except (OSError, zmq.ZMQError) as e:
            raise Unreachable(
                f"cannot reach {ROLE_NAMES[node.role]} {node.address}, the address it registered: "
                f"{_reason(e)}; the scheduler must reach every node there (check DMLC_INTERFACE or "
                "DMLC_NODE_HOST and the firewall)") from None
        self.senders[node.id] = dealer

    def _barrier(self, group: int, app_id: int, customer_id: int, member: int) -> None:
        members = group_ids(group, self.num_servers, self.num_workers)
        arrived = self.arrived.setdefault(group, set())
        arrived.add(member)  # (a second request of one member for one barrier counts once)
        self._vlog(f"Barrier count for {group} : {len(arrived)}")
        if len(arrived) < len(members):
            return
        arrived.clear()
        for r in members:
            if r != SCHEDULER_ID:
                self._send(r, Meta(BARRIER, request=False, app_id=app_id, customer_id=customer_id,
                                   barrier_group=group))
        if group & SCHEDULER_GROUP:
            self.barriers_passed += 1
            if self.barriers_passed == 1:
                self._barrier(ALL_GROUPS, 0, 0, SCHEDULER_ID)  # straight on to ps::Finalize's barrier


def _reason(e: Exception) -> str:
    """An error's reason (pyzmq's messages add the address, which ours name already)."""
    import zmq

    if isinstance(e, zmq.ZMQError) and e.errno is not None:
        return zmq.strerror(e.errno)
    return getattr(e, "strerror", None) or str(e)


def _fail(text: str) -> int:
    sys.stderr.write(f"pslaunch scheduler: error: {text}\n")
    return 1


def main(env: Mapping[str, str] = os.environ) -> int:
    """Serve the job that ``DMLC_*`` describes; its exit code."""
    for signum in (signal.SIGUSR1, signal.SIGUSR2):  # a batch system's notice: for the workers, not us
        signal.signal(signum, signal.SIG_IGN)
    if env.get(pc.ROLE, "scheduler") != "scheduler":
        return _fail(f"{pc.ROLE} is {env.get(pc.ROLE)!r}: this program is the scheduler only")
    why = builtin_scheduler_refusal(env)
    if why:
        return _fail(why)
    try:
        host, port = env[pc.ROOT_URI], int(env[pc.ROOT_PORT])
        servers, workers = int(env[pc.NUM_SERVER]), int(env[pc.NUM_WORKER])
        verbose = int(env.get(pc.VERBOSE, "0").strip() or 0)
    except KeyError as e:
        return _fail(f"{e.args[0]} is not set: run this under pslaunch --scheduler builtin")
    except ValueError as e:
        return _fail(f"a DMLC_* variable is not a number: {e}")
    try:  # (ps-lite reads it with atoi: 0, or unset, is off)
        heartbeat_timeout = float(env.get(pc.HEARTBEAT_TIMEOUT, "0").strip() or 0)
    except ValueError:
        return _fail(f"{pc.HEARTBEAT_TIMEOUT}={env[pc.HEARTBEAT_TIMEOUT][:30]!r} is not a number of seconds")
    try:
        import zmq
    except ImportError as e:
        return _fail(f"the builtin scheduler needs pyzmq ({e}): {INSTALL}")
    names = [x.strip() for x in env.get(PEERS, "*").split(",") if x.strip()]
    peers = None
    if names and "*" not in names:
        peers, unknown = resolve_peers(names, host)
        for name in unknown:
            sys.stderr.write(f"pslaunch scheduler: warning: {PEERS} names {name[:60]!r}, which does not resolve: "
                             "its processes cannot connect\n")
    scheduler = Scheduler(host, port, servers, workers, verbose, peers, heartbeat_timeout)
    try:
        scheduler.bind()
    except (OSError, ValueError, zmq.ZMQError) as e:
        scheduler.close()
        return _fail(f"cannot listen on {host}:{port}: {_reason(e)}")
    try:
        return scheduler.run()
    except Unreachable as e:
        scheduler.close()
        return _fail(str(e))
    except KeyboardInterrupt:
        scheduler.close()
        return 130


if __name__ == "__main__":
    sys.exit(main())
