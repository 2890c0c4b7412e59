"""Test helper run under the launcher: a training job's output, without the training.

Each worker prints, every ``--interval`` seconds, MXNet's Speedometer line on stderr (as MXNet's
logging does: ``Epoch[0] Batch [10-20]\\tSpeed: 1234.50 samples/sec\\taccuracy=0.500000``; its
speed differs per rank) and a numbered, timestamped line on stdout
(``tick K of worker R at EPOCH_SECONDS``: a reader can tell a lost line and how late one came).
Worker 3 alone also prints ``zebra-<3 * 7919>`` once, a string in no other output and not in the
command line (a search must find it once). The scheduler listens where the launcher waits for it;
servers wait. With ``--pid-dir``, each process writes ``DIR/<name>.pid`` (a test kills it);
``--lines`` stops a worker after that many ticks (default: after ``--seconds``); ``--fail R:CODE``
makes worker R exit with CODE after its ticks.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import sys
import time


def name_of(env: dict) -> str:
    role = env.get("DMLC_ROLE", "worker")
    if role == "scheduler":
        return "scheduler"
    task = int(env.get("DMLC_TASK_ID", "0"))
    return f"server-{task - int(env.get('DMLC_NUM_WORKER', '0'))}" if role == "server" else f"worker-{task}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--lines", type=int, default=0, help="ticks per worker (0: as many as --seconds allow)")
    ap.add_argument("--batch", type=int, default=10, help="batches per Speedometer line")
    ap.add_argument("--pid-dir")
    ap.add_argument("--fail", default="", metavar="RANK:CODE")
    a = ap.parse_args()
    env = dict(os.environ)
    name = name_of(env)
    if a.pid_dir:
        with open(os.path.join(a.pid_dir, name + ".pid"), "w") as f:
            f.write(str(os.getpid()))
    role = env.get("DMLC_ROLE", "worker")
    if role == "scheduler":
        s = socket.socket()
        s.bind((env["DMLC_PS_ROOT_URI"], int(env["DMLC_PS_ROOT_PORT"])))
        s.listen(64)
        time.sleep(a.seconds + 1)
        return 0
    if role == "server":
        time.sleep(a.seconds + 0.5)
        return 0
    rank = int(env.get("DMLC_TASK_ID", "0"))
    if rank == 3:
        print(f"worker {rank} found the zebra-{rank * 7919}", flush=True)
    n = a.lines or max(1, int(a.seconds / a.interval))
    start = time.monotonic()
    for k in range(1, n + 1):
        speed = 1000 + 150 * rank + 80 * math.sin(k / 4 + rank)
        print(f"Epoch[0] Batch [{(k - 1) * a.batch}-{k * a.batch}]\tSpeed: {speed:.2f} samples/sec"
              f"\taccuracy={min(0.99, 0.1 + k / (n + 1)):.6f}", file=sys.stderr, flush=True)
        print(f"tick {k} of worker {rank} at {time.time():.6f}", flush=True)
        delay = start + k * a.interval - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    print(f"Epoch[0] Validation-accuracy={min(0.99, 0.1 + n / (n + 1)):.6f}", file=sys.stderr, flush=True)
    if a.fail and int(a.fail.split(":")[0]) == rank:
        print(f"worker {rank} gives up: the loss is NaN", file=sys.stderr, flush=True)
        return int(a.fail.split(":")[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
