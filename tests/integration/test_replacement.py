"""``--restart-scope process`` (issue 34) with real programs on every backend that can replace a
lost worker in place (local, ssh on the namespace testbed, Slurm): a worker of a parameter-server
job is killed mid-run; its replacement rejoins where it ran, the scheduler and the servers run
on (each once: the pids are compared), and the job's result is that of an uninterrupted run.

The probe-program version of the same is a row of the conformance suite
(``test_a_lost_worker_is_replaced_in_place_where_the_backend_can``); the node programs' own
tests are ``test_kv_replacement.py`` (the trainer's KV store) and ``test_mxnet_recovery.py``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.clusters import CLUSTERS, Cluster, make_cluster
from support.helpers import BIN, wait_for

pytestmark = pytest.mark.integration

REPLACING = ("local", "ssh", "slurm")


@pytest.fixture(params=[pytest.param(kind, marks=CLUSTERS[kind]) for kind in REPLACING])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Cluster:
    c = make_cluster(request.param, tmp_path, request)
    yield c
    c.close()


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
