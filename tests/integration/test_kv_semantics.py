"""KVStore semantics with real processes on loopback, started through the launcher."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pscontract as pc

REPO = Path(__file__).resolve().parent.parent.parent
WORKER = REPO / "tests" / "bin" / "kv_worker.py"

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def launch(tmp_path: Path, scenario: str, *, workers: int = 2, servers: int = 1,
           kvtype: str = "dist_sync", env: dict[str, str] | None = None,
           timeout: float = 120) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    """Run ``kv_worker.py SCENARIO`` as every role of a job; return the run and each worker's JSON."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "launcher", "-n", str(workers), "-s", str(servers),
           "--launcher", "local"]
    for k, v in (env or {}).items():
        cmd += ["--env", f"{k}={v}"]
    cmd += [sys.executable, str(WORKER), scenario, "--type", kvtype, "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    results = {}
    for f in out.glob("worker-*.json"):
        data = json.loads(f.read_text())
        results[data["rank"]] = data
    return run, results


def ok(run: subprocess.CompletedProcess, results: dict, workers: int = 2) -> None:
    assert run.returncode == 0, run.stdout + run.stderr
    assert sorted(results) == list(range(workers)), run.stdout + run.stderr


@pytest.mark.parametrize("servers, kvtype", [(1, "dist_sync"), (2, "dist_sync"),
                                             (2, "dist_device_sync")])
def test_sync_sums_across_workers(tmp_path: Path, servers: int, kvtype: str) -> None:
    # Integer-valued sums (exact): int and str keys, init from rank 0, several
    # rounds, a float64 array split over the servers (bound lowered to 100
    # elements), lists of keys, per-device lists, numpy values, non-contiguous outs.
    run, results = launch(tmp_path, "sync", servers=servers, kvtype=kvtype,
                          env={pc.BIGARRAY_BOUND: "100"})
    ok(run, results)
    assert results[0]["sum"] == [6.0] * 4  # three "devices" x 2 workers
    quiet = run.stdout + run.stderr
    assert "Bind to" not in quiet and "Barrier count" not in quiet  # PS_VERBOSE unset: quiet


def test_three_workers_two_servers(tmp_path: Path) -> None:
    run, results = launch(tmp_path, "sync", workers=3, servers=2,
                          env={pc.BIGARRAY_BOUND: "100"})
    ok(run, results, workers=3)
    assert results[2]["sum"] == [9.0] * 4


def test_store_closes_itself_at_exit(tmp_path: Path) -> None:
    run, results = launch(tmp_path, "noclose", env={pc.BIGARRAY_BOUND: "100"})
    ok(run, results)


def test_async_applies_every_push(tmp_path: Path) -> None:
    run, results = launch(tmp_path, "async", kvtype="dist_async")
    ok(run, results)
    assert results[1]["value"] == [-10.0] * 8


def test_async_without_an_optimizer_is_a_clear_error(tmp_path: Path) -> None:
    run, results = launch(tmp_path, "async_noopt", kvtype="dist_async")
    ok(run, results)
    assert results[1]["error"].startswith("dist_async needs an optimizer on the servers")


def test_optimizer_runs_on_the_servers(tmp_path: Path) -> None:
    run, results = launch(tmp_path, "optim", servers=2, env={pc.MAC_PAYLOAD: "1"})
    ok(run, results)
    assert results[0]["w"] == pytest.approx([-1.6625] * 6)  # the last step with the new lr 0.1


@pytest.mark.parametrize("kvtype", ["dist_sync", "dist_async"])
def test_wd_mult_names_the_users_keys(tmp_path: Path, kvtype: str) -> None:
    run, results = launch(tmp_path, "wd", servers=2, kvtype=kvtype, workers=1)
    ok(run, results, workers=1)
    assert results[0]["b"] == [1.0, 1.0] and results[0]["w"] == [0.5625] * 3


def test_placement_is_balanced_by_bytes(tmp_path: Path) -> None:
    run, results = launch(tmp_path, "place", servers=2)
    ok(run, results)
    loads = results[0]["loads"]
    assert results[1]["loads"] == loads  # every worker computes the same placement
    assert max(loads) == 400_000 * 4 and min(loads) > 100_000  # MXNet: 1,722,000 and 2,320
    assert results[0]["servers"]["4"] != results[0]["servers"]["2"]  # fc1 and conv2 apart


def test_ps_verbose_lines(tmp_path: Path) -> None:
    run, results = launch(tmp_path, "noop", env={pc.VERBOSE: "1"})
    ok(run, results)
    text = run.stdout + run.stderr
    for pattern in (r"H Bind to role=scheduler, ip=127\.0\.0\.1, port=\d+",
                    r"S\[\?\] Bind to role=server, ip=127\.0\.0\.1, port=\d+",
                    r"H assign rank=1 to node role=worker, ip=127\.0\.0\.1",
                    r"H the scheduler is connected to 2 workers and 1 servers",
                    r"S\[0\] is connected to others", r"W\[1\] is connected to others",
                    r"H Barrier count for workers : 2", r"W\[0\] is stopping",
                    r"S\[0\] is stopped", r"H is stopped"):
        assert re.search(pattern, text), f"{pattern!r} not in output:\n{text}"
    assert "cmd=PUSH" not in text


def test_ps_verbose_2_logs_every_message(tmp_path: Path) -> None:
    run, results = launch(tmp_path, "optim", env={pc.VERBOSE: "2"})
    ok(run, results)
    text = run.stdout + run.stderr
    # one item: a 16-byte index and 6 float32
    assert re.search(r"W\[0\] => S\[0\]: cmd=PUSH key=0 part=0 items=1 bytes=40", text), text
    assert re.search(r"S\[0\] <= worker 1 \(pid \d+ on 127\.0\.0\.1\): cmd=PUSH", text), text
    assert re.search(r"W\[1\] <= S\[0\]: cmd=VALUES key=0 part=0 req=\d+ seq=\d+ items=1 "
                     r"bytes=40", text), text
