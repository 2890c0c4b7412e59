#!/usr/bin/env python3
"""Launch latency: from Enter to every process running, against the number of processes.

For N workers and N servers (so 2N+1 processes with the scheduler), each
process writes the time it started running; the latency is the latest of
those times minus the moment the launcher was started. The job's program is
a tiny shell script; the scheduler role is a short Python program that
listens on the root port (as a real scheduler does) until every other
process has started.

Compared side by side with the predecessor (MXNet 1.9.1's tools/launch.py and
its dmlc tracker, local mode) when an MXNet venv is available
(``--mxnet-python``, default ``.venv-mxnet/bin/python``). The pinned dmlc
tracker crashes on Python >= 3.9 (``Thread.isAlive``); the benchmark patches
that one attribute in memory so the predecessor can run at all.

    .venv/bin/python scripts/bench_launch.py                # N = 1, 4, 16, 32, 64
    .venv/bin/python scripts/bench_launch.py --first-batch  # and Enter to the first training batch
    .venv/bin/python scripts/bench_launch.py -N 4 -r 10
    .venv/bin/python scripts/bench_launch.py --launcher ssh   # 2 and 4 hosts x 1, 4, 16 per host (root)
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import pscontract as pc  # noqa: E402

SCHEDULER_PY = f"""
import os, socket, sys, time
out, expected = sys.argv[1], int(sys.argv[2])
with open(os.path.join(out, "scheduler"), "w") as f:
    f.write(repr(time.time()))
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((os.environ["{pc.ROOT_URI}"], int(os.environ["{pc.ROOT_PORT}"])))
s.listen(128)
end = time.time() + 60
while time.time() < end and len(os.listdir(out)) < expected:
    time.sleep(0.005)
"""

JOB_SH = f"""#!/bin/sh
# every role runs this; the scheduler listens until all others have started
if [ "${pc.ROLE}" = scheduler ]; then
    exec "$BENCH_PYTHON" -S "$BENCH_DIR/sched.py" "$BENCH_OUT" "$BENCH_EXPECTED"
fi
date +%s.%N > "$BENCH_OUT/${pc.ROLE}-${pc.TASK_ID}"
"""


def _prepare(root: str) -> str:
    with open(os.path.join(root, "sched.py"), "w") as f:
        f.write(SCHEDULER_PY)
    job = os.path.join(root, "job.sh")
    with open(job, "w") as f:
        f.write(JOB_SH)
    os.chmod(job, 0o755)
    return job


def _one_run(argv: list[str], root: str, n: int, env_extra: dict[str, str]) -> tuple[float, float, float]:
    """(first process running, all running, launcher finished), seconds after start."""
    out = tempfile.mkdtemp(dir=root)
    expected = 2 * n + 1
    env = dict(os.environ, BENCH_OUT=out, BENCH_DIR=root, BENCH_EXPECTED=str(expected),
               BENCH_PYTHON=sys.executable, **env_extra)
    t0 = time.time()
    proc = subprocess.run(argv, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          timeout=120)
    t_end = time.time()
    stamps = []
    for name in os.listdir(out):
        with open(os.path.join(out, name)) as f:
            stamps.append(float(f.read().strip()))
    shutil.rmtree(out, ignore_errors=True)
    if len(stamps) != expected:
        raise RuntimeError(f"{argv[0]}: only {len(stamps)} of {expected} processes ran "
                           f"(exit {proc.returncode}): {proc.stderr.decode(errors='replace')[-500:]}")
    return min(stamps) - t0, max(stamps) - t0, t_end - t0


def bench_pslaunch(job: str, root: str, n: int) -> tuple[float, float, float]:
    argv = [sys.executable, "-m", "launcher", "-n", str(n), "-s", str(n), "--launcher", "local",
            "--kill-grace", "2", job]
    return _one_run(argv, root, n, {"PYTHONPATH": REPO})


def bench_dmlc(mxnet_python: str, job: str, root: str, n: int) -> tuple[float, float, float]:
    shim = ("import threading, runpy, sys, os, importlib.util; threading.Thread.isAlive = threading.Thread.is_alive; "
            "spec = importlib.util.find_spec('mxnet'); "
            "path = os.path.join(spec.submodule_search_locations[0], 'tools', 'launch.py'); "
            "sys.argv = ['launch.py'] + sys.argv[1:]; runpy.run_path(path, run_name='__main__')")
    argv = [mxnet_python, "-c", shim, "-n", str(n), "-s", str(n), "--launcher", "local", job]
    return _one_run(argv, root, n, {})


FAIL_SH = f"""#!/bin/sh
# worker 0 fails with code 3 after a moment; everything else waits to be stopped
if [ "${pc.ROLE}" = scheduler ]; then
    exec "$BENCH_PYTHON" -S "$BENCH_DIR/sched.py" "$BENCH_OUT" 1000
fi
if [ "${pc.ROLE}" = worker ] && [ "${pc.TASK_ID}" = 0 ]; then
    sleep 0.5; date +%s.%N > "$BENCH_OUT/failed"; exit 3
fi
exec sleep 60
"""


def bench_failure(root: str, n: int, repeats: int) -> list[float]:
    """Seconds from worker 0's exit (code 3) to the launcher's exit, with 2n other processes running."""
    job = os.path.join(root, "fail.sh")
    with open(job, "w") as f:
        f.write(FAIL_SH)
    os.chmod(job, 0o755)
    times = []
    for _ in range(repeats):
        out = tempfile.mkdtemp(dir=root)
        env = dict(os.environ, BENCH_OUT=out, BENCH_DIR=root, BENCH_PYTHON=sys.executable, PYTHONPATH=REPO)
        argv = [sys.executable, "-m", "launcher", "-n", str(n), "-s", str(n), "--kill-grace", "10", job]
        proc = subprocess.run(argv, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=120)
        t_end = time.time()
        if proc.returncode != 3:
            raise RuntimeError(f"expected exit code 3, got {proc.returncode}")
        with open(os.path.join(out, "failed")) as f:
            times.append(t_end - float(f.read()))
        shutil.rmtree(out, ignore_errors=True)
    return times


# --- Enter to the first training batch ----------------------------------------------------------------

FIRST_BATCH = re.compile(r"Epoch\[0\] Batch \[")
TRAIN_ARGS = ["--network", "mlp", "--kv-store", "dist_sync", "--num-epochs", "1", "--disp-batches", "1"]


def _dmlc_argv(mxnet_python: str, *args: str) -> list[str]:
    """MXNet 1.9.1's tools/launch.py (its dmlc tracker; ``Thread.isAlive`` patched for Python 3.9+)."""
    shim = ("import threading, runpy, sys, os, importlib.util; threading.Thread.isAlive = threading.Thread.is_alive; "
            "spec = importlib.util.find_spec('mxnet'); "
            "path = os.path.join(spec.submodule_search_locations[0], 'tools', 'launch.py'); "
            "sys.argv = ['launch.py'] + sys.argv[1:]; runpy.run_path(path, run_name='__main__')")
    return [mxnet_python, "-c", shim, *args]


def first_batch(argv: list[str], cwd: str, env: dict[str, str], timeout: float = 300) -> float:
    """Seconds from starting ``argv`` until a worker prints its first Speedometer line; then the job
    is stopped (the launcher's whole session: launch.py never stops its processes itself)."""
    t0 = time.time()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    assert proc.stdout is not None
    tail: list[bytes] = []
    try:
        end = t0 + timeout
        for line in proc.stdout:
            if FIRST_BATCH.search(line.decode(errors="replace")):
                return time.time() - t0
            tail = (tail + [line])[-20:]
            if time.time() > end:
                break
        raise RuntimeError(f"{argv[0]}: no training batch (exit {proc.poll()}): "
                           + b"".join(tail).decode(errors="replace")[-1500:])
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)  # launch.py and its children; pslaunch stops its own
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=15)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.stdout.close()
        _kill_leftovers(env.get("BENCH_MARK", ""))


def _kill_leftovers(mark: str) -> None:
    """Whatever a stopped job left (launch.py's ps-lite processes outlive it): found by the mark
    every process of the run inherited."""
    if not mark:
        return
    needle = f"BENCH_MARK={mark}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        os.kill(int(entry), signal.SIGKILL)
            except OSError:
                continue


#: the launchers of the first-batch rows: pslaunch as is, pslaunch with its builtin ps-lite
#: scheduler (MXNet's program only: our trainer's scheduler role is its own KVStore's), launch.py
BUILTIN = "pslaunch --scheduler builtin"


def bench_first_batch(a: argparse.Namespace, compare: bool) -> None:
    """Enter to the first batch of ``-n 2 -s 1`` dist_sync: MXNet's example (or its stand-in) and
    our trainer, each under pslaunch and under launch.py (our trainer's dist kvstore wants the job
    secret, which launch.py passes on from its environment), and MXNet's also under pslaunch's
    builtin scheduler."""
    example = os.environ.get("PSLAUNCH_MXNET_EXAMPLE")
    rows: dict[str, dict[str, list[float]]] = {}
    programs: dict[str, tuple[str, list[str]]] = {}
    workdir = tempfile.mkdtemp(prefix="bench-first-batch-")
    try:
        if compare:
            if example:
                shutil.copytree(example, os.path.join(workdir, "ex"),
                                ignore=shutil.ignore_patterns("data", "*.pyc", "__pycache__"))
                subprocess.run([sys.executable, "-m", "trainer.data",
                                "--export-idx", os.path.join(workdir, "ex", "data")],
                               check=True, capture_output=True, timeout=300, cwd=REPO)
                mx_cwd, mx_prog, mx_name = os.path.join(workdir, "ex"), ["train_mnist.py"], "MXNet's train_mnist.py"
            else:
                mx_cwd, mx_prog = workdir, [os.path.join(REPO, "scripts", "bench_train_mxnet.py")]
                mx_name = "MXNet (bench_train_mxnet.py)"
            programs[mx_name] = (mx_cwd, [a.mxnet_python, *mx_prog, *TRAIN_ARGS])
            rows[mx_name] = {"pslaunch": [], BUILTIN: [], "launch.py": []}
        programs["our trainer"] = (REPO, [sys.executable, os.path.join(REPO, "trainer", "train_mnist.py"), *TRAIN_ARGS])
        rows["our trainer"] = {"pslaunch": [], "launch.py": []} if compare else {"pslaunch": []}
        # One program at a time (a run of one leaves the next a different machine: caches, memory),
        # after an uncounted warm-up round (the first run of a fresh copy pays for cold caches:
        # twice the CPU in its workers); its launchers interleaved, each round in the other order.
        for name, sides in rows.items():
            cwd, prog = programs[name]
            for i in range(-1, a.repeats):
                for side in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
                    env = dict(os.environ, PYTHONPATH=REPO, BENCH_MARK=f"{os.getpid()}-{i}-{side}")
                    if side == "launch.py":
                        env[pc.SECRET] = secrets.token_hex(32)  # (pslaunch makes its own per job)
                        argv = _dmlc_argv(a.mxnet_python, "-n", "2", "-s", "1", "--launcher", "local", *prog)
                    else:
                        builtin = ["--scheduler", "builtin"] if side == BUILTIN else []
                        argv = [sys.executable, "-m", "launcher", *builtin, "-n", "2", "-s", "1", *prog]
                    took = first_batch(argv, cwd, env)
                    if i >= 0:
                        rows[name][side].append(took)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nEnter to the first training batch (-n 2 -s 1, dist_sync, mlp, the first Speedometer line of a "
          f"worker), median of {a.repeats}; the launchers take turns, so each round's ratio compares runs "
          "a few seconds apart (paired: the machine's slow spells hit both)")
    print(f"{'program':<30} | {'launcher':<28} | {'time':>7} | {'launch.py':>9} | {'ratio':>6} | "
          f"{'paired ratio, median (quartiles)':>32} | {'rounds ahead':>12}")
    for name, sides in rows.items():
        for side, times in sides.items():
            if side == "launch.py":
                continue
            ours_s = statistics.median(times)
            line = f"{name:<30} | {side:<28} | {ours_s:>6.2f}s |"
            if "launch.py" in sides:
                theirs = statistics.median(sides["launch.py"])
                mid, lo, hi, ahead = paired_ratios(times, sides["launch.py"])
                paired, rounds = f"{mid:.2f}x ({lo:.2f}-{hi:.2f})", f"{ahead} of {len(times)}"
                line += f" {theirs:>8.2f}s | {theirs / ours_s:>5.2f}x | {paired:>32} | {rounds:>12}"
            else:
                line += f" {'-':>9} | {'-':>6} | {'-':>32} | {'-':>12}"
            print(line, flush=True)


def paired_ratios(ours: list[float], theirs: list[float]) -> tuple[float, float, float, int]:
    """Round by round, ``theirs / ours`` (above 1: we were faster): the median, the lower and upper
    quartiles, and in how many rounds we were at least as fast."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError("paired_ratios: one time per round on each side")
    ratios = sorted(t / o for o, t in zip(ours, theirs))
    if len(ratios) == 1:
        lo = hi = ratios[0]
    else:
        lo, _, hi = statistics.quantiles(ratios, n=4, method="inclusive")
    return statistics.median(ratios), lo, hi, sum(r >= 1.0 for r in ratios)


def _mxnet_tools_available(python: str) -> bool:
    try:
        return subprocess.run([python, "-c", "import importlib.util as u, dmlc_tracker; assert u.find_spec('mxnet')"],
                              capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-N", "--workers", type=int, nargs="+", default=[1, 4, 16, 32, 64],
                    help="worker counts (servers = workers)")
    ap.add_argument("-r", "--repeats", type=int, default=5)
    ap.add_argument("--mxnet-python", default=os.environ.get("PSLAUNCH_MXNET_PYTHON")
                    or os.path.join(REPO, ".venv-mxnet", "bin", "python"))
    ap.add_argument("--no-compare", action="store_true", help="skip the MXNet launch.py side")
    ap.add_argument("--first-batch", action="store_true",
                    help="also: Enter to the first training batch of -n 2 -s 1 (MXNet's example when "
                         "PSLAUNCH_MXNET_EXAMPLE names it, else scripts/bench_train_mxnet.py; and our trainer)")
    ap.add_argument("--no-failure", dest="failure", action="store_false",
                    help="skip the fail-fast measurement (failure to launcher exit)")
    ap.add_argument("--launcher", choices=["local", "ssh"], default="local",
                    help="ssh: the ssh backend on a network-namespace testbed (root; see bench_launch_ssh.py)")
    import bench_launch_ssh

    bench_launch_ssh.add_arguments(ap)
    a = ap.parse_args()
    if a.launcher == "ssh":
        return bench_launch_ssh.bench_ssh_main(a.hosts, a.per_host, a.repeats, a.sync)
    compare = not a.no_compare and os.path.exists(a.mxnet_python) and _mxnet_tools_available(a.mxnet_python)
    root = tempfile.mkdtemp(prefix="bench-launch-")
    job = _prepare(root)
    print(f"launch latency, local backend, N workers + N servers + 1 scheduler; median of {a.repeats} runs; "
          f"{os.cpu_count()} cores")
    print("time from starting the launcher until: the first process runs / every process runs / the launcher exits")
    head = f"{'N':>3} {'procs':>5} | {'pslaunch first':>14} {'all':>8} {'exit':>8}"
    if compare:
        head += (f" | {'launch.py first':>15} {'all':>8} {'exit':>8} | "
                 f"{'launch.py / pslaunch: first':>27} {'all':>6} {'exit':>6}")
    print(head)
    print("-" * len(head))
    try:
        for n in a.workers:
            ours, theirs = [], []
            for r in range(a.repeats):  # interleaved, in turn first: load changes hit both alike
                if compare and r % 2:
                    theirs.append(bench_dmlc(a.mxnet_python, job, root, n))
                ours.append(bench_pslaunch(job, root, n))
                if compare and not r % 2:
                    theirs.append(bench_dmlc(a.mxnet_python, job, root, n))
            row = [statistics.median(x[i] for x in ours) for i in range(3)]
            line = (f"{n:>3} {2 * n + 1:>5} | {row[0] * 1000:>11.0f} ms "
                    f"{row[1] * 1000:>5.0f} ms {row[2] * 1000:>5.0f} ms")
            if compare:
                peer = [statistics.median(x[i] for x in theirs) for i in range(3)]
                line += (f" | {peer[0] * 1000:>12.0f} ms {peer[1] * 1000:>5.0f} ms {peer[2] * 1000:>5.0f} ms"
                         f" | {peer[0] / row[0]:>26.2f}x {peer[1] / row[1]:>5.2f}x {peer[2] / row[2]:>5.2f}x")
            print(line, flush=True)
        if a.failure:
            print()
            print("fail fast: worker 0 exits with code 3; time until pslaunch has stopped the other 2N "
                  "processes (SIGTERM) and exited with 3")
            print(f"{'N':>3} {'procs':>5} | {'median':>8} {'max':>8}")
            for n in a.workers:
                t = bench_failure(root, n, a.repeats)
                print(f"{n:>3} {2 * n + 1:>5} | {statistics.median(t) * 1000:>5.0f} ms {max(t) * 1000:>5.0f} ms",
                      flush=True)
        if a.first_batch:
            bench_first_batch(a, compare)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if not compare and not a.no_compare:
        print("(MXNet launch.py not compared: no MXNet venv; see --mxnet-python)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
