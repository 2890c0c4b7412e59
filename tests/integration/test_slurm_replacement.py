"""``--restart-scope process`` on ``--launcher slurm``: a lost worker is replaced in place.

On the Slurm test cluster (scripts/setup-slurm.sh), a parameter-server job (``tests/bin/lose_worker.py``)
loses worker 1 (it SIGKILLs itself): its replacement runs as a step of its own, one task on the
node where the lost one ran, in the same allocation, connected to the job's hub, labelled like the
lost one; the scheduler and the server run on (their pids never change), and nothing is left in
``squeue`` afterwards. When the worker is lost once more than ``--max-restarts`` allows, the job
ends with the last loss's code and says that the budget is used up.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Optional

import pytest
from support.clusters import SlurmCluster as Probes
from support.helpers import REPO, run_pslaunch
from support.slurm_testbed import SlurmCluster, slurm  # noqa: F401  (slurm is a fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

LOSE_WORKER = REPO / "tests" / "bin" / "lose_worker.py"
#: a directory whose srun refuses the replacement's step (and runs every other through Slurm's)
SRUN_REFUSING = REPO / "tests" / "bin" / "srun_refusing"
#: kill to replacement running (``--summary-json``'s lost_at to started_at), of every test run
LATENCIES: list[float] = []


@pytest.fixture
def job(tmp_path: Path, slurm: SlurmCluster):  # noqa: F811
    """A job outside an allocation, named after the test; what it left is found and removed afterwards."""
    c = Probes(tmp_path / "out")
    c.out.mkdir()
    yield c
    c.close()
    assert not c.leftovers(), c.leftovers()


def run_losing(job: Probes, times: int, *options: str, restarts: int = 2, env: Optional[dict] = None
               ) -> tuple[int, str, str, dict, dict]:
    """Run ``-n 2 -s 1`` whose worker 1 kills itself ``times`` times: exit code, stdout, stderr,
    the summary, and the processes' records (``{(name, k): record}``, k: its PSLAUNCH_REPLACEMENT)."""
    summary = job.out.parent / "summary.json"
    r = run_pslaunch(*job.argv("-n", "2", "-s", "1", "--kill-grace", "1", "--max-restarts", str(restarts),
                               "--restart-scope", "process", "--summary-json", str(summary), *options,
                               sys.executable, str(LOSE_WORKER), "--out", str(job.out), "--times", str(times)),
                     timeout=200, env=env)
    assert summary.exists(), r.stderr  # (pslaunch wrote it, however the job ended)
    records = {}
    for f in job.out.glob("*.json"):
        rec = json.loads(f.read_text())
        records[(rec["name"], rec["replacement"])] = rec
    return r.returncode, r.stdout, r.stderr, json.loads(summary.read_text()), records


def check_in_place(doc: dict, records: dict, losses: int) -> str:
    """Each loss of worker 1 was replaced on its node, in a step of its own, with the lost worker's
    variables and a marker of its own; the scheduler and the server ran once. Returns the node."""
    first = records[("worker-1", 0)]
    node = first["env"]["SLURMD_NODENAME"]
    steps = {first["env"]["SLURM_STEP_ID"]}
    assert len(doc["replacements"]) == losses, doc["replacements"]
    for k, rep in enumerate(doc["replacements"], 1):
        lost, new = records[("worker-1", k - 1)], records[("worker-1", k)]
        env = new["env"]
        assert env["SLURMD_NODENAME"] == node and new["netns"] == first["netns"], (k, env)
        assert env["SLURM_JOB_ID"] == first["env"]["SLURM_JOB_ID"], (k, env)  # the same allocation
        assert env["SLURM_STEP_ID"] not in steps, (k, env)  # a step of its own
        steps.add(env["SLURM_STEP_ID"])
        assert (env["DMLC_ROLE"], env["DMLC_TASK_ID"], env["PSLAUNCH_REPLACEMENT"]) == ("worker", "1", str(k)), env
        assert env["PSLAUNCH_PROCESS"] == first["env"]["PSLAUNCH_PROCESS"] + f"~{k}", env
        assert env["DMLC_NODE_HOST"] == first["env"]["DMLC_NODE_HOST"], env
        assert (rep["process"], rep["replacement"], rep["signal"]) == ("worker-1", k, "SIGKILL"), rep
        assert (rep["pid"], rep["new_pid"]) == (lost["pid"], new["pid"]), (rep, lost, new)
        assert rep["host"] == rep["new_host"] and node in rep["new_host"], rep
        LATENCIES.append(rep["started_at"] - rep["lost_at"])
    # the scheduler and the server ran once, from the start to the end: one record, one pid each
    by_name: dict[str, list[dict]] = {}
    for p in doc["processes"]:
        by_name.setdefault(p["name"], []).append(p)
    for name in ("scheduler", "server-0", "worker-0"):
        assert [p["pid"] for p in by_name[name]] == [records[(name, 0)]["pid"]], (name, by_name[name])
        assert [k for (n, k) in records if n == name] == [0], (name, sorted(records))
    worker1 = by_name["worker-1"]
    assert [p["pid"] for p in worker1] == [records[("worker-1", k)]["pid"] for k in range(losses + 1)], worker1
    assert [p["replaced"] for p in worker1] == [True] * losses + [False], worker1  # the lost ones stay recorded
    return node


@pytest.mark.timeout(240)
def test_a_lost_worker_is_replaced_on_its_node_and_the_job_finishes(job: Probes,
                                                                    slurm: SlurmCluster) -> None:  # noqa: F811
    code, out, err, doc, records = run_losing(job, 1)
    assert code == 0, err
    node = check_in_place(doc, records, 1)
    assert re.search(r"worker 1 on \S+ \(pid \d+\) killed by SIGKILL; replacing it in place \(restart 1/2\)",
                     err), err
    # the replacement's output is labelled like the lost worker's, and every worker finished
    assert f"[worker 1 @ {node}] worker-1 runs (replacement 1, pid {records[('worker-1', 1)]['pid']})" in out, out
    assert f"[worker 1 @ {node}] worker-1 done" in out and "all 4 processes exited 0" in err, (out, err)
    assert [p["exit_code"] for p in doc["processes"] if p["name"] == "worker-1"] == [137, 0], doc["processes"]
    assert doc["restarts"]["done"] == 1, doc["restarts"]
    assert slurm.jobs(job.name) == []  # released before pslaunch exited
    print(f"\nslurm replacement: worker 1 on {node} lost, replaced {LATENCIES[-1]:.2f}s later "
          f"(lost_at to started_at; median so far {statistics.median(LATENCIES):.2f}s of {len(LATENCIES)})")


@pytest.mark.timeout(240)
def test_a_worker_lost_more_often_than_the_budget_allows_ends_the_job(job: Probes,
                                                                      slurm: SlurmCluster) -> None:  # noqa: F811
    code, out, err, doc, records = run_losing(job, 3, "--restart-delay", "0.2")
    assert code == 137, err
    check_in_place(doc, records, 2)
    assert re.search(r"replacing it in place \(restart 1/2\)", err) and \
        re.search(r"replacing it in place in \d\.\ds \(restart 2/2\)", err), err
    assert re.search(r"attempt 1/1 failed: worker 1 on \S+ \(pid \d+\) killed by SIGKILL; 2/2 restarts used", err), err
    assert ("worker-1", 3) not in records  # no third replacement
    assert slurm.jobs(job.name) == []


@pytest.mark.timeout(240)
def test_a_replacement_whose_step_cannot_start_fails_the_job_in_one_line(job: Probes,
                                                                         slurm: SlurmCluster) -> None:  # noqa: F811
    env = {**os.environ, "PATH": f"{SRUN_REFUSING}{os.pathsep}{os.environ['PATH']}"}
    # (--max-restarts 1: the replacement uses it up, so the job ends, rather than restarting every process)
    code, out, err, doc, records = run_losing(job, 1, restarts=1, env=env)
    assert code == 137, err  # the lost worker's: it is the job's failure
    said = [x for x in err.splitlines() if "could not start a replacement" in x]
    assert len(said) == 1 and re.search(
        r"could not start a replacement for worker 1: worker 1's replacement \(Slurm step \S+ task 0\) did not "
        r"start: srun could not start the workers' step: Unable to create step for job 0", said[0]), err
    assert re.search(r"error: worker 1 \(Slurm step \S+ task 1 on \S+, pid \d+\) was killed by SIGKILL", err), err
    (rep,) = doc["replacements"]
    assert rep["new_pid"] is None and "Unable to create step" in rep["error"], rep
    assert re.search(r"attempt 1/1 failed: worker 1 on \S+ \(pid \d+\) killed by SIGKILL; 1/1 restarts used", err), err
    assert ("worker-1", 1) not in records and records[("worker-1", 0)]["pid"] == rep["pid"]
    assert {rec["env"]["PSLAUNCH_ATTEMPT"] for rec in records.values()} == {"0"}  # no second attempt
    assert slurm.jobs(job.name) == []  # (and the job fixture finds nothing of it left on the nodes)
