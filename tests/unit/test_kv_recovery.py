"""A lost worker replaced in place (``--restart-scope process``): the rules
(:mod:`trainer.kv.recovery`), a server's repeated pushes in chosen orders, and the
scheduler's rank takeover on loopback with hand-driven nodes."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import zmq
from support.kvjob import free_port
from test_kv_scheduler import SECRET, Node, Running
from test_kv_server import Recorder, tensor_msg, values

from pscontract import ClusterEnv
from trainer.kv import protocol as P
from trainer.kv import recovery as R
from trainer.kv.client import KVClient
from trainer.kv.errors import KVAbortError, KVStoreError
from trainer.kv.scheduler import Scheduler
from trainer.kv.server import Server, Shard
from trainer.kv.transport import Link, Verbose

# --- the rules --------------------------------------------------------------------------------


def test_push_kind_tells_a_new_step_from_repeats() -> None:
    assert R.push_kind(step=3, taken=3, in_round=False) == R.NEW
    assert R.push_kind(step=4, taken=3, in_round=False) == R.NEW  # ahead: the normal path decides
    assert R.push_kind(step=2, taken=3, in_round=True) == R.REPEAT_IN_ROUND
    assert R.push_kind(step=2, taken=3, in_round=False) == R.REPEAT_DONE
    assert R.push_kind(step=1, taken=3, in_round=True) == R.REPEAT_DONE  # an older round: over


def test_resume_step_and_position() -> None:
    assert R.resume_step([7, 6, None]) == 6  # a half-pushed step is pushed again
    assert R.resume_step([None, None]) == 0 and R.resume_step([]) == 0
    assert R.resume_position((0, 0), 250, 100) == (2, 50)
    assert R.resume_position((1, 30), 75, 100) == (2, 5)  # this attempt began inside epoch 1
    assert R.resume_position((0, 0), 0, 100) == (0, 0)


def test_environment() -> None:
    assert R.replaces_workers({R.RESTART_SCOPE: "process"})
    assert not R.replaces_workers({R.RESTART_SCOPE: "job"}) and not R.replaces_workers({})
    assert R.replacement_number({R.REPLACEMENT: "2"}) == 2
    assert R.replacement_number({}) == 0 and R.replacement_number({R.REPLACEMENT: "-1"}) == 0
    assert R.replacement_number({R.REPLACEMENT: "x"}) == 0
    assert R.silence_limit(2, replacing=True) == R.HEARTBEAT_FLOOR
    assert R.silence_limit(2, replacing=False) == 2 and R.silence_limit(0, replacing=True) == 0
    assert R.silence_limit(30, replacing=True) == 30


# --- a server: repeated pushes -----------------------------------------------------------------


def worker(name: str, rank: int) -> P.Peer:
    p = P.Peer(name.encode())
    p.label = name
    p.info = rank  # what the worker's REGISTER to the server sets
    return p


def push(values_: list[float], step: int, req: int, flags: int = 0) -> P.Message:
    msg = tensor_msg(P.PUSH, values_, req=req, flags=flags | P.F_STEP)
    msg.status = step
    return msg


def sync_shard() -> tuple[Shard, Recorder, P.Peer, P.Peer]:
    rec = Recorder()
    shard = Shard(num_workers=2, mac_payload=False, send=rec)
    w0, w1 = worker("w0", 0), worker("w1", 1)
    shard.handle(w0, tensor_msg(P.INIT, [0, 0], req=1))
    rec.take()
    return shard, rec, w0, w1


def test_a_replacement_repeating_a_step_in_the_round_is_not_summed_twice() -> None:
    shard, rec, w0, w1 = sync_shard()
    shard.handle(w1, push([1, 1], step=0, req=2))  # the lost worker's push, then it dies
    again = worker("w1-replacement", 1)  # another connection, the same rank
    shard.handle(again, push([1, 1], step=0, req=3))  # the replacement pushes step 0 again
    assert rec.take() == []  # not a round of w1 and w1': w0 is missing
    shard.handle(w0, push([10, 10], step=0, req=4))
    sent = {r["req"]: r for r in rec.take()}
    assert values(sent[3]) == [11, 11] and values(sent[4]) == [11, 11]  # w1's gradient once
    assert shard.updates == 1 and shard.repeats == 1
    # step 1: the replacement's push counts
    shard.handle(again, push([2, 2], step=1, req=5))
    shard.handle(w0, push([3, 3], step=1, req=6))
    assert [values(r) for r in rec.take()] == [[5, 5], [5, 5]]


def test_a_repeat_of_a_finished_round_is_answered_with_the_value_now() -> None:
    shard, rec, w0, w1 = sync_shard()
    shard.handle(w1, push([1, 1], step=0, req=2))
    shard.handle(w0, push([2, 2], step=0, req=3))
    rec.take()
    again = worker("w1-replacement", 1)
    shard.handle(again, push([100, 100], step=0, req=4))
    (reply,) = rec.take()
    assert values(reply) == [3, 3] and shard.updates == 1  # not summed into the next round
    shard.handle(w0, push([1, 1], step=1, req=5))
    assert rec.take() == []  # the next round waits for rank 1's step 1


def test_async_repeats_are_not_applied_again_and_steps_say_where_a_rank_was() -> None:
    rec = Recorder()
    shard = Shard(num_workers=2, mac_payload=False, send=rec)
    w0, w1 = worker("w0", 0), worker("w1", 1)
    for key in (0, 1):
        shard.handle(w0, tensor_msg(P.INIT, [0, 0], key=key, req=1))
    shard.handle(w0, P.Message(P.SET_OPTIMIZER, P.F_MAC, 0, 0, 0, 2, 0, 0, 0,
                               [zmq.Frame(json.dumps({"name": "sgd", "learning_rate": 1.0}).encode())]))
    rec.take()
    for step in range(3):
        for key in (0, 1):
            m = tensor_msg(P.PUSH, [1, 1], key=key, req=10, flags=P.F_ASYNC | P.F_STEP)
            m.status = step
            shard.handle(w1, m)
    m = tensor_msg(P.PUSH, [1, 1], key=0, req=11, flags=P.F_ASYNC | P.F_STEP)
    m.status = 3
    shard.handle(w1, m)  # step 3 of key 0 only: then w1 dies
    assert shard.updates == 7
    again = worker("w1-replacement", 1)
    shard.handle(again, P.Message(P.STEPS, P.F_MAC, 0, 0, 0, 12, 0, 0, 0, []))
    (reply,) = rec.take()
    assert json.loads(reply["data"][0]) == {"step": 3}  # key 1 had 3 of its pushes
    for key in (0, 1):
        m = tensor_msg(P.PUSH, [1, 1], key=key, req=13, flags=P.F_ASYNC | P.F_STEP)
        m.status = 3
        shard.handle(again, m)
    assert shard.updates == 8 and shard.repeats == 1  # key 0's step 3 applied once
    assert shard.slots[(0, 0)].value.tolist() == shard.slots[(1, 0)].value.tolist() == [-4, -4]


def test_steps_need_a_registered_rank() -> None:
    shard, rec, _, _ = sync_shard()
    stranger = P.Peer(b"x")
    shard.handle(stranger, P.Message(P.STEPS, P.F_MAC, 0, 0, 0, 1, 0, 0, 0, []))
    (reply,) = rec.take()
    assert reply["status"] == P.ST_ERROR


def test_the_step_travels_in_the_mac_covered_header() -> None:
    a = P.Session(b"k" * 32, b"k" * 32)
    b = P.Session(b"k" * 32, b"k" * 32)
    index = P.pack_index([(0, 0, 2, 1)])
    data = np.zeros(2, np.float32).tobytes()
    head = a.seal(P.PUSH, count=1, status=41, flags=P.F_STEP, payload=[index, data])
    msg = b.open([head, index, data])
    assert (msg.status, msg.flags & P.F_STEP) == (41, P.F_STEP)
    forged = bytearray(a.seal(P.PUSH, count=1, status=41, flags=P.F_STEP, payload=[index, data]))
    forged[16] = 7  # another step, same MAC
    with pytest.raises(P.ProtocolError):
        b.open([bytes(forged), index, data])


# --- the scheduler: losing a worker and its replacement taking over --------------------------------


def env(port: int, workers: int, start_timeout: float = 30) -> ClusterEnv:
    return ClusterEnv(role="scheduler", root_uri="127.0.0.1", root_port=port,
                      num_workers=workers, num_servers=0, start_timeout=start_timeout,
                      heartbeat_interval=0, heartbeat_timeout=0)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(0)


def ready(node: Node) -> dict:
    msg = node.recv(10)
    assert msg is not None and msg.cmd == P.READY, msg
    return msg.json()


def finish(nodes: list[Node], run: Running) -> None:
    for n in nodes:
        n.link.send(P.BARRIER, key=P.GROUP_WORKERS)
    for n in nodes:
        msg = n.recv(10)
        assert msg is not None and (msg.cmd, msg.key) == (P.RELEASE, P.GROUP_WORKERS)
    for n in nodes:
        n.link.send(P.FINALIZE)
    for n in nodes:
        msg = n.recv(10)
        assert msg is not None and msg.cmd == P.DONE
    run.join(10)
    assert run.error is None


def test_a_lost_worker_is_waited_for_and_its_replacement_takes_its_rank(
        ctx: zmq.Context, caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    sched = Scheduler(env(port, 2), SECRET, replace_workers=True)
    run = Running(sched)
    a, b = Node(ctx, port, 0), Node(ctx, port, 1)
    assert ready(a)["rank"] == 0 and "recovery" not in ready(b)
    a.link.send(P.BARRIER, key=P.GROUP_WORKERS)  # worker 0 waits at a barrier, worker 1 dies
    b.link.close(0)
    time.sleep(1.0)
    assert run.thread.is_alive() and a.recv(0.2) is None  # no abort, no release
    assert 1 in sched.lost
    lines = [r.getMessage() for r in caplog.records if "replacement" in r.getMessage()]
    assert lines == ["H worker 1 (task 1, pid 1001 on 127.0.0.1) disconnected (it exited or was "
                     "killed): waiting up to 30 s (PS_START_TIMEOUT) for its replacement"], lines
    c = Node(ctx, port, 1, replacement=1, pid=2001)
    got = ready(c)
    assert (got["rank"], got["recovery"], got["num_workers"]) == (1, True, 2)
    assert not sched.lost
    c.link.send(P.BARRIER, key=P.GROUP_WORKERS)  # the barrier worker 0 waits at completes
    for n in (a, c):
        msg = n.recv(10)
        assert msg is not None and (msg.cmd, msg.key) == (P.RELEASE, P.GROUP_WORKERS)
    finish([a, c], run)


def test_a_replacement_takes_over_from_a_worker_that_still_looks_connected(ctx: zmq.Context) -> None:
    port = free_port()
    run = Running(Scheduler(env(port, 2), SECRET, replace_workers=True))
    a, b = Node(ctx, port, 0), Node(ctx, port, 1)
    ready(a), ready(b)
    c = Node(ctx, port, 1, replacement=1, pid=2001)  # its REGISTER proves b gone
    assert ready(c)["rank"] == 1
    b.link.send(P.BARRIER, key=P.GROUP_WORKERS)  # the old one counts for nothing now
    b.link.close(0)  # nor does its closed connection
    finish([a, c], run)


def test_no_replacement_in_time_aborts_naming_the_worker(ctx: zmq.Context) -> None:
    port = free_port()
    run = Running(Scheduler(env(port, 2, start_timeout=1.5), SECRET, replace_workers=True))
    a, b = Node(ctx, port, 0), Node(ctx, port, 1)
    ready(a), ready(b)
    b.link.close(0)
    run.join(10)
    assert isinstance(run.error, KVAbortError)
    assert str(run.error) == ("worker 1 (task 1, pid 1001 on 127.0.0.1) disconnected (it exited or "
                              "was killed), and no replacement registered within 1.5 s "
                              "(PS_START_TIMEOUT)")
    msg = a.recv(5)
    assert msg is not None and msg.cmd == P.ABORT


def test_without_the_scope_a_replacement_is_turned_away_and_a_loss_aborts(ctx: zmq.Context) -> None:
    port = free_port()
    run = Running(Scheduler(env(port, 2), SECRET, replace_workers=False))
    a, b = Node(ctx, port, 0), Node(ctx, port, 1)
    ready(a), ready(b)
    c = Node(ctx, port, 1, replacement=1)
    msg = c.recv(5)
    assert msg is not None and msg.cmd == P.ABORT and "one worker more" in msg.json()["reason"]
    b.link.close(0)
    run.join(10)
    assert isinstance(run.error, KVAbortError) and "disconnected before the end" in str(run.error)


@pytest.mark.parametrize("bad", [{"task_id": 7}, {"task_id": "1"}, {"task_id": None},
                                 {"replacement": 1.5}, {"replacement": True},
                                 {"pid": float("inf")}, {"port": "x"}])
def test_a_malformed_replacement_gets_nowhere(ctx: zmq.Context, bad: dict) -> None:
    port = free_port()
    sched = Scheduler(env(port, 2), SECRET, replace_workers=True)
    run = Running(sched)
    a, b = Node(ctx, port, 0), Node(ctx, port, 1)
    ready(a), ready(b)
    odd = Link(ctx, "127.0.0.1", port, SECRET, "the scheduler", "H", False, Verbose(0, "W"))
    odd.handshake(time.monotonic() + 10)
    odd.send_json(P.REGISTER, {"role": "worker", "task_id": 1, "host": "127.0.0.1", "port": 0,
                               "pid": 3000, "replacement": 1, **bad})
    time.sleep(0.5)
    assert run.thread.is_alive()
    assert sorted(n.pid for n in sched.nodes.values()) == [1000, 1001]  # nobody replaced
    odd.close(0)
    finish([a, b], run)


def test_a_stranger_without_the_secret_cannot_register_a_replacement(ctx: zmq.Context) -> None:
    port = free_port()
    sched = Scheduler(env(port, 2), SECRET, replace_workers=True)
    run = Running(sched)
    a, b = Node(ctx, port, 0), Node(ctx, port, 1)
    ready(a), ready(b)
    stranger = Link(ctx, "127.0.0.1", port, P.secret_key("cd" * 32), "the scheduler", "H", False,
                    Verbose(0, "X"))
    with pytest.raises(KVStoreError):
        stranger.handshake(time.monotonic() + 3)
    stranger.close(0)
    assert sorted(n.pid for n in sched.nodes.values()) == [1000, 1001]
    finish([a, b], run)


# --- the whole protocol in this process: a scheduler, a server and three workers' clients ----------


def node_env(role: str, port: int, task: int | None) -> ClusterEnv:
    return ClusterEnv(role=role, root_uri="127.0.0.1", root_port=port, num_workers=2, num_servers=1,
                      task_id=task, node_host="127.0.0.1", start_timeout=30,
                      heartbeat_interval=0.5, heartbeat_timeout=0)


class Thread:
    """Run ``fn`` in a thread; ``join`` re-raises what it raised."""

    def __init__(self, fn: Any) -> None:
        self.error: BaseException | None = None
        self.result: Any = None

        def run() -> None:
            try:
                self.result = fn()
            except BaseException as e:  # noqa: BLE001 - reported by join
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> Any:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_replacement_goes_on_at_its_step_and_no_step_counts_twice(asynchronous: bool) -> None:
    """Worker 1 makes 3 steps and half of the 4th (key 0 pushed, key 1 not), then its
    connections close as a killed process's do; its replacement learns step 3 from the server,
    pushes both keys of step 3 (key 0's is a repeat) and the rest. Every step is one update of
    each key: with SGD at rate 1, w = -(1 + 2) per step, whatever the timing."""
    steps = 6
    port = free_port()
    sched = Scheduler(node_env("scheduler", port, None), SECRET, replace_workers=True)
    server = Server(node_env("server", port, 2), SECRET)
    threads = [Thread(sched.run), Thread(server.run)]
    keys = ["k0", "k1"]

    def start(task: int, replacement: int = 0) -> KVClient:
        if replacement:
            os.environ[R.REPLACEMENT] = str(replacement)
        try:
            kv = KVClient(node_env("worker", port, task), SECRET, asynchronous=asynchronous)
        finally:
            os.environ.pop(R.REPLACEMENT, None)
        kv.init(keys, [np.zeros(3, np.float32)] * 2)
        kv.set_optimizer({"name": "sgd", "learning_rate": 1.0})
        return kv

    def step(kv: KVClient, grad: float, only_first: bool = False) -> np.ndarray:
        for key in keys[:1] if only_first else keys:  # two messages, as two buckets go
            kv.push([key], [np.full(3, grad, np.float32)])
        if only_first:
            return np.zeros(0)
        out = [np.empty(3, np.float32), np.empty(3, np.float32)]
        kv.pull(keys, out)
        return out[1]

    def worker0() -> np.ndarray:
        kv = start(0)
        for _ in range(steps):
            step(kv, 1.0)
        if asynchronous:
            kv.barrier()  # every push of both workers applied
        out = [np.empty(3, np.float32), np.empty(3, np.float32)]
        kv.pull(keys, out)
        kv.close()
        return np.concatenate(out)

    def worker1() -> None:
        kv = start(1)
        for _ in range(3):
            step(kv, 2.0)
        step(kv, 2.0, only_first=True)
        end = time.monotonic() + 20  # the half step reached the server (linger 0 would drop it)
        while server.shard.slots[(0, 0)].taken.get(1) != 4:
            assert time.monotonic() < end, "worker 1's push of step 3 never arrived"
            time.sleep(0.01)
        kv._shutdown(0)  # its connections close, as a killed process's do

    def replacement() -> int | None:
        kv = start(1, replacement=1)
        first = kv.resume_step
        for _ in range(first or 0, steps):
            step(kv, 2.0)
        if asynchronous:
            kv.barrier()
        kv.close()
        return first

    w0 = Thread(worker0)
    Thread(worker1).join(30)
    resumed = Thread(replacement).join(60)
    final = w0.join(60)
    for t in threads:
        t.join(30)
    assert resumed == 3
    assert final.tolist() == [-3.0 * steps] * 6
    assert server.shard.updates == (2 * steps * 2 if asynchronous else 2 * steps)
    assert server.shard.repeats == 1  # key 0 of step 3, pushed again by the replacement
