#!/usr/bin/env python3
"""Enter-to-all-running on the Kubernetes test cluster: ``--launcher k8s`` beside ``--launcher ssh``.

The test cluster (``scripts/setup-k8s.sh``: a real control plane, 3 nodes run by
``scripts/k8s_node.py``) gives each Pod a network namespace of its own on the bridge ``psk8s``
(10.202.8.0/24). For ssh, this script makes 3 host namespaces on the same bridge, one per node
(10.202.8.201-203, outside the nodes' Pod ranges, made by the node program's own ``make_netns``),
starts an sshd in each (port 22, a throw-away host key in a known_hosts file that the ssh client
verifies, a throw-away client key; the same ``sshd_config`` as ``tests/support/testbed.py``) and
removes them at the end. Both launchers run in this machine's namespace (10.202.8.1 on the
bridge). For P processes (``-n P -s 0``) every process runs a tiny shell script that writes the
time it started and waits until all P have; a run's time is the last stamp minus the moment the
launcher was started (Enter); the median over ``-r`` runs; k8s and ssh runs alternate, so that
load changes hit both alike. A k8s run ends when its Pods, Secret and Service are deleted (the
launcher waits for that), so every run starts on an empty namespace.

    .venv/bin/python scripts/bench_launch_k8s.py             # P = 4, 16; 5 runs each
    .venv/bin/python scripts/bench_launch_k8s.py -P 4 -r 3

Needs root, the kubernetes client in this interpreter and the built test cluster
(scripts/deps/80-k8s.sh); it starts the cluster if it is not running and leaves it running.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts"))

import k8s_node  # noqa: E402
from support import k8s_testbed, stamps  # noqa: E402
from support.testbed import NamespaceSSHDs  # noqa: E402

MODES = ("k8s", "ssh")
GATEWAY = "10.202.8.1"  # this machine on the bridge (scripts/setup-k8s.sh)
SUBNET = "10.202.8.0/24"
SSH_HOSTS = ("10.202.8.201", "10.202.8.202", "10.202.8.203")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-P", "--processes", type=int, nargs="+", default=[4, 16])
    ap.add_argument("-r", "--repeats", type=int, default=5)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (the finally blocks stop the sshds)
    why = k8s_testbed.k8s_problem()
    if why:
        print(f"no Kubernetes test cluster: {why}", file=sys.stderr)
        return 1
    r = k8s_testbed.setup_k8s("start")
    if r.returncode != 0:
        print(f"scripts/setup-k8s.sh start failed: {r.stderr[-2000:]}", file=sys.stderr)
        return 1
    kube = k8s_testbed.parse_exports(r.stdout)
    root = Path(tempfile.mkdtemp(prefix="pslaunch-bench-k8s-"))
    root.chmod(0o755)
    job = stamps.write_job(root)
    hostfile = root / "hosts"
    hostfile.write_text("".join(f"{ip}\n" for ip in SSH_HOSTS))
    load = os.getloadavg()
    rows = []
    ssh: NamespaceSSHDs | None = None
    try:
        names = []
        for i, ip in enumerate(SSH_HOSTS):
            names.append((f"kh{i}", k8s_node.make_netns(ip, 24, "psk8s", GATEWAY,
                                                          f"127.0.0.1\tlocalhost\n{ip}\tkh{i}\n"), ip))
        ssh = NamespaceSSHDs(names, root / "ssh", "10.202.8.*")
        for p in a.processes:
            common = ["-n", str(p), "-s", "0", "--kill-grace", "1", "--start-timeout", "240",
                      "--env", "BENCH_OUT", "--env", "BENCH_EXPECTED"]
            prefix = [sys.executable, "-m", "launcher"]
            runs = {
                "k8s": [*prefix, "--launcher", "k8s", "--k8s-namespace", kube["PSLAUNCH_K8S_NAMESPACE"],
                        "--k8s-image", "localhost/unused:bench", "--host-ip", GATEWAY, *common, str(job)],
                "ssh": [*prefix, "--launcher", "ssh", "-H", str(hostfile), "--env", f"DMLC_INTERFACE={SUBNET}",
                        *common, str(job)],
            }
            env = {m: dict(os.environ, PYTHONPATH=str(REPO)) for m in MODES}
            env["k8s"]["KUBECONFIG"] = kube["PSLAUNCH_K8S_KUBECONFIG"]
            env["ssh"]["HOME"] = str(ssh.home)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(a.repeats):  # interleaved
                for mode in MODES:
                    times[mode].append(stamps.time_to_all_running(runs[mode], env[mode], root, p))
            rows.append((p, {m: statistics.median(times[m]) for m in MODES}, times))
            print(json.dumps({"processes": p, "runs": times}), file=sys.stderr, flush=True)
    finally:
        if ssh is not None:
            ssh.close()
        for ip in SSH_HOSTS:
            k8s_node.remove_netns(ip)
        shutil.rmtree(root, ignore_errors=True)
    print(f"Enter-to-all-running on the 3-node Kubernetes test cluster, seconds, median of {a.repeats} (range); "
          f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print()
    print("| processes | k8s (one Pod each) | ssh (3 hosts on the same bridge) |")
    print("| ---: | --- | --- |")
    for p, med, times in rows:
        cell = {m: f"{med[m]:.2f} ({min(times[m]):.2f}-{max(times[m]):.2f})" for m in MODES}
        print(f"| {p} | {cell['k8s']} | {cell['ssh']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
