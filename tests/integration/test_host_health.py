# ruff: noqa: F811 - the testbed fixture is imported, and test arguments share its name
"""Hosts that fail, on the ssh namespace testbed (tests/support/testbed.py): a torch job (gloo,
``--tracker torch``) with ``--max-restarts`` whose host's link is taken down mid-job.

* a spare takes the lost host's place and the job finishes (the summary names both);
* without a spare, ``-n 2:4`` goes on with 3 workers (``WORLD_SIZE=3``);
* a job that cannot keep its minimum ends with one line;
* a host that does not answer when the job starts again is left out, and a spare takes its place.

The worker is tests/bin/elastic_worker.py: each rank writes when it joined, then attempt 0 holds
until the link goes down. Deadlines are for liveness only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.helpers import BIN, REPO, pslaunch_argv, wait_for
from support.testbed import Testbed, TestHost

pytestmark = [pytest.mark.integration, pytest.mark.ssh]

WORKER = str(BIN / "elastic_worker.py")
DEADLINE = 240.0  # liveness only
KEEPALIVE = "1"  # a host is lost after 4 silent keep-alive intervals


def leftovers(testbed: Testbed) -> dict[str, list[int]]:
    return {h.name: pids for h in testbed.hosts if (pids := testbed.job_pids(h))}


@pytest.fixture(autouse=True)
def _clean_hosts(testbed: Testbed):
    """Every test starts and ends with no job process on any host (the downed host's wrapper stops
    its processes by itself once the keep-alives stop reaching it)."""
    wait_for(lambda: not leftovers(testbed), 30, interval=0.2, what="no job process on any host")
    yield
    wait_for(lambda: not leftovers(testbed), 30, interval=0.2, what="no job process on any host")


def start_job(testbed: Testbed, hostfile: Path, n: str, out: Path, summary: Path, *args: str,
              delay: str = "0.5") -> subprocess.Popen:
    argv = pslaunch_argv("--launcher", "ssh", "-H", str(hostfile), "-n", n, "--tracker", "torch",
                         "--max-restarts", "2", "--restart-delay", delay, "--kill-grace", "2",
                         "--ssh-keepalive", KEEPALIVE, "--ssh-connect-timeout", "5", "--timeout", str(DEADLINE),
                         "--summary-json", str(summary), "--env", "PSLAUNCH_NETGUARD_LOG", sys.executable, WORKER,
                         "--out", str(out), *(args or ("--hold", "600")))
    return subprocess.Popen(argv, cwd=REPO, env=testbed.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def records(out: Path, attempt: int) -> dict[int, dict]:
    return {int(f.stem.split("-r")[1]): json.loads(f.read_text()) for f in out.glob(f"a{attempt}-r*.json")}


def take_down_while_running(testbed: Testbed, p: subprocess.Popen, out: Path, ranks: int,
                            down: TestHost) -> tuple[float, str, str]:
    """Wait until every rank of attempt 0 joined, take ``down``'s link down, and wait for the job's
    end; the link is back up in any case. ``(when the link went down, stdout, stderr)``."""
    try:
        try:
            wait_for(lambda: len(records(out, 0)) == ranks or p.poll() is not None, DEADLINE, interval=0.1,
                     what=f"{ranks} ranks of attempt 0 joined")
            assert p.poll() is None, p.communicate()
            t_down = time.time()
            testbed.link(down, up=False)
            stdout, stderr = p.communicate(timeout=DEADLINE)
            return t_down, stdout, stderr
        finally:
            testbed.link(down, up=True)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


def hosts_of(testbed: Testbed, recs: dict[int, dict]) -> list[str]:
    """The testbed host each rank ran on, by rank."""
    names = []
    for _, rec in sorted(recs.items()):
        host = testbed.host_of(rec["netns"])
        names.append(host.addr_a if host is not None else "launcher")
    return names


@pytest.mark.timeout(300)
def test_a_lost_host_is_left_out_and_a_spare_takes_its_place(testbed: Testbed, shared_out: Path,
                                                             tmp_path: Path) -> None:
    h = testbed.hosts
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{h[0].addr_a}\n{h[1].addr_a}\n{h[2].addr_a}\n{h[3].addr_a} spare\n")
    summary = tmp_path / "summary.json"
    p = start_job(testbed, hostfile, "3", shared_out, summary)
    t_down, _, err = take_down_while_running(testbed, p, shared_out, 3, h[1])
    assert p.returncode == 0, err
    assert hosts_of(testbed, records(shared_out, 0)) == [h[0].addr_a, h[1].addr_a, h[2].addr_a]
    last = records(shared_out, 1)
    assert hosts_of(testbed, last) == [h[0].addr_a, h[3].addr_a, h[2].addr_a], err
    assert {r["world"] for r in last.values()} == {3}
    assert f"host {h[1].addr_a} is lost: no reply to keep-alives" in err
    assert f"leaving out host {h[1].addr_a} for " in err
    assert "s more: lost in attempt 0: no reply to keep-alives" in err
    assert f"spare {h[3].addr_a} takes the place of {h[1].addr_a}" in err
    doc = json.loads(summary.read_text())
    first, second = doc["attempts"]
    assert first["reason"] == "failure" and first["cause"]["host"] == h[1].addr_a and first["hosts"] is None
    assert second["reason"] == "success"
    assert second["hosts"]["used"] == [h[0].addr_a, h[3].addr_a, h[2].addr_a]
    assert second["hosts"]["spares"] == [{"spare": h[3].addr_a, "replaces": h[1].addr_a}]
    (out,) = second["hosts"]["excluded"]
    assert out["host"] == h[1].addr_a and out["reason"].startswith("lost in attempt 0: no reply to keep-alives")
    assert 60.0 <= out["cooldown"] <= 120.0
    started = min(r["started"] for r in last.values()) - t_down
    joined = max(r["joined"] for r in last.values()) - t_down
    print(f"link down -> attempt 1's first rank started {started:.1f}s later, every rank joined (the spare "
          f"{h[3].addr_a} training in place of {h[1].addr_a}) {joined:.1f}s later")


@pytest.mark.timeout(300)
def test_without_a_spare_min_max_goes_on_with_three_workers(testbed: Testbed, shared_out: Path,
                                                            tmp_path: Path) -> None:
    h = testbed.hosts
    hostfile = testbed.write_hostfile(tmp_path / "hosts", h[:4])
    summary = tmp_path / "summary.json"
    p = start_job(testbed, hostfile, "2:4", shared_out, summary)
    t_down, _, err = take_down_while_running(testbed, p, shared_out, 4, h[2])
    assert p.returncode == 0, err
    last = records(shared_out, 1)
    assert sorted(last) == [0, 1, 2], err
    assert {(r["world"], r["WORLD_SIZE"], r["DMLC_NUM_WORKER"]) for r in last.values()} == {(3, "3", "3")}
    assert hosts_of(testbed, last) == [h[0].addr_a, h[1].addr_a, h[3].addr_a]
    assert f"the next attempt runs 3 of 4 workers (-n 2:4): {h[2].addr_a} is out and no spare is left" in err
    doc = json.loads(summary.read_text())
    assert doc["attempts"][1]["hosts"]["workers"] == 3 and doc["attempts"][1]["hosts"]["dropped"] == [h[2].addr_a]
    assert len(doc["processes"]) == 3
    joined = max(r["joined"] for r in last.values()) - t_down
    print(f"link down -> 3 of 4 workers joined again {joined:.1f}s later")


@pytest.mark.timeout(300)
def test_a_job_that_cannot_keep_its_minimum_ends_with_one_line(testbed: Testbed, shared_out: Path,
                                                               tmp_path: Path) -> None:
    h = testbed.hosts
    hostfile = testbed.write_hostfile(tmp_path / "hosts", h[:2])
    summary = tmp_path / "summary.json"
    p = start_job(testbed, hostfile, "2:2", shared_out, summary)
    _, _, err = take_down_while_running(testbed, p, shared_out, 2, h[1])
    assert p.returncode == 255, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"pslaunch: error: attempt 1 failed and the job cannot go on: the hosts left hold 1 "
                           f"worker, fewer than -n 2:2's minimum, and the hostfile has no spare; left out: "
                           f"{h[1].addr_a} (lost in attempt 0: no reply to keep-alives"), err
    assert "Traceback" not in err and "restarting" not in err
    doc = json.loads(summary.read_text())
    assert len(doc["attempts"]) == 1 and doc["attempts"][0]["delay"] is None
    assert not records(shared_out, 1)


@pytest.mark.timeout(300)
def test_a_host_that_does_not_answer_when_the_job_starts_again_is_left_out(testbed: Testbed, shared_out: Path,
                                                                          tmp_path: Path) -> None:
    h = testbed.hosts
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{h[0].addr_a}\n{h[1].addr_a}\n{h[2].addr_a}\n{h[3].addr_a} spare\n")
    summary = tmp_path / "summary.json"
    # rank 0 fails in attempt 0; h2's link goes down while the job waits to restart (after the teardown)
    p = start_job(testbed, hostfile, "3", shared_out, summary, "--fail", "0", delay="3")
    lines: list[str] = []
    readers = [threading.Thread(target=lambda f=f, keep=keep: keep.extend(f), daemon=True)
               for f, keep in ((p.stdout, []), (p.stderr, lines))]
    for t in readers:
        t.start()
    try:
        try:
            wait_for(lambda: any("restarting every process in" in x for x in lines) or p.poll() is not None,
                     DEADLINE, interval=0.05, what="attempt 0's failure")
            testbed.link(h[2], up=False)
            p.wait(timeout=DEADLINE)
        finally:
            testbed.link(h[2], up=True)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for t in readers:
            t.join(10)
    err = "".join(lines)
    assert p.returncode == 0, err
    assert f"{h[2].addr_a}: cannot reach {h[2].addr_a}:" in err
    assert f"attempt 2/3 failed: its start failed: {h[2].addr_a}: cannot reach" in err
    assert f"spare {h[3].addr_a} takes the place of {h[2].addr_a}" in err
    doc = json.loads(summary.read_text())
    assert [a["reason"] for a in doc["attempts"]] == ["failure", "failure", "success"]
    assert doc["attempts"][1]["cause"]["unreachable"] == [h[2].addr_a]
    assert doc["attempts"][2]["hosts"]["spares"] == [{"spare": h[3].addr_a, "replaces": h[2].addr_a}]
    assert hosts_of(testbed, records(shared_out, 2)) == [h[0].addr_a, h[1].addr_a, h[3].addr_a]
