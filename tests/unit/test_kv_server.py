"""A server's data plane (:class:`trainer.kv.server.Shard`) in exact, chosen orders.

The end-to-end tests run real processes, where the order in which two workers'
messages reach a server is up to the scheduler of the OS; here every order is
spelled out. Replies are recorded instead of sent.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import zmq

from trainer.kv import protocol as P
from trainer.kv.server import Shard


class Recorder:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def __call__(self, peer: P.Peer, cmd: int, key: int = 0, part: int = 0, req: int = 0,
                 status: int = 0, dtype: int = 0, count: int = 0, flags: int = 0,
                 payload: Any = (), digest: bytes | None = None, copy: bool = False) -> bool:
        # a reply sent without a copy shares the buffer: read it now, as ZeroMQ would later
        data = [bytes(memoryview(p)) for p in payload]
        self.sent.append(dict(to=peer.label, cmd=cmd, key=key, part=part, req=req, status=status,
                              dtype=dtype, count=count, data=data, copy=copy))
        return True

    def take(self) -> list[dict[str, Any]]:
        out, self.sent = self.sent, []
        return out


def peer(name: str) -> P.Peer:
    p = P.Peer(name.encode())
    p.label = name
    return p


W0, W1 = peer("w0"), peer("w1")


def batch(cmd: int, items: list[tuple[int, int, int, int]], data: list[bytes], req: int = 0,
          flags: int = 0) -> P.Message:
    index = P.pack_index(items)
    return P.Message(cmd, flags, 0, items[0][0] if items else 0, 0, req, 0, 0, len(items),
                     [zmq.Frame(index), *(zmq.Frame(d) for d in data)], items)


def tensor_msg(cmd: int, values: list[float], key: int = 0, req: int = 0, flags: int = 0) -> P.Message:
    a = np.asarray(values, np.float32)
    return batch(cmd, [(key, 0, a.size, 1)], [a.tobytes()], req, flags)


def pull_msg(key: int = 0, req: int = 0, flags: int = 0, count: int = 2) -> P.Message:
    return batch(P.PULL, [(key, 0, count, 1)], [], req, flags)


def json_msg(cmd: int, obj: Any, req: int = 0) -> P.Message:
    return P.Message(cmd, P.F_MAC, 0, 0, 0, req, 0, 0, 0, [zmq.Frame(json.dumps(obj).encode())])


def values(reply: dict[str, Any], item: int = 0) -> list[float]:
    assert reply["cmd"] == P.VALUES, reply
    return np.frombuffer(reply["data"][1 + item], np.float32).tolist()


@pytest.fixture
def shard() -> tuple[Shard, Recorder]:
    rec = Recorder()
    s = Shard(num_workers=2, mac_payload=False, send=rec)
    s.handle(W0, tensor_msg(P.INIT, [0, 0], req=1))
    assert rec.take()[0]["status"] == P.ST_OK
    return s, rec


def test_a_round_sums_both_pushes_and_answers_each(shard) -> None:
    s, rec = shard
    s.handle(W0, tensor_msg(P.PUSH, [1, 2], req=10))
    assert rec.take() == []  # the round waits for w1
    s.handle(W1, tensor_msg(P.PUSH, [3, 4], req=20))
    replies = rec.take()
    assert [(r["to"], r["req"]) for r in replies] == [("w0", 10), ("w1", 20)]
    assert all(values(r) == [4, 6] and not r["copy"] for r in replies)


def test_a_second_push_waits_for_the_next_round_without_blocking_others(shard) -> None:
    s, rec = shard
    s.handle(W0, tensor_msg(P.PUSH, [1, 1], req=10))
    s.handle(W0, tensor_msg(P.PUSH, [2, 2], req=11))  # w0 is one round ahead
    s.handle(W1, tensor_msg(P.PUSH, [10, 10], req=20))  # joins the first round
    first = rec.take()
    assert [(r["to"], r["req"], values(r)) for r in first] == [("w0", 10, [11, 11]),
                                                              ("w1", 20, [11, 11])]
    s.handle(W1, tensor_msg(P.PUSH, [20, 20], req=21))
    second = rec.take()
    assert [(r["to"], r["req"], values(r)) for r in second] == [("w0", 11, [22, 22]),
                                                               ("w1", 21, [22, 22])]


def test_pulls_see_the_pullers_own_pushes(shard) -> None:
    s, rec = shard
    s.handle(W1, pull_msg(req=30))  # no push from w1 in this round: at once
    assert [(r["req"], values(r)) for r in rec.take()] == [(30, [0, 0])]
    s.handle(W0, tensor_msg(P.PUSH, [1, 1], req=10))
    s.handle(W0, pull_msg(req=11))  # held until the round completes
    s.handle(W1, pull_msg(req=31))  # w1 has not pushed: the old value, at once
    assert [(r["to"], r["req"], values(r)) for r in rec.take()] == [("w1", 31, [0, 0])]
    s.handle(W1, tensor_msg(P.PUSH, [2, 2], req=32))
    assert [(r["to"], r["req"], values(r)) for r in rec.take()] == [
        ("w0", 10, [3, 3]), ("w0", 11, [3, 3]), ("w1", 32, [3, 3])]


def test_a_pull_behind_a_queued_push_waits_for_that_round(shard) -> None:
    s, rec = shard
    s.handle(W0, tensor_msg(P.PUSH, [1, 1], req=10))
    s.handle(W0, tensor_msg(P.PUSH, [5, 5], req=11))
    s.handle(W0, pull_msg(req=12))
    s.handle(W1, tensor_msg(P.PUSH, [1, 1], req=20))
    assert [r["req"] for r in rec.take()] == [10, 20]
    s.handle(W1, tensor_msg(P.PUSH, [5, 5], req=21))
    assert [(r["req"], values(r)) for r in rec.take()] == [(11, [10, 10]), (12, [10, 10]),
                                                            (21, [10, 10])]


def test_the_optimizer_runs_once_per_round_on_the_sum(shard) -> None:
    s, rec = shard
    s.handle(W0, json_msg(P.SET_OPTIMIZER, {"name": "sgd", "learning_rate": 0.5}, req=2))
    assert rec.take()[0]["status"] == P.ST_OK
    s.handle(W0, tensor_msg(P.PUSH, [1, 2], req=10))
    s.handle(W1, tensor_msg(P.PUSH, [3, 2], req=20))
    assert values(rec.take()[0]) == [-2, -2]  # 0 - 0.5 * (1+3, 2+2)


def test_async_needs_an_optimizer_then_applies_each_push(shard) -> None:
    s, rec = shard
    s.handle(W0, tensor_msg(P.PUSH, [1, 1], req=10, flags=P.F_ASYNC))
    (err,) = rec.take()
    assert err["status"] == P.ST_ERROR and b"dist_async needs an optimizer" in err["data"][0]
    s.handle(W0, json_msg(P.SET_OPTIMIZER, {"name": "sgd", "learning_rate": 1.0}, req=2))
    rec.take()
    s.handle(W0, tensor_msg(P.PUSH, [1, 1], req=11, flags=P.F_ASYNC))
    assert rec.take() == []  # a plain async push is not answered
    s.handle(W1, tensor_msg(P.PUSH, [2, 2], req=21, flags=P.F_ASYNC | P.F_PULL))
    (r,) = rec.take()
    assert values(r) == [-3, -3] and r["copy"]  # a snapshot: others change it in place


@pytest.mark.parametrize("make, expected", [
    (lambda: tensor_msg(P.PUSH, [1, 1], key=9), b"key 9 (part 0) was never initialised"),
    (lambda: tensor_msg(P.PUSH, [1, 1, 1]), b"has 3 elements of <f4 here, but init gave 2"),
    (lambda: pull_msg(key=9), b"was never initialised"),
    (lambda: pull_msg(count=5), b"has 5 elements of <f4 here, but init gave 2"),
    (lambda: json_msg(P.SET_OPTIMIZER, {"name": "rmsprop"}), b"unknown optimizer 'rmsprop'"),
])
def test_bad_requests_get_one_line_errors(shard, make, expected: bytes) -> None:
    s, rec = shard
    s.handle(W0, make())
    (r,) = rec.take()
    assert r["status"] == P.ST_ERROR and expected in r["data"][0] and b"\n" not in r["data"][0]


def test_optimizer_states_round_trip(shard) -> None:
    s, rec = shard
    s.handle(W0, json_msg(P.SET_OPTIMIZER, {"name": "sgd", "learning_rate": 1.0,
                                            "momentum": 0.5}))
    s.handle(W0, tensor_msg(P.PUSH, [1, 1]))
    s.handle(W1, tensor_msg(P.PUSH, [1, 1]))
    rec.take()
    s.handle(W0, P.Message(P.GET_STATES, 0, 0, 0, 0, 5, 0, 0, 0, []))
    (r,) = rec.take()
    meta = json.loads(r["data"][0])
    assert meta["slots"] == [{"key": 0, "part": 0, "count": 1, "names": ["mom"]}]
    assert np.frombuffer(r["data"][1], np.float32).tolist() == [-2, -2]
    other = Shard(2, False, rec)
    other.handle(W0, tensor_msg(P.INIT, [0, 0]))
    frames = [zmq.Frame(d) for d in r["data"]]
    other.handle(W0, P.Message(P.SET_STATES, P.F_MAC, 0, 0, 0, 6, 0, 0, 0, frames))
    assert rec.take()[-1]["status"] == P.ST_OK
    assert other.updater is not None and other.updater.counts == {(0, 0): 1}
    np.testing.assert_array_equal(other.updater.states[(0, 0)]["mom"], [-2, -2])


def test_wd_mult_applies_by_key_id_on_a_server() -> None:
    # The server's optimizer states are keyed by (key id, part); wd_mult names key ids
    # (the worker translates its own keys, see trainer.kv.client.wd_mult_to_ids).
    rec = Recorder()
    s = Shard(num_workers=1, mac_payload=False, send=rec)
    s.handle(W0, tensor_msg(P.INIT, [1, 1], key=0))
    s.handle(W0, tensor_msg(P.INIT, [1, 1], key=1))
    s.handle(W0, json_msg(P.SET_OPTIMIZER, {"name": "sgd", "learning_rate": 1.0, "wd": 0.5,
                                            "wd_mult": {"0": 0.0}}))
    rec.take()
    s.handle(W0, tensor_msg(P.PUSH, [0, 0], key=0, req=10))
    s.handle(W0, tensor_msg(P.PUSH, [0, 0], key=1, req=11))
    bias, weight = rec.take()
    assert values(bias) == [1, 1]  # wd_mult 0: no decay
    assert values(weight) == [0.5, 0.5]  # 1 - 1.0 * 0.5 * 1


def test_a_failed_round_still_serves_the_next_rounds_requests() -> None:
    rec = Recorder()
    s = Shard(num_workers=2, mac_payload=False, send=rec)

    def ints(cmd: int, v: list[int], req: int) -> P.Message:
        a = np.asarray(v, np.int32)  # an optimizer cannot update integers: every round fails
        return batch(cmd, [(0, 0, a.size, 4)], [a.tobytes()], req)

    s.handle(W0, ints(P.INIT, [0, 0], 1))
    s.handle(W0, json_msg(P.SET_OPTIMIZER, {"name": "sgd", "learning_rate": 0.5}))
    rec.take()
    s.handle(W0, ints(P.PUSH, [1, 1], 10))
    s.handle(W0, ints(P.PUSH, [1, 1], 11))  # the next round: queued
    s.handle(W1, ints(P.PUSH, [1, 1], 20))
    assert [(r["req"], r["status"]) for r in rec.take()] == [(10, P.ST_ERROR), (20, P.ST_ERROR)]
    s.handle(W1, ints(P.PUSH, [1, 1], 21))  # completes the queued round
    replies = rec.take()
    assert [(r["req"], r["status"]) for r in replies] == [(11, P.ST_ERROR), (21, P.ST_ERROR)]
    assert b"the optimizer failed on key 0" in replies[0]["data"][0]


def test_a_batch_gets_one_answer_when_its_last_item_completes() -> None:
    rec = Recorder()
    s = Shard(num_workers=2, mac_payload=False, send=rec)
    two = [(0, 0, 2, 1), (1, 0, 1, 1)]
    s.handle(W0, batch(P.INIT, two, [np.zeros(2, np.float32).tobytes(),
                                     np.zeros(1, np.float32).tobytes()], req=1))
    assert [r["cmd"] for r in rec.take()] == [P.REPLY]
    f32 = lambda *v: np.asarray(v, np.float32).tobytes()  # noqa: E731
    s.handle(W0, batch(P.PUSH, two, [f32(1, 1), f32(5)], req=10))
    # w1 pushes key 0 alone, then key 1: w0's answer waits for both rounds
    s.handle(W1, batch(P.PUSH, [(0, 0, 2, 1)], [f32(2, 2)], req=20))
    assert [(r["to"], r["req"], values(r)) for r in rec.take()] == [("w1", 20, [3, 3])]
    s.handle(W1, batch(P.PUSH, [(1, 0, 1, 1)], [f32(6)], req=21))
    replies = rec.take()
    assert [(r["to"], r["req"]) for r in replies] == [("w0", 10), ("w1", 21)]
    assert values(replies[0], 0) == [3, 3] and values(replies[0], 1) == [11]
    assert replies[0]["data"][0] == P.pack_index(two)  # the request's own index
    assert replies[0]["count"] == 2


def test_an_item_that_fails_fails_its_whole_batch_but_not_the_rounds() -> None:
    rec = Recorder()
    s = Shard(num_workers=1, mac_payload=False, send=rec)
    s.handle(W0, tensor_msg(P.INIT, [0, 0], req=1))
    rec.take()
    f32 = lambda *v: np.asarray(v, np.float32).tobytes()  # noqa: E731
    s.handle(W0, batch(P.PUSH, [(0, 0, 2, 1), (7, 0, 2, 1)], [f32(1, 1), f32(1, 1)], req=10))
    (r,) = rec.take()
    assert r["status"] == P.ST_ERROR and b"key 7 (part 0) was never initialised" in r["data"][0]
    s.handle(W0, pull_msg(req=11))
    assert values(rec.take()[0]) == [1, 1]  # key 0's round went through
