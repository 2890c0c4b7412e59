#!/usr/bin/env python3
"""Time from Enter to every rank of a PyTorch job joined: pslaunch --tracker torch beside torchrun.

For each world size K (``--sizes``, default 2,4,8) it runs, interleaved, ``--repeat`` times:

* ``python -m launcher -n K --tracker torch python THIS --worker DIR`` (local backend), and
* ``python -m torch.distributed.run --standalone --nproc-per-node K THIS --worker DIR``,

where each worker (this file with ``--worker``) calls ``init_process_group("gloo")`` (env://),
passes one ``barrier()``, writes ``time.time()`` and leaves. "All joined" is the last rank's
time minus the moment just before the launcher was started; "exit" is when the launcher
returned. The table shows the medians and the ratio torchrun / pslaunch (above 1: pslaunch is
faster), and ends with the load average: run it on a quiet machine, and read the ratios.

    python scripts/bench_ddp_start.py                  # 2, 4, 8 workers, 5 runs each
    python scripts/bench_ddp_start.py --sizes 2 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(out: str) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    joined = time.time()
    Path(out, f"{dist.get_rank()}.json").write_text(json.dumps({"joined": joined}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # (torch 2.13 with gloo sometimes aborts in the interpreter's finalization)


def run_once(kind: str, k: int, tmp: Path, timeout: float) -> tuple[float, float]:
    """``(seconds to all joined, seconds to the launcher's exit)`` of one run."""
    out = tmp / f"{kind}-{k}-{time.monotonic_ns()}"
    out.mkdir()
    me = str(Path(__file__).resolve())
    if kind == "pslaunch":
        argv = [sys.executable, "-m", "launcher", "-n", str(k), "--tracker", "torch", "--launcher", "local",
                sys.executable, me, "--worker", str(out)]
    else:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(k),
                me, "--worker", str(out)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    t0 = time.time()
    r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    done = time.time()
    if r.returncode != 0:
        raise RuntimeError(f"{kind} -n {k} exited {r.returncode}:\n" + "\n".join(r.stderr.splitlines()[-10:]))
    joined = [json.loads(f.read_text())["joined"] for f in out.glob("*.json")]
    if len(joined) != k:
        raise RuntimeError(f"{kind} -n {k}: {len(joined)} of {k} ranks joined")
    return max(joined) - t0, done - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.worker)
    sizes = [int(s) for s in a.sizes.split(",")]
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ddp-") as tmp:
        for rep in range(a.repeat):
            for k in sizes:
                for kind in ("pslaunch", "torchrun"):
                    joined, exited = run_once(kind, k, Path(tmp), a.timeout)
                    results.setdefault((kind, k), []).append((joined, exited))
                    print(f"[{rep + 1}/{a.repeat}] {kind} {k}: all joined {joined:.2f} s, exit {exited:.2f} s",
                          file=sys.stderr, flush=True)
    print(f"\nEnter to all ranks joined (init_process_group + barrier, gloo), local, median of {a.repeat}; "
          f"{os.cpu_count()} cores\n")
    print("| ranks | pslaunch --tracker torch: all joined / exit | torchrun --standalone: all joined / exit "
          "| all joined, torchrun / pslaunch |")
    print("| ---: | --- | --- | ---: |")
    rows = []
    for k in sizes:
        p = [statistics.median(x) for x in zip(*results[("pslaunch", k)])]
        t = [statistics.median(x) for x in zip(*results[("torchrun", k)])]
        rows.append({"ranks": k, "pslaunch": p, "torchrun": t})
        print(f"| {k} | {p[0]:.2f} / {p[1]:.2f} s | {t[0]:.2f} / {t[1]:.2f} s | {t[0] / p[0]:.2f}x |")
    print(f"\nload average before/after: {load0} / {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
