"""The root cause from the program's own error file (issue 31, item 4): a real torch program
decorated with ``@record`` raises on one process; the failure report and ``--summary-json``
carry its exception and traceback, on every backend that runs here. A program that writes
nothing has no error; a hostile file is bounded, printable, and no link is ever followed.
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
from pathlib import Path

import pytest
from support.clusters import Cluster, make_cluster
from support.helpers import REPO, wait_for

pytestmark = pytest.mark.integration

PY = sys.executable
WORKER = str(REPO / "tests" / "bin" / "record_worker.py")
MESSAGE = "ValueError: boom in worker-1: the root cause"
KINDS = [
    "local",
    pytest.param("ssh", marks=pytest.mark.ssh),
    pytest.param("mpi-openmpi", marks=pytest.mark.mpi),
    pytest.param("slurm", marks=pytest.mark.slurm),
    pytest.param("sge", marks=pytest.mark.sge),
]


@pytest.fixture(autouse=True)
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A TMPDIR of this test's own for the launcher and what inherits its environment: the error
    files' directories of other tests' jobs running beside it (in /tmp) are not this test's."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    return tmp


def error_dirs(cluster: Cluster, private: Path) -> set[str]:
    """The error files' directories that exist where the job's processes run: this test's TMPDIR
    (the launcher's, and its local processes' and the Slurm tasks'), mpirun's TMPDIR, a private
    /tmp on each testbed host (their jobs are one at a time). A Grid Engine task's TMPDIR is the
    job's own, which Grid Engine removes."""
    patterns = ("pslaunch-error-*", "pslaunch-errors-*")  # (a process's, and an agent's or launcher's all)
    found = {path for p in patterns for path in glob.glob(os.path.join(private, p))}
    tmp = getattr(cluster, "tmp", None)
    if tmp is not None:
        found |= {path for p in patterns for path in glob.glob(os.path.join(tmp, p))}
    tb = getattr(cluster, "tb", None)
    for host in getattr(tb, "hosts", ()) if type(cluster).__name__ == "SSHCluster" else ():
        r = tb.run(host, ["sh", "-c", "ls -d /tmp/pslaunch-error* 2>/dev/null; true"])  # type: ignore[union-attr]
        found |= {f"{host.name}:{line}" for line in r.stdout.split()}
    return found


def report_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("pslaunch: error:")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", KINDS)
def test_the_report_and_the_summary_carry_the_exception_torch_recorded(kind: str, tmp_path: Path, private_tmp: Path,
                                                                      request: pytest.FixtureRequest) -> None:
    cluster = make_cluster(kind, tmp_path, request)
    summary = tmp_path / "summary.json"
    before = error_dirs(cluster, private_tmp)
    try:
        r = cluster.run("-n", "3", "--tracker", "torch", "--kill-grace", "2", "--summary-json", str(summary),
                        PY, WORKER, "--fail", "worker-1", "--delay", "1", timeout=240)
        print(r.stderr[-6000:])
        assert r.returncode == 1, r.stderr
        lines = report_lines(r.stderr)
        head = next(line for line in lines if "first" in line)
        assert re.match(r"pslaunch: error: worker 1( @ \S+)? \(", head), head  # (ssh: the host in the label)
        assert f"exited with code 1 first: {MESSAGE}; stopped the other processes" in head
        at = next(i for i, line in enumerate(lines) if line.startswith("pslaunch: error: the traceback worker 1")
                  and line.endswith(" wrote to its error file:"))
        trace = [line.removeprefix("pslaunch: error:   ! ") for line in lines[at + 1:] if "  ! " in line]
        assert trace[0] == "Traceback (most recent call last):" and trace[-1] == MESSAGE
        assert any("in fail_here" in line for line in trace) and any("raise ValueError" in line for line in trace)
        assert at < next(i for i, line in enumerate(lines) if "last " in line and " lines of worker 1" in line)
        doc = json.loads(summary.read_text())
        procs = {p["name"]: p for p in doc["processes"]}
        assert doc["first_failure"] == "worker-1"
        error = procs["worker-1"]["error"]
        assert error["message"] == MESSAGE and error["traceback"].endswith(MESSAGE)
        assert "in fail_here" in error["traceback"]
        # the file's time and the end, both by the clock of the host it ran on
        assert procs["worker-1"]["start_time"] < error["time"] <= procs["worker-1"]["end_time"] + 0.01
        assert all(p["error"] is None for name, p in procs.items() if name != "worker-1")  # stopped: none
        # (an mpi rank's agent killed by mpirun leaves the directory to its watchdog, within the grace)
        wait_for(lambda: not error_dirs(cluster, private_tmp) - before, 15.0, interval=0.2,
                 what="the error files' directories to be removed")
        assert cluster.leftovers() == []
    finally:
        cluster.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def test_a_program_that_writes_nothing_has_no_error(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    cluster = make_cluster(kind, tmp_path, request)
    summary = tmp_path / "summary.json"
    try:
        r = cluster.run("-n", "2", "-s", "1", "--kill-grace", "1", "--summary-json", str(summary),
                        *cluster.probe("--listen", "--sleep", "60", "--fail", "worker-1:3:0.5"))
        assert r.returncode == 3, r.stderr
        head = next(line for line in report_lines(r.stderr) if "first" in line)
        assert head.endswith("exited with code 3 first; stopped the other processes")
        assert "error file" not in r.stderr
        doc = json.loads(summary.read_text())
        assert [p["error"] for p in doc["processes"]] == [None] * 4
    finally:
        cluster.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def test_a_hostile_error_file_is_bounded_printable_and_no_link_is_followed(kind: str, tmp_path: Path,
                                                                         private_tmp: Path,
                                                                         request: pytest.FixtureRequest) -> None:
    cluster = make_cluster(kind, tmp_path, request)
    out = cluster.out
    (out / "sentinel").write_text("SENTINEL\n")
    (out / "decoy").mkdir()
    (out / "decoy" / "error.json").write_text('{"message": "PLANTED"}')
    summary = tmp_path / "summary.json"
    before = error_dirs(cluster, private_tmp)
    try:
        r = cluster.run("-n", "3", "-s", "0", "--tracker", "torch", "--kill-grace", "1", "--summary-json",
                        str(summary), PY, WORKER, "--hostile", str(out))
        assert r.returncode == 1, r.stderr
        doc = json.loads(summary.read_text())
        procs = {p["name"]: p for p in doc["processes"]}
        assert doc["first_failure"] == "worker-0"
        error = procs["worker-0"]["error"]
        assert error["message"].startswith("^[[2J^[]0;pwned^Gfirst line^@")  # printable, one line
        assert len(error["message"]) <= 2000 and len(error["traceback"]) <= 16000
        assert "longer than 64 KiB; the rest is not read" in error["traceback"]
        assert not any(c in error["message"] + error["traceback"] for c in "\x1b\x07\x00\x9b")
        report = "\n".join(report_lines(r.stderr))
        assert "exited with code 1 first: ^[[2J^[]0;pwned^Gfirst line" in report and "\x1b" not in report
        # links: neither read nor followed when removed
        assert procs["worker-1"]["error"] is None and procs["worker-2"]["error"] is None
        assert "PLANTED" not in r.stderr and "SENTINEL" not in r.stderr
        assert (out / "sentinel").read_text() == "SENTINEL\n"
        assert (out / "decoy" / "error.json").read_text() == '{"message": "PLANTED"}'
        wait_for(lambda: not error_dirs(cluster, private_tmp) - before, 15.0, interval=0.2,
                 what="the error files' directories to be removed")
    finally:
        cluster.close()


@pytest.mark.timeout(120)
def test_each_attempts_cause_carries_its_error(tmp_path: Path) -> None:
    """With --max-restarts, every attempt's cause in --summary-json has the exception, and the last
    line names it."""
    cluster = make_cluster("local", tmp_path, None)  # type: ignore[arg-type]
    summary = tmp_path / "summary.json"
    try:
        r = cluster.run("-n", "2", "--tracker", "torch", "--kill-grace", "1", "--max-restarts", "1",
                        "--restart-delay", "0", "--summary-json", str(summary), PY, WORKER, "--fail", "worker-1",
                        timeout=100)
        assert r.returncode == 1, r.stderr
        last = r.stderr.rstrip().splitlines()[-1]
        assert re.fullmatch(rf"pslaunch: error: attempt 2/2 failed: worker 1 on localhost \(pid \d+\) exited with "
                            rf"code 1: {MESSAGE}; 1/1 restarts used", last), last
        attempts = json.loads(summary.read_text())["attempts"]
        assert len(attempts) == 2
        for a in attempts:
            assert a["cause"]["error"][0] == MESSAGE and a["cause"]["error"][-1] == MESSAGE
    finally:
        cluster.close()
