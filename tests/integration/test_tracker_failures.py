"""The trackers as the launcher runs them (local backend): when one cannot start or fails, the
job fails with one line that names it and the fix; its child process never outlives the job."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from support.clusters import LocalCluster
from support.helpers import (
    BIN,
    one_line_error,
    read_probes,
    run_pslaunch,
    wait_probes,
    xgboost_python,
)

pytestmark = pytest.mark.integration

DDP = str(BIN / "ddp_worker.py")


def python_without(module: str) -> str:
    """A Python on this machine that cannot import ``module`` (the system's, not the venv's)."""
    for cand in ("/usr/bin/python3", shutil.which("python3") or ""):
        if cand and os.path.exists(cand) and os.system(f"{cand} -c 'import {module}' 2>/dev/null") != 0:
            return cand
    pytest.skip(f"every python3 here has {module}")


@pytest.mark.timeout(60)
def test_a_tracker_python_that_is_not_here_is_one_line(tmp_path: Path) -> None:
    r = run_pslaunch("-n", "2", "--tracker", "torch", "--tracker-python", str(tmp_path / "nope" / "python"),
                     sys.executable, DDP, "--out", str(tmp_path))
    assert r.returncode == 1, r.stderr
    line = one_line_error(r.stderr)
    assert f"--tracker torch runs its torch store on this machine with {tmp_path}/nope/python, which is not " \
           "here: give --tracker-python PYTHON (one with torch)" in line


@pytest.mark.timeout(60)
def test_an_xgboost_tracker_that_cannot_start_fails_before_any_worker(tmp_path: Path, probe) -> None:
    python = python_without("xgboost")
    r = run_pslaunch("-n", "2", "--tracker", "xgboost", "--tracker-python", python, *probe())
    assert r.returncode == 1, r.stderr
    assert f"the xgboost tracker cannot start: cannot import xgboost with {python}" in one_line_error(r.stderr)
    assert read_probes(probe.dir) == {}  # no worker started


@pytest.mark.timeout(90)
def test_a_torch_store_that_fails_stops_the_job_naming_it(tmp_path: Path) -> None:
    # the workers start beside the store; when it cannot serve, they would wait for it: the job ends
    python = python_without("torch")
    cluster = LocalCluster(tmp_path)
    try:
        t0 = time.monotonic()
        r = cluster.run("-n", "2", "--tracker", "torch", "--tracker-python", python, "--kill-grace", "2",
                        sys.executable, DDP, "--out", str(tmp_path))
        took = time.monotonic() - t0
        assert r.returncode == 1, r.stderr
        errors = [x for x in r.stderr.splitlines() if x.startswith("pslaunch: error:")]
        assert errors and "the torch store (on localhost, pid " in errors[0], r.stderr
        assert f"cannot import torch.distributed with {python}" in errors[0]
        assert took < 60
        assert not cluster.leftovers()
    finally:
        cluster.close()


@pytest.mark.timeout(60)
def test_without_xgboost_the_rabit_tracker_holds_its_port_for_workers_that_never_ask(tmp_path: Path, probe) -> None:
    # (-s 0: the rabit tracker is XGBoost's own, run with the command's Python: here the main venv's,
    # which has no xgboost; N workers and no servers whose programs never talk to it run as before)
    cluster = LocalCluster(tmp_path)
    try:
        r = cluster.run("-n", "2", "-s", "0", *probe())
        assert r.returncode == 0, r.stderr
        assert sorted(read_probes(probe.dir)) == ["worker-0", "worker-1"]
        assert "rabit tracker: no worker asked it for a rank" in r.stderr
        assert not cluster.leftovers()
    finally:
        cluster.close()


@pytest.mark.xgboost
@pytest.mark.timeout(120)
def test_an_xgboost20_worker_that_asks_a_tracker_without_xgboost_ends_the_job_with_what_to_install(
        tmp_path: Path) -> None:
    xgb20 = xgboost_python("2.0")
    if xgb20 is None:
        pytest.skip("the XGBoost 2.0.3 venv is missing (run scripts/deps/70-xgboost.sh)")
    cluster = LocalCluster(tmp_path)
    try:
        r = cluster.run("-n", "2", "-s", "0", "--tracker-python", sys.executable, "--kill-grace", "2", xgb20,
                        str(BIN / "xgb_worker.py"), "--api", "env", "--out", str(tmp_path))
        assert r.returncode == 1, r.stderr
        lines = r.stderr.splitlines()  # the job's start, then one line: the tracker's
        assert len(lines) == 2 and lines[0].startswith("pslaunch: starting 2 workers"), r.stderr
        assert lines[1].startswith("pslaunch: error: the rabit tracker (on localhost, pid "), r.stderr
        assert lines[1].endswith(
            f": the worker at 127.0.0.1 asked for its rank, but {sys.executable} has no XGBoost: install xgboost 2.0 "
            "or older there (pip install 'xgboost<2.1') or give --tracker-python a Python that has it"), r.stderr
        assert not cluster.leftovers()
    finally:
        cluster.close()


@pytest.mark.xgboost
@pytest.mark.timeout(120)
def test_an_xgboost3_worker_under_the_rabit_tracker_is_told_which_tracker(tmp_path: Path, probe) -> None:
    python = xgboost_python("3.0")
    if python is None:
        pytest.skip("the XGBoost 3.0 venv is missing (run scripts/deps/70-xgboost.sh)")
    hint = ("speaks XGBoost 2.1+'s tracker protocol, which this rabit tracker does not: "
            "run the job with --tracker xgboost")
    # the tracker Python (the command's) has XGBoost 3.0: a program that never asks for a rank runs,
    # and the stand-in tells the first worker that asks which tracker to use
    r = run_pslaunch("-n", "2", "-s", "0", "--kill-grace", "2", python, *probe()[1:], timeout=100)
    assert r.returncode == 0, r.stderr
    assert sorted(read_probes(probe.dir)) == ["worker-0", "worker-1"]
    r = run_pslaunch("-n", "2", "-s", "0", "--kill-grace", "2", python, str(BIN / "xgb_worker.py"), "--api", "args",
                     "--out", str(tmp_path), timeout=100)
    assert r.returncode == 1, r.stderr
    errors = [x for x in r.stderr.splitlines() if x.startswith("pslaunch: error: ")]
    assert len(errors) == 1 and errors[0].startswith("pslaunch: error: the rabit tracker (on localhost, pid "), r.stderr
    assert errors[0].endswith(f": the worker at 127.0.0.1 {hint}"), r.stderr
    # XGBoost 2.0's tracker (--tracker-python) and 3.0 workers: said when the first one connects
    xgb20 = xgboost_python("2.0")
    if xgb20 is None:
        pytest.skip("the XGBoost 2.0.3 venv is missing (run scripts/deps/70-xgboost.sh)")
    r = run_pslaunch("-n", "2", "-s", "0", "--tracker-python", xgb20, "--kill-grace", "2", python,
                     str(BIN / "xgb_worker.py"), "--api", "args", "--out", str(tmp_path), timeout=100)
    assert r.returncode not in (0, 124), r.stderr
    # (the failure report's first line says it, once: issue 32)
    (said,) = [x for x in r.stderr.splitlines() if hint in x]
    assert said.startswith("pslaunch: error: worker ") and f"first: the worker at 127.0.0.1 {hint}" in said, r.stderr


@pytest.mark.timeout(120)
def test_kill_9_of_the_launcher_takes_the_torch_store_along(tmp_path: Path) -> None:
    out = tmp_path / "probes"
    out.mkdir()
    cluster = LocalCluster(out)
    try:
        p = cluster.start("-n", "2", "--tracker", "torch", "--kill-grace", "1",
                          *cluster.probe("--sleep", "60"))
        wait_probes(out, 2, timeout=30, alive=True)
        # the store's child process carries the job's variables too (--env): found by the mark
        assert "torch_store.py" in " ".join(cluster.leftovers())
        p.send_signal(signal.SIGKILL)
        p.communicate()
        end = time.monotonic() + 20
        while cluster.leftovers() and time.monotonic() < end:
            time.sleep(0.2)
        assert not cluster.leftovers()
    finally:
        cluster.close()
