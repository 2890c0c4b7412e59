"""A KVStore test program: every role of a job runs it (``import trainer.kvstore``
turns the scheduler and server processes into their roles).

``kv_worker.py SCENARIO [--out DIR] [--type dist_sync]``; a worker writes
``DIR/worker-<rank>.json`` with what it saw and exits non-zero (one line on
stderr) when a check fails.

Scenarios:
    sync       integer sums across workers: int and str keys, a split array,
               push+pull, pushpull, several rounds, lists of keys, device lists.
    async      dist_async with SGD lr=1: every push is applied at once.
    async_noopt  dist_async without an optimizer: the push says so at once.
    optim      sgd/momentum on the servers; states round trip.
    wd         wd_mult by the user's keys reaches the servers (biases do not decay).
    place      balanced placement: report the bytes per server.
    stall      after one round every worker writes ``ready-<rank>``; rank 1 then
               sleeps (the test kills or stops it) while the others wait in pushpull.
    gate       like stall, but every worker waits for a file ``go``, then finishes.
    big        like gate, then a 256 MB float32 array is pushed and pulled (its sum checked).
    fail       rank 1 raises an exception mid-run.
    noop       create the store and close it.
    noclose    sync, without closing the store: the end of the program does it.
"""

from __future__ import annotations

# ruff: noqa: I001, E402  (trainer.kvstore must come first: it runs the server roles)

import argparse
import json
import os
import sys
import time
from pathlib import Path

from trainer import kvstore  # the scheduler and servers stop here

import numpy as np
import torch


OUT_DIR = "."


def fail(msg: str) -> None:
    sys.stderr.write(f"kv_worker: {msg}\n")
    sys.exit(3)


def expect(cond: bool, msg: str) -> None:
    if not cond:
        fail(msg)


def scenario_sync(kv: kvstore.KVStore, out: dict) -> None:
    n, r = kv.num_workers, kv.rank
    tri = n * (n + 1) // 2
    kv.init([3, "fc1_weight"], [torch.zeros(2, 3), torch.full((4,), 7.0) * (r + 1)])
    big = torch.zeros(10, 12, dtype=torch.float64)
    kv.init("big", big)
    # rank 0's init wins
    w = torch.empty(4)
    kv.pull("fc1_weight", w)
    expect(bool((w == 7.0).all()), f"init from rank 0: pulled {w.tolist()}")
    for rnd in range(3):
        kv.push(3, torch.ones(2, 3) * (r + 1) * (rnd + 1))
        got = torch.empty(2, 3)
        kv.pull(3, got)
        expect(bool((got == tri * (rnd + 1)).all()), f"round {rnd}: sum {got.tolist()}")
    # a split array (bound lowered by the test), summed and reassembled
    v = torch.arange(120, dtype=torch.float64).reshape(10, 12) * (r + 1)
    o = torch.empty(10, 12, dtype=torch.float64)
    kv.pushpull("big", v, o)
    expect(torch.equal(o, torch.arange(120, dtype=torch.float64).reshape(10, 12) * tri),
           f"split array: {o.flatten()[:5].tolist()}")
    # lists of keys, two "devices" per key, outs on two "devices"
    kv.push([3, "fc1_weight"], [[torch.ones(2, 3), torch.ones(2, 3)], [torch.ones(4)] * 3])
    o1 = [torch.empty(2, 3), torch.empty(2, 3)]
    o2 = torch.empty(4)
    kv.pull([3, "fc1_weight"], [o1, o2])
    expect(all(bool((t == 2 * n).all()) for t in o1), f"device lists: {o1[1].tolist()}")
    expect(bool((o2 == 3 * n).all()), f"list keys: {o2.tolist()}")
    # two pushes before a pull: the pull sees both rounds; a pull with no push before it
    kv.push(3, torch.ones(2, 3))
    kv.push(3, torch.full((2, 3), 2.0))
    kv.pull(3, got)
    expect(bool((got == 2 * n).all()), f"push, push, pull: {got.tolist()}")
    kv.pull(3, got)
    expect(bool((got == 2 * n).all()), f"pull again: {got.tolist()}")
    kv.push("big", v)  # answered, never pulled: must not disturb what follows
    # numpy values and non-contiguous outs
    kv.push(3, np.full((2, 3), 5.0, np.float32))
    nc = torch.empty(3, 2).t()
    kv.pull(3, nc)
    expect(bool((nc == 5 * n).all()), f"numpy push / non-contiguous out: {nc.tolist()}")
    kv.barrier()
    out["sum"] = o2.tolist()


def scenario_async(kv: kvstore.KVStore, out: dict) -> None:
    kv.init(0, torch.zeros(8))
    kv.set_optimizer({"name": "sgd", "learning_rate": 1.0})
    for _ in range(5):
        kv.push(0, torch.ones(8))
    kv.barrier()
    got = torch.empty(8)
    kv.pull(0, got)
    # every push of every worker was applied: w = -(5 * n)
    expect(bool((got == -5.0 * kv.num_workers).all()), f"async: {got.tolist()}")
    out["value"] = got.tolist()


def scenario_async_noopt(kv: kvstore.KVStore, out: dict) -> None:
    kv.init(0, torch.zeros(2))
    try:
        kv.push(0, torch.ones(2))
    except kvstore.KVConfigError as e:
        out["error"] = str(e)
    else:
        fail("dist_async push without an optimizer was accepted")


def scenario_optim(kv: kvstore.KVStore, out: dict) -> None:
    n = kv.num_workers
    kv.init("w", torch.ones(6))
    kv.set_optimizer({"name": "sgd", "learning_rate": 0.5, "momentum": 0.5,
                      "rescale_grad": 1.0 / n})
    got = torch.empty(6)
    for _ in range(2):
        kv.pushpull("w", torch.ones(6), got)
    # grad = 1 each round; mom1 = -0.5, w1 = 0.5; mom2 = -0.25 - 0.5 = -0.75, w2 = -0.25
    expect(torch.allclose(got, torch.full((6,), -0.25)), f"sgd momentum: {got.tolist()}")
    states = kv.get_optimizer_states()
    st = states["states"]["w"]
    expect(st["count"] == 2, f"count {st['count']}")
    expect(torch.allclose(st["arrays"]["mom"], torch.full((6,), -0.75)), f"mom {st['arrays']}")
    kv.set_optimizer_states(states)
    kv.pushpull("w", torch.ones(6), got)
    # mom3 = -0.375 - 0.5 = -0.875, w3 = -1.125
    expect(torch.allclose(got, torch.full((6,), -1.125)), f"after restore: {got.tolist()}")
    # A resumed run with a new learning rate: the states go to the optimizer it set.
    states = kv.get_optimizer_states()
    kv.set_optimizer({"name": "sgd", "learning_rate": 0.1, "momentum": 0.5, "rescale_grad": 1.0 / n})
    kv.set_optimizer_states(states)
    kv.pushpull("w", torch.ones(6), got)
    # mom4 = -0.4375 - 0.1 = -0.5375, w4 = -1.6625 (with the saved lr 0.5 it would be -2.0625)
    expect(torch.allclose(got, torch.full((6,), -1.6625)), f"after restore with a new lr: {got.tolist()}")
    out["w"] = got.tolist()


def scenario_wd(kv: kvstore.KVStore, out: dict) -> None:
    kv.init(["w", "b"], [torch.ones(3), torch.ones(2)])
    kv.set_optimizer({"name": "sgd", "learning_rate": 0.5, "wd": 0.5, "wd_mult": {"b": 0.0}})
    w, b = torch.empty(3), torch.empty(2)
    kv.pushpull(["w", "b"], [torch.zeros(3), torch.zeros(2)], [w, b])
    # w = 1 - 0.5 * 0.5 * 1; b keeps its value (wd_mult 0)
    expect(torch.equal(w, torch.full((3,), 0.75)) and torch.equal(b, torch.ones(2)),
           f"wd_mult: w {w.tolist()}, b {b.tolist()}")
    states = kv.get_optimizer_states()
    expect(states["optimizer"]["wd_mult"] == {"b": 0.0}, f"states: {states['optimizer']}")
    kv.set_optimizer_states(states)
    kv.pushpull(["w", "b"], [torch.zeros(3), torch.zeros(2)], [w, b])
    expect(torch.equal(w, torch.full((3,), 0.5625)) and torch.equal(b, torch.ones(2)),
           f"wd_mult after restore: w {w.tolist()}, b {b.tolist()}")
    out["w"], out["b"] = w.tolist(), b.tolist()


def scenario_place(kv: kvstore.KVStore, out: dict) -> None:
    # LeNet's parameters: weights and biases alternate
    shapes = [(20, 1, 5, 5), (20,), (50, 20, 5, 5), (50,), (500, 800), (500,), (10, 500), (10,)]
    kv.init(list(range(len(shapes))), [torch.zeros(s) for s in shapes])
    client = kv._client  # type: ignore[attr-defined]
    out["loads"] = list(client.placement.loads)
    out["servers"] = {str(k): [p.server for p in client.keys[k].parts] for k in client.keys}


def scenario_stall(kv: kvstore.KVStore, out: dict) -> None:
    kv.init(0, torch.zeros(4))
    got = torch.empty(4)
    kv.pushpull(0, torch.ones(4), got)
    Path(OUT_DIR, f"ready-{kv.rank}").write_text(str(os.getpid()))
    if kv.rank == 1:
        time.sleep(3600)
    kv.pushpull(0, torch.ones(4), got)  # never completes: rank 1 does not push
    fail("the round completed without rank 1")


def scenario_gate(kv: kvstore.KVStore, out: dict) -> None:
    kv.init(0, torch.zeros(4))
    got = torch.empty(4)
    kv.pushpull(0, torch.ones(4), got)
    Path(OUT_DIR, f"ready-{kv.rank}").write_text(str(os.getpid()))
    while not Path(OUT_DIR, "go").exists():
        time.sleep(0.05)
    kv.pushpull(0, torch.ones(4), got)
    expect(bool((got == kv.num_workers).all()), f"after the gate: {got.tolist()}")


def scenario_big(kv: kvstore.KVStore, out: dict) -> None:
    scenario_gate(kv, out)
    n = (256 << 20) // 4
    value = torch.full((n,), float(kv.rank + 1))
    kv.init("big", value)
    got = torch.zeros(n)
    kv.push("big", value)
    kv.pull("big", got)
    total = kv.num_workers * (kv.num_workers + 1) / 2
    expect(bool((got == total).all()), f"256 MB: {got[:3].tolist()} ... {got[-3:].tolist()}")
    out["big"] = [float(got[0]), float(got[-1]), int(got.numel())]


def scenario_fail(kv: kvstore.KVStore, out: dict) -> None:
    kv.init(0, torch.zeros(4))
    if kv.rank == 1:
        raise ValueError("simulated bug in the training loop")
    got = torch.empty(4)
    kv.pushpull(0, torch.ones(4), got)
    fail("the round completed without rank 1")


def scenario_noop(kv: kvstore.KVStore, out: dict) -> None:
    out["rank"] = kv.rank


SCENARIOS = {name[len("scenario_"):]: f for name, f in globals().items()
             if name.startswith("scenario_")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", choices=sorted(SCENARIOS) + ["noclose"])
    ap.add_argument("--type", default="dist_sync")
    ap.add_argument("--out", default=".", help="directory for worker-<rank>.json (default: .)")
    args = ap.parse_args()
    global OUT_DIR
    OUT_DIR = args.out
    out: dict = {}
    if args.scenario == "noclose":  # rely on the interpreter's exit to close the store
        kv = kvstore.create(args.type)
        out["rank"] = kv.rank
        scenario_sync(kv, out)
        Path(args.out, f"worker-{out['rank']}.json").write_text(json.dumps(out))
        return
    with kvstore.create(args.type) as kv:
        out["rank"] = kv.rank
        SCENARIOS[args.scenario](kv, out)
    Path(args.out, f"worker-{out['rank']}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
