#!/usr/bin/env python3
"""--launcher mpi output: are lines whole and labelled, and how long does a flood take?

Every process of a ``-n N -s S`` job (the scheduler too) prints ``L`` lines of
``W`` characters as fast as it can, each line naming its sender. The table
shows, per mpirun found (Open MPI, MPICH) and line width, the lines that
arrived broken or under the wrong label (0 is the only right answer) and the
job's wall time, median of ``-r`` runs.

mpirun itself cannot carry such output: Open MPI 4.1 forwards each rank's
output in chunks of its own size, and chunks of different ranks interleave in
the middle of lines. The rank wrappers send their output on their own
connections to the launcher instead (docs/mpi.md); run this from an older
checkout (``--repo``) to see the difference.

    .venv/bin/python scripts/bench_mpi_output.py
    .venv/bin/python scripts/bench_mpi_output.py -n 4 -s 2 --lines 2000 --widths 80,5000 -r 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUNS = {"Open MPI": ("PSLAUNCH_MPIRUN_OPENMPI", "/usr/bin/mpirun.openmpi"),
           "MPICH": ("PSLAUNCH_MPIRUN_MPICH", "/usr/bin/mpirun.mpich")}

FLOOD = ("import os, sys\n"
         "who = os.environ['DMLC_ROLE'] + os.environ.get('DMLC_TASK_ID', '')\n"
         "lines, width = int(sys.argv[1]), int(sys.argv[2])\n"
         "out = sys.stdout\n"
         "for i in range(lines):\n"
         "    out.write(f'{who}:{i}:' + who[0] * width + '\\n')\n")

LINE_RE = re.compile(r"\[(scheduler|server \d+|worker \d+)\] (scheduler|server\d+|worker\d+):(\d+):([a-z]+)")


def count_lines(stdout: str, num_workers: int, width: int) -> tuple[int, int]:
    """(lines that are whole and correctly labelled, all other lines)."""
    good = bad = 0
    for line in stdout.splitlines():
        m = LINE_RE.fullmatch(line)
        ok = False
        if m:
            label, who, body = m.group(1), m.group(2), m.group(4)
            if who == "scheduler":
                expected_label = "scheduler"
            elif who.startswith("worker"):
                expected_label = f"worker {who[6:]}"
            else:  # servers' task ids follow the workers'
                expected_label = f"server {int(who[6:]) - num_workers}"
            ok = label == expected_label and body == who[0] * width
        good, bad = (good + 1, bad) if ok else (good, bad + 1)
    return good, bad


def run_once(mpirun: str, args: argparse.Namespace, width: int) -> tuple[float, int, int]:
    argv = [sys.executable, "-m", "launcher", "--launcher", "mpi", "--mpirun", mpirun, "-n", str(args.num_workers),
            "-s", str(args.num_servers), sys.executable, "-c", FLOOD, str(args.lines), str(width)]
    t0 = time.monotonic()
    r = subprocess.run(argv, cwd=args.repo, capture_output=True, text=True, errors="replace", timeout=600)
    took = time.monotonic() - t0
    good, _ = count_lines(r.stdout, args.num_workers, width)
    return took, good, r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", "--num-workers", type=int, default=4)
    ap.add_argument("-s", "--num-servers", type=int, default=2)
    ap.add_argument("--lines", type=int, default=2000, help="lines per process (default 2000)")
    ap.add_argument("--widths", default="80,5000", help="line widths, comma-separated (default 80,5000)")
    ap.add_argument("-r", "--repeat", type=int, default=3)
    ap.add_argument("--repo", default=REPO, help="the checkout whose launcher runs (default: this one)")
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    found = {name: os.environ.get(var) or path for name, (var, path) in MPIRUNS.items()}
    found = {name: path for name, path in found.items() if os.access(path, os.X_OK)}
    if not found:
        print("no mpirun found (scripts/deps/40-mpi.sh installs Open MPI and MPICH)", file=sys.stderr)
        return 1
    procs = 1 + args.num_workers + args.num_servers
    print(f"-n {args.num_workers} -s {args.num_servers}: {procs} processes x {args.lines} lines, "
          f"median of {args.repeat} runs, launcher from {args.repo}")
    print()
    print("| mpirun | width | lines expected | not whole or mislabelled (each run) | wall time (median) |")
    print("| --- | ---: | ---: | --- | ---: |")
    failed = False
    for name, path in found.items():
        for width in widths:
            times, bads = [], []
            for _ in range(args.repeat):
                took, good, code = run_once(path, args, width)
                failed |= code != 0
                times.append(took)
                bads.append(procs * args.lines - good)  # lines that did not arrive whole, where they belong
            print(f"| {name} | {width:,} | {procs * args.lines:,} | {', '.join(f'{b:,}' for b in bads)} | "
                  f"{statistics.median(times):.2f} s |", flush=True)
    if failed:
        print("\nsome jobs exited non-zero", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
