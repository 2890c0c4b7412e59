#!/usr/bin/env python3
"""The fault table: what a failure in the middle of a real job costs, and what it leaves behind.

Each row starts a real distributed job on the local backend (our trainer, ``--kv-store
dist_sync``, 2 workers and 1 server, or for the escape rows ``tests/bin/probe.py``, whose
processes leave their process groups with ``setsid()`` and a double fork), waits until it
trains, then injects one fault:

* ``kill -9`` of the scheduler, of the server, of a worker;
* ``SIGSTOP`` of a worker (hung: only the parameter server's heartbeat can notice);
* a worker that left grandchildren outside its group, then ``kill -9`` of that worker;
* ``kill -9`` of the launcher itself (its watchdog must clean up).

It reports the seconds from the fault until the launcher exited (for the launcher's own
``kill -9``: until the last process of the job was gone), the exit code, the first line of
the launcher's report, and how many processes of the job were still alive afterwards (found
by the job's ``PSLAUNCH_JOB_ID``, which every process of a job and all it starts inherit).

    python scripts/bench_faults.py [--rows 'NAME;NAME'] [--repo DIR]

``--repo`` runs another checkout's launcher and trainer (this script's checkout by default), for
a before/after table.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time

from launcher.node import procgroup

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = b"PSLAUNCH_JOB_ID="
ROLE = b"DMLC_ROLE="
TASK = b"DMLC_TASK_ID="
TRAIN = [sys.executable, "trainer/train_mnist.py", "--network", "mlp", "--kv-store", "dist_sync",
         "--num-epochs", "1000", "--num-examples", "6400", "--disp-batches", "5"]
PROBE = [sys.executable, os.path.join(REPO, "tests", "bin", "probe.py"), "--out", "{out}",
         "--listen", "--sleep", "300", "--escape"]


def job_envs() -> dict[int, dict[bytes, bytes | int]]:
    """Every live process with a job id: pid -> its job variables (and its parent and start time)."""
    found = {}
    for st in procgroup.scan() or ():
        if not st.alive:
            continue
        try:
            with open(f"/proc/{st.pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        mine = {k: v.split(b"=", 1)[1] for v in env for k in (JOB, ROLE, TASK) if v.startswith(k)}
        if JOB in mine:
            mine[b"ppid"], mine[b"start"] = st.ppid, st.start
            found[st.pid] = mine
    return found


def job_processes(launcher: int, workers: int = 2) -> dict[str, int]:
    """The launcher's job processes by name (``worker-1``): its children with a job id (the
    earliest of each name: a subreaper launcher also adopts what a process detached)."""
    out: dict[str, tuple[int, int]] = {}
    for pid, env in job_envs().items():
        if int(env[b"ppid"]) != launcher or ROLE not in env:
            continue
        role = env[ROLE].decode()
        task = int(env.get(TASK) or 0)
        name = "scheduler" if role == "scheduler" else f"{role}-{task if role == 'worker' else task - workers}"
        started = int(env[b"start"])
        if name not in out or started < out[name][1]:
            out[name] = (pid, started)
    return {name: pid for name, (pid, _) in out.items()}


def left_of(job: bytes) -> int:
    return sum(1 for env in job_envs().values() if env[JOB] == job)


def wait_for(cond, timeout: float, interval: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    return None


def run_row(name: str, argv: list[str], target: str, fault: str, log: str, repo: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=repo)
    probes = tempfile.mkdtemp(prefix="probes-")
    argv = [a.replace("{out}", probes) for a in argv]
    training = "trainer/train_mnist.py" in argv
    out = open(log, "w+b")
    launcher = subprocess.Popen([sys.executable, "-m", "launcher", "-n", "2", "-s", "1", "--kill-grace", "10",
                                 *argv], cwd=repo, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        procs = wait_for(lambda: (lambda p: p if len(p) == 4 else None)(job_processes(launcher.pid)), 120)
        if not procs:
            raise RuntimeError(f"{name}: the job did not start (see {log})")
        job = job_envs()[procs["scheduler"]][JOB]
        # training: a worker has printed its first progress line (the probe: all started)
        if training:
            ok = wait_for(lambda: b"] Batch [" in open(log, "rb").read(), 180)
            if not ok:
                raise RuntimeError(f"{name}: no training progress (see {log})")
        else:
            time.sleep(1.0)
        t0 = time.monotonic()
        if target == "launcher":
            os.kill(launcher.pid, signal.SIGKILL)
            launcher.wait()
            wait_for(lambda: left_of(job) == 0, 60, 0.02)
            took = time.monotonic() - t0
        else:
            os.kill(procs[target], getattr(signal, fault))
            launcher.wait(timeout=180)
            took = time.monotonic() - t0
        time.sleep(1.0)  # anything that would outlive the launcher for a moment is counted too
        left = left_of(job)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        out.close()
    text = open(log, "rb").read().decode(errors="replace")
    report = next((line.split("error: ", 1)[1] for line in text.splitlines() if "pslaunch: error: " in line), "")
    return {"row": name, "seconds": took, "code": launcher.returncode, "left": left, "report": report}


ROWS = {
    "kill -9 scheduler": (TRAIN, "scheduler", "SIGKILL"),
    "kill -9 server 0": (TRAIN, "server-0", "SIGKILL"),
    "kill -9 worker 1": (TRAIN, "worker-1", "SIGKILL"),
    "SIGSTOP worker 1 (hung)": (TRAIN, "worker-1", "SIGSTOP"),
    "escaped grandchildren, kill -9 worker 1": (PROBE, "worker-1", "SIGKILL"),
    "kill -9 of the launcher (training)": (TRAIN, "launcher", "SIGKILL"),
    "kill -9 of the launcher (escaped grandchildren)": (PROBE, "launcher", "SIGKILL"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="all", help="row names separated by semicolons (default: all)")
    ap.add_argument("--repo", default=REPO, help="the checkout whose launcher and trainer run (default: this one)")
    a = ap.parse_args()
    names = list(ROWS) if a.rows == "all" else [r.strip() for r in a.rows.split(";")]
    tmp = tempfile.mkdtemp(prefix="bench-faults-")
    print("| fault | seconds to exit | exit code | processes left | the launcher's report |")
    print("|---|---:|---:|---:|---|")
    for i, name in enumerate(names):
        argv, target, fault = ROWS[name]
        r = run_row(name, argv, target, fault, os.path.join(tmp, f"row{i}.log"), a.repo)
        code = "(killed)" if target == "launcher" else str(r["code"])
        report = r["report"][:110] + ("..." if len(r["report"]) > 110 else "")
        print(f"| {name} | {r['seconds']:.2f} | {code} | {r['left']} | {report} |", flush=True)
    print(f"\n(logs in {tmp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
