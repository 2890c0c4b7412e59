"""The builtin ps-lite scheduler against real libzmq sockets (pyzmq) that play ps-lite's nodes
byte for byte as ``ZMQVan`` does: a ROUTER bound per node, a DEALER to the scheduler whose
identity is ``ps<id>`` once the node has one. Real MXNet runs are in test_mxnet.py."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from launcher import node
from launcher.trackers.pslite import (
    ADD_NODE,
    BARRIER,
    EMPTY,
    HEARTBEAT,
    SCHEDULER,
    SERVER,
    WORKER,
    Meta,
    Node,
)

zmq = pytest.importorskip("zmq")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(servers: int, workers: int, **extra: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    env = dict(os.environ, DMLC_ROLE="scheduler", DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
               DMLC_NUM_SERVER=str(servers), DMLC_NUM_WORKER=str(workers), **extra)
    proc = subprocess.Popen(node.command("pslite"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise AssertionError("the builtin scheduler did not listen: " + proc.communicate()[1])


class FakeNode:
    """A ps-lite node as ZMQVan makes one (real libzmq)."""

    def __init__(self, ctx, role: int, port: int) -> None:
        self.ctx, self.role, self.sched_port, self.id = ctx, role, port, EMPTY
        self.router = ctx.socket(zmq.ROUTER)
        self.port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.dealer = self._dealer(None)

    def _dealer(self, identity: bytes | None):
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            d.setsockopt(zmq.IDENTITY, identity)
        d.connect(f"tcp://127.0.0.1:{self.sched_port}")
        return d

    def register(self) -> None:
        self.dealer.send(Meta(ADD_NODE, [Node(self.role, EMPTY, "127.0.0.1", self.port)], timestamp=0).encode())

    def recv(self, timeout: float = 10.0) -> tuple[bytes, Meta]:
        assert self.router.poll(int(timeout * 1000)), f"node {self.id}: nothing from the scheduler in {timeout} s"
        frames = self.router.recv_multipart()
        assert len(frames) == 2, frames
        return frames[0], Meta.decode(frames[1])

    def nothing_pending(self) -> bool:
        return not self.router.poll(300)

    def take_id(self, meta: Meta) -> None:
        (me,) = [n for n in meta.nodes if n.port == self.port]
        self.id = me.id
        self.dealer.close()
        self.dealer = self._dealer(b"ps%d" % self.id)  # ZMQVan::Connect once the node has its id

    def barrier(self, group: int, customer_id: int = 0) -> None:
        self.dealer.send(Meta(BARRIER, request=True, app_id=0, customer_id=customer_id, barrier_group=group,
                              timestamp=1).encode())

    def close(self) -> None:
        self.dealer.close()
        self.router.close(linger=0)


def _pass_barrier(nodes: list[FakeNode], group: int) -> None:
    """Every node of ``nodes`` asks for barrier ``group``, and each is answered."""
    for n in nodes:
        n.barrier(group)
    for n in nodes:
        assert n.recv()[1].cmd == BARRIER


def _tear_down(proc: subprocess.Popen, ctx, nodes: list[FakeNode]) -> None:
    for n in nodes:
        n.close()
    ctx.term()
    if proc.poll() is None:
        proc.kill()


def _ended(proc: subprocess.Popen, within: float = 10.0) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the builtin scheduler did not end: " + proc.communicate()[1]) from None
    return proc.returncode, err


def test_registration_barriers_heartbeat_and_exit() -> None:
    proc, port = _start(2, 2, PS_VERBOSE="1")
    ctx = zmq.Context()
    nodes = [FakeNode(ctx, role, port) for role in (WORKER, SERVER, WORKER, SERVER)]
    try:
        for n in nodes[:3]:
            n.register()
        assert all(n.nothing_pending() for n in nodes)  # nobody hears anything until all registered
        nodes[3].register()
        replies = [n.recv() for n in nodes]
        for n, (identity, meta) in zip(nodes, replies):
            assert identity == b"ps1" and meta.cmd == ADD_NODE and not meta.request
            assert [x.role for x in meta.nodes].count(SCHEDULER) == 1 and meta.nodes[-1].role == SCHEDULER
            assert (meta.nodes[-1].id, meta.nodes[-1].port) == (1, port)
            n.take_id(meta)
        # one host: numbered by ascending port within each role
        for role, first in ((SERVER, 8), (WORKER, 9)):
            mine = sorted((n for n in nodes if n.role == role), key=lambda n: n.port)
            assert [n.id for n in mine] == [first, first + 2]
        # the start barrier: all four nodes and the scheduler itself
        for n in nodes[:3]:
            n.barrier(7)
        assert all(n.nothing_pending() for n in nodes)
        nodes[3].barrier(7, customer_id=5)
        for n in nodes:
            _, meta = n.recv()
            assert (meta.cmd, meta.request, meta.app_id, meta.customer_id) == (BARRIER, False, 0, 5)
        # a workers' barrier is answered to the workers only
        workers = [n for n in nodes if n.role == WORKER]
        _pass_barrier(workers, 4)
        assert all(n.nothing_pending() for n in nodes if n.role == SERVER)
        # a heartbeat is acknowledged with the scheduler's node
        w = workers[0]
        w.dealer.send(Meta(HEARTBEAT, [Node(WORKER, w.id, "127.0.0.1", w.port)], timestamp=9).encode())
        _, ack = w.recv()
        assert ack.cmd == HEARTBEAT and [(x.role, x.id) for x in ack.nodes] == [(SCHEDULER, 1)]
        # the finalize barrier: answered, then the scheduler is done
        _pass_barrier(nodes, 7)
        code, err = _ended(proc)
        assert code == 0, err
        assert "the scheduler is connected to 2 workers and 2 servers" in err and "assign rank=8" in err
        assert "warning" not in err
    finally:
        _tear_down(proc, ctx, nodes)


def test_garbage_and_surplus_nodes_are_warned_about_and_the_job_goes_on() -> None:
    proc, port = _start(1, 1)
    ctx = zmq.Context()
    nodes = [FakeNode(ctx, role, port) for role in (SERVER, WORKER)]
    extra = FakeNode(ctx, WORKER, port)
    # a peer that speaks no ZeroMQ is libzmq's to handle (it waits for a ZMTP 1.0 message that
    # never comes), as in ps-lite's own scheduler: the scheduler never hears of it
    web = socket.create_connection(("127.0.0.1", port))
    try:
        web.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        # two workers for the one place: the first to register takes it, the other is warned
        # about and hears nothing; then a server after the job is complete
        nodes[1].register()
        extra.register()
        assert nodes[1].nothing_pending() and extra.nothing_pending()
        nodes[0].register()
        nodes[0].take_id(nodes[0].recv()[1])
        (taken,) = [n for n in (nodes[1], extra) if not n.nothing_pending()]
        surplus = extra if taken is nodes[1] else nodes[1]
        taken.take_id(taken.recv()[1])
        got = [nodes[0], taken]
        late = FakeNode(ctx, SERVER, port)
        late.register()
        assert surplus.nothing_pending() and late.nothing_pending()
        late.close()
        # a barrier of a group ps-lite has not: that connection is dropped, the job goes on
        rogue = FakeNode(ctx, WORKER, port)
        rogue.barrier(9)
        time.sleep(0.3)
        rogue.close()
        for _ in range(2):  # the start and finalize barriers
            _pass_barrier(got, 7)
        code, err = _ended(proc)
        assert code == 0, err
        lines = [x for x in err.splitlines() if x.strip()]
        assert f"pslaunch scheduler: warning: ignored a worker at 127.0.0.1:{surplus.port}: this job has 1 workers " \
               "(DMLC_NUM_WORKER)" in lines, err
        assert f"pslaunch scheduler: warning: ignored a server at 127.0.0.1:{late.port}: all 2 servers and workers " \
               "of this job have registered (DMLC_NUM_SERVER, DMLC_NUM_WORKER)" in lines, err
        assert "pslaunch scheduler: warning: ignored a message from 127.0.0.1: a barrier of node group 9 (ps-lite's " \
               "groups are 1 to 7)" in lines, err
        assert len(lines) == 3, err
        assert "Traceback" not in err
    finally:
        web.close()
        _tear_down(proc, ctx, [*nodes, extra])


def test_a_node_the_scheduler_cannot_reach_ends_the_job_in_one_line() -> None:
    """A worker registers an address where nothing listens (a wrong DMLC_NODE_HOST or interface):
    ps-lite's scheduler would retry for ever; this one says so and exits 1, telling nobody to go on."""
    proc, port = _start(1, 1)
    ctx = zmq.Context()
    server, worker = FakeNode(ctx, SERVER, port), FakeNode(ctx, WORKER, port)
    # The worker registers a port that is bound but not listening: it refuses connections, and no
    # other process (the suite runs in parallel) can take it meanwhile. (Not the worker's own closed
    # ROUTER: libzmq closes it in its I/O thread, and a connect in that window was accepted.)
    refusing = socket.socket()
    try:
        refusing.bind(("127.0.0.1", 0))
        worker.router.close(linger=0)
        worker.port = refusing.getsockname()[1]
        worker.register()
        server.register()
        code, err = _ended(proc)
        assert code == 1, err
        assert err == (f"pslaunch scheduler: error: cannot reach worker 127.0.0.1:{worker.port}, the address it "
                       "registered: Connection refused; the scheduler must reach every node there (check "
                       "DMLC_INTERFACE or DMLC_NODE_HOST and the firewall)\n")
        assert server.nothing_pending()
    finally:
        refusing.close()
        _tear_down(proc, ctx, [server, worker])


def test_a_taken_port_is_one_line() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = dict(os.environ, DMLC_ROLE="scheduler", DMLC_PS_ROOT_URI="127.0.0.1", DMLC_PS_ROOT_PORT=str(port),
                   DMLC_NUM_SERVER="1", DMLC_NUM_WORKER="1")
        r = subprocess.run(node.command("pslite"), env=env, capture_output=True, text=True, timeout=20)
    assert r.returncode == 1
    assert r.stderr == f"pslaunch scheduler: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_a_malformed_message_is_one_warning_and_never_ends_the_scheduler() -> None:
    """Input from the network never ends the scheduler: each message that does not parse, or
    registers no address, is ignored with one warning, and the job goes on."""
    proc, port = _start(1, 1)
    ctx = zmq.Context()
    nodes = [FakeNode(ctx, role, port) for role in (SERVER, WORKER)]
    rogue = ctx.socket(zmq.DEALER)
    long_id = ctx.socket(zmq.DEALER)
    try:
        rogue.connect(f"tcp://127.0.0.1:{port}")
        long_id.setsockopt(zmq.IDENTITY, b"ps" + b"9" * 253)  # (ZeroMQ's longest identity)
        long_id.connect(f"tcp://127.0.0.1:{port}")

        def add(hostname: str, port: int) -> bytes:
            return Meta(ADD_NODE, [Node(WORKER, EMPTY, hostname, port)], timestamp=0).encode()

        rogue.send(b"\x08")                                  # a varint cut short
        rogue.send_multipart([b"\x1a\x02\x10\x01", b"data"])  # a control message without its command
        rogue.send(add("\u00fc-host", 5))                      # a host name libzmq cannot connect to
        rogue.send(add("a b", 5))
        rogue.send(add("127.0.0.1", 70000))                  # a port no TCP has
        rogue.send(b"")                                      # an empty meta: a data message
        long_id.send(add("127.0.0.1", 5))                    # an id of 253 digits: no node's
        time.sleep(0.5)
        for n in nodes:
            n.register()
        for n in nodes:
            n.take_id(n.recv()[1])
        for _ in range(2):
            _pass_barrier(nodes, 7)
        code, err = _ended(proc)
        assert code == 0, err
        lines = [x for x in err.splitlines() if x.strip()]
        prefix = "pslaunch scheduler: warning: ignored a message from 127.0.0.1: "
        assert sorted(lines) == sorted([  # (the two sockets' messages interleave in any order)
            prefix + "a protobuf varint runs past the end of the frame",
            prefix + "a control message without its command",
            prefix + "a worker registered, but its host name '\u00fc-host' is no host name or address",
            prefix + "a worker registered, but its host name 'a b' is no host name or address",
            prefix + "a worker registered, but its port 70000 is not from 1 to 65535",
            "pslaunch scheduler: warning: ignored a data message from 127.0.0.1: a ps-lite scheduler serves no "
            "application",
            prefix + "its identity ps<253 digits> is no ps-lite node's",
        ]), err
    finally:
        rogue.close(linger=0)
        long_id.close(linger=0)
        _tear_down(proc, ctx, nodes)


def _beat(nodes: list[FakeNode], seconds: float) -> None:
    """``nodes`` send heartbeats (ps-lite's Van::Heartbeat) for ``seconds``; the acks are read."""
    end = time.time() + seconds
    while time.time() < end:
        for n in nodes:
            n.dealer.send(Meta(HEARTBEAT, [Node(n.role, n.id, "127.0.0.1", n.port)], timestamp=9).encode())
        for n in nodes:
            assert n.recv()[1].cmd == HEARTBEAT
        time.sleep(0.25)


def test_a_dead_worker_is_replaced_by_a_late_one_as_ps_lite_recovers() -> None:
    """ps-lite's recovery (Van::UpdateLocalID): with heartbeats on, a worker that registers after
    the job is ready takes the id of the worker silent for more than PS_HEARTBEAT_TIMEOUT, with
    is_recovery and the whole list; the live nodes get it alone; a second late worker, with no
    dead worker left, is one warning and changes nothing."""
    proc, port = _start(1, 2, PS_VERBOSE="1", PS_HEARTBEAT_TIMEOUT="1")
    ctx = zmq.Context()
    nodes = [FakeNode(ctx, role, port) for role in (SERVER, WORKER, WORKER)]
    extra: list[FakeNode] = []
    try:
        for n in nodes:
            n.register()
        for n in nodes:
            n.take_id(n.recv()[1])
        _pass_barrier(nodes, 7)
        server, lost, kept = nodes[0], nodes[1], nodes[2]
        before = {n.id: n.port for n in nodes}
        lost.close()  # (its heartbeats stop: SIGKILL)
        _beat([server, kept], 1.8)
        new = FakeNode(ctx, WORKER, port)
        extra.append(new)
        new.register()
        identity, meta = new.recv()
        assert identity == b"ps1" and meta.cmd == ADD_NODE
        # the list in the order of the first one (one host: by port), the lost worker's id in its place
        assert [(x.role, x.id) for x in meta.nodes] == [*sorted(
            [(SERVER, server.id), (WORKER, lost.id), (WORKER, kept.id)], key=lambda r: before[r[1]]), (SCHEDULER, 1)]
        (me,) = [x for x in meta.nodes if x.port == new.port]
        assert me.id == lost.id and me.is_recovery
        assert not any(x.is_recovery for x in meta.nodes if x is not me)
        new.take_id(meta)
        for n in (server, kept):  # the live nodes learn its address, nothing else
            _, told = n.recv()
            assert told.cmd == ADD_NODE and [(x.id, x.port, x.is_recovery) for x in told.nodes] == [
                (lost.id, new.port, True)]
        # a second late worker: nobody is dead now; one warning, nobody hears of it
        late = FakeNode(ctx, WORKER, port)
        extra.append(late)
        late.register()
        assert late.nothing_pending() and server.nothing_pending() and kept.nothing_pending()
        workers = [kept, new]
        _pass_barrier(workers, 4)  # the replacement is a member of its rank's barriers
        _pass_barrier([server, *workers], 7)  # ps::Finalize
        code, err = _ended(proc)
        assert code == 0, err
        assert f"replace dead node role=worker, id={lost.id}, ip=127.0.0.1, port={lost.port} by node role=worker, " \
               f"id={lost.id}, ip=127.0.0.1, port={new.port}, is_recovery=1" in err
        warnings = [x for x in err.splitlines() if "warning" in x]
        assert warnings == [f"pslaunch scheduler: warning: ignored a worker at 127.0.0.1:{late.port}: all 3 servers "
                            "and workers of this job have registered, and there is no dead worker for it to replace: "
                            "none is silent for more than PS_HEARTBEAT_TIMEOUT=1 s"], err
    finally:
        _tear_down(proc, ctx, [*nodes[:1], *nodes[2:], *extra])
