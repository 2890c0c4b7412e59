"""The worker side's pure helpers (no processes)."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import zmq

from pscontract import ClusterEnv
from trainer.kv import client as C
from trainer.kv import protocol as P
from trainer.kv.client import KeyInfo, wd_mult_to_ids, wd_mult_to_keys
from trainer.kv.errors import KVConfigError
from trainer.kv.placement import Part, Placement
from trainer.kv.transport import CLEAN_LINGER_MS, Verbose

KEYS = {"fc1_weight": KeyInfo(0, 1, 4, [Part(0, 0, 0, 4)]),
        "fc1_bias": KeyInfo(1, 1, 2, [Part(0, 0, 0, 2)]),
        7: KeyInfo(2, 1, 2, [Part(0, 0, 0, 2)])}


def test_wd_mult_travels_as_key_ids_and_comes_back_as_keys() -> None:
    spec = {"name": "sgd", "wd": 0.1, "wd_mult": {"fc1_bias": 0.0, "7": 2.0}}
    sent = wd_mult_to_ids(spec, KEYS)
    assert sent["wd_mult"] == {"1": 0.0, "2": 2.0}
    assert spec["wd_mult"] == {"fc1_bias": 0.0, "7": 2.0}  # the caller's spec is untouched
    assert wd_mult_to_keys(sent, KEYS)["wd_mult"] == {"fc1_bias": 0.0, "7": 2.0}
    assert wd_mult_to_ids({"name": "sgd", "wd_mult": {}}, KEYS) == {"name": "sgd", "wd_mult": {}}


def test_wd_mult_for_a_key_not_initialised_is_a_one_line_error() -> None:
    with pytest.raises(KVConfigError, match="wd_mult names key 'conv_bias', which is not "
                                            "initialised") as e:
        wd_mult_to_ids({"name": "sgd", "wd_mult": {"conv_bias": 0.0}}, KEYS)
    assert "\n" not in str(e.value)


def test_a_failing_worker_lingers_so_its_fail_message_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    # The control thread sends FAIL, then is told to stop at once (KVClient.fail):
    # closing the scheduler link with linger 0 would drop the FAIL unsent.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = ClusterEnv(role="worker", root_uri="127.0.0.1", root_port=port, num_workers=1,
                     num_servers=1, heartbeat_interval=0)

    class FakeClient:
        ctx = zmq.Context()
        secret = b"k" * 32
        v = Verbose(0, "W[0]")
        started = 0.0
        host = "127.0.0.1"
        finished = False

    fake = FakeClient()
    fake.env = env  # type: ignore[attr-defined]
    main = fake.ctx.socket(zmq.PAIR)
    main.bind("inproc://test-control")
    control = C._Control(fake, "inproc://test-control")  # type: ignore[arg-type]
    sent, lingers = [], []
    monkeypatch.setattr(control.sched, "connect", lambda *a, **k: None)
    monkeypatch.setattr(control.sched.link, "send_json", lambda cmd, obj, **k: sent.append(cmd))
    real_close = control.sched.close
    monkeypatch.setattr(control.sched, "close",
                        lambda linger_ms=0: (lingers.append(linger_ms), real_close(0)))
    control.start()
    main.send_multipart([b"fail", b"boom"])
    assert main.poll(5000) and main.recv_multipart()[0] == b"failed"
    main.send_multipart([b"stop", b""])
    control.join(5)
    assert not control.is_alive()
    main.close(0)
    fake.ctx.term()
    assert sent == [P.FAIL]
    assert lingers == [CLEAN_LINGER_MS]


def test_dist_async_push_without_an_optimizer_fails_at_once() -> None:
    kv = C.KVClient.__new__(C.KVClient)  # no job: the check comes before any I/O
    kv.closed, kv.aborted, kv.asynchronous, kv.has_optimizer = False, None, True, False
    with pytest.raises(KVConfigError, match=r"dist_async needs an optimizer .*kv.set_optimizer"):
        kv.push(["w"], [np.zeros(2, np.float32)])


def _bare_client(rank: int = 1) -> C.KVClient:
    """A KVClient without a job, for the checks that come before any I/O."""
    kv = C.KVClient.__new__(C.KVClient)
    kv.closed, kv.aborted, kv.asynchronous, kv.has_optimizer = False, None, False, False
    kv.rank, kv.keys, kv.placement = rank, {}, Placement(2)
    kv._steps = {}
    return kv


@pytest.mark.parametrize("keys, arrays, message", [
    (["a", "a"], [np.zeros(2, np.float32)] * 2, "key 'a' was already initialised"),
    (["a", "b"], [np.zeros(2, np.float32), np.zeros(2, np.complex64)], "cannot go through"),
])
def test_a_refused_init_changes_nothing(keys, arrays, message: str) -> None:
    kv = _bare_client()
    with pytest.raises(KVConfigError, match=message):
        kv.init(keys, arrays)
    assert kv.keys == {} and kv.placement.loads == [0, 0]


def test_a_dist_async_barrier_first_confirms_this_workers_pushes(monkeypatch) -> None:
    # Plain async pushes get no reply and the barrier goes through the scheduler:
    # before it, one small pull per server proves the pushes there were applied.
    kv = _bare_client()
    kv.asynchronous, kv.has_optimizer, kv._flags = True, True, P.F_ASYNC
    kv.links = ["link0", "link1"]
    kv._req, kv._pending, kv._latest, kv._stash, kv._plans = 0, {}, {}, {}, {}
    kv._unconfirmed = {}
    kv._deferred_error = None
    kv.placement.bigarray_bound = 100
    kv.keys = {"big": KeyInfo(0, 1, 200, kv.placement.assign([(200, 4)])[0]),
               "small": KeyInfo(1, 1, 3, [Part(1, 0, 0, 3)])}
    sent: list[tuple] = []

    def fake_send(link, cmd, kind, batch, targets=None, count=0, flags=0, payload=(), step=0,
                  copy=False):
        items = list(P.ITEM.iter_unpack(payload[0]))
        sent.append((link, cmd, items, [len(p) for p in payload[1:]]))
        if batch is not None:
            batch.left += 1
        return len(sent)

    def fake_wait(batch):
        sent.append(("wait", batch.left))

    monkeypatch.setattr(kv, "_send", fake_send)
    monkeypatch.setattr(kv, "_wait", fake_wait)
    kv.push(["big", "small"], [np.zeros(200, np.float32), np.zeros(3, np.float32)])
    # one message per server: server 1 gets part 1 of "big" and "small" together
    assert sent == [("link0", P.PUSH, [(0, 0, 100, 1)], [100]),
                    ("link1", P.PUSH, [(0, 1, 100, 1), (1, 0, 3, 1)], [100, 3])]
    sent.clear()
    kv._confirm_pushes()
    # server 0 holds part 0 of "big" (100 elements); server 1's smallest is "small" (3)
    assert sent == [("link0", P.PULL, [(0, 0, 100, 1)], []),
                    ("link1", P.PULL, [(1, 0, 3, 1)], []), ("wait", 2)]
    sent.clear()
    kv._confirm_pushes()  # nothing pushed since: nothing to confirm
    assert sent == []


def test_a_plan_batches_per_server_and_streams_big_arrays(monkeypatch) -> None:
    kv = _bare_client()
    kv.links = ["link0", "link1"]
    kv._plans = {}
    kv.placement = Placement(2, bigarray_bound=10**9)  # not split across the servers
    names = ["w1", "b1", "big", "b2"]
    sizes = [(1000, 4), (10, 4), (3 << 20, 4), (5, 4)]  # big: 12 MB, 12 chunks of 1 MB
    for name, p, (n, _) in zip(names, kv.placement.assign(sizes), sizes):
        kv.keys[name] = KeyInfo(len(kv.keys), 1, n, p)
    plan = kv._plan(names)
    assert kv._plan(names) is plan  # built once per list of keys
    servers = [out.server for out in plan]
    big_server = kv.keys["big"].parts[0].server
    # the big array's server gets it in messages of about BATCH_BYTES (4 MB: 4 chunks);
    # the other server gets every small key in one message
    assert servers.count(big_server) == 3 and servers.count(1 - big_server) == 1
    small = next(out for out in plan if out.server != big_server)
    assert sorted(pos for pos, *_ in small.items) == [0, 1, 3]
    chunks = [item for out in plan if out.server == big_server for item in out.items]
    assert [(lo, hi) for _, lo, hi, _, _ in chunks] == [(i << 18, (i + 1) << 18) for i in range(12)]
    with pytest.raises(KVConfigError, match="key 'nope' is not initialised"):
        kv._plan(["w1", "nope"])
