"""A torch.distributed (gloo) rank for the host-health tests (tests/integration/test_host_health.py).

It joins with ``init_process_group("gloo")`` (``env://``, from ``pslaunch --tracker torch``), checks
that an all-reduce of ones gives the world size, and writes ``<out>/a<ATTEMPT>-r<RANK>.json``: its
attempt, rank, world size, ``DMLC_NUM_WORKER``, the network namespace it ran in (which testbed
host), when it started and when it had joined (``time.time()``). In attempt 0 it then waits
``--hold`` seconds (the test takes a host's link down meanwhile), or with ``--fail RANK`` that rank
exits 3 at once (the job restarts); in later attempts it leaves at
once, with ``os._exit(0)`` after ``destroy_process_group()`` (torch's gloo exit race, see
tests/bin/gloo_exit_race.py, never aborts it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hold", type=float, default=0.0, help="attempt 0: seconds to wait after joining")
    ap.add_argument("--fail", type=int, default=None, metavar="RANK", help="attempt 0: this rank exits 3")
    a = ap.parse_args()
    started = time.time()
    attempt = int(os.environ.get("PSLAUNCH_ATTEMPT", "0"))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ones = torch.ones(1)
    dist.all_reduce(ones)
    if int(ones.item()) != world:
        print(f"rank {rank}: all-reduce gave {ones.item()}, not {world}", file=sys.stderr, flush=True)
        return 3
    record = {"attempt": attempt, "rank": rank, "world": world, "WORLD_SIZE": os.environ.get("WORLD_SIZE"),
              "DMLC_NUM_WORKER": os.environ.get("DMLC_NUM_WORKER"), "netns": os.readlink("/proc/self/ns/net"),
              "started": started, "joined": time.time(), "pid": os.getpid()}
    out = Path(a.out)
    tmp = out / f".a{attempt}-r{rank}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.replace(out / f"a{attempt}-r{rank}.json")
    print(f"rank {rank}/{world}: joined in attempt {attempt}", flush=True)
    if attempt == 0 and a.fail == rank:
        print(f"rank {rank}: failing with code 3 (--fail)", file=sys.stderr, flush=True)
        os._exit(3)
    if attempt == 0 and a.hold:
        end = time.monotonic() + a.hold
        while time.monotonic() < end:
            time.sleep(0.2)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
