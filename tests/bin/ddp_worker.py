"""A small PyTorch DistributedDataParallel worker for the tracker tests (gloo, CPU, float64).

Under ``pslaunch --tracker torch`` (or torchrun) it joins with ``init_process_group("env://")``,
trains a two-layer network on its shard of a deterministic data set with DDP, and writes
``<out>/<name>.json``: its rank, world size, the torch variables it got, when it joined
(``time.time()`` after the first barrier), and the final parameters (float64 values, as a list).

``--solo N`` trains one process, no process group, on what N ranks see together: the same
steps on batches N times larger. DDP averages the ranks' gradients, so its parameters equal the
solo run's up to the order of float64 additions.

``--exit-before-join TASK:CODE`` makes the worker whose ``DMLC_TASK_ID`` is TASK exit with CODE
before it joins; ``--join-only`` joins, writes its record and leaves without training.

``--store-check`` (``--max-restarts``): joins, sets a key of its own attempt and rank in the
store at ``MASTER_ADDR:MASTER_PORT`` (a ``TCPStore`` client, as every rank is one), and writes
``<out>/task-T-attempt-A.json``: which keys of earlier attempts that store still has, and how many
of this attempt's it has (every rank's: the store works); in every attempt but the last, the last
rank then exits 3 (the job restarts).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
         "TORCHELASTIC_USE_AGENT_STORE", "DMLC_TASK_ID", "DMLC_NODE_HOST", "PSLAUNCH_LOCAL_PROCS", "GLOO_SOCKET_IFNAME",
         "NCCL_SOCKET_IFNAME")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=6, help="rows per rank per step")
    ap.add_argument("--solo", type=int, default=None, metavar="N")
    ap.add_argument("--exit-before-join", default=None, metavar="TASK:CODE")
    ap.add_argument("--join-only", action="store_true")
    ap.add_argument("--store-check", action="store_true")
    a = ap.parse_args()
    task = os.environ.get("DMLC_TASK_ID", os.environ.get("RANK", "0"))
    if a.exit_before_join:
        who, code = a.exit_before_join.split(":")
        if who == task:
            print(f"ddp_worker task {task}: exiting with {code} before joining", file=sys.stderr, flush=True)
            return int(code)
    t0 = time.time()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    record = {"env": {k: os.environ.get(k) for k in NAMES}, "pid": os.getpid(), "torch": torch.__version__,
              "host": os.uname().nodename, "started": t0}
    if a.solo:
        world, rank, net = a.solo, 0, model
        rows = a.batch * world
    else:
        dist.init_process_group("gloo")
        dist.barrier()
        record["joined"] = time.time()
        world, rank = dist.get_world_size(), dist.get_rank()
        record.update(rank=rank, world=world)
        if a.join_only:
            return finish(a, record, task, dist)
        if a.store_check:
            return store_check(a, record, task, dist)
        net = torch.nn.parallel.DistributedDataParallel(model)
        rows = a.batch
    world_all = a.solo or world
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(a.steps * a.batch * world_all, 4, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[0.5], [-1.0], [0.25], [2.0]], dtype=torch.float64) + 0.1 * torch.randn(
        len(x), 1, generator=g, dtype=torch.float64)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(a.steps):
        lo = step * a.batch * world_all + (0 if a.solo else rank * a.batch)
        xb, yb = x[lo:lo + rows], y[lo:lo + rows]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(xb), yb)
        loss.backward()
        opt.step()
    record["params"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    record["loss"] = float(loss.detach())
    del net, opt  # (DDP's reducer holds the process group: gone before the group is destroyed)
    return finish(a, record, task, dist if not a.solo else None)


def store_check(a: argparse.Namespace, record: dict, task: str, dist) -> int:  # noqa: ANN001
    """``--store-check``: what this attempt's store holds of earlier attempts (see the docstring)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    attempt, rank, world = int(os.environ.get("PSLAUNCH_ATTEMPT", "0")), record["rank"], record["world"]
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=60))
    store.set(f"ddp-worker/attempt-{attempt}/rank-{rank}", str(os.getpid()))
    keys = {i: [f"ddp-worker/attempt-{i}/rank-{r}" for r in range(world)] for i in range(attempt + 1)}
    # (a TCPStore client's set is not answered: after a barrier, another rank's key may still be on
    # its way to the store; wait for every rank's, at most 30 s, so that "this" counts what arrived)
    try:
        store.wait(keys[attempt], timedelta(seconds=30))
    except RuntimeError:
        pass
    dist.barrier()
    record["earlier"] = [k for i in range(attempt) for k in keys[i] if store.check([k])]
    record["this"] = sum(store.check([k]) for k in keys[attempt])
    record["attempt"] = attempt
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"task-{task}-attempt-{attempt}.json").write_text(json.dumps(record))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    if attempt < int(os.environ.get("PSLAUNCH_MAX_RESTARTS", "0")):
        os._exit(3 if rank == world - 1 else 0)
    dist.destroy_process_group()
    os._exit(0)  # (see finish)


def finish(a: argparse.Namespace, record: dict, task: str, dist: object) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name or 'task-' + task}.json").write_text(json.dumps(record))
    if dist is not None:
        dist.barrier()  # type: ignore[attr-defined]
        dist.destroy_process_group()  # type: ignore[attr-defined]
        # torch 2.13 with gloo sometimes aborts in the interpreter's finalization, after all this
        # ("terminate called without an active exception": about 1 run in 30 under load, here and
        # once on Grid Engine); the worker's work is done and recorded, so skip the finalization
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
