"""A tracker for dmlc's rabit protocol: what ``-s 0`` jobs (XGBoost up to 2.0) connect to.

Written from the protocol as rabit's C++ engine speaks it (XGBoost 2.0.3,
``rabit/src/allreduce_base.cc``) and as dmlc-core's ``tracker.py`` serves it;
no code is taken from either. Standard library only, and nothing else from the
launcher is imported, so the module can live wherever the launcher needs it.

Wire format
-----------
Every integer is a signed 32-bit int in the *sender's native byte order*
(rabit ``send``s its ``int`` variables as they are in memory; every platform
XGBoost ships for is little-endian). A string is an int length followed by that
many bytes, no terminator. A worker opens a new TCP connection to the tracker
for each command, and every connection starts with the same header::

    worker -> tracker   int magic = 0xff99
    tracker -> worker   int magic = 0xff99        (only if the worker's was right)
    worker -> tracker   int rank                  (-1 until the tracker gave one)
                        int world_size            (-1 unless rabit_world_size was set)
                        str task_id               (DMLC_TASK_ID, "NULL" when unset)
                        str command               ("start", "recover", "print", "shutdown")

``print``: ``str message``, then the worker closes. The tracker relays it.

``shutdown``: nothing more; the worker closes. The tracker counts the rank as
finished, and ends when every rank has said it.

``start`` (rank -1) and ``recover`` (rank >= 0: a worker that lost links and
keeps its rank) ask for a rank and links. The tracker answers once the rank is
decided (``start``: when all N workers have asked, see *Ranks*) and then runs
the link dialog with one worker at a time::

    tracker -> worker   int rank, int parent_rank (-1 at the root), int world_size,
                        int k, k x int tree_neighbour_rank,
                        int ring_prev_rank, int ring_next_rank   (-1: none)
    repeat:
      worker -> tracker int n_good, n_good x int rank   (links it still holds; 0 at start)
      tracker -> worker int n_connect, int n_accept,
                        n_connect x (str host, int port, int rank)
      worker -> tracker int n_errors                    (connections that failed)
    until n_errors == 0
    worker -> tracker   int listen_port                 (where it accepts its n_accept peers)

The worker must hold a link to each tree neighbour and to its ring neighbours.
It *connects* to those that finished their own dialog earlier (their host is
the address their tracker connection came from, their port the one they sent)
and *accepts* the rest, which will be told to connect to it. That is why the
dialogs run strictly one after the other. Between peers, each side of a new
link sends its rank and reads the other's.

Ranks
-----
All ``start`` requests are held until N workers have asked (as dmlc does). A
worker whose task id is a decimal integer in ``0..N-1``, and the first to claim
it, gets that rank, so ``rank == DMLC_TASK_ID`` whenever the launcher numbers
its workers (host by host, which keeps each host's ranks contiguous). The other
workers take the free ranks in order of their address, then of arrival, as
dmlc's tracker sorts its whole batch by host. A worker that asks again with a
task id already given a rank (a restarted worker) gets the same rank.

Topology
--------
The tree is binary over contiguous rank ranges: the root of ``[lo, hi)`` is
``lo``, its children are the roots of the two halves of ``[lo+1, hi)``. Depth is
``log2(N)``, and every subtree is a block of consecutive ranks, so with ranks
grouped by host most tree links stay inside a host. The ring is
``0 -> 1 -> ... -> N-1 -> 0``: it crosses between hosts as few times as
possible, and shares the link ``lo -> lo+1`` of every inner tree node.

Safety
------
Nothing read from the network is unpickled, evaluated or trusted: a wrong
magic number, an unknown command, a negative or oversized length, or a
handshake slower than ``handshake_timeout`` drops that connection and is
counted; the tracker goes on serving. Strings are bounded (task id
``max_task_id`` bytes; print messages kept up to ``max_print`` bytes, the rest
read and discarded, and dropped beyond 64 times that), and so is the number of
connections still in their header (``n_workers + 64``: more are closed as soon
as they are accepted). Control characters in relayed messages are replaced, so
a stray client cannot drive the launcher's terminal.

Failures
--------
Some events mean the job cannot complete, and turn the state to ``failed``
(``wait()`` returns at once, ``error`` says why): a worker that closes its
tracker connection after asking for a rank (rabit in XGBoost 2.0 never does:
its process died), a world size other than N, an XGBoost 2.1+ worker (its JSON
handshake is recognised and named), a worker whose link set-up fails
``MAX_LINK_ROUNDS`` times or stalls for ``link_timeout``. A worker that dies
before it ever connects is invisible here: its exit code is the launcher's to
see; ``status()`` then tells how many asked.

Lifecycle: ``RabitTracker(...)`` binds (the port is known at once for
:meth:`RabitTracker.worker_env`), :meth:`~RabitTracker.start` serves in a
daemon thread, :meth:`~RabitTracker.wait` returns a :class:`TrackerStatus` when
the job is done or failed, or when its timeout passes, and
:meth:`~RabitTracker.close` stops the thread and closes every socket, at any
time, within a fraction of a second.
"""

from __future__ import annotations

import collections
import errno
import ipaddress
import re
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from typing import Callable, Generator, Iterable, Optional

MAGIC = 0xFF99
_INT = struct.Struct("=i")  # native byte order, exactly 4 bytes
NO_TASK_ID = "NULL"  # what rabit sends when DMLC_TASK_ID is unset
MAX_COMMAND = 16
#: how many times one worker may report failed connections before the tracker gives up
MAX_LINK_ROUNDS = 30
#: connections still in their header beyond the workers themselves
EXTRA_PENDING = 64
_LOG_PER_REASON = 5
_TASK_RANK = re.compile(r"(0|[1-9][0-9]*)\Z")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class TrackerError(Exception):
    """The tracker cannot start (no free port, a bad address); ``str(e)`` names the fix."""


# --- topology (pure) -----------------------------------------------------------


@dataclass(frozen=True)
class RankLinks:
    """What the tracker tells one rank: its tree and ring neighbours (-1 for none)."""

    rank: int
    parent: int
    tree: tuple[int, ...]  # parent first (if any), then children, ascending
    prev: int
    next: int

    @property
    def peers(self) -> frozenset[int]:
        """Every rank this one must hold a link to."""
        return frozenset(r for r in (*self.tree, self.prev, self.next) if r >= 0)


def link_map(n: int) -> tuple[RankLinks, ...]:
    """The tree and ring of an ``n``-worker job, indexed by rank (see the module doc)."""
    if n < 1:
        raise ValueError(f"a rabit job needs at least one worker, not {n}")
    parent = [-1] * n
    children: list[list[int]] = [[] for _ in range(n)]
    stack = [(0, n)]  # ranges [lo, hi) whose root is lo
    while stack:
        lo, hi = stack.pop()
        rest = hi - lo - 1
        if rest <= 0:
            continue
        mid = lo + 1 + (rest + 1) // 2  # left half [lo+1, mid), right half [mid, hi)
        for child_lo, child_hi in ((lo + 1, mid), (mid, hi)):
            if child_lo < child_hi:
                parent[child_lo] = lo
                children[lo].append(child_lo)
                stack.append((child_lo, child_hi))
    out = []
    for r in range(n):
        tree = ([parent[r]] if parent[r] >= 0 else []) + sorted(children[r])
        prev, nxt = (r - 1) % n, (r + 1) % n
        out.append(RankLinks(r, parent[r], tuple(tree), -1 if prev == r else prev, -1 if nxt == r else nxt))
    return tuple(out)


def assign_ranks(n: int, free: Iterable[int], batch: list[tuple[str, str]]) -> list[int]:
    """Ranks for ``batch`` (``(task_id, host)`` in arrival order) out of the ``free`` ranks.

    A task id that is a decimal integer in ``0..n-1`` and free is taken as the
    rank by the first worker that claims it; the others get the remaining
    ranks, ascending, in order of host address and then of arrival.
    """
    free_sorted = sorted(free)
    if len(batch) != len(free_sorted):
        raise ValueError(f"{len(batch)} workers for {len(free_sorted)} free ranks")
    left = set(free_sorted)
    ranks: list[Optional[int]] = [None] * len(batch)
    for i, (task_id, _host) in enumerate(batch):
        if _TASK_RANK.match(task_id) and int(task_id) in left:
            ranks[i] = int(task_id)
            left.discard(int(task_id))
    rest = sorted((i for i in range(len(batch)) if ranks[i] is None), key=lambda i: (_host_key(batch[i][1]), i))
    for i, r in zip(rest, sorted(left)):
        ranks[i] = r
    return [r for r in ranks if r is not None]


def _host_key(host: str) -> tuple:
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
        return (0, ip.version, ip.packed)
    except ValueError:
        return (1, host)


def _clean(text: str) -> str:
    return _CONTROL.sub("?", text)


# --- status --------------------------------------------------------------------

#: ``waiting`` (not every rank has its links yet), ``running`` (all have),
#: ``done`` (all said shutdown), ``failed`` (the job cannot go on: see ``error``),
#: ``closed`` (close() came first)
STATES = ("waiting", "running", "done", "failed", "closed")


@dataclass(frozen=True)
class Member:
    """A rank as the tracker knows it."""

    rank: int
    task_id: str
    host: str


@dataclass(frozen=True)
class TrackerStatus:
    """A snapshot of the tracker, safe to read from any thread."""

    state: str
    n_workers: int
    asked: int  # workers that have asked for a rank and are still connected or served
    members: tuple[Member, ...]  # ranks whose link set-up finished, by rank
    shutdown: tuple[int, ...]  # ranks that said shutdown
    prints: int
    rejected: dict = field(default_factory=dict)  # reason -> count of dropped connections
    error: Optional[str] = None
    started_s: Optional[float] = None  # seconds from start() to the last rank's links
    finished_s: Optional[float] = None  # seconds from start() to the last shutdown

    @property
    def ended(self) -> bool:
        return self.state in ("done", "failed", "closed")

    def summary(self) -> str:
        """One line for the launcher's log."""
        parts = [f"{self.state}: {len(self.members)} of {self.n_workers} workers joined",
                 f"{len(self.shutdown)} shut down"]
        if self.rejected:
            parts.append("dropped connections: " + ", ".join(f"{k} {v}" for k, v in sorted(self.rejected.items())))
        if self.error:
            parts.append(self.error)
        if self.asked == 0 and self.state in ("waiting", "closed"):
            # XGBoost 2.0 without collective.init() trains alone and never calls
            parts.append("no worker asked for a rank: does the program start rabit "
                         "(xgboost.collective.init() or CommunicatorContext())?")
        return "; ".join(parts)


# --- connections ---------------------------------------------------------------

_PARK = object()  # a coroutine yields this to wait until the tracker resumes it


class _Drop(Exception):
    """Close this connection; ``reason`` is the counter, ``detail`` the log line."""

    def __init__(self, reason: str, detail: str, fatal: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.fatal = fatal


class _Conn:
    __slots__ = ("sock", "host", "peer", "seq", "gen", "need", "buf", "out", "deadline", "rank",
                 "world", "task_id", "cmd", "phase", "closed")

    def __init__(self, sock: socket.socket, peer: tuple, seq: int) -> None:
        self.sock = sock
        self.peer = peer
        self.host = str(peer[0]).split("%")[0]
        self.seq = seq
        self.gen: Optional[Generator] = None
        self.need: object = None  # int bytes wanted, _PARK, or None before the first step
        self.buf = bytearray()
        self.out = bytearray()
        self.deadline: Optional[float] = None
        self.rank = -1
        self.world = -1
        self.task_id = NO_TASK_ID
        self.cmd = ""
        self.phase = "header"  # header, pending, queued, linking, done
        self.closed = False

    def who(self) -> str:
        if self.rank >= 0:
            return f"rank {self.rank} (task id {self.task_id}, {self.host})"
        if self.task_id != NO_TASK_ID:
            return f"the worker with task id {self.task_id} ({self.host})"
        return f"a worker at {self.host}:{self.peer[1]}"


@dataclass
class _Waiting:
    """A rank whose dialog is over and that still waits for peers to connect to it."""

    host: str
    port: int
    accepts: int


# --- the tracker ---------------------------------------------------------------


class RabitTracker:
    """Serves ``n_workers`` rabit workers; see the module docstring for the protocol.

    ``on_print(rank, text)`` gets every ``print`` message (rank -1 if the sender
    gave none); ``on_log(text)`` gets the tracker's own notes. Both run on the
    tracker's thread; an exception there is counted and ignored.
    """

    def __init__(self, n_workers: int, host: str = "127.0.0.1", port_range: tuple[int, int] = (9091, 9998), *,
                 advertise: Optional[str] = None,
                 on_print: Optional[Callable[[int, str], None]] = None,
                 on_log: Optional[Callable[[str], None]] = None,
                 handshake_timeout: float = 30.0, link_timeout: float = 300.0,
                 max_print: int = 64 * 1024, max_task_id: int = 1024) -> None:
        if not isinstance(n_workers, int) or n_workers < 1:
            raise TrackerError(f"a rabit tracker needs at least 1 worker, not {n_workers!r}")
        lo, hi = port_range
        if not 1 <= lo <= hi <= 65535:
            raise TrackerError(f"bad port range {lo}-{hi}: need 1 <= LOW <= HIGH <= 65535")
        self.n_workers = n_workers
        self.host = host
        self.advertise = advertise or host
        if self.advertise in ("", "0.0.0.0", "::"):
            raise TrackerError(f"workers cannot connect to {self.advertise!r}: give the tracker's address to advertise")
        self._on_print = on_print
        self._on_log = on_log
        self.handshake_timeout = handshake_timeout
        self.link_timeout = link_timeout
        self.max_print = max_print
        self.max_task_id = max_task_id
        self.max_header_conns = n_workers + EXTRA_PENDING
        self._links = link_map(n_workers)

        try:
            infos = socket.getaddrinfo(host or None, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as e:
            raise TrackerError(f"cannot listen on {host!r}: {e.strerror}; give an address of this host") from None
        family = infos[0][0]
        backlog = min(self.max_header_conns, socket.SOMAXCONN)
        self.port = 0
        for port in range(lo, hi + 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            # SO_REUSEADDR: a port left in TIME_WAIT by an earlier job is free. It also lets two
            # trackers starting at once both bind a port, and the second listen() then fails
            # with EADDRINUSE: bind and listen both count, and a port lost either way is skipped.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
                sock.listen(backlog)
            except OSError as e:
                sock.close()
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    continue
                raise TrackerError(f"cannot listen on {host}:{port}: {e.strerror}; give an address of this host") from None
            self.port = port
            break
        if not self.port:
            raise TrackerError(f"no free port in {lo}-{hi} on {host}: widen --port-range")
        sock.setblocking(False)
        self._listener = sock
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._stop = False
        self._thread: Optional[threading.Thread] = None
        self._t0: Optional[float] = None
        # state below is touched by the tracker thread only, except under _lock for status()
        self._state = "waiting"
        self._error: Optional[str] = None
        self._rejected: collections.Counter = collections.Counter()
        self._logged: collections.Counter = collections.Counter()
        self._prints = 0
        self._members: dict[int, Member] = {}
        self._shutdown: set[int] = set()
        self._started_s: Optional[float] = None
        self._finished_s: Optional[float] = None
        self._drain_until: Optional[float] = None
        self._accept_paused_until: Optional[float] = None
        self._conns: dict[int, _Conn] = {}  # fileno -> conn
        self._seq = 0
        self._pending: list[_Conn] = []  # "start" with no rank yet, in arrival order
        self._queue: collections.deque[_Conn] = collections.deque()  # ranks waiting for their dialog
        self._active: Optional[_Conn] = None  # the one dialog in progress
        self._waiting: dict[int, _Waiting] = {}
        self._job_map: dict[str, int] = {}  # task id -> rank
        self._assigned: dict[int, _Conn] = {}  # rank -> the connection it was last given to
        self._sel: Optional[selectors.BaseSelector] = None

    # -- public API ----------------------------------------------------------

    def worker_env(self, task_id: Optional[int] = None) -> dict[str, str]:
        """The variables a rabit worker reads to find this tracker.

        XGBoost 2.0's rabit reads ``DMLC_TRACKER_URI``, ``DMLC_TRACKER_PORT``,
        ``DMLC_TASK_ID`` (sent to the tracker; the rank when it is 0..N-1),
        ``DMLC_ROLE`` (must be ``worker``), ``DMLC_WORKER_CONNECT_RETRY`` and
        ``DMLC_NUM_ATTEMPT`` (read, unused). ``DMLC_NUM_WORKER`` is not read by
        rabit but is part of dmlc's contract, and scripts use it.
        """
        env = {
            "DMLC_TRACKER_URI": self.advertise,
            "DMLC_TRACKER_PORT": str(self.port),
            "DMLC_NUM_WORKER": str(self.n_workers),
        }
        if task_id is not None:
            env["DMLC_TASK_ID"] = str(task_id)
        return env

    def start(self) -> RabitTracker:
        with self._lock:
            if self._thread is not None or self._stop:
                raise TrackerError("the tracker was already started or closed")
            self._t0 = time.monotonic()
            self._thread = threading.Thread(target=self._run, name=f"rabit-tracker-{self.port}", daemon=True)
        self._log(f"listening on {self.advertise}:{self.port} for {self.n_workers} workers")
        self._thread.start()
        return self

    def status(self) -> TrackerStatus:
        with self._lock:
            return self._snapshot()

    def wait(self, timeout: Optional[float] = None) -> TrackerStatus:
        """Block until the tracker is done, failed or closed, or ``timeout`` seconds pass.

        Never raises for a timeout: the returned status says where things stand
        (``state`` ``waiting`` or ``running`` when it timed out).
        """
        end = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if timeout is None and self._thread is None and not self._stop:
                raise TrackerError("wait() without a timeout on a tracker that was never started")
            while self._state not in ("done", "failed", "closed"):
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left if left is not None else 1.0)
            return self._snapshot()

    def close(self, timeout: float = 5.0) -> TrackerStatus:
        """Stop serving and close every socket; safe at any time and more than once."""
        with self._lock:
            self._stop = True
            thread = self._thread
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if thread is None:
            self._close_all()
        with self._cond:
            if self._state in ("waiting", "running"):
                self._state = "closed"
            self._cond.notify_all()
            return self._snapshot()

    def __enter__(self) -> RabitTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loop ------------------------------------------------------------

    def _run(self) -> None:
        sel = self._sel = selectors.DefaultSelector()
        try:
            sel.register(self._listener, selectors.EVENT_READ, "listen")
            sel.register(self._wake_r, selectors.EVENT_READ, "wake")
            while True:
                with self._lock:
                    if self._stop:
                        break
                now = time.monotonic()
                if self._drain_until is not None and (now >= self._drain_until or not self._header_conns()):
                    break
                if self._accept_paused_until is not None and now >= self._accept_paused_until:
                    self._accept_paused_until = None
                    if self._drain_until is None:
                        sel.register(self._listener, selectors.EVENT_READ, "listen")
                events = sel.select(self._next_timeout(now))
                ready = []
                for key, mask in events:
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    else:
                        ready.append((key.data, mask))
                # in order of arrival: a worker's print is served before its later shutdown
                for conn, mask in sorted(ready, key=lambda cm: cm[0].seq):
                    if conn.closed:
                        continue
                    if mask & selectors.EVENT_WRITE:
                        self._flush(conn)
                    if mask & selectors.EVENT_READ and not conn.closed:
                        self._readable(conn)
                self._expire(time.monotonic())
        except Exception as e:  # a bug here must not leave wait() hanging
            self._fail(f"rabit tracker stopped on an internal error: {type(e).__name__}: {e}")
        finally:
            self._close_all()
            with self._cond:
                if self._state in ("waiting", "running"):
                    self._state = "closed"
                self._cond.notify_all()

    def _header_conns(self) -> int:
        return sum(1 for c in self._conns.values() if c.phase == "header")

    def _next_timeout(self, now: float) -> float:
        t = 1.0
        for c in self._conns.values():
            if c.deadline is not None:
                t = min(t, max(0.0, c.deadline - now))
        for until in (self._drain_until, self._accept_paused_until):
            if until is not None:
                t = min(t, max(0.0, until - now))
        return t

    def _accept(self) -> None:
        for _ in range(64):  # a bounded batch per wake-up; the rest come next round
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: count it, keep serving the others
                self._reject("accept_error", f"accept failed: {e.strerror}")
                # the listener stays readable: stop watching it for a moment rather than spin
                self._sel.unregister(self._listener)
                self._accept_paused_until = time.monotonic() + 0.2
                return
            if self._header_conns() >= self.max_header_conns:
                self._reject("busy", f"too many connections in progress; closed one from {peer[0]}")
                sock.close()
                continue
            sock.setblocking(False)
            self._seq += 1
            conn = _Conn(sock, peer, self._seq)
            conn.deadline = time.monotonic() + self.handshake_timeout
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)
            conn.gen = self._serve(conn)
            self._step(conn, None)

    def _readable(self, conn: _Conn) -> None:
        while not conn.closed:
            if conn.need is _PARK:
                # nothing is due from a parked worker: data is a protocol error, EOF means it left
                try:
                    data = conn.sock.recv(1)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    data = b""
                if data:
                    self._drop(conn, _Drop("protocol", f"{conn.who()} sent data while waiting for its rank",
                                           fatal=True))
                else:
                    self._left(conn)
                return
            want = conn.need - len(conn.buf)
            try:
                data = conn.sock.recv(min(want, 65536))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._left(conn)
                return
            conn.buf += data
            if len(conn.buf) == conn.need:
                chunk = bytes(conn.buf)
                conn.buf.clear()
                self._step(conn, chunk)

    def _step(self, conn: _Conn, value: object) -> None:
        try:
            need = conn.gen.send(value)
        except StopIteration:
            self._finish(conn)
            return
        except _Drop as d:
            self._drop(conn, d)
            return
        conn.need = need
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.closed:
            return
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
                del conn.out[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._left(conn)
                return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        self._sel.modify(conn.sock, events, conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline is not None and now >= c.deadline]:
            if conn.phase == "linking":
                self._drop(conn, _Drop("timeout", f"{conn.who()} stalled in link set-up for {self.link_timeout:g} s",
                                       fatal=True))
            else:
                self._drop(conn, _Drop("timeout", f"a connection from {conn.host} sent no complete request in "
                                                  f"{self.handshake_timeout:g} s"))

    # -- the protocol, one coroutine per connection -----------------------------

    def _serve(self, c: _Conn) -> Generator:
        raw = yield 4
        magic = _INT.unpack(raw)[0]
        if magic != MAGIC:
            raise _Drop("bad_magic", f"dropped a connection from {c.host}: magic number {magic & 0xFFFFFFFF:#x}, "
                                     f"not {MAGIC:#x} (not a rabit worker)")
        c.out += _INT.pack(MAGIC)
        c.rank = _INT.unpack((yield 4))[0]
        raw = yield 4
        if raw.startswith(b'{"'):
            # XGBoost >= 2.1 sends a JSON string here: say so rather than a vague error
            raise _Drop("new_protocol", f"{c.host} speaks XGBoost 2.1+'s tracker protocol, which this rabit tracker "
                                        "does not: run the job with --tracker xgboost", fatal=True)
        c.world = _INT.unpack(raw)[0]
        c.rank = c.rank if c.rank >= 0 else -1
        c.task_id = _clean((yield from self._string(c, self.max_task_id, "task id")).decode("utf-8", "replace"))
        cmd = (yield from self._string(c, MAX_COMMAND, "command")).decode("ascii", "replace")
        c.cmd = cmd
        if cmd == "print":
            yield from self._print(c)
        elif cmd == "shutdown":
            self._on_shutdown(c)
        elif cmd in ("start", "recover"):
            yield from self._join(c)
        else:
            raise _Drop("bad_command", f"dropped a connection from {c.host}: unknown command {_clean(cmd)!r}")

    def _string(self, c: _Conn, limit: int, what: str) -> Generator:
        n = _INT.unpack((yield 4))[0]
        if n < 0 or n > limit:
            raise _Drop("oversized", f"dropped a connection from {c.host}: a {what} of {n} bytes (limit {limit})")
        if n == 0:
            return b""
        return (yield n)

    def _print(self, c: _Conn) -> Generator:
        n = _INT.unpack((yield 4))[0]
        if n < 0 or n > 64 * self.max_print:
            raise _Drop("oversized", f"dropped a print of {n} bytes from {c.host} (limit {64 * self.max_print})")
        keep = min(n, self.max_print)
        data = (yield keep) if keep else b""
        skipped = n - keep
        while skipped:  # read the rest so the worker's send completes, but keep none of it
            chunk = yield min(skipped, 65536)
            skipped -= len(chunk)
        text = _clean(data.decode("utf-8", "replace").strip())
        if n > keep:
            text += f" [... {n - keep} more bytes not shown]"
            self._count("print_truncated")
        with self._lock:
            self._prints += 1
        if self._on_print is not None:
            try:
                self._on_print(c.rank, text)
            except Exception:
                self._count("callback_error")

    def _on_shutdown(self, c: _Conn) -> None:
        r = c.rank
        if r < 0 or r >= self.n_workers or r not in self._members or r in self._shutdown:
            raise _Drop("unexpected", f"dropped a shutdown from {c.host} for rank {r}, which "
                                      + ("already said shutdown" if r in self._shutdown else "has no links"))
        self._waiting.pop(r, None)
        with self._lock:
            self._shutdown.add(r)
            last = len(self._shutdown) == self.n_workers
            if last:
                self._finished_s = self._elapsed()
        if not last:
            return
        try:
            self._sel.unregister(self._listener)
        except (KeyError, ValueError):
            pass
        # prints sent just before a shutdown may still be in flight: serve the connections
        # already accepted, briefly, and accept no more
        self._drain_until = time.monotonic() + 2.0
        span = ""
        if self._started_s is not None:
            span = f", {self._finished_s - self._started_s:.2f} s after the last joined"
        self._log(f"all {self.n_workers} workers shut down{span}")  # before wait() can return
        with self._cond:
            if self._state in ("waiting", "running"):
                self._state = "done"
            self._cond.notify_all()

    def _join(self, c: _Conn) -> Generator:
        n = self.n_workers
        if c.world not in (-1, n):
            raise _Drop("unexpected", f"{c.who()} expects a world of {c.world} workers but this job has {n}: "
                                      "remove rabit_world_size or make it match -n", fatal=True)
        c.deadline = None  # waiting for the others may take long: the job's own timeout applies
        if c.rank >= 0:
            if c.rank >= n or c.rank not in self._assigned or c.rank in self._shutdown:
                raise _Drop("unexpected", f"dropped {c.cmd} from {c.host} for rank {c.rank}, which this tracker "
                                          "did not give out or which has shut down")
        elif c.cmd == "recover":
            raise _Drop("unexpected", f"dropped recover from {c.host}: a recovering worker must name its rank")
        elif c.task_id != NO_TASK_ID and c.task_id in self._job_map:
            c.rank = self._job_map[c.task_id]
        else:
            free = [r for r in range(n) if r not in self._assigned]
            if len(self._pending) >= len(free):
                raise _Drop("unexpected", f"dropped start from {c.host} (task id {c.task_id}): all {n} ranks "
                                          "are taken (more workers than -n?)")
            c.phase = "pending"
            self._pending.append(c)
            if len(self._pending) == len(free):
                self._assign(free)  # queues the whole batch, this worker included
            else:
                yield _PARK  # resumed by _next_dialog once it has a rank and its turn
        if c.phase != "queued":
            c.phase = "queued"
            self._queue.append(c)
        if self._active is None:
            self._next_dialog()
        if self._active is not c:
            yield _PARK  # resumed by _next_dialog when its turn comes
        yield from self._dialog(c)

    def _assign(self, free: list[int]) -> None:
        batch = self._pending
        self._pending = []
        ranks = assign_ranks(self.n_workers, free, [(c.task_id, c.host) for c in batch])
        for c, r in sorted(zip(batch, ranks), key=lambda cr: cr[1]):
            c.rank = r
            self._assigned[r] = c
            if c.task_id != NO_TASK_ID:
                self._job_map[c.task_id] = r
            if c.phase == "pending":
                c.phase = "queued"
                self._queue.append(c)
        by_task = sum(1 for c, r in zip(batch, ranks) if c.task_id == str(r))
        how = "rank = DMLC_TASK_ID" if by_task == len(batch) else (
            f"{by_task} by DMLC_TASK_ID, {len(batch) - by_task} by host and arrival")
        self._log(f"{len(batch)} workers asked for ranks: {how}")

    def _next_dialog(self) -> None:
        """Hand the dialog to the next queued worker and resume it.

        A worker whose coroutine is the one running now (it queued itself) is
        not resumed: it sees that it is active when the call returns.
        """
        self._active = None
        while self._queue:
            c = self._queue.popleft()
            if c.closed:
                continue
            self._active = c
            if not c.gen.gi_running:
                self._step(c, None)
            return

    def _dialog(self, c: _Conn) -> Generator:
        c.phase = "linking"
        c.deadline = time.monotonic() + self.link_timeout
        links = self._links[c.rank]
        self._assigned[c.rank] = c
        peers = links.peers
        c.out += b"".join(_INT.pack(v) for v in (c.rank, links.parent, self.n_workers, len(links.tree), *links.tree,
                                                  links.prev, links.next))
        rounds = 0
        while True:
            n_good = _INT.unpack((yield 4))[0]
            if n_good < 0 or n_good > len(peers):
                raise _Drop("protocol", f"{c.who()} reported {n_good} good links of {len(peers)}", fatal=True)
            good = set()
            for _ in range(n_good):
                good.add(_INT.unpack((yield 4))[0])
            if not good <= peers:
                raise _Drop("protocol", f"{c.who()} holds links to {sorted(good - peers)}, not its peers", fatal=True)
            bad = peers - good
            connect = sorted(r for r in bad if r in self._waiting)
            c.out += _INT.pack(len(connect)) + _INT.pack(len(bad) - len(connect))
            for r in connect:
                w = self._waiting[r]
                host = w.host.encode()
                c.out += _INT.pack(len(host)) + host + _INT.pack(w.port) + _INT.pack(r)
            c.deadline = time.monotonic() + self.link_timeout
            n_err = _INT.unpack((yield 4))[0]
            if n_err == 0:
                break
            rounds += 1
            if rounds >= MAX_LINK_ROUNDS:
                targets = ", ".join(f"rank {r} at {self._waiting[r].host}:{self._waiting[r].port}" for r in connect)
                raise _Drop("link_failed", f"{c.who()} could not connect to its peers ({targets}) in {rounds} tries: "
                                           "check that workers can reach each other's ports", fatal=True)
        port = _INT.unpack((yield 4))[0]
        if not 0 < port < 65536:
            raise _Drop("protocol", f"{c.who()} sent listening port {port}", fatal=True)
        for r in connect:
            w = self._waiting[r]
            w.accepts -= 1
            if w.accepts <= 0:
                del self._waiting[r]
        accepts = len(bad) - len(connect)
        if accepts:
            self._waiting[c.rank] = _Waiting(c.host, port, accepts)
        else:
            self._waiting.pop(c.rank, None)
        c.phase = "done"
        with self._lock:
            self._members[c.rank] = Member(c.rank, c.task_id, c.host)
            first_full = len(self._members) == self.n_workers and self._started_s is None
            if first_full:
                self._started_s = self._elapsed()
        if first_full:
            self._log(f"all {self.n_workers} workers joined in {self._started_s:.2f} s" + self._rank_table())
            with self._cond:
                if self._state == "waiting":
                    self._state = "running"
                self._cond.notify_all()

    def _rank_table(self) -> str:
        if self.n_workers > 16:
            return ""
        return ": " + ", ".join(f"rank {m.rank} = task {m.task_id} on {m.host}"
                                for m in sorted(self._members.values(), key=lambda m: m.rank))

    # -- endings -------------------------------------------------------------

    def _finish(self, conn: _Conn) -> None:
        was_active = conn is self._active
        self._close(conn)
        if was_active:
            self._next_dialog()

    def _left(self, conn: _Conn) -> None:
        """The peer closed (or reset) the connection before it was served."""
        if conn.phase == "header":
            self._drop(conn, _Drop("closed_early", f"a connection from {conn.host} closed before its request ended"))
        else:
            self._drop(conn, _Drop("worker_left", f"{conn.who()} closed its tracker connection while "
                                   + {"pending": "waiting for all workers to ask for ranks",
                                      "queued": "waiting for its link set-up",
                                      "linking": "setting up its links"}.get(conn.phase, "being served")
                                   + " (did the worker die?)", fatal=True))

    def _drop(self, conn: _Conn, d: _Drop) -> None:
        was_active = conn is self._active
        if conn in self._pending:
            self._pending.remove(conn)
        # counted and failed before the socket closes: whoever sees the close sees the count
        self._reject(d.reason, d.detail)
        if d.fatal:
            self._fail(d.detail)
        if conn.gen is not None:
            conn.gen.close()
        self._close(conn)
        if was_active:
            self._next_dialog()

    def _count(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] += 1

    def _reject(self, reason: str, detail: str) -> None:
        self._count(reason)
        self._logged[reason] += 1
        if self._logged[reason] <= _LOG_PER_REASON:
            self._log(detail)
        elif self._logged[reason] == _LOG_PER_REASON + 1:
            self._log(f"more connections dropped for {reason}; counting them without a note")

    def _fail(self, message: str) -> None:
        with self._cond:
            if self._state in ("waiting", "running"):
                self._state = "failed"
                self._error = message
            self._cond.notify_all()

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        fd = conn.sock.fileno()
        self._conns.pop(fd, None)
        try:
            if self._sel is not None:
                self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            if conn.gen is not None:
                conn.gen.close()
            self._close(conn)
        self._pending.clear()
        self._queue.clear()
        self._active = None
        for s in (self._listener, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        if self._sel is not None:
            try:
                self._sel.close()
            except (OSError, ValueError):
                pass

    # -- helpers -------------------------------------------------------------

    def _elapsed(self) -> float:
        return time.monotonic() - (self._t0 or time.monotonic())

    def _log(self, text: str) -> None:
        if self._on_log is not None:
            try:
                self._on_log(text)
            except Exception:
                self._count("callback_error")

    def _snapshot(self) -> TrackerStatus:
        return TrackerStatus(
            state=self._state,
            n_workers=self.n_workers,
            asked=len(self._assigned) + len(self._pending),
            members=tuple(self._members[r] for r in sorted(self._members)),
            shutdown=tuple(sorted(self._shutdown)),
            prints=self._prints,
            rejected=dict(self._rejected),
            error=self._error,
            started_s=self._started_s,
            finished_s=self._finished_s,
        )
