"""The ``local`` and ``device`` stores, and what ``create`` refuses (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pscontract as pc
from trainer import kvstore
from trainer.kvstore import KVConfigError


@pytest.fixture(params=["local", "device"])
def kv(request: pytest.FixtureRequest) -> kvstore.KVStore:
    return kvstore.create(request.param)


def test_identity(kv: kvstore.KVStore) -> None:
    assert kv.rank == 0 and kv.num_workers == 1 and kv.type in ("local", "device")
    kv.barrier()
    with kv:
        pass


def test_push_sums_several_devices_and_pull_fills_each(kv: kvstore.KVStore) -> None:
    kv.init(3, torch.zeros(2, 3))
    kv.push(3, [torch.ones(2, 3), torch.full((2, 3), 2.0), torch.full((2, 3), 3.0)])
    outs = [torch.empty(2, 3), torch.empty(2, 3)]
    kv.pull(3, outs)
    assert all(torch.equal(o, torch.full((2, 3), 6.0)) for o in outs)


def test_lists_of_keys_str_keys_and_numpy(kv: kvstore.KVStore) -> None:
    kv.init(["a", 7], [torch.zeros(4), np.zeros((2, 2), np.float32)])
    kv.push(["a", 7], [[torch.ones(4)] * 2, np.full((2, 2), 5, np.float32)])
    a, b = torch.empty(4), np.empty((2, 2), np.float32)
    kv.pull(["a", 7], [a, b])
    assert torch.equal(a, torch.full((4,), 2.0)) and (b == 5).all()


def test_pushpull_and_integer_dtypes(kv: kvstore.KVStore) -> None:
    kv.init("n", torch.zeros(5, dtype=torch.int64))
    out = torch.empty(5, dtype=torch.int64)
    kv.pushpull("n", [torch.arange(5), torch.arange(5)], out)
    assert out.tolist() == [0, 2, 4, 6, 8]


def test_init_does_not_alias_the_value(kv: kvstore.KVStore) -> None:
    v = torch.ones(3)
    kv.init(0, v)
    v += 1
    out = torch.empty(3)
    kv.pull(0, out)
    assert out.tolist() == [1, 1, 1]


def test_optimizer_updates_on_push_and_states_round_trip(kv: kvstore.KVStore) -> None:
    kv.init("w", torch.ones(4))
    kv.set_optimizer({"name": "sgd", "learning_rate": 0.5, "momentum": 0.5})
    g = torch.ones(4)
    kv.push("w", g)
    assert g.tolist() == [1, 1, 1, 1]  # the caller's gradient is not touched
    out = torch.empty(4)
    kv.pull("w", out)
    assert torch.allclose(out, torch.full((4,), 0.5))
    states = kv.get_optimizer_states()
    assert states["states"]["w"]["count"] == 1
    other = kvstore.create("local")
    other.init("w", out)
    other.set_optimizer_states(states)
    kv.push("w", g)
    other.push("w", g)
    a, b = torch.empty(4), torch.empty(4)
    kv.pull("w", a)
    other.pull("w", b)
    assert torch.allclose(a, b) and torch.allclose(a, torch.full((4,), -0.25))


@pytest.mark.parametrize("call, message", [
    (lambda kv: kv.push(9, torch.ones(1)), "key 9 is not initialised"),
    (lambda kv: kv.init(0, torch.ones(1)), "already initialised"),
    (lambda kv: kv.push(0, torch.ones(2)), "holds shape"),
    (lambda kv: kv.push(0, [torch.ones(3), torch.ones(2)]), "must have one shape"),
    (lambda kv: kv.push([0, 1], [torch.ones(3)]), "2 keys need a list of 2"),
    (lambda kv: kv.push(1.5, torch.ones(3)), "must be an int or a str"),
    (lambda kv: kv.push(0, [1, 2, 3]), "must be a torch tensor or a numpy array"),
    (lambda kv: kv.set_optimizer({"name": "sgdd"}), "unknown optimizer"),
])
def test_errors_name_the_problem(call, message: str) -> None:
    kv = kvstore.create("local")
    kv.init(0, torch.zeros(3))
    with pytest.raises(KVConfigError, match=message):
        call(kv)


def test_unknown_type() -> None:
    with pytest.raises(KVConfigError, match="unknown kvstore type 'dist_sinc'"):
        kvstore.create("dist_sinc")
    assert kvstore.create("local_allreduce_device").type == "device"


def _contract(**extra: str) -> dict[str, str]:
    env = pc.contract("worker", root_uri="127.0.0.1", root_port=9, num_workers=1,
                           num_servers=1, secret="", start_timeout=1, job_id="j", task_id=0,
                           cluster="local", node_host="127.0.0.1")
    env.update(extra)
    return env


def test_dist_refuses_to_start_without_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in _contract().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(pc.SECRET)
    monkeypatch.delenv(pc.INSECURE, raising=False)
    with pytest.raises(KVConfigError) as e:
        kvstore.create("dist_sync")
    assert "PSLAUNCH_SECRET is not set" in str(e.value) and "PSLAUNCH_INSECURE=1" in str(e.value)
    assert "\n" not in str(e.value)


def test_dist_outside_a_job_names_the_missing_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (pc.ROOT_URI, pc.ROOT_PORT, pc.ROLE):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(KVConfigError, match="DMLC_PS_ROOT_URI is not set"):
        kvstore.create("dist_async")


def test_dist_needs_a_server(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in _contract(**{pc.NUM_SERVER: "0", pc.SECRET: "ab" * 32}).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(KVConfigError, match="at least one server"):
        kvstore.create("dist_sync")
