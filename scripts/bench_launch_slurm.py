#!/usr/bin/env python3
"""Launch latency on the Slurm test cluster: ``--launcher slurm`` beside ``--launcher ssh`` on the same nodes.

The Slurm nodes (``scripts/setup-slurm.sh``: network namespaces ``psslurm-sN``) have no sshd;
this script starts one per node for the run (port 22 on the node's A address, a throw-away
host key and client key; the same ``sshd_config`` as ``tests/support/testbed.py``) and stops
them at the end. For H nodes and P processes per node, a job of N = H*P/2 workers, N servers
and the scheduler runs a tiny shell script that writes the time it started; the scheduler
(a short Python program, on this host) listens until all of them have. Three ways:

* **ssh**: ``--launcher ssh`` with a hostfile of the H nodes' addresses;
* **slurm, in allocation**: ``--launcher slurm`` with ``SLURM_JOB_ID`` of an allocation of
  the H nodes (made once, before the timing);
* **slurm, new allocation**: ``--launcher slurm`` making (and releasing) its own allocation
  of the H nodes every run (``--slurm-nodes H --slurm-args --nodelist=...``).

Columns: until every process runs ("all running", from the moment the launcher was started)
and until the launcher has exited (including, for a new allocation, its release); median of
``-r`` runs. With ``--failure``: worker 0 exits 3 as soon as it runs, the rest sleep; the
seconds from its exit to the launcher's exit (all processes stopped, allocation released).

    .venv/bin/python scripts/bench_launch_slurm.py            # H = 2, 4; P = 2, 4; 5 runs each
    .venv/bin/python scripts/bench_launch_slurm.py -H 4 -P 2 -r 3 --failure

Needs root and the running test cluster (``eval "$(scripts/setup-slurm.sh)"``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from support import slurm_testbed  # noqa: E402
from support.testbed import NamespaceSSHDs  # noqa: E402

SCHEDULER_PY = """
import os, socket, sys, time
out, expected = sys.argv[1], int(sys.argv[2])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((os.environ["DMLC_PS_ROOT_URI"], int(os.environ["DMLC_PS_ROOT_PORT"])))
s.listen(128)
end = time.time() + 60
while time.time() < end and len([f for f in os.listdir(out) if not f.startswith(".")]) < expected:
    time.sleep(0.005)
"""

JOB_SH = """#!/bin/sh
if [ "$DMLC_ROLE" = scheduler ]; then
    exec "$BENCH_PYTHON" -S "$BENCH_DIR/sched.py" "$BENCH_OUT" "$BENCH_EXPECTED"
fi
me="$DMLC_ROLE-$DMLC_TASK_ID"
date +%s.%N > "$BENCH_OUT/.$me" && mv "$BENCH_OUT/.$me" "$BENCH_OUT/$me"
if [ "$BENCH_FAIL" = 1 ]; then
    if [ "$DMLC_ROLE-$DMLC_TASK_ID" = worker-0 ]; then  # once every process runs
        while [ "$(ls "$BENCH_OUT" | wc -l)" -lt "$BENCH_EXPECTED" ]; do sleep 0.01; done
        date +%s.%N > "$BENCH_OUT/.failed"
        exit 3
    fi
    exec sleep 60
fi
"""

MODES = ("ssh", "slurm, in allocation", "slurm, new allocation")


def one_run(argv: list[str], env: dict[str, str], root: Path, expected: int, failure: bool) -> tuple[float, float]:
    """``expected``: servers and workers (the scheduler waits for their stamps; the
    scheduler's listing skips the dot files that are still being written).

    (all running, launcher exited) seconds after the launcher started; with ``failure``,
    (all running, the failing worker's exit to the launcher's exit)."""
    out = Path(tempfile.mkdtemp(dir=root))
    env = dict(env, BENCH_OUT=str(out), BENCH_EXPECTED=str(expected), BENCH_FAIL="1" if failure else "0")
    t0 = time.time()
    r = subprocess.run(argv, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=180)
    t_end = time.time()
    if r.returncode != (3 if failure else 0):
        raise RuntimeError(f"{' '.join(argv[:6])}... exited {r.returncode}: {r.stderr[-2000:]}")
    stamps = {p.name: float(p.read_text()) for p in out.iterdir() if not p.name.startswith(".")}
    if len(stamps) != expected:
        raise RuntimeError(f"{len(stamps)} of {expected} processes ran: {r.stderr[-2000:]}")
    failed = float((out / ".failed").read_text()) if failure else t0
    shutil.rmtree(out, ignore_errors=True)
    return max(stamps.values()) - t0, t_end - failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-H", "--nodes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("-P", "--per-node", type=int, nargs="+", default=[2, 4])
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("--failure", action="store_true", help="time from a worker's failure to the launcher's exit")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (the finally blocks stop the sshds)
    why = slurm_testbed.problem()
    if why:
        print(f"no Slurm test cluster: {why}", file=sys.stderr)
        return 1
    cluster = slurm_testbed.load()
    root = Path(tempfile.mkdtemp(prefix="pslaunch-bench-slurm-"))
    (root / "sched.py").write_text(SCHEDULER_PY)
    job = root / "job.sh"
    job.write_text(JOB_SH)
    job.chmod(0o755)
    ssh = NamespaceSSHDs([(n.name, n.netns, n.addr_a) for n in cluster.nodes], root / "ssh", "10.202.*")
    load = os.getloadavg()
    rows = []
    try:
        for h in a.nodes:
            nodes = cluster.nodes[:h]
            hostfile = root / f"hosts{h}"
            hostfile.write_text("".join(f"{n.addr_a}\n" for n in nodes))
            names = ",".join(n.name for n in nodes)
            for p in a.per_node:
                n = max(1, h * p // 2)
                common = ["-n", str(n), "-s", str(n), "--kill-grace", "1", "--start-timeout", "120",
                          "--env", f"DMLC_INTERFACE={cluster.subnet_a}",
                          *[x for v in ("BENCH_OUT", "BENCH_DIR", "BENCH_EXPECTED", "BENCH_PYTHON", "BENCH_FAIL")
                            for x in ("--env", v)]]
                base_env = dict(os.environ, BENCH_DIR=str(root), BENCH_PYTHON=sys.executable)
                base_env.pop("SLURM_JOB_ID", None)
                name = f"bench-{os.getpid()}"
                runs = {
                    "ssh": [sys.executable, "-m", "launcher", "--launcher", "ssh", "-H", str(hostfile), *common,
                            str(job)],
                    "slurm, in allocation": [sys.executable, "-m", "launcher", "--launcher", "slurm", *common,
                                             str(job)],
                    "slurm, new allocation": [sys.executable, "-m", "launcher", "--launcher", "slurm", "--jobname",
                                              name, "--slurm-nodes", str(h), "--slurm-args", f"--nodelist={names}",
                                              *common, str(job)],
                }
                times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
                for _ in range(a.repeats):  # interleaved, so that load changes hit every mode alike
                    for mode in MODES:
                        env = dict(base_env)
                        alloc = ""
                        if mode == "ssh":
                            env["HOME"] = str(ssh.home)
                        elif mode == "slurm, in allocation":  # made before the clock starts, gone after
                            alloc = env["SLURM_JOB_ID"] = cluster.salloc(h, name, f"--nodelist={names}")
                        try:
                            times[mode].append(one_run(runs[mode], env, root, 2 * n, a.failure))
                        finally:
                            if alloc:
                                cluster.scancel(alloc)
                                while cluster.job_state(alloc):
                                    time.sleep(0.1)
                rows.append((h, p, 2 * n + 1, {m: (statistics.median(t[0] for t in times[m]),
                                                   statistics.median(t[1] for t in times[m])) for m in MODES}))
                print(json.dumps({"nodes": h, "per_node": p, "runs": times}), file=sys.stderr)
    finally:
        ssh.close()
        shutil.rmtree(root, ignore_errors=True)
    second = "failure -> exit" if a.failure else "exit"
    print(f"launch latency on the Slurm test cluster, median of {a.repeats}; load average before: "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; seconds (all running / {second})")
    print()
    print("| nodes | per node | processes | " + " | ".join(MODES) + " |")
    print("| ---: | ---: | ---: | " + " | ".join("---" for _ in MODES) + " |")
    for h, p, procs, med in rows:
        print(f"| {h} | {p} | {procs} | " + " | ".join(f"{med[m][0]:.2f} / {med[m][1]:.2f}" for m in MODES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
