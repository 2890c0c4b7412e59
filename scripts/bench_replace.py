"""A lost worker, replaced in place or by restarting the job: from the kill to training again.

Runs the bundled trainer (MLP, dist_sync, 2 workers, 1 server) under pslaunch, waits until
worker 1 trains, then ``--rounds`` times: SIGKILL worker 1 (the trainer process itself, found by
its environment), wait until it trains again, let it train ``--train-between`` seconds. Side by
side, the two policies of ``--restart-scope``:

* ``process``: pslaunch starts a replacement of worker 1 alone; "training again" is its line
  ``... is training again`` (the answer to its first push), and the scheduler's and the server's
  pids must not change;
* ``job`` (torchrun's and launch.py's way): every role starts again; "training again" is the
  first ``Batch [`` line of worker 1 in the next attempt (its 10th batch: ``--disp-batches 10``),
  from step 0 (no checkpoint: the work since the start is lost too, which this does not count).

Usage::

    python scripts/bench_replace.py [--launcher local|ssh] [--rounds 5]

``--launcher ssh`` builds the network-namespace testbed (tests/support/testbed.py; root) and
runs the server and the workers on 3 hosts, the scheduler here.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

MARK = "PSLAUNCH_BENCH_MARK"
TRAIN = ("--network", "mlp", "--num-epochs", "100", "--num-examples", "12800", "--batch-size", "64",
         "--disp-batches", "10", "--kv-store", "dist_sync")


class Job:
    """One pslaunch run whose output lines are kept with the time each arrived."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                  cwd=REPO, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait_line(self, pattern: str, after: float, timeout: float) -> float:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for t, line in list(self.lines):
                if t >= after and re.search(pattern, line):
                    return t
            if self.p.poll() is not None:
                break
            time.sleep(0.01)
        tail = "\n".join(line for _, line in self.lines[-30:])
        raise SystemExit(f"no {pattern!r} within {timeout:g}s:\n{tail}")

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


def pids(mark: str, **want: str) -> list[int]:
    """The trainer processes of this run (its mark) whose environment has ``want``."""
    from support.helpers import pids_with_env

    found = []
    for pid in pids_with_env(MARK, mark):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                raw = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        env = dict(x.split(b"=", 1) for x in raw.split(b"\0") if b"=" in x)
        if b"train_mnist" in cmd and all(env.get(k.encode()) == v.encode() for k, v in want.items()):
            found.append(pid)
    return found


def bench(scope: str, launcher_args: list[str], env: dict[str, str], rounds: int, between: float) -> list[float]:
    from support import trainer as T

    mark = uuid.uuid4().hex
    argv = [sys.executable, "-m", "launcher", *launcher_args, "-n", "2", "-s", "1", "--kill-grace", "1",
            "--max-restarts", str(rounds), "--restart-scope", scope, "--restart-delay", "0", "--no-progress",
            "--host-cooldown", "0",  # (the same host fails every round: never leave it out here)
            "--env", f"{MARK}={mark}", "--env", "OMP_NUM_THREADS=1",
            *T.train_argv(*TRAIN, data_dir=T.mnist_dir())]
    job = Job(argv, env)
    label = r"^\[worker 1[^\]]*\] "
    again = label + (r".*is training again" if scope == "process" else r".*Batch \[")
    times = []
    try:
        job.wait_line(label + r".*Batch \[", 0.0, 300)
        stay = {role: pids(mark, DMLC_ROLE=role) for role in ("scheduler", "server")}
        for k in range(1, rounds + 1):
            (victim,) = pids(mark, DMLC_ROLE="worker", DMLC_TASK_ID="1")
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            # (a line worker 1 printed just before the kill may arrive just after it: the next
            # attempt's lines come after pslaunch says it restarts)
            since = killed if scope == "process" else job.wait_line(r"restarting every process", killed, 60)
            back = job.wait_line(again, since, 120)
            times.append(back - killed)
            print(f"  {scope}: round {k}: training again {back - killed:.2f} s after the kill", flush=True)
            time.sleep(between)
        now = {role: pids(mark, DMLC_ROLE=role) for role in ("scheduler", "server")}
        print(f"  {scope}: pids before the first kill {stay}, after the last return {now}", flush=True)
        if scope == "process":
            assert now == stay, f"the scheduler or the server changed: {stay} -> {now}"
    finally:
        job.stop()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launcher", choices=("local", "ssh"), default="local")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--train-between", type=float, default=3.0, help="seconds of training after each return")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    launcher_args = ["--launcher", args.launcher]
    tb = None
    if args.launcher == "ssh":
        from support import testbed as testbed_mod

        tb = testbed_mod.build(3)
        env.update(HOME=str(tb.home))
        env.pop("SSH_AUTH_SOCK", None)
        hostfile = tb.write_hostfile(Path(tempfile.mkdtemp(prefix="bench-replace-")) / "hosts", tb.hosts[:3])
        launcher_args += ["-H", str(hostfile)]
    try:
        results = {scope: bench(scope, launcher_args, env, args.rounds, args.train_between)
                   for scope in ("process", "job")}
    finally:
        if tb is not None:
            tb.close()
    print(f"\nfrom the kill of worker 1 to training again, {args.rounds} kills, --launcher {args.launcher} "
          f"({os.cpu_count()} cores); MLP dist_sync, 2 workers, 1 server")
    print(f"{'--restart-scope':<18}{'median':>9}{'min':>9}{'max':>9}  what starts again")
    what = {"process": "worker 1 alone, at its step (scheduler and server pids unchanged)",
            "job": "every role, from step 0 without a checkpoint (as torchrun and launch.py do)"}
    for scope, times in results.items():
        print(f"{scope:<18}{statistics.median(times):>8.2f}s{min(times):>8.2f}s{max(times):>8.2f}s  {what[scope]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
