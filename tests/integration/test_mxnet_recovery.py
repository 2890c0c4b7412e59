"""Real MXNet 1.9.1 (C++ ps-lite): a SIGKILLed worker is replaced in place through ps-lite's
recovery path, under MXNet's own scheduler (``--scheduler command``) and pslaunch's builtin one.

The processes are started here with the environment pslaunch gives them (launcher/spec/plan.py,
``pslaunch --dry-run``) plus what ELASTIC-CONTRACT.md adds for ``--restart-scope process``
(heartbeats on, PSLAUNCH_RESTART_SCOPE); the replacement gets the lost worker's environment and
PSLAUNCH_REPLACEMENT=1, PS_HEARTBEAT_TIMEOUT + 1 s after the kill, as the launcher starts it.
The program is tests/bin/mxnet_recovery.py. The last test runs the same job through pslaunch
``--restart-scope process``: the launcher starts the replacement itself."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Optional

import pytest
from support.helpers import BIN, free_port, run_pslaunch

from launcher import node

pytestmark = [pytest.mark.integration, pytest.mark.mxnet]

HEARTBEAT_TIMEOUT = 2
PROGRAM = str(BIN / "mxnet_recovery.py")
STEPS = 40


class Proc:
    """One process of the job, its output (stdout and stderr together) in a file."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], folder: Path) -> None:
        self.label, self.env = label, env
        self.path = folder / (label.replace(" ", "-") + ".log")
        self.out: IO[bytes] = open(self.path, "wb")
        self.popen = subprocess.Popen(argv, env=env, stdout=self.out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        self.pid = self.popen.pid

    def text(self) -> str:
        return self.path.read_text(errors="replace")

    def wait_for(self, pattern: str, within: float) -> re.Match[str]:
        """The first match of ``pattern`` in the output, waited for at most ``within`` s."""
        end = time.time() + within
        while time.time() < end:
            m = re.search(pattern, self.text())
            if m:
                return m
            assert self.popen.poll() is None, f"{self.label} ended ({self.popen.returncode}):\n{self.text()[-3000:]}"
            time.sleep(0.05)
        raise AssertionError(f"{self.label}: no {pattern!r} in {within} s:\n{self.text()[-3000:]}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait()
        self.out.close()


def _job_env(port: int, servers: int, workers: int, kv_type: str) -> dict[str, str]:
    """What every process of a local pslaunch job gets (--restart-scope process: heartbeats on)."""
    return dict(os.environ, DMLC_NUM_ATTEMPT="0", DMLC_NUM_SERVER=str(servers), DMLC_NUM_WORKER=str(workers),
                DMLC_PS_ROOT_PORT=str(port), DMLC_PS_ROOT_URI="127.0.0.1", OMP_NUM_THREADS="1",
                PSLAUNCH_ATTEMPT="0", PSLAUNCH_RESTART_SCOPE="process", PS_HEARTBEAT_INTERVAL="1",
                PS_HEARTBEAT_TIMEOUT=str(HEARTBEAT_TIMEOUT), PS_VERBOSE="1", PYTHONUNBUFFERED="1",
                KV_TYPE=kv_type, STEPS=str(STEPS), STEP_PAUSE="0.1")


def _node_env(base: dict[str, str], role: str, task_id: int, procs: int) -> dict[str, str]:
    return dict(base, DMLC_ROLE=role, DMLC_TASK_ID=str(task_id), DMLC_NODE_HOST="127.0.0.1",
                DMLC_JOB_CLUSTER="local", PSLAUNCH_LOCAL_PROCS=str(procs))


def _finish(proc: Proc, within: float) -> int:
    try:
        return proc.popen.wait(timeout=within)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{proc.label} did not finish in {within} s:\n{proc.text()[-3000:]}") from None


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("scheduler", "kv_type", "servers"), [  # (each scheduler with each kv type and 1 or 2 servers)
    ("command", "dist_sync", 1), ("command", "dist_async", 2),
    ("builtin", "dist_sync", 2), ("builtin", "dist_async", 1)])
def test_a_killed_mxnet_worker_is_replaced_in_place(mxnet: str, tmp_path: Path, scheduler: str, kv_type: str,
                                                    servers: int) -> None:
    port = free_port()
    base = _job_env(port, servers, 2, kv_type)
    procs = servers + 2
    sched_argv = node.command("pslite") if scheduler == "builtin" else [mxnet, PROGRAM]
    started: list[Proc] = []
    replacement: Optional[Proc] = None
    try:
        sched = Proc("scheduler", sched_argv, dict(base, DMLC_ROLE="scheduler", PSLAUNCH_SCHEDULER_PEERS="127.0.0.1"),
                     tmp_path)
        started.append(sched)
        for r in range(servers):
            started.append(Proc(f"server {r}", [mxnet, PROGRAM], _node_env(base, "server", 2 + r, procs), tmp_path))
        workers = [Proc(f"worker {r}", [mxnet, PROGRAM], _node_env(base, "worker", r, procs), tmp_path)
                   for r in range(2)]
        started += workers
        kept, lost = workers
        lost_rank = lost.wait_for(r"rank (\d): step 5 ", within=120).group(1)  # (ps-lite's rank, not the task id)
        os.kill(lost.pid, signal.SIGKILL)
        killed_at = time.time()
        assert lost.popen.wait(timeout=10) == -signal.SIGKILL
        time.sleep(HEARTBEAT_TIMEOUT + 1)  # (as the launcher waits for a ps-lite scheduler: the contract)
        survivors = [p for p in started if p is not lost]
        assert all(p.popen.poll() is None for p in survivors), [(p.label, p.popen.poll()) for p in survivors]
        replacement = Proc("worker 1 replacement", [mxnet, PROGRAM], dict(lost.env, PSLAUNCH_REPLACEMENT="1"),
                           tmp_path)
        m = replacement.wait_for(r"rank (\d): recovery \(replacement 1\): connected at ([\d.]+).*resumes at step (\d+)",
                                 within=60)
        connected = float(m.group(2)) - killed_at
        trained = float(replacement.wait_for(rf"rank {m.group(1)}: step {m.group(3)} at ([\d.]+)", 60).group(1))
        for p in [*survivors, replacement]:
            assert _finish(p, 120) == 0, p.text()[-3000:]
        # the same scheduler and servers throughout: the pids they had at the start exited 0 at the end
        assert [p.pid for p in survivors] == [p.popen.pid for p in survivors]
        text = sched.text()
        (line,) = [x for x in text.splitlines() if "replace dead node" in x]
        rank = m.group(1)
        assert rank == lost_rank and f"id={9 + 2 * int(rank)}," in line.split(" by ")[0], (rank, lost_rank, line)
        assert line.endswith("is_recovery=1"), line
        for p, who in ((kept, None), (replacement, rank)):
            (result,) = [x for x in p.text().splitlines() if " of 2: pulled " in x]
            got, expected = result.split(": pulled ")[1].split(", expected ")
            assert got == expected, result
            if who is not None:
                assert result.startswith(f"rank {who} of 2")
        resumed = int(m.group(3))
        assert 6 <= resumed <= 7, m.group(0)  # (the lost worker's steps 1 to 5 or 6 were applied)
        print(f"{scheduler} {kv_type} {servers} server(s): kill to connected {connected:.2f} s, "
              f"to training again {trained - killed_at:.2f} s, resumed at step {resumed}")
        assert connected < HEARTBEAT_TIMEOUT + 1 + 30
    finally:
        for p in [*started, *([replacement] if replacement else [])]:
            p.stop()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("scheduler, kv_type", [("command", "dist_sync"), ("builtin", "dist_async")])
def test_pslaunch_replaces_a_lost_mxnet_worker_in_place(mxnet: str, tmp_path: Path, scheduler: str,
                                                        kv_type: str) -> None:
    """Through the CLI: worker 1 dies (SIGKILL) after its step 5; pslaunch starts its replacement
    once ps-lite's scheduler can see it dead (PS_HEARTBEAT_TIMEOUT + 1 s), ps-lite gives it the
    lost node's id with is_recovery, it resumes where the lost one stopped, and every worker ends
    with the uninterrupted result; the scheduler and the server run once, to their end."""
    summary = tmp_path / "summary.json"
    r = run_pslaunch("-n", "2", "-s", "1", "--kill-grace", "1", "--timeout", "130", "--scheduler", scheduler,
                     "--max-restarts", "1", "--restart-scope", "process", "--summary-json", str(summary),
                     "--env", "LOSE_AT=1:5", "--env", f"KV_TYPE={kv_type}", "--env", f"STEPS={STEPS}",
                     mxnet, PROGRAM, timeout=140)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    assert "replacing it in place in " in r.stderr and "(restart 1/1)" in r.stderr, r.stderr
    doc = json.loads(summary.read_text())
    (rep,) = doc["replacements"]
    assert rep["process"] == "worker-1" and rep["signal"] == "SIGKILL"
    assert rep["delay"] >= HEARTBEAT_TIMEOUT, rep  # (ps-lite's scheduler had to see it dead first)
    names = [p["name"] for p in doc["processes"]]
    assert sorted(names) == ["scheduler", "server-0", "worker-0", "worker-1", "worker-1"], names
    assert all(p["exit_code"] == 0 for p in doc["processes"] if not p["replaced"]), doc["processes"]
    worker1 = [x for x in r.stdout.splitlines() if x.startswith("[worker 1]")]
    assert any("lost at step 5" in x for x in worker1), worker1
    assert any(re.search(r"recovery \(replacement 1\).*resumes at step [67]\b", x) for x in worker1), worker1
    pulled = [x for x in r.stdout.splitlines() if "pulled" in x]
    assert len(pulled) == 2 and all("wrong result" not in x for x in r.stdout.splitlines()), pulled
