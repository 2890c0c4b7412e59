"""The failure report against real programs (issue 32, items 1 and 4): its first line names the
job type a torch.distributed or XGBoost 2.1+ program needs, and the first process to fail in its
own words; a traceback many processes print is shown once; no ``pslaunch-cause:`` line reaches
the user."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from support import helpers as H
from support import trainer as T

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

DDP = '''\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
model(torch.ones(2, 4)).sum().backward()
dist.destroy_process_group()
'''


def report(stderr: str) -> list[str]:
    """The failure report: the ``pslaunch: error:`` lines from the first on (without the prefix)."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("pslaunch: error: "))
    return [line.removeprefix("pslaunch: error: ") for line in lines[start:]]


def assert_said_once(proc: subprocess.CompletedProcess) -> None:
    text = proc.stdout + proc.stderr
    assert "pslaunch-cause" not in text, text
    assert text.count("Traceback (most recent call last):") <= 1, text
    assert "[bt]" not in text, text


def test_a_ddp_program_run_without_tracker_torch_is_told_so_in_the_first_line(tmp_path: Path) -> None:
    script = tmp_path / "ddp.py"
    script.write_text(DDP)
    proc = H.run_pslaunch("-n", "2", "--launcher", "local", "--log-dir", str(tmp_path / "logs"),
                          sys.executable, str(script), timeout=180, env=T.child_env())
    assert proc.returncode == 1, proc.stderr
    first = report(proc.stderr)[0]
    assert "exited with code 1 first: torch.distributed found no RANK: this is a collective job; run it with " \
           f"--tracker torch (pslaunch -n 2 --tracker torch {sys.executable} {script})" in first, proc.stderr
    assert_said_once(proc)
    assert proc.stderr.count("environment variable RANK expected, but not set") == 1, proc.stderr
    assert len(proc.stderr.splitlines()) < 45, proc.stderr  # (5 tracebacks and a tail: about 130 lines before)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").iterdir()}
    failed = [name for name, text in logs.items() if "RANK expected, but not set" in text]
    assert len(failed) >= 2 and all("Traceback (most recent call last):" in logs[n] for n in failed)  # (kept whole)


def test_xgboost3_under_the_rabit_tracker_is_told_to_use_the_xgboost_tracker(tmp_path: Path) -> None:
    xgb20, xgb30 = H.xgboost_python("2.0"), H.xgboost_python("3.0")
    if xgb20 is None or xgb30 is None:
        pytest.skip("the XGBoost 2.0.3 and 3.0 venvs are not here (scripts/deps/70-xgboost.sh)")
    worker = str(H.REPO / "tests" / "bin" / "xgb_worker.py")
    proc = H.run_pslaunch("-n", "2", "-s", "0", "--launcher", "local", "--tracker-python", xgb20,
                          xgb30, worker, "--api", "args", "--out", str(tmp_path), timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = report(proc.stderr)
    assert "exited with code 1 first: " in lines[0] and "run the job with --tracker xgboost (pslaunch -n 2 " \
           "--tracker xgboost " in lines[0], proc.stderr
    assert "no worker asked" not in proc.stderr, proc.stderr  # (nothing contradicts it)
    assert [line for line in proc.stderr.splitlines() if "--tracker xgboost" in line] == \
        [f"pslaunch: error: {lines[0]}"], proc.stderr  # (said once: in the first line)
    assert_said_once(proc)


def test_the_first_worker_to_fail_is_the_headline_in_its_own_words() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --gpus 0 works")
    proc = subprocess.run(T.launched_argv("--gpus", "0", "--kv-store", "dist_sync", "--num-epochs", "1",
                                          servers=2), capture_output=True, text=True, timeout=180,
                          env=T.child_env(), cwd=H.REPO)
    assert proc.returncode == 2, proc.stderr
    lines = report(proc.stderr)
    assert lines[0].startswith("worker ") and " exited with code 2 first: train_mnist: error: --gpus 0: CUDA is " \
        "not available to this torch" in lines[0], proc.stderr
    assert len(lines) == 1, proc.stderr  # (its one line is the headline: no tail repeats it)
    assert_said_once(proc)


def test_a_stopped_worker_is_named_once_and_no_marker_line_is_shown(tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(T.launched_argv("--kv-store", "dist_sync", "--num-epochs", "3", "--disp-batches", "5",
                                            servers=2, launcher_args=("--log-dir", str(tmp_path))),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=T.child_env(PSLAUNCH_TEST_TAG=tag, PS_HEARTBEAT_TIMEOUT="4"), cwd=H.REPO)
    stopped: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "worker-1.log").exists() or "Batch" not in (tmp_path / "worker-1.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "worker 1 never trained"
            time.sleep(0.1)
        stopped = T.trainer_pids(tag, "worker-1")
        assert stopped, "worker 1 not found"
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        out, err = proc.communicate(timeout=120)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, err
    lines = report(err)
    assert lines[0].startswith("worker 1 (on localhost, pid ") and "sent no heartbeat for 4 s" in lines[0], err
    text = out + err
    assert "pslaunch-cause" not in text, text
    # the sentence: once as the first process that printed it said it, once in the report's first line
    assert text.count("sent no heartbeat for 4 s") == 2, text
