"""A lost worker replaced in place (``PSLAUNCH_RESTART_SCOPE=process``), without the launcher:
train_mnist's scheduler, server and workers started here with the contract, worker 1
SIGKILLed mid-training, and a replacement started with its environment plus
``PSLAUNCH_REPLACEMENT=1``, as the launcher will. The scheduler and the server live on (the
same processes, exit 0), the replacement goes on at the lost worker's step, the servers make
as many updates as in an uninterrupted run, and the accuracy is that run's within 0.01."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import trainer as H
from support.kvjob import KVJob

import pscontract as pc
from trainer.kv import recovery as R

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

#: 2 workers x 64 x 200 batches per epoch, 3 epochs: 600 steps per worker; the last epoch at a
#: tenth of the learning rate (dist_async's accuracy varies from run to run by 0.02 after 200
#: steps, and by 0.01 after 600 at one rate: the stale pushes' noise settles at the lower one)
ARGS = ("--network", "mlp", "--num-epochs", "3", "--num-examples", "25600", "--batch-size", "64",
        "--disp-batches", "10", "--seed", "1", "--lr-step-epochs", "2")
BATCHES = 200
#: what pslaunch sets with --restart-scope process
SCOPE = {R.RESTART_SCOPE: "process", pc.HEARTBEAT_INTERVAL: "1", pc.HEARTBEAT_TIMEOUT: "2",
         "OMP_NUM_THREADS": "1"}
#: worker 1 is killed once it has logged this batch of epoch 1
KILL_AFTER = 50
STEPS = 3 * BATCHES


@pytest.fixture(scope="module", autouse=True)
def mnist_dir() -> Path:
    return H.mnist_dir()


def start_job(tmp: Path, kv: str) -> KVJob:
    tmp.mkdir(parents=True, exist_ok=True)
    return KVJob(tmp, workers=2, servers=1, command=H.train_argv("--kv-store", kv, *ARGS),
                 env=SCOPE, role_env={"server-0": {pc.VERBOSE: "1"}}, start_timeout=60).start()


def start_replacement(job: KVJob, name: str = "worker-1", number: int = 1) -> str:
    """Start ``name``'s replacement: its environment plus ``PSLAUNCH_REPLACEMENT``."""
    env = job._env(name)
    env[R.REPLACEMENT] = str(number)
    label = f"{name}-replacement-{number}"
    with open(job.tmp / f"{label}.log", "wb") as log:
        job.procs[label] = subprocess.Popen(job.command, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, cwd=job.tmp,
                                            start_new_session=True)
    return label


def wait_for(job: KVJob, name: str, pattern: str, timeout: float) -> re.Match[str]:
    end = time.monotonic() + timeout
    while True:
        found = re.search(pattern, job.output(name))
        if found:
            return found
        job.poll()
        assert name not in job.exit_times, f"{name} ended first:\n{job.outputs()}"
        assert time.monotonic() < end, f"no {pattern!r} from {name} in {timeout} s:\n{job.outputs()}"
        time.sleep(0.02)


def updates(job: KVJob) -> int:
    found = re.findall(r"S\[0\] is stopping after (\d+) updates", job.output("server-0"))
    assert len(found) == 1, job.output("server-0")
    return int(found[0])


def summary(job: KVJob, name: str) -> dict:
    (s,) = H.summaries(job.output(name))
    return s


def uninterrupted(tmp: Path, kv: str) -> tuple[int, float]:
    job = start_job(tmp, kv)
    try:
        codes = job.wait(400)
        assert set(codes.values()) == {0}, (codes, job.outputs())
        return updates(job), summary(job, "worker-0")["validation_accuracy"]
    finally:
        job.cleanup()


@pytest.mark.parametrize("kv", ["dist_sync", "dist_async"])
def test_a_killed_worker_is_replaced_in_place(tmp_path: Path, kv: str) -> None:
    base_updates, base_accuracy = uninterrupted(tmp_path / "uninterrupted", kv)
    job = start_job(tmp_path / "replaced", kv)
    try:
        wait_for(job, "worker-1", rf"Epoch\[1\] Batch \[\d+-{KILL_AFTER}\]", 300)
        pids = {n: job.procs[n].pid for n in ("scheduler", "server-0", "worker-0")}
        killed = job.signal("worker-1", signal.SIGKILL)
        job.procs["worker-1"].wait(10)
        logged = [int(e) * BATCHES + int(b) for e, b in
                  re.findall(r"Epoch\[(\d+)\] Batch \[\d+-(\d+)\]", job.output("worker-1"))]
        replacement = start_replacement(job)
        wait_for(job, replacement, r"is training again", 120)
        back = time.monotonic() - killed
        codes = job.wait(400)
        print(f"\n{kv}: the replacement trained again {back:.2f} s after the kill")
        assert codes["worker-1"] == -signal.SIGKILL
        assert {n: codes[n] for n in (*pids, replacement)} == dict.fromkeys((*pids, replacement), 0), \
            job.outputs()
        # the scheduler and the server are the processes started first: never restarted
        assert {n: job.procs[n].pid for n in pids} == pids
        sched = job.output("scheduler")
        assert re.search(r"H worker 1 \(task 1, pid \d+ on 127\.0\.0\.1\) disconnected \(it exited or "
                         r"was killed\): waiting up to 60 s \(PS_START_TIMEOUT\) for its replacement",
                         sched), sched
        assert "takes the place of worker 1" in sched
        assert [line for line in sched.splitlines() if pc.parse_cause(line)] == [], sched
        # the replacement went on where worker 1 was: after every batch it had logged, not at 0
        got = summary(job, replacement)
        step = got["resumed_at_step"]
        assert logged and max(logged) + 1 <= step < STEPS, (logged, step)
        assert f"going on at epoch {step // BATCHES} batch {step % BATCHES} (step {step} of this attempt" in \
            job.output(replacement)
        # as many updates as the uninterrupted run, and its accuracy (rank 0's, as the trainer
        # reports it) within 0.01
        assert updates(job) == base_updates
        accuracy = summary(job, "worker-0")["validation_accuracy"]
        print(f"{kv}: validation accuracy {accuracy:.4f} (uninterrupted {base_accuracy:.4f}), "
              f"{updates(job)} updates in both, resumed at step {step}")
        assert abs(accuracy - base_accuracy) <= 0.01
        if kv == "dist_sync":  # the same weights on every worker (under dist_async each has its own)
            assert got["validation_accuracy"] == accuracy
    finally:
        job.cleanup()
