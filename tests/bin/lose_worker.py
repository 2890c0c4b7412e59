"""Test helper run under the launcher: a parameter-server job that loses one worker.

Every process writes ``OUT/<name>.<k>.json`` (``k``: its ``PSLAUNCH_REPLACEMENT``, 0 for the
first) with its pid, node and the variables that say which process it is. Then:

* the scheduler listens on the root port; it and the servers wait until every worker is done
  (``OUT/worker-R.done``), at most ``--wait`` seconds (then exit 1: a replacement never came);
* the worker named by ``--lose`` (``worker-1``) SIGKILLs itself ``--after`` seconds after it
  started, as long as it is one of the first ``--times`` of its line (its ``PSLAUNCH_REPLACEMENT``
  is below ``--times``); every other worker writes its ``.done`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

# The contract's names, spelled here on purpose: this program stands for any user program.
NAMES = ("DMLC_ROLE", "DMLC_TASK_ID", "DMLC_NUM_WORKER", "PSLAUNCH_REPLACEMENT", "PSLAUNCH_PROCESS",
         "PSLAUNCH_ATTEMPT", "PSLAUNCH_RESTART_SCOPE", "SLURMD_NODENAME", "SLURM_STEP_ID", "SLURM_JOB_ID",
         "DMLC_NODE_HOST")


def name_of(env: dict) -> str:
    role = env.get("DMLC_ROLE", "worker")
    if role == "scheduler":
        return "scheduler"
    task = int(env.get("DMLC_TASK_ID", "0"))
    nw = int(env.get("DMLC_NUM_WORKER", "0"))
    return f"server-{task - nw}" if role == "server" else f"worker-{task}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--lose", default="worker-1", metavar="worker-R")
    ap.add_argument("--times", type=int, default=1, help="the first N of the worker's line kill themselves")
    ap.add_argument("--after", type=float, default=1.0, metavar="SECONDS")
    ap.add_argument("--wait", type=float, default=120.0, metavar="SECONDS")
    a = ap.parse_args()
    env = os.environ
    me = name_of(dict(env))
    k = int(env.get("PSLAUNCH_REPLACEMENT") or 0)
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    record = {"name": me, "replacement": k, "pid": os.getpid(), "host": socket.gethostname(), "netns": netns,
              "time": time.time(), "env": {n: env[n] for n in NAMES if n in env}}
    tmp = os.path.join(a.out, f".{me}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(a.out, f"{me}.{k}.json"))
    print(f"{me} runs (replacement {k}, pid {os.getpid()})", flush=True)
    if me == "scheduler" or me.startswith("server-"):
        listener = None
        if me == "scheduler":
            listener = socket.socket()
            listener.bind((env["DMLC_PS_ROOT_URI"], int(env["DMLC_PS_ROOT_PORT"])))
            listener.listen(64)
        workers = int(env["DMLC_NUM_WORKER"])
        end = time.monotonic() + a.wait
        while time.monotonic() < end:
            if all(os.path.exists(os.path.join(a.out, f"worker-{r}.done")) for r in range(workers)):
                print(f"{me}: every worker is done", flush=True)
                return 0
            time.sleep(0.1)
        print(f"{me}: the workers were not done after {a.wait:g}s", file=sys.stderr, flush=True)
        return 1
    time.sleep(a.after)
    if me == a.lose and k < a.times:
        print(f"{me} kills itself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    open(os.path.join(a.out, f"{me}.done"), "w").close()
    print(f"{me} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
