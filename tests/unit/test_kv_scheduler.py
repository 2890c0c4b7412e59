"""The scheduler in this process on loopback, with hand-driven nodes (no torch, no jobs)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import zmq
from support.kvjob import free_port

from pscontract import ClusterEnv
from trainer.kv import protocol as P
from trainer.kv.errors import KVAbortError
from trainer.kv.scheduler import Scheduler
from trainer.kv.transport import Link, Verbose

SECRET = P.secret_key("ab" * 32)


class Running:
    """A scheduler running in a thread; ``error`` is what its run() raised."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.sched.run()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            self.error = e

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the scheduler did not stop"


class Node:
    """A worker as the scheduler sees it: an authenticated DEALER."""

    def __init__(self, ctx: zmq.Context, port: int, task_id: int, **info: Any) -> None:
        self.link = Link(ctx, "127.0.0.1", port, SECRET, "the scheduler", "H", False,
                         Verbose(0, "W"))
        self.link.handshake(time.monotonic() + 10)
        self.link.send_json(P.REGISTER, {"role": "worker", "task_id": task_id,
                                         "host": "127.0.0.1", "port": 0, "pid": 1000 + task_id,
                                         **info})

    def recv(self, timeout: float) -> P.Message | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.link.sock.poll(50):
                msg = self.link.receive(self.link.sock.recv_multipart(copy=False))
                if msg is not None and msg.cmd != P.HEARTBEAT:
                    return msg
        return None


def env(port: int, workers: int) -> ClusterEnv:
    return ClusterEnv(role="scheduler", root_uri="127.0.0.1", root_port=port,
                      num_workers=workers, num_servers=0, start_timeout=30,
                      heartbeat_interval=0, heartbeat_timeout=0)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(0)


def test_ranks_from_task_ids_barrier_and_clean_end(ctx: zmq.Context) -> None:
    port = free_port()
    run = Running(Scheduler(env(port, 2), SECRET))
    a = Node(ctx, port, task_id=1)  # registers first, but is task 1
    b = Node(ctx, port, task_id=0)
    ready = {n: n.recv(10) for n in (a, b)}
    assert [ready[n].cmd for n in (a, b)] == [P.READY, P.READY]  # type: ignore[union-attr]
    assert ready[a].json()["rank"] == 1 and ready[b].json()["rank"] == 0  # type: ignore[union-attr]
    a.link.send(P.BARRIER, key=P.GROUP_WORKERS)
    assert a.recv(0.5) is None  # held until every worker is there
    b.link.send(P.BARRIER, key=P.GROUP_WORKERS)
    for n in (a, b):
        msg = n.recv(10)
        assert msg is not None and (msg.cmd, msg.key) == (P.RELEASE, P.GROUP_WORKERS)
    for n in (a, b):
        n.link.send(P.FINALIZE)
    for n in (a, b):
        msg = n.recv(10)
        assert msg is not None and msg.cmd == P.DONE
    run.join(10)
    assert run.error is None


def test_a_fail_behind_many_messages_is_reported_rather_than_the_disconnection(
        ctx: zmq.Context) -> None:
    # The scheduler reads a bounded batch per turn; a node that sends FAIL behind
    # more than one batch and then closes must still be reported by its FAIL.
    class Slow(Scheduler):
        slept = False

        def _handle(self, peer: P.Peer, msg: P.Message, now: float) -> Any:
            if msg.cmd == P.HEARTBEAT and not self.slept:
                self.slept = True
                time.sleep(0.5)  # the node floods, fails and closes meanwhile
            return super()._handle(peer, msg, now)

    port = free_port()
    run = Running(Slow(env(port, 2), SECRET))
    a, b = Node(ctx, port, 0), Node(ctx, port, 1)
    assert a.recv(10) is not None and b.recv(10) is not None
    a.link.send(P.HEARTBEAT)
    time.sleep(0.1)
    for _ in range(300):
        a.link.send(P.HEARTBEAT)
    a.link.send_json(P.FAIL, {"reason": "ValueError: boom"})
    a.link.close(2000)
    run.join(10)
    assert isinstance(run.error, KVAbortError)
    assert "worker 0 (task 0, pid 1000 on 127.0.0.1) failed: ValueError: boom" in str(run.error)
    msg = b.recv(5)
    assert msg is not None and msg.cmd == P.ABORT and "boom" in msg.json()["reason"]


def test_a_nonsense_registration_is_dropped_and_counted(ctx: zmq.Context) -> None:
    port = free_port()
    sched = Scheduler(env(port, 1), SECRET)
    run = Running(sched)
    odd = Node(ctx, port, 0, pid=float("inf"))  # JSON Infinity: int() overflows
    assert odd.recv(0.5) is None
    assert run.thread.is_alive() and sched.hub.drops.counts.get("malformed") == 1
    good = Node(ctx, port, 0)
    msg = good.recv(10)
    assert msg is not None and msg.cmd == P.READY
    good.link.send(P.FINALIZE)
    run.join(10)
    assert run.error is None
