# ruff: noqa: F811 - the testbed fixture is imported, and test arguments share its name
"""Each process's CPU and RSS through its handle (issue 33, item 5) on the ssh backend (the namespace
testbed) and on Slurm: a busy process that holds 100 MB reports about what the kernel says it used
(``/proc/<pid>/schedstat``, read by ``tests/bin/usage_driver.py``, not by the code under test) and
an RSS of at least 100 MiB; with the switch off (no ``--ui``, no ``--report``) the nodes send
nothing and every handle says None."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from support.clusters import SlurmCluster
from support.helpers import REPO
from support.testbed import Testbed

pytestmark = [pytest.mark.integration]

DRIVER = REPO / "tests" / "bin" / "usage_driver.py"
#: holds 100 MiB (written, so resident), then spins for ``seconds``
BUSY = ("import time; b = b'x' * (100 << 20); end = time.time() + {seconds}\n"
        "while time.time() < end: pass")


def busy(seconds: float) -> list[str]:
    return [sys.executable, "-c", BUSY.format(seconds=seconds)]


def run_driver(args: list[str], env: dict | None, log: Path, switch: bool, timeout: float = 120) -> list[dict]:
    """Run pslaunch ``args`` under the usage driver; the lines it logged."""
    env = {**(os.environ if env is None else env), "PSLAUNCH_USAGE_LOG": str(log),
           "PSLAUNCH_USAGE_SWITCH": "1" if switch else "0"}
    r = subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True, timeout=timeout,
                       env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def check_busy(rows: list[dict], name: str) -> None:
    """``name``'s values: several, CPU about the kernel's count (and busy), RSS >= 100 MiB."""
    mine = [r for r in rows if r["name"] == name]
    values = [r["usage"] for r in mine if r["usage"] is not None]
    kernel = [r["kernel"] for r in mine if r["usage"] is not None and r["kernel"] is not None]
    cpu = statistics.median(v[0] for v in values) if values else None
    truth = statistics.median(kernel) if kernel else None
    print(f"{name}: {len(values)} values, median cpu {cpu} %, kernel {truth} %, "
          f"rss {[round(v[1] / 2**20) for v in values]} MiB")
    assert len(values) >= 3, mine
    assert truth is not None and truth > 5.0, kernel  # (it did spin: on a loaded machine, not much)
    assert cpu is not None and abs(cpu - truth) <= max(15.0, 0.25 * truth), (cpu, truth)
    # (the first may come before b is made, the last as the program ends: 10 MiB once in a fresh CI run)
    assert all(100 << 20 <= v[1] < 400e6 for v in values[1:-1]), values


@pytest.mark.ssh
@pytest.mark.timeout(180)
def test_a_busy_process_over_ssh_reports_its_cpu_and_rss(testbed: Testbed, tmp_path: Path) -> None:
    hosts = str(testbed.write_hostfile(tmp_path / "hosts", testbed.hosts[:1], "{addr_a}"))
    args = ["--launcher", "ssh", "-H", hosts, "-n", "1", "-s", "0", "--kill-grace", "1"]
    rows = run_driver([*args, *busy(6)], testbed.env(), tmp_path / "on.jsonl", switch=True)
    check_busy(rows, "worker-0")
    off = run_driver([*args, *busy(3)], testbed.env(), tmp_path / "off.jsonl", switch=False)
    assert [r for r in off if r["name"] == "worker-0"] and all(r["usage"] is None for r in off)


@pytest.mark.slurm
@pytest.mark.timeout(240)
def test_a_busy_slurm_task_reports_its_cpu_and_rss(tmp_path: Path) -> None:
    job = SlurmCluster(tmp_path / "probes")
    try:
        args = job.argv("-n", "2", "-s", "0", "--kill-grace", "1")
        rows = run_driver([*args, *busy(8)], job.env(), tmp_path / "on.jsonl", switch=True, timeout=200)
        check_busy(rows, "worker-0")
        check_busy(rows, "worker-1")
    finally:
        job.close()
    assert not job.leftovers(), job.leftovers()
