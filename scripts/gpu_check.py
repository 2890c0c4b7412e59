#!/usr/bin/env python3
"""Check the trainer on this machine's GPUs: samples/s and accuracy of each GPU kv-store.

On a machine with CUDA it trains with ``scripts/train_mnist.py`` on GPU 0, and on GPUs 0
and 1 where there are two or more:

* ``--kv-store device``: one process, the devices' gradients summed on the first GPU;
* ``--kv-store dist_device_sync``: two workers and one server on the local launcher
  (``python -m launcher -n 2 -s 1``), each worker summing its GPUs before pushing;
* ``--kv-store dist_allreduce``, when this trainer has it (its ``--kv-store`` choices are
  read at run time): one worker per GPU under ``--tracker torch``, no servers.

and prints one table: samples/s per worker, the final validation accuracy, the seconds each
run took, and how it ended. Exit code 0 when every run succeeded, 1 when one failed, and 2
(with one line) on a machine without CUDA, where there is nothing to check.

Examples::

    python scripts/gpu_check.py                       # lenet, one full epoch per run
    python scripts/gpu_check.py --network mlp --num-epochs 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trainer.summary import read_summaries  # noqa: E402

TRAIN = REPO / "scripts" / "train_mnist.py"


@dataclass(frozen=True)
class Run:
    """One check: a kv-store on some GPUs, and the command that runs it."""

    kv_store: str
    gpus: str
    workers: int
    argv: tuple[str, ...]


def kv_store_choices() -> tuple[str, ...]:
    """The ``--kv-store`` values this checkout's train_mnist accepts."""
    from trainer.train_mnist import build_parser

    for action in build_parser()._actions:
        if "--kv-store" in action.option_strings:
            return tuple(action.choices or ())
    return ()


def plan(gpu_count: int, choices: tuple[str, ...], python: str, train_args: list[str]) -> list[Run]:
    """The runs for ``gpu_count`` GPUs (pure: the golden test checks it)."""
    runs = []
    launcher = [python, "-m", "launcher", "--launcher", "local"]
    for gpus in ["0", "0,1"][: 2 if gpu_count >= 2 else 1]:
        n = len(gpus.split(","))
        common = [str(TRAIN), "--gpus", gpus, *train_args]
        runs.append(Run("device", gpus, 1, (python, *common, "--kv-store", "device")))
        runs.append(Run("dist_device_sync", gpus, 2, (*launcher, "-n", "2", "-s", "1", python, *common,
                                                      "--kv-store", "dist_device_sync")))
        if "dist_allreduce" in choices:  # one worker per GPU: LOCAL_RANK picks it from --gpus
            runs.append(Run("dist_allreduce", gpus, n, (*launcher, "-n", str(n), "--tracker", "torch",
                                                        python, *common, "--kv-store", "dist_allreduce")))
    return runs


def cuda_devices() -> tuple[int, str]:
    """The number of CUDA devices torch sees, and a one-line description."""
    import torch

    if not torch.cuda.is_available():
        return 0, f"torch {torch.__version__} sees no CUDA device"
    n = torch.cuda.device_count()
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(n))
    return n, f"{n} CUDA device(s): {names} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--network", choices=("lenet", "mlp"), default="lenet")
    p.add_argument("--num-epochs", type=int, default=1)
    p.add_argument("--num-examples", type=int, default=60000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--data-dir", default=None, help="train_mnist's --data-dir")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    a = p.parse_args()
    count, described = cuda_devices()
    if not count:
        print(f"gpu_check: no CUDA here ({described}): nothing to check; run it on a machine with "
              "a GPU", file=sys.stderr)
        return 2
    train_args = ["--network", a.network, "--num-epochs", str(a.num_epochs), "--num-examples",
                  str(a.num_examples), "--batch-size", str(a.batch_size), "--disp-batches", "100000"]
    if a.data_dir:
        train_args += ["--data-dir", a.data_dir]
    runs = plan(count, kv_store_choices(), sys.executable, train_args)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), env.get("PYTHONPATH")) if x)
    print(f"# gpu_check: {described}; {a.network}, batch {a.batch_size}, {a.num_epochs} epoch(s) of "
          f"{a.num_examples} examples", flush=True)
    rows = []
    for run in runs:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(list(run.argv), capture_output=True, text=True, env=env, cwd=REPO,
                                  timeout=a.timeout)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
            summaries = read_summaries(proc.stdout)
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            status, summaries, tail = f"timed out ({a.timeout:g} s)", [], []
        seconds = time.perf_counter() - t0
        if status == "ok" and len(summaries) != run.workers:
            status = f"{len(summaries)} of {run.workers} summaries"
        speed = sum(s["samples_per_sec"] for s in summaries) / len(summaries) if summaries else None
        acc = sum(s["validation_accuracy"] for s in summaries) / len(summaries) if summaries else None
        rows.append((run, speed, acc, seconds, status))
        print(f"# {run.kv_store} on GPU {run.gpus}: {status}" + ("" if status == "ok" else
                                                               "\n#   " + "\n#   ".join(tail)), flush=True)
    print()
    print("| kv-store | GPUs | workers | samples/s per worker | val. acc. | seconds | status |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for run, speed, acc, seconds, status in rows:
        print(f"| {run.kv_store} | {run.gpus} | {run.workers} | "
              f"{'-' if speed is None else f'{speed:,.0f}'} | {'-' if acc is None else f'{acc:.4f}'} | "
              f"{seconds:.1f} | {status} |")
    return 0 if all(r[4] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
