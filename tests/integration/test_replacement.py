"""``--restart-scope process`` (issue 34) with real programs on every backend that can replace a
lost worker in place (local, ssh on the namespace testbed, Slurm): a worker of a parameter-server
job is killed mid-run; its replacement rejoins where it ran, the scheduler and the servers run
on (each once: the pids are compared), and the job's result is that of an uninterrupted run.

The probe-program version of the same is a row of the conformance suite
(``test_a_lost_worker_is_replaced_in_place_where_the_backend_can``); the node programs' own
tests are ``test_kv_replacement.py`` (the trainer's KV store) and ``test_mxnet_recovery.py``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
from support import trainer as T
from support.clusters import CLUSTERS, MARK, Cluster, make_cluster
from support.helpers import BIN, REPO, pids_with_env, wait_for

pytestmark = pytest.mark.integration

REPLACING = ("local", "ssh", "slurm")


@pytest.fixture(params=[pytest.param(kind, marks=CLUSTERS[kind]) for kind in REPLACING])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Cluster:
    c = make_cluster(request.param, tmp_path, request)
    yield c
    c.close()


#: LeNet's smaller sibling, 2 workers x 64 x 100 batches per epoch, 2 epochs: 200 steps per worker
TRAIN = ("--network", "mlp", "--num-epochs", "2", "--num-examples", "12800", "--batch-size", "64",
         "--disp-batches", "10", "--seed", "1", "--kv-store", "dist_sync")
STEPS, BATCHES = 200, 100


class Lines:
    """pslaunch's stdout and stderr, each line with the time it arrived (a reader thread each)."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._threads = [threading.Thread(target=self._read, args=(stream,), daemon=True)
                         for stream in (p.stdout, p.stderr)]
        for t in self._threads:
            t.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append((time.time(), line.rstrip("\n")))

    def first(self, pattern: str, timeout: float, after: float = 0.0) -> Optional[tuple[float, str]]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for t, line in list(self.lines):
                if t >= after and re.search(pattern, line):
                    return t, line
            time.sleep(0.02)
        return None

    def text(self) -> str:
        for t in self._threads:
            t.join(10)
        return "\n".join(line for _, line in self.lines)


def _worker_pid(mark: str, task: int) -> int:
    """The pid of the job's worker ``task`` itself (the trainer, not a wrapper around it)."""
    found = []
    for pid in pids_with_env(MARK, mark):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if env.get(b"DMLC_ROLE") == b"worker" and env.get(b"DMLC_TASK_ID") == str(task).encode() and \
                b"train_mnist" in cmd and b"PSLAUNCH_REPLACEMENT" not in env:
            found.append(pid)
    assert len(found) == 1, found
    return found[0]


@pytest.fixture(scope="module")
def uninterrupted() -> dict:
    """The same job without a loss, on the local backend: its worker 0 summary and its updates."""
    argv = [sys.executable, "-m", "launcher", "-n", "2", "-s", "1", "--env-server", "PS_VERBOSE=1",
            *T.train_argv(*TRAIN, data_dir=T.mnist_dir())]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=T.child_env(), cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr
    return {"summary": T.summaries(r.stdout)[0], "updates": _updates(r.stdout + r.stderr)}


def _updates(text: str) -> int:
    found = re.findall(r"S\[0\] is stopping after (\d+) updates", text)
    assert len(found) == 1, text[-3000:]
    return int(found[0])


def _nothing_left(cluster: Cluster) -> None:
    wait_for(lambda: not cluster.leftovers(), 20, interval=0.2, what="nothing of the job left")


def _once_each(doc: dict, names: tuple[str, ...]) -> None:
    """Each of ``names`` ran once, to its end (exit 0): never restarted nor replaced."""
    for name in names:
        runs = [p for p in doc["processes"] if p["name"] == name]
        assert len(runs) == 1 and runs[0]["exit_code"] == 0 and not runs[0]["replaced"], (name, runs)


@pytest.mark.timeout(240)
@pytest.mark.mxnet
def test_a_lost_mxnet_worker_is_replaced_in_place(cluster: Cluster, mxnet: str, tmp_path: Path) -> None:
    """Real MXNet 1.9.1, dist_async with 2 servers under the builtin scheduler: worker 1 dies
    (SIGKILL) after its step 5; ps-lite's recovery gives its replacement the lost node's id, it
    resumes at step 6, and every worker ends with the uninterrupted result."""
    summary = tmp_path / "summary.json"
    r = cluster.run("-n", "2", "-s", "2", "--scheduler", "builtin", "--kill-grace", "1", "--timeout", "200",
                    "--max-restarts", "1", "--restart-scope", "process", "--summary-json", str(summary),
                    "--env", "LOSE_AT=1:5", "--env", "KV_TYPE=dist_async", "--env", "STEPS=30",
                    mxnet, str(BIN / "mxnet_recovery.py"), timeout=220)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    doc = json.loads(summary.read_text())
    (rep,) = doc["replacements"]
    assert rep["process"] == "worker-1" and rep["signal"] == "SIGKILL" and rep["new_pid"] != rep["pid"]
    assert rep["new_host"] == rep["host"], rep  # (where it ran: its host is up)
    _once_each(doc, ("scheduler", "server-0", "server-1", "worker-0"))
    worker1 = [x for x in r.stdout.splitlines() if x.startswith("[worker 1")]
    assert any(re.search(r"recovery \(replacement 1\).*resumes at step 6\b", x) for x in worker1), worker1
    pulled = [x for x in r.stdout.splitlines() if "pulled" in x]
    assert len(pulled) == 2 and "wrong result" not in r.stdout + r.stderr, pulled
    _nothing_left(cluster)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", ["server-0", "scheduler"])
def test_a_lost_server_or_scheduler_still_restarts_the_whole_job(request: pytest.FixtureRequest, tmp_path: Path,
                                                                 victim: str) -> None:
    """Only workers are replaced in place: a server holds its share of the parameters and the
    scheduler the membership, so losing either restarts every role (out of the same budget)."""
    cluster = make_cluster("local", tmp_path, request)
    summary = tmp_path / "summary.json"
    r = cluster.run("-n", "2", "-s", "1", "--kill-grace", "1", "--max-restarts", "1", "--restart-delay", "0",
                    "--restart-scope", "process", "--summary-json", str(summary),
                    *cluster.probe("--listen", "--sleep", "3", "--kill-self", f"{victim}:KILL:1", "--on-attempts", "0"),
                    timeout=100)
    assert r.returncode == 0, r.stderr
    doc = json.loads(summary.read_text())
    assert [(a["attempt"], a["reason"]) for a in doc["attempts"]] == [(0, "failure"), (1, "success")]
    assert doc["attempts"][0]["cause"]["process"] == victim and doc["replacements"] == []
    assert "replacing it in place" not in r.stderr and "restarting every process" in r.stderr, r.stderr
    _nothing_left(cluster)


@pytest.mark.timeout(420)
def test_a_lost_trainer_worker_is_replaced_in_place(cluster: Cluster, tmp_path: Path, uninterrupted: dict) -> None:
    """The bundled trainer, dist_sync: worker 1 is killed (SIGKILL, from outside) in epoch 1; its
    replacement takes its rank, goes on at its step, and the job ends with the uninterrupted
    run's updates and accuracy; the scheduler and the server ran once."""
    summary = tmp_path / "summary.json"
    p = cluster.start("-n", "2", "-s", "1", "--kill-grace", "1", "--timeout", "360", "--max-restarts", "1",
                      "--restart-scope", "process", "--summary-json", str(summary), "--env", "OMP_NUM_THREADS=1",
                      "--env-server", "PS_VERBOSE=1", *T.train_argv(*TRAIN, data_dir=T.mnist_dir()))
    lines = Lines(p)
    try:
        assert lines.first(r"^\[worker 1[^\]]*\] .*Epoch\[1\] Batch \[\d+-50\]", 300), lines.text()[-3000:]
        killed = time.time()
        os.kill(_worker_pid(cluster.mark, 1), signal.SIGKILL)
        back = lines.first(r"^\[worker 1[^\]]*\] .*is training again", 120, after=killed)
        assert back, lines.text()[-3000:]
        assert p.wait(timeout=300) == 0, lines.text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = lines.text()
    print(f"\n{cluster.launcher}: worker 1 trained again {back[0] - killed:.2f} s after the kill")
    doc = json.loads(summary.read_text())
    (rep,) = doc["replacements"]
    assert rep["process"] == "worker-1" and rep["signal"] == "SIGKILL" and rep["new_host"] == rep["host"], rep
    _once_each(doc, ("scheduler", "server-0", "worker-0"))
    sums = T.summaries(text)
    assert [s["rank"] for s in sums] == [0, 1], sums
    step = sums[1]["resumed_at_step"]
    assert BATCHES + 50 <= step < STEPS, step  # (after every batch it had logged, never 0)
    assert _updates(text) == uninterrupted["updates"]
    accuracy, base = sums[0]["validation_accuracy"], uninterrupted["summary"]["validation_accuracy"]
    print(f"{cluster.launcher}: validation accuracy {accuracy:.4f} (uninterrupted {base:.4f}), resumed at step {step}")
    assert abs(accuracy - base) <= 0.01
    _nothing_left(cluster)
