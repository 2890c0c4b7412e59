"""Big arrays through the whole protocol, exactly, and the frame bound that holds before
authentication (what the KV store's speed work must keep)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from support.kvjob import free_port
from test_kv_recovery import Thread
from test_kv_scheduler import SECRET

from pscontract import ClusterEnv
from trainer.kv import client as C
from trainer.kv import protocol as P
from trainer.kv import transport as T
from trainer.kv.client import KVClient
from trainer.kv.scheduler import Scheduler
from trainer.kv.server import Server
from trainer.kv.transport import Hub, Link, Verbose

#: 5 M float32 (20 MB): split over both servers, 10 parts of 1 MB each, 3 messages per server
BIG = 5_000_000


def env(role: str, port: int, task: int | None) -> ClusterEnv:
    return ClusterEnv(role=role, root_uri="127.0.0.1", root_port=port, num_workers=2, num_servers=2,
                      task_id=task, node_host="127.0.0.1", start_timeout=30,
                      heartbeat_interval=0.5, heartbeat_timeout=0)


def pushed(rank: int, step: int, n: int) -> np.ndarray:
    """A different whole number at every position, worker and step: a part in the wrong
    place, a missed or doubled part, or a stale answer changes the sum (exact in float32)."""
    return ((np.arange(n, dtype=np.int64) * 7 + rank * 1000 + step * 100_003) % 4_000_000).astype(
        np.float32)


@pytest.mark.parametrize("pooled", [True, False], ids=["zmq-copies", "staged"])
def test_big_keys_come_back_exactly_after_a_push_and_a_pull(pooled: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers, two servers, dist_sync: each step pushes a 20 MB key (both servers' parts
    in several messages) and a small one, overwrites what it pushed, then pulls both from the
    answers the pushes got. Every pulled value is the exact sum of the two workers' pushes of
    that step, whether ZeroMQ copied the pushed frames (pooled memory) or buffers of ours did."""
    monkeypatch.setattr(C, "keep_freed_memory", lambda: pooled)
    port = free_port()
    threads = [Thread(Scheduler(env("scheduler", port, None), SECRET).run),
               Thread(Server(env("server", port, 2), SECRET).run),
               Thread(Server(env("server", port, 3), SECRET).run)]
    keys = ["big", "small"]
    sizes = [BIG, 1000]

    def worker(rank: int) -> list[bool]:
        kv = KVClient(env("worker", port, rank), SECRET)
        kv.init(keys, [np.zeros(n, np.float32) for n in sizes])
        exact = []
        for step in range(3):
            grads = [pushed(rank, step, n) for n in sizes]
            kv.push(keys, grads)
            for g in grads:  # a plain push leaves the caller's arrays free at once
                g[:] = -1
            outs = [np.full(n, np.nan, np.float32) for n in sizes]
            kv.pull(keys, outs)
            exact += [np.array_equal(o, pushed(0, step, n) + pushed(1, step, n))
                      for o, n in zip(outs, sizes)]
        kv.close()
        return exact

    workers = [Thread(lambda r=r: worker(r)) for r in range(2)]
    results = [w.join(120) for w in workers]
    for t in threads:
        t.join(30)
    assert results == [[True] * 6] * 2


def _closed(monitor: zmq.Socket, hub: Hub, seconds: float) -> bool:
    """Service ``hub`` until the peer's monitor reports its connection closed."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        hub.service()
        if hub.sock.poll(10):
            assert hub.receive() == []  # nothing reaches the application
        for event, _ in T._monitor_events(monitor):
            if event == zmq.EVENT_DISCONNECTED:
                return True
    return False


def test_a_frame_over_the_bound_is_refused_before_authentication() -> None:
    """A peer with the gate's token (it passes ZeroMQ's PLAIN gate) that has not proved the
    secret sends one frame just over MAX_FRAME: its connection is closed, nothing is
    delivered; a real peer then authenticates and sends a whole chunk."""
    ctx = T.bulk_context()
    hub = Hub(ctx, SECRET, False, Verbose(0, "S[0]"))
    stranger = ctx.socket(zmq.DEALER)
    link: Link | None = None
    try:
        port = hub.bind("127.0.0.1")
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.setsockopt(zmq.PLAIN_USERNAME, b"pslaunch")
        stranger.setsockopt(zmq.PLAIN_PASSWORD, P.gate_token(SECRET))
        monitor = stranger.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            stranger.connect(f"tcp://127.0.0.1:{port}")
            stranger.send(bytes(P.MAX_FRAME + 1))
            assert _closed(monitor, hub, 10), "an oversized frame before authentication was taken"
        finally:
            stranger.disable_monitor()
            monitor.close(0)
            stranger.close(0)

        link = Link(ctx, "127.0.0.1", port, SECRET, "the hub", "S[0]", False, Verbose(0, "W[0]"))
        done = Thread(lambda: link.handshake(time.monotonic() + 20))  # type: ignore[union-attr]
        end = time.monotonic() + 20
        while not hub.acceptor.peers and time.monotonic() < end:
            hub.service()
            if hub.sock.poll(10):
                hub.receive()
        done.join(20)
        chunk = np.arange(P.CHUNK_BYTES // 4, dtype=np.float32)
        link.send(P.PUSH, count=1, payload=[P.pack_index([(0, 0, chunk.size, 1)]), chunk])
        got = []
        while not got and time.monotonic() < end:
            hub.service()
            if hub.sock.poll(10):
                got = hub.receive()
        assert len(got) == 1
        assert np.array_equal(np.frombuffer(got[0][1].data[0].buffer, np.float32), chunk)
    finally:
        if link is not None:
            link.close(0)
        hub.close(0)
        ctx.term()
