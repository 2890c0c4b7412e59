#!/usr/bin/env python3
"""Benchmark train_mnist: samples/s per worker for lenet and mlp, beside MXNet 1.9.1 in the same run.

For each network and batch size it runs, one after the other:

* ``local``: one process, ``--kv-store local``, all cores;
* ``dist_sync`` and ``dist_async``: two workers and one server on the local
  launcher (``python -m launcher -n 2 -s 1 --launcher local``);
* ``dist_allreduce``: two workers and no server, the gradients summed with
  torch.distributed's allreduce (``python -m launcher -n 2 --tracker torch``;
  MXNet has no such store, so that row is ours only);

first ours (``scripts/train_mnist.py``), then, when an MXNet 1.9.1 Python is
found, MXNet's own training (``scripts/bench_train_mxnet.py``) with the same
settings, and prints one table: samples/s per worker (the mean over the
workers, from each epoch's time), the ratio ours/MXNet, and the final
validation accuracy of each. MXNet runs alone with ``OMP_NUM_THREADS`` set to
the core count (its best on this machine); under the launcher every process
gets one thread, ours as MXNet's.

Short runs (the default: one epoch of 19,200 examples, 300 batches of 64 on one
worker) measure speed; for the accuracy targets run two full epochs::

    python scripts/bench_train.py                                   # the speed table
    python scripts/bench_train.py --networks lenet --batch-sizes 64 --num-examples 60000 --num-epochs 2
    python scripts/bench_train.py --mxnet none                      # ours only

Close other work first: the numbers are only as quiet as the machine (``--repeat 3``
keeps the fastest of three runs of each case; the table ends with the load average).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import pscontract as pc  # noqa: E402
from trainer.summary import read_summaries  # noqa: E402

MODES = ("local", "dist_sync", "dist_async", "dist_allreduce")
MXNET_CANDIDATES = ("/opt/mxnet-venv/bin/python", str(REPO / ".venv-mxnet" / "bin" / "python"))


def find_mxnet(choice: str | None) -> str | None:
    """The Python of an MXNet venv: ``--mxnet``, ``$PSLAUNCH_MXNET_PYTHON``, or a known place."""
    if choice == "none":
        return None
    for cand in (choice, os.environ.get("PSLAUNCH_MXNET_PYTHON"), *MXNET_CANDIDATES):
        if cand and os.path.exists(cand):
            return cand
    return None


def run(argv: list[str], env: dict[str, str], timeout: float) -> tuple[list[dict[str, Any]], float, str]:
    """Run a command; return its JSON summary lines, its wall time and its output tail."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout)
    wall = time.perf_counter() - t0
    out = read_summaries(proc.stdout)
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {proc.returncode}:\n{tail}")
    return out, wall, tail


def command(python: str, script: str, mode: str, args: list[str]) -> list[str]:
    kv = "local" if mode == "local" else mode
    inner = [python, str(REPO / "scripts" / script), "--kv-store", kv, *args]
    if mode == "local":
        return inner
    if mode == "dist_allreduce":  # no servers: the torch tracker's rendezvous, gloo's allreduce
        return [sys.executable, "-m", "launcher", "-n", "2", "--tracker", "torch", "--launcher", "local", *inner]
    return [sys.executable, "-m", "launcher", "-n", "2", "-s", "1", "--launcher", "local", *inner]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--networks", default="lenet,mlp")
    p.add_argument("--batch-sizes", default="64,128")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--num-examples", type=int, default=19200)
    p.add_argument("--num-epochs", type=int, default=1)
    p.add_argument("--mxnet", default=None, help="MXNet's python, or 'none' (default: found automatically)")
    p.add_argument("--data-dir", default=None, help="train_mnist's --data-dir")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--repeat", type=int, default=1, help="run each case this many times, keep the fastest")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    a = p.parse_args()
    mxnet = find_mxnet(a.mxnet)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env = dict(os.environ)
    env[pc.PYTHONPATH] = os.pathsep.join([str(REPO)] + [x for x in env.get(pc.PYTHONPATH, "").split(os.pathsep) if x])
    env.pop(pc.OMP_NUM_THREADS, None)

    rows = []
    load0 = _load()
    print(f"# bench_train: {cores} cores, {a.num_epochs} epoch(s) of {a.num_examples} examples, MXNet: {mxnet or 'not run'}",
          flush=True)
    for network in a.networks.split(","):
        for batch in (int(b) for b in a.batch_sizes.split(",")):
            for mode in a.modes.split(","):
                common = ["--network", network, "--batch-size", str(batch), "--num-epochs", str(a.num_epochs),
                          "--num-examples", str(a.num_examples), "--disp-batches", "100000"]
                if a.data_dir:
                    common += ["--data-dir", a.data_dir]
                row: dict[str, Any] = {"network": network, "batch": batch, "mode": mode}
                for who, python, script in (("ours", sys.executable, "train_mnist.py"),
                                            ("mxnet", mxnet, "bench_train_mxnet.py")):
                    if python is None or (who == "mxnet" and mode == "dist_allreduce"):
                        continue
                    run_env = dict(env)
                    if who == "mxnet" and mode == "local":
                        run_env[pc.OMP_NUM_THREADS] = str(cores)
                    best: list[dict[str, Any]] | None = None
                    try:
                        for _ in range(a.repeat):
                            summaries, wall, _ = run(command(python, script, mode, common), run_env, a.timeout)
                            if best is None or _mean(s["samples_per_sec"] for s in summaries) > _mean(
                                    s["samples_per_sec"] for s in best):
                                best = summaries
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        print(f"# {network} batch {batch} {mode} ({who}) FAILED: {e}", flush=True)
                        row[f"{who}_error"] = str(e)
                        continue
                    summaries = best or []
                    row[who] = _mean(s["samples_per_sec"] for s in summaries)
                    row[f"{who}_acc"] = _mean(s["validation_accuracy"] for s in summaries)
                    row[f"{who}_wall"] = round(wall, 2)
                    row[f"{who}_runs"] = summaries
                if row.get("ours") and row.get("mxnet"):
                    row["ratio"] = row["ours"] / row["mxnet"]
                rows.append(row)
                if a.json:
                    Path(a.json).write_text(json.dumps(rows, indent=1))
                print(f"# {network} batch {batch} {mode}: ours {_fmt(row.get('ours'), '.0f')}/s, "
                      f"MXNet {_fmt(row.get('mxnet'), '.0f')}/s", flush=True)
    print()
    print("| network | batch | kv-store (workers) | ours samples/s per worker | MXNet 1.9.1 | ours / MXNet "
          "| ours val. acc. | MXNet val. acc. |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        who = {"local": "local (1)", "dist_allreduce": "dist_allreduce (2, --tracker torch)"}.get(
            r["mode"], f"{r['mode']} (2 + 1 server)")
        ours_failed, mx_failed = "ours_error" in r, "mxnet_error" in r
        print(f"| {r['network']} | {r['batch']} | {who} | {_fmt(r.get('ours'), ',.0f', ours_failed)} "
              f"| {_fmt(r.get('mxnet'), ',.0f', mx_failed)} | {_fmt(r.get('ratio'), '.2f')} "
              f"| {_fmt(r.get('ours_acc'), '.4f', ours_failed)} | {_fmt(r.get('mxnet_acc'), '.4f', mx_failed)} |")
    print(f"\nload average before/after: {load0} / {_load()}")
    return 1 if any(k.endswith("_error") for r in rows for k in r) else 0


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def _mean(values: Any) -> float:
    vals = [float(v) for v in values if v is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def _fmt(value: float | None, spec: str, failed: bool = False) -> str:
    if value is None:
        return "failed" if failed else "-"
    return format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
