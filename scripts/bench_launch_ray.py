#!/usr/bin/env python3
"""Enter-to-all-running on the Ray test cluster: ``--launcher ray`` beside ``--launcher ssh`` on the same nodes.

The Ray nodes (``scripts/setup-ray.sh``: network namespaces ``psray-rN``, 3 nodes) have no sshd;
this script starts one per node for the run (port 22 on the node's address, a throw-away host
key in a known_hosts file that the ssh client verifies, a throw-away client key; the same
``sshd_config`` as ``tests/support/testbed.py``) and stops them at the end. Both launchers run
as a driver on the head does: in the head's namespace. For P processes (``-n P -s 0``), every
process runs a tiny shell script that writes the time it started and waits until all P have;
the time of a run is the last stamp minus the moment the launcher was started (Enter), its
median over ``-r`` runs; ray and ssh runs alternate, so that load changes hit both alike.

The Ray cluster runs with ceil(P/3) logical CPUs per node for P processes (Ray's ``PACK``
fills the nodes; the ssh backend places P processes round-robin over the 3 hosts): the script
restarts it with ``PSLAUNCH_RAY_CPUS`` for each P, and afterwards with the 2 CPUs per node the
tests expect (or stops it, if it did not run before). Each running actor is about 80 MiB: 64
processes take about 6 GiB.

    .venv/bin/python scripts/bench_launch_ray.py             # P = 4, 16, 64; 5 runs each
    .venv/bin/python scripts/bench_launch_ray.py -P 4 -r 3

Needs root and ray in this interpreter (scripts/deps/65-ray.sh).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from support import ray_testbed, stamps  # noqa: E402
from support.testbed import NamespaceSSHDs  # noqa: E402

MODES = ("ray", "ssh")


def setup_ray(*args: str, cpus: int) -> None:
    r = subprocess.run([str(ray_testbed.SCRIPT), *args], env=dict(os.environ, PSLAUNCH_RAY_CPUS=str(cpus)),
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"scripts/setup-ray.sh {' '.join(args)} failed: {r.stderr[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-P", "--processes", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("-r", "--repeats", type=int, default=5)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (the finally blocks stop the sshds)
    why = ray_testbed.problem()
    if why:
        print(f"no Ray test cluster: {why}", file=sys.stderr)
        return 1
    ran_before = ray_testbed._running()
    root = Path(tempfile.mkdtemp(prefix="pslaunch-bench-ray-"))
    root.chmod(0o755)
    job = stamps.write_job(root)
    setup_ray("start", cpus=2)
    cluster = ray_testbed.load()
    hostfile = root / "hosts"
    hostfile.write_text("".join(f"{n.addr}\n" for n in cluster.nodes))
    load = os.getloadavg()
    rows = []
    ssh: NamespaceSSHDs | None = None
    try:
        for p in a.processes:
            cpus = max(2, math.ceil(p / len(cluster.nodes)))
            if ssh is not None:
                ssh.close()
            setup_ray("start", cpus=cpus)  # (restarts it when the CPUs differ, and kills all in the namespaces)
            ssh = NamespaceSSHDs([(n.name, n.netns, n.addr) for n in cluster.nodes], root / f"ssh-{p}", "10.202.5.*")
            common = ["-n", str(p), "-s", "0", "--kill-grace", "1", "--start-timeout", "240",
                      "--env", "BENCH_OUT", "--env", "BENCH_EXPECTED"]
            prefix = [*cluster.launcher_prefix(), sys.executable, "-m", "launcher"]
            runs = {
                "ray": [*prefix, "--launcher", "ray", "--ray-address", cluster.address, "--host-ip",
                        cluster.head.addr, *common, str(job)],
                "ssh": [*prefix, "--launcher", "ssh", "-H", str(hostfile), "--env",
                        f"DMLC_INTERFACE={cluster.subnet}", *common, str(job)],
            }
            env = {m: dict(os.environ, PYTHONPATH=str(REPO)) for m in MODES}
            env["ssh"]["HOME"] = str(ssh.home)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(a.repeats):  # interleaved
                for mode in MODES:
                    times[mode].append(stamps.time_to_all_running(runs[mode], env[mode], root, p))
            rows.append((p, cpus, {m: statistics.median(times[m]) for m in MODES}, times))
            print(json.dumps({"processes": p, "cpus_per_node": cpus, "runs": times}), file=sys.stderr, flush=True)
    finally:
        if ssh is not None:
            ssh.close()
        shutil.rmtree(root, ignore_errors=True)
        if ran_before:
            setup_ray("start", cpus=2)
        else:
            setup_ray("stop", cpus=2)
    print(f"Enter-to-all-running on the 3-node Ray test cluster, seconds, median of {a.repeats} (range); "
          f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print()
    print("| processes | ray | ssh |")
    print("| ---: | --- | --- |")
    for p, _, med, times in rows:
        cell = {m: f"{med[m]:.2f} ({min(times[m]):.2f}-{max(times[m]):.2f})" for m in MODES}
        print(f"| {p} | {cell['ray']} | {cell['ssh']} |")
    print()
    print("Ray's logical CPUs per node: " + ", ".join(f"{cpus} for {p}" for p, cpus, _, _ in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
