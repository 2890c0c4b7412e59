"""launcher/trackers/rabit.py against fake rabit workers written from the protocol.

The fake workers speak the worker's side as XGBoost 2.0.3's rabit engine does
(rabit/src/allreduce_base.cc): real TCP on loopback, a listening socket per
worker, and real links between workers with the rank exchange, so a topology
the tracker hands out is checked by building it.
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
from typing import Optional

import pytest
from support.helpers import wait_for

from launcher.trackers.rabit import (
    MAGIC,
    MAX_LINK_ROUNDS,
    RabitTracker,
    TrackerError,
    assign_ranks,
    link_map,
)

INT = struct.Struct("=i")
DEADLINE = 20.0  # liveness only: every socket call of a fake worker times out after this


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"peer closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def recv_int(s: socket.socket) -> int:
    return INT.unpack(recv_exact(s, 4))[0]


def send_int(s: socket.socket, v: int) -> None:
    s.sendall(INT.pack(v))


def send_str(s: socket.socket, text: str | bytes) -> None:
    data = text.encode() if isinstance(text, str) else text
    send_int(s, len(data))
    s.sendall(data)


def recv_str(s: socket.socket) -> str:
    return recv_exact(s, recv_int(s)).decode()


def closed_by_peer(s: socket.socket, timeout: float = 5.0) -> bool:
    """True if the other side closed (EOF or reset) within ``timeout``."""
    s.settimeout(timeout)
    try:
        while True:
            if not s.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def raw_connect(port: int, src: str = "127.0.0.1") -> socket.socket:
    s = socket.socket()
    s.settimeout(DEADLINE)
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    return s


class FakeWorker:
    """One rabit worker: header, start dialog, peer links, print, shutdown."""

    def __init__(self, port: int, task_id: str = "NULL", src: str = "127.0.0.1", world: int = -1) -> None:
        self.port = port
        self.task_id = task_id
        self.src = src
        self.world = world
        self.rank = -1
        self.info: dict = {}
        self.links: dict[int, socket.socket] = {}
        self.error: Optional[BaseException] = None

    def header(self, cmd: str, rank: Optional[int] = None) -> socket.socket:
        s = raw_connect(self.port, self.src)
        send_int(s, MAGIC)
        assert recv_int(s) == MAGIC
        send_int(s, self.rank if rank is None else rank)
        send_int(s, self.world)
        send_str(s, self.task_id)
        send_str(s, cmd)
        return s

    def join(self, cmd: str = "start") -> None:
        s = self.header(cmd)
        rank, parent, world, k = (recv_int(s) for _ in range(4))
        tree = [recv_int(s) for _ in range(k)]
        prev, nxt = recv_int(s), recv_int(s)
        assert self.rank in (-1, rank)
        self.rank = rank
        self.info = {"parent": parent, "world": world, "tree": tree, "prev": prev, "next": nxt}
        listener = socket.socket()
        listener.settimeout(DEADLINE)
        listener.bind((self.src, 0))
        listener.listen(16)
        send_int(s, len(self.links))
        for r in self.links:
            send_int(s, r)
        n_conn, n_accept = recv_int(s), recv_int(s)
        for _ in range(n_conn):
            host, port, peer = recv_str(s), recv_int(s), recv_int(s)
            c = socket.create_connection((host, port), timeout=DEADLINE)
            send_int(c, rank)
            assert recv_int(c) == peer, "the peer's rank differs from the tracker's word"
            self.links[peer] = c
        send_int(s, 0)  # no connection failed
        send_int(s, listener.getsockname()[1])
        s.close()
        for _ in range(n_accept):
            c, _ = listener.accept()
            c.settimeout(DEADLINE)
            send_int(c, rank)
            self.links[recv_int(c)] = c
        listener.close()

    def print(self, message: str | bytes) -> None:
        s = self.header("print")
        send_str(s, message)
        s.close()

    def shutdown(self) -> None:
        for c in self.links.values():
            c.close()
        self.header("shutdown").close()

    def run(self, after_join=None, cmd: str = "start") -> None:
        try:
            self.join(cmd)
            if after_join is not None:
                after_join(self)
        except BaseException as e:  # reported by the test thread
            self.error = e


def run_workers(workers: list[FakeWorker], after_join=None, stagger: float = 0.0) -> None:
    threads = []
    for w in workers:
        t = threading.Thread(target=w.run, args=(after_join,), daemon=True)
        t.start()
        threads.append(t)
        if stagger:
            time.sleep(stagger)
    for t in threads:
        t.join(DEADLINE)
        assert not t.is_alive(), "a fake worker hung"
    errors = [w.error for w in workers if w.error]
    assert not errors, errors


class Recorder:
    def __init__(self) -> None:
        self.prints: list[tuple[int, str]] = []
        self.logs: list[str] = []

    def on_print(self, rank: int, text: str) -> None:
        self.prints.append((rank, text))

    def on_log(self, text: str) -> None:
        self.logs.append(text)


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def make_tracker(rec: Recorder):
    made: list[RabitTracker] = []

    def make(n: int, **kw) -> RabitTracker:
        kw.setdefault("on_print", rec.on_print)
        kw.setdefault("on_log", rec.on_log)
        t = RabitTracker(n, "127.0.0.1", kw.pop("port_range", (19091, 19999)), **kw)
        made.append(t)
        return t.start()

    yield make
    for t in made:
        t.close()


# --- topology (pure) -------------------------------------------------------------


def test_link_map_golden() -> None:
    assert [(x.parent, x.tree, x.prev, x.next) for x in link_map(1)] == [(-1, (), -1, -1)]
    assert [(x.parent, x.tree, x.prev, x.next) for x in link_map(2)] == [(-1, (1,), 1, 1), (0, (0,), 0, 0)]
    assert [(x.parent, x.tree) for x in link_map(7)] == [
        (-1, (1, 4)), (0, (0, 2, 3)), (1, (1,)), (1, (1,)), (0, (0, 5, 6)), (4, (4,)), (4, (4,))]
    assert [(x.prev, x.next) for x in link_map(4)] == [(3, 1), (0, 2), (1, 3), (2, 0)]


@pytest.mark.parametrize("n", range(1, 18))
def test_link_map_is_a_tree_and_a_ring(n: int) -> None:
    links = link_map(n)
    assert [x.rank for x in links] == list(range(n))
    roots = [x.rank for x in links if x.parent == -1]
    assert roots == [0]
    edges = set()
    for x in links:
        children = [r for r in x.tree if r != x.parent]
        if x.parent >= 0:
            assert x.tree[0] == x.parent and x.rank in links[x.parent].tree
        for c in children:
            assert links[c].parent == x.rank
        edges |= {frozenset((x.rank, r)) for r in x.tree}
    assert len(edges) == n - 1  # connected (every rank reaches the root below) with n-1 edges: a tree
    for x in links:
        depth, r = 0, x.rank
        while links[r].parent != -1:
            r, depth = links[r].parent, depth + 1
        assert depth <= max(1, n).bit_length()
    # every subtree is a block of consecutive ranks
    for x in links:
        sub, todo = set(), [x.rank]
        while todo:
            r = todo.pop()
            sub.add(r)
            todo += [c for c in links[r].tree if c != links[r].parent]
        assert sub == set(range(min(sub), max(sub) + 1))
    # the ring visits every rank once, in rank order
    if n == 1:
        assert (links[0].prev, links[0].next) == (-1, -1)
    else:
        seen, r = [], 0
        for _ in range(n):
            seen.append(r)
            assert links[links[r].next].prev == r
            r = links[r].next
        assert seen == list(range(n)) and r == 0
    for x in links:
        assert x.rank not in x.peers


def test_assign_ranks_prefers_valid_task_ids() -> None:
    hosts = ["10.0.0.2"] * 4
    assert assign_ranks(4, range(4), list(zip(["2", "0", "3", "1"], hosts))) == [2, 0, 3, 1]
    # invalid, duplicate, out-of-range, padded and NULL ids fall back to host then arrival
    batch = [("1", "10.0.0.9"), ("1", "10.0.0.9"), ("01", "10.0.0.1"), ("NULL", "10.0.0.10"), ("7", "10.0.0.2")]
    assert assign_ranks(5, range(5), batch) == [1, 3, 0, 4, 2]  # .1, .2, .9, .10 take 0, 2, 3, 4
    # by host address (numerically), then by arrival
    batch = [("NULL", "10.0.0.10"), ("NULL", "10.0.0.9"), ("NULL", "10.0.0.10"), ("NULL", "10.0.0.9")]
    assert assign_ranks(4, range(4), batch) == [2, 0, 3, 1]
    # only the free ranks are given out
    assert assign_ranks(4, [1, 3], [("3", "h"), ("0", "h")]) == [3, 1]
    with pytest.raises(ValueError):
        assign_ranks(2, [0, 1], [("0", "h")])


# --- a live tracker with fake workers ----------------------------------------------


@pytest.mark.parametrize("n", range(1, 18))
def test_every_worker_gets_its_rank_and_builds_its_links(n: int, make_tracker, rec: Recorder) -> None:
    t = make_tracker(n)
    task_ids = [str(i) for i in range(n)]
    random.Random(n).shuffle(task_ids)
    if n % 3 == 0:
        task_ids[0] = "NULL"  # one worker without a task id takes the rank left over
    workers = [FakeWorker(t.port, task) for task in task_ids]
    run_workers(workers)
    expected = link_map(n)
    assert sorted(w.rank for w in workers) == list(range(n))
    for w in workers:
        if w.task_id != "NULL":
            assert w.rank == int(w.task_id)
        x = expected[w.rank]
        assert w.info == {"parent": x.parent, "world": n, "tree": list(x.tree), "prev": x.prev, "next": x.next}
        assert set(w.links) == set(x.peers), f"rank {w.rank}"
    by_rank = {w.rank: w for w in workers}
    for w in workers:  # links are symmetric and live: a byte goes through each
        for peer, sock in w.links.items():
            assert w.rank in by_rank[peer].links
            sock.sendall(bytes([w.rank]))
    for w in workers:
        for peer, sock in w.links.items():
            assert recv_exact(sock, 1) == bytes([peer])
    wait_for(lambda: t.status().state == "running", DEADLINE, what="the tracker to see every rank linked")
    assert [m.rank for m in t.status().members] == list(range(n))
    for w in workers:
        w.shutdown()
    st = t.wait(DEADLINE)
    assert st.state == "done", st
    assert st.shutdown == tuple(range(n)) and st.rejected == {} and st.error is None
    assert any(f"all {n} workers joined" in x for x in rec.logs)
    assert any(f"all {n} workers shut down" in x for x in rec.logs)


def test_without_task_ids_ranks_go_by_host_then_arrival(make_tracker) -> None:
    # four loopback source addresses stand for hosts; the tracker must group them
    t = make_tracker(4)
    srcs = ["127.0.0.3", "127.0.0.2", "127.0.0.3", "127.0.0.2"]
    workers = [FakeWorker(t.port, "NULL", src) for src in srcs]
    threads = []
    for i, w in enumerate(workers):  # one at a time, so the arrival order is known
        th = threading.Thread(target=w.run, daemon=True)
        th.start()
        threads.append(th)
        if i < 3:
            wait_for(lambda i=i: t.status().asked == i + 1, DEADLINE, what=f"worker {i} to ask")
    for th in threads:
        th.join(DEADLINE)
    assert [w.error for w in workers] == [None] * 4
    assert [w.rank for w in workers] == [2, 0, 3, 1]
    # the peers were told each other's own address: links between hosts were built
    assert {w.rank: set(w.links) for w in workers} == {x.rank: set(x.peers) for x in link_map(4)}
    for w in workers:
        w.shutdown()
    assert t.wait(DEADLINE).state == "done"


def test_a_restarted_worker_gets_its_rank_back_and_its_peers_recover(make_tracker) -> None:
    t = make_tracker(3)
    workers = [FakeWorker(t.port, str(i)) for i in range(3)]
    run_workers(workers)
    # rank 1's process dies; its peers lose their links to it
    for c in workers[1].links.values():
        c.close()
    for w in (workers[0], workers[2]):
        w.links.pop(1).close()
    # a new process with the same task id asks with "start" and rank -1; the survivors
    # ask with rabit's "recover", their rank, and the links they still hold
    again = FakeWorker(t.port, "1")
    threads = [threading.Thread(target=again.run, daemon=True)]
    threads += [threading.Thread(target=w.run, kwargs={"cmd": "recover"}, daemon=True) for w in (workers[0], workers[2])]
    for th in threads:
        th.start()
    for th in threads:
        th.join(DEADLINE)
    assert [w.error for w in (again, workers[0], workers[2])] == [None] * 3
    assert again.rank == 1
    assert (set(again.links), set(workers[0].links), set(workers[2].links)) == ({0, 2}, {1, 2}, {0, 1})
    st = t.status()
    assert st.state == "running" and st.rejected == {}
    for w in (workers[0], again, workers[2]):
        w.shutdown()
    assert t.wait(DEADLINE).state == "done"


def test_print_relay_keeps_order_and_cleans_control_characters(make_tracker, rec: Recorder) -> None:
    t = make_tracker(1)
    w = FakeWorker(t.port, "0")
    run_workers([w])
    for i in range(20):
        w.print(f"line {i}\n")
    w.print("bell\x07 and \x1b[31mred\x1b[0m\tend")
    w.print("héllo ✓")
    w.shutdown()
    st = t.wait(DEADLINE)
    assert st.state == "done" and st.prints == 22
    assert rec.prints[:20] == [(0, f"line {i}") for i in range(20)]
    assert rec.prints[20] == (0, "bell? and ?[31mred?[0m\tend")
    assert rec.prints[21] == (0, "héllo ✓")


def test_a_print_just_before_the_last_shutdown_is_not_lost(make_tracker, rec: Recorder) -> None:
    for _ in range(5):
        rec.prints.clear()
        t = make_tracker(1)
        w = FakeWorker(t.port, "0")
        run_workers([w])
        w.print("last words")
        w.shutdown()
        assert t.wait(DEADLINE).state == "done"
        assert rec.prints == [(0, "last words")]


def test_unexpected_shutdowns_are_dropped(make_tracker) -> None:
    t = make_tracker(2)
    stray = FakeWorker(t.port, "NULL")
    stray.header("shutdown", rank=5).close()  # a rank that does not exist
    stray.header("shutdown", rank=-1).close()
    workers = [FakeWorker(t.port, str(i)) for i in range(2)]
    run_workers(workers)
    workers[0].shutdown()
    workers[0].header("shutdown").close()  # twice
    wait_for(lambda: t.status().rejected.get("unexpected") == 3, DEADLINE, what="3 unexpected shutdowns")
    assert t.status().state == "running" and t.status().shutdown == (0,)
    workers[1].shutdown()
    assert t.wait(DEADLINE).state == "done"


def test_more_workers_than_expected_are_turned_away(make_tracker) -> None:
    t = make_tracker(1)
    run_workers([FakeWorker(t.port, "0")])
    extra = FakeWorker(t.port, "NULL")
    s = extra.header("start")
    assert closed_by_peer(s)
    assert t.status().rejected == {"unexpected": 1}


def test_garbage_is_dropped_and_counted_and_the_job_goes_on(make_tracker, rec: Recorder) -> None:
    t = make_tracker(1)
    http = raw_connect(t.port)
    http.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert closed_by_peer(http)
    wrong = raw_connect(t.port)
    send_int(wrong, 0xFF98)
    assert closed_by_peer(wrong)
    unknown = FakeWorker(t.port, "0").header("rm -rf")
    assert closed_by_peer(unknown)
    half = raw_connect(t.port)
    half.sendall(INT.pack(MAGIC)[:2])
    half.close()
    wait_for(lambda: sum(t.status().rejected.values()) == 4, DEADLINE, what="4 dropped connections")
    assert t.status().rejected == {"bad_magic": 2, "bad_command": 1, "closed_early": 1}
    assert t.status().summary() == ("waiting: 0 of 1 workers joined; 0 shut down; dropped connections: "
                                    "bad_command 1, bad_magic 2, closed_early 1; no worker asked for a rank: "
                                    "does the program start rabit (xgboost.collective.init() or CommunicatorContext())?")
    assert any("0x20544547" in x and "not a rabit worker" in x for x in rec.logs)  # "GET " as an int
    w = FakeWorker(t.port, "0")
    run_workers([w])
    w.shutdown()
    assert t.wait(DEADLINE).state == "done"


def test_oversized_strings_are_refused_without_reading_them(make_tracker) -> None:
    t = make_tracker(1, max_task_id=64)
    for length in (1 << 30, -5, 65):
        s = raw_connect(t.port)
        send_int(s, MAGIC)
        assert recv_int(s) == MAGIC
        send_int(s, -1)
        send_int(s, -1)
        send_int(s, length)
        assert closed_by_peer(s)
    s = FakeWorker(t.port, "0").header("print")
    send_int(s, 1 << 30)  # a print far beyond 64 x max_print
    assert closed_by_peer(s)
    assert t.status().rejected == {"oversized": 4}
    assert t.status().state == "waiting"


def test_a_long_print_is_cut_but_read_to_the_end(make_tracker, rec: Recorder) -> None:
    t = make_tracker(1, max_print=1000)
    w = FakeWorker(t.port, "0")
    run_workers([w])
    s = w.header("print")
    send_str(s, "x" * 1000 + "y" * 20000)
    s.shutdown(socket.SHUT_WR)
    assert closed_by_peer(s)  # an orderly close after reading everything, not a reset
    w.print("after")
    w.shutdown()
    assert t.wait(DEADLINE).state == "done"
    assert rec.prints == [(0, "x" * 1000 + " [... 20000 more bytes not shown]"), (0, "after")]
    assert t.status().rejected == {"print_truncated": 1}


def test_silent_connections_time_out_and_pending_ones_are_bounded(make_tracker) -> None:
    # long enough that none of the first 65 expires while the 70 connect (a full accept
    # queue makes a client's SYN wait a second for its retry)
    t = make_tracker(1, handshake_timeout=4.0)
    idle = [raw_connect(t.port) for _ in range(70)]  # beyond n_workers + 64 still in their header
    wait_for(lambda: t.status().rejected.get("busy", 0) >= 5, DEADLINE, what="connections beyond the bound")
    assert all(closed_by_peer(s, timeout=DEADLINE) for s in idle)  # the rest after handshake_timeout
    rejected = t.status().rejected
    assert rejected["busy"] + rejected["timeout"] == 70 and rejected["timeout"] >= 60
    w = FakeWorker(t.port, "0")  # the tracker still serves
    run_workers([w])
    w.shutdown()
    assert t.wait(DEADLINE).state == "done"


_LOW_FD_TRACKER = """
import json, os, resource, sys
sys.path.insert(0, sys.argv[1])
from launcher.trackers.rabit import RabitTracker
t = RabitTracker(1, "127.0.0.1", (19091, 19999), handshake_timeout=60).start()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 4, hard))
print(t.port, flush=True)
sys.stdin.readline()
print(json.dumps(t.status().rejected), flush=True)
sys.stdin.readline()
print(json.dumps(t.wait(20).state), flush=True)
"""


def test_out_of_file_descriptors_the_tracker_pauses_instead_of_spinning() -> None:
    import subprocess
    import sys

    from support.helpers import REPO

    p = subprocess.Popen([sys.executable, "-c", _LOW_FD_TRACKER, str(REPO)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        idle = [raw_connect(port) for _ in range(20)]  # the kernel queues them; accept() gets EMFILE
        time.sleep(1.0)
        p.stdin.write("\n")
        p.stdin.flush()
        rejected = json.loads(p.stdout.readline())
        # a spinning loop would fail accept() thousands of times a second
        assert 1 <= rejected["accept_error"] <= 15, rejected
        for s in idle:
            s.close()
        w = FakeWorker(port, "0")  # once the fds are back, the tracker serves again
        run_workers([w])
        w.shutdown()
        p.stdin.write("\n")
        p.stdin.flush()
        assert json.loads(p.stdout.readline()) == "done"
    finally:
        p.kill()
        p.wait(10)


def test_a_new_xgboost_worker_is_told_to_use_the_xgboost_tracker(make_tracker) -> None:
    t = make_tracker(2)
    s = raw_connect(t.port)
    send_int(s, MAGIC)
    assert recv_int(s) == MAGIC
    send_str(s, '{"rank":-1,"task_id":"0","world_size":-1}')  # what XGBoost 2.1+ sends next
    assert closed_by_peer(s)
    st = t.wait(DEADLINE)
    assert st.state == "failed" and "--tracker xgboost" in st.error
    assert st.rejected == {"new_protocol": 1}


def test_a_world_size_that_differs_from_the_job_fails_it(make_tracker) -> None:
    t = make_tracker(2)
    s = FakeWorker(t.port, "0", world=3).header("start")
    assert closed_by_peer(s)
    st = t.wait(DEADLINE)
    assert st.state == "failed" and "world of 3 workers but this job has 2" in st.error
    # a failure names its own cause, without the hint about programs that never start rabit
    assert st.summary() == f"failed: 0 of 2 workers joined; 0 shut down; dropped connections: unexpected 1; {st.error}"


def test_a_worker_that_dies_while_waiting_fails_the_job_at_once(make_tracker) -> None:
    t = make_tracker(3)
    first = FakeWorker(t.port, "0").header("start")
    s = FakeWorker(t.port, "1").header("start")
    wait_for(lambda: t.status().asked == 2, DEADLINE, what="two workers to ask")
    t0 = time.monotonic()
    s.close()  # the process died before the third worker came
    st = t.wait(DEADLINE)
    assert time.monotonic() - t0 < 5
    assert st.state == "failed" and "task id 1" in st.error and "did the worker die?" in st.error
    first.close()


def test_a_worker_that_cannot_reach_its_peer_fails_after_bounded_tries(make_tracker) -> None:
    t = make_tracker(2)
    w0 = FakeWorker(t.port, "0")
    th = threading.Thread(target=w0.run, daemon=True)
    th.start()
    s = FakeWorker(t.port, "1").header("start")
    assert [recv_int(s) for _ in range(4)] == [1, 0, 2, 1]  # rank, parent, world, one tree link
    assert [recv_int(s) for _ in range(3)] == [0, 0, 0]  # the link, ring prev, ring next
    rounds = 0
    try:
        while True:
            send_int(s, 0)
            n_conn, n_accept = recv_int(s), recv_int(s)
            assert (n_conn, n_accept) == (1, 0)
            recv_str(s), recv_int(s), recv_int(s)
            send_int(s, 1)  # "my connection failed"
            rounds += 1
    except (EOFError, ConnectionResetError, BrokenPipeError):
        pass
    assert rounds == MAX_LINK_ROUNDS
    st = t.wait(DEADLINE)
    assert st.state == "failed" and "rank 1" in st.error and "could not connect to its peers (rank 0 at 127.0.0.1:" in st.error
    th.join(0.1)


# --- lifecycle -----------------------------------------------------------------------


def test_nobody_talks_wait_returns_at_its_timeout(make_tracker) -> None:
    t = make_tracker(2)
    t0 = time.monotonic()
    st = t.wait(0.3)
    assert 0.25 < time.monotonic() - t0 < 5
    assert st.state == "waiting" and st.asked == 0 and not st.ended


def test_close_while_workers_are_connected_or_half_connected(make_tracker) -> None:
    t = make_tracker(4)
    joined = [FakeWorker(t.port, str(i)) for i in range(2)]
    waiting = [w.header("start") for w in joined]  # asked, waiting for the other two
    silent = raw_connect(t.port)  # connected, said nothing
    half = raw_connect(t.port)
    half.sendall(INT.pack(MAGIC))  # magic only
    wait_for(lambda: t.status().asked == 2, DEADLINE, what="two workers to ask")
    t0 = time.monotonic()
    st = t.close()
    assert time.monotonic() - t0 < 2
    assert st.state == "closed"
    for s in (*waiting, silent):
        assert closed_by_peer(s)
    assert recv_int(half) == MAGIC and closed_by_peer(half)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", t.port), timeout=2)
    assert t.close().state == "closed"  # again
    assert t.wait(None).state == "closed"


def test_close_releases_a_wait_without_timeout(make_tracker) -> None:
    t = make_tracker(2)
    box: dict = {}
    th = threading.Thread(target=lambda: box.setdefault("status", t.wait()), daemon=True)
    th.start()
    time.sleep(0.2)
    assert th.is_alive()
    t.close()
    th.join(DEADLINE)
    assert not th.is_alive() and box["status"].state == "closed"


def test_close_during_link_setup(make_tracker) -> None:
    t = make_tracker(2)
    s0 = FakeWorker(t.port, "0").header("start")
    s1 = FakeWorker(t.port, "1").header("start")
    assert recv_int(s0) == 0  # rank 0 is in its dialog, rank 1 queued behind it
    assert t.close().state == "closed"
    assert closed_by_peer(s0) and closed_by_peer(s1)


def test_close_before_start_and_start_after_close() -> None:
    t = RabitTracker(1, "127.0.0.1", (19091, 19999))
    port = t.port
    assert t.close().state == "closed"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    with pytest.raises(TrackerError):
        t.start()


def test_close_from_a_callback_does_not_deadlock(rec: Recorder) -> None:
    box: dict = {}

    def on_print(rank: int, text: str) -> None:
        box["status"] = box["t"].close()

    t = box["t"] = RabitTracker(1, "127.0.0.1", (19091, 19999), on_print=on_print).start()
    w = FakeWorker(t.port, "0")
    run_workers([w])
    w.print("stop")
    wait_for(lambda: "status" in box, DEADLINE, what="the callback")
    assert t.wait(DEADLINE).state == "closed"


def test_a_raising_callback_is_counted_and_ignored() -> None:
    def boom(*_a) -> None:
        raise RuntimeError("boom")

    with RabitTracker(1, "127.0.0.1", (19091, 19999), on_print=boom, on_log=boom).start() as t:
        w = FakeWorker(t.port, "0")
        run_workers([w])
        w.print("x")
        w.shutdown()
        st = t.wait(DEADLINE)
        assert st.state == "done" and st.rejected.get("callback_error", 0) >= 2


# --- binding and the environment -----------------------------------------------------


def test_first_free_port_of_the_range_and_none_free() -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    p = busy.getsockname()[1]
    try:
        with RabitTracker(1, "127.0.0.1", (p, p + 40)) as t:
            assert p < t.port <= p + 40
        with pytest.raises(TrackerError, match=rf"no free port in {p}-{p} on 127.0.0.1: widen --port-range"):
            RabitTracker(1, "127.0.0.1", (p, p))
    finally:
        busy.close()


def test_trackers_starting_at_once_each_get_their_own_port() -> None:
    """Two trackers may both bind a port (SO_REUSEADDR) before either listens; the loser's
    listen() fails with EADDRINUSE and must move on to the next port, not fail the job."""
    n, rounds = 12, 10
    for _ in range(rounds):
        barrier = threading.Barrier(n)
        out: list = [None] * n

        def start(i: int, barrier: threading.Barrier = barrier, out: list = out) -> None:
            barrier.wait()
            try:
                out[i] = RabitTracker(2, "127.0.0.1", (19600, 19600 + 2 * n))
            except Exception as e:  # noqa: BLE001 - reported below
                out[i] = e

        threads = [threading.Thread(target=start, args=(i,)) for i in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(DEADLINE)
        trackers = [o for o in out if isinstance(o, RabitTracker)]
        try:
            assert len(trackers) == n, [o for o in out if not isinstance(o, RabitTracker)]
            assert len({t.port for t in trackers}) == n
        finally:
            for t in trackers:
                t.close()


def test_bad_arguments_are_one_line_errors() -> None:
    with pytest.raises(TrackerError, match="at least 1 worker"):
        RabitTracker(0)
    with pytest.raises(TrackerError, match="bad port range"):
        RabitTracker(1, "127.0.0.1", (10, 5))
    with pytest.raises(TrackerError, match="give the tracker's address to advertise"):
        RabitTracker(1, "0.0.0.0", (19091, 19999))
    with pytest.raises(TrackerError, match="never started"):
        RabitTracker(1, "127.0.0.1", (19091, 19999)).wait()


def test_worker_env() -> None:
    with RabitTracker(3, "127.0.0.1", (19091, 19999)) as t:
        assert t.worker_env() == {"DMLC_TRACKER_URI": "127.0.0.1", "DMLC_TRACKER_PORT": str(t.port),
                                  "DMLC_NUM_WORKER": "3"}
        assert t.worker_env(task_id=2)["DMLC_TASK_ID"] == "2"
    with RabitTracker(1, "0.0.0.0", (19091, 19999), advertise="127.0.0.1") as t:
        assert t.worker_env()["DMLC_TRACKER_URI"] == "127.0.0.1"
