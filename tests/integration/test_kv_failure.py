"""Failure detection: every process exits non-zero, naming the culprit, within the
heartbeat timeout, with no launcher to clean up (its fail-fast is not involved)."""

from __future__ import annotations

import re
import signal
import socket
import time
from pathlib import Path

import pytest
from support.kvjob import KVJob, worker_command

import pscontract as pc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

HEARTBEAT_TIMEOUT = 10.0  # the default


def causes(text: str) -> list[tuple[str | None, int | None, str]]:
    """The cause lines (pscontract.cause_line) in a process's output."""
    return [c for c in map(pc.parse_cause, text.splitlines()) if c is not None]


def only_cause(job: KVJob, name: str) -> tuple[str | None, int | None, str]:
    found = causes(job.output(name))
    assert len(found) == 1, job.output(name)
    return found[0]


def wait_file(path: Path, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path.name} never appeared"
        time.sleep(0.05)


@pytest.fixture
def job_factory(tmp_path: Path):
    jobs = []

    def make(**kw) -> KVJob:
        job = KVJob(tmp_path, **kw)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.cleanup()


def stalled_job(make, tmp_path: Path, **kw) -> KVJob:
    job = make(command=worker_command("stall", "--out", str(tmp_path)), **kw).start()
    for rank in range(job.workers):
        wait_file(tmp_path / f"ready-{rank}", 90)
    time.sleep(0.3)  # the others are now blocked in pushpull, waiting for rank 1
    return job


def test_killed_worker_stops_everyone_naming_it(job_factory, tmp_path: Path) -> None:
    job = stalled_job(job_factory, tmp_path, servers=2)
    killed = job.signal("worker-1", signal.SIGKILL)
    codes = job.wait(HEARTBEAT_TIMEOUT + 5)
    last = max(job.exit_times.values())
    print(f"\nfailure detection: every process exited {last - killed:.2f} s after SIGKILL of worker 1")
    assert codes["worker-1"] == -signal.SIGKILL
    for name in ("scheduler", "server-0", "server-1", "worker-0"):
        assert codes[name] not in (None, 0), (name, codes, job.outputs())
        assert "worker 1 (task 1, pid" in job.output(name), job.output(name)
        assert "disconnected before the end of the job" in job.output(name)
    assert last - killed < HEARTBEAT_TIMEOUT
    role, rank, reason = only_cause(job, "scheduler")  # for the launcher's report
    assert (role, rank) == ("worker", 1) and "disconnected before the end of the job" in reason
    for name in ("server-0", "server-1", "worker-0"):  # told by the scheduler: no cause of theirs
        assert causes(job.output(name)) == [], job.output(name)


def test_hung_worker_is_caught_by_heartbeats(job_factory, tmp_path: Path) -> None:
    job = stalled_job(job_factory, tmp_path, env={pc.HEARTBEAT_INTERVAL: "0.5",
                                                  pc.HEARTBEAT_TIMEOUT: "3"})
    stopped = job.signal("worker-1", signal.SIGSTOP)  # alive, connected, silent
    codes = job.wait(15, names=["scheduler", "server-0", "worker-0"])
    elapsed = max(job.exit_times.values()) - stopped
    print(f"\nhang detection: every other process exited {elapsed:.2f} s after SIGSTOP of worker 1 "
          "(PS_HEARTBEAT_TIMEOUT=3)")
    job.signal("worker-1", signal.SIGKILL)
    for name in ("scheduler", "server-0", "worker-0"):
        assert codes[name] not in (None, 0), (name, job.outputs())
        assert "worker 1 (task 1, pid" in job.output(name)
        assert "sent no heartbeat for 3 s (PS_HEARTBEAT_TIMEOUT)" in job.output(name)
    # detected by the heartbeat path (not earlier); the rest is the processes' own exit
    assert 2.5 < elapsed < 3 + 7
    role, rank, reason = only_cause(job, "scheduler")
    assert (role, rank) == ("worker", 1) and "sent no heartbeat for 3 s" in reason


def test_exception_in_a_worker_is_reported_to_all(job_factory, tmp_path: Path) -> None:
    job = job_factory(command=worker_command("fail")).start()
    codes = job.wait(90)
    assert all(c not in (None, 0) for c in codes.values()), job.outputs()
    assert "ValueError: simulated bug in the training loop" in job.output("worker-1")
    for name in ("scheduler", "server-0", "worker-0"):
        assert "worker 1 (task 1, pid" in job.output(name)
        assert "failed: ValueError: simulated bug in the training loop" in job.output(name)
    role, rank, reason = only_cause(job, "scheduler")
    assert (role, rank) == ("worker", 1) and "simulated bug" in reason


def test_killed_server_stops_everyone(job_factory, tmp_path: Path) -> None:
    job = stalled_job(job_factory, tmp_path)
    killed = job.signal("server-0", signal.SIGKILL)
    codes = job.wait(HEARTBEAT_TIMEOUT + 5, names=["scheduler", "worker-0", "worker-1"])
    assert max(job.exit_times.values()) - killed < HEARTBEAT_TIMEOUT
    for name in ("scheduler", "worker-0", "worker-1"):
        assert codes[name] not in (None, 0), (name, job.outputs())
        assert "server 0 (task 2, pid" in job.output(name)
    assert only_cause(job, "scheduler")[:2] == ("server", 0)


def test_killed_scheduler_stops_everyone(job_factory, tmp_path: Path) -> None:
    job = stalled_job(job_factory, tmp_path)
    killed = job.signal("scheduler", signal.SIGKILL)
    codes = job.wait(HEARTBEAT_TIMEOUT + 5, names=["server-0", "worker-0", "worker-1"])
    assert max(job.exit_times.values()) - killed < HEARTBEAT_TIMEOUT
    for name in ("server-0", "worker-0", "worker-1"):
        assert codes[name] not in (None, 0), (name, job.outputs())
        assert "lost the connection to the scheduler at 127.0.0.1" in job.output(name)
        role, rank, reason = only_cause(job, name)  # each saw it on its own
        assert (role, rank) == ("scheduler", None) and "exited or was killed" in reason


def test_missing_server_times_out_instead_of_hanging(job_factory) -> None:
    job = job_factory(command=worker_command("noop"), skip=["server-0"], start_timeout=8).start()
    codes = job.wait(40)
    assert codes["scheduler"] == 1, job.outputs()
    assert codes["worker-0"] not in (None, 0) and codes["worker-1"] not in (None, 0)
    text = job.output("scheduler")
    assert "timed out after 8 s (PS_START_TIMEOUT) waiting for " in text, text
    assert "server 0 (task 2)" in text and "to register with the scheduler at 127.0.0.1:" in text
    assert only_cause(job, "scheduler")[:2] == ("server", 0)
    for name in ("worker-0", "worker-1"):
        # told by the scheduler, or (if it started after the scheduler gave up) its own timeout
        text = job.output(name)
        assert "server 0 (task 2)" in text or "in time" in text, text


def test_missing_scheduler_times_out(job_factory) -> None:
    job = job_factory(command=worker_command("noop"), workers=1,
                      skip=["scheduler", "server-0"], start_timeout=2).start()
    codes = job.wait(30)
    assert codes["worker-0"] not in (None, 0)
    text = job.output("worker-0")
    assert (f"cannot reach the scheduler at 127.0.0.1:{job.port} from host "
            f"{socket.gethostname()} (127.0.0.1) within 2 s (PS_START_TIMEOUT): connection "
            "refused") in text, text
    # the cause line names this worker, for the launcher's report
    causes = [pc.parse_cause(line) for line in text.splitlines() if pc.parse_cause(line)]
    assert len(causes) == 1 and causes[0][:2] == ("worker", 0), text


def test_wrong_secret_is_rejected(job_factory) -> None:
    # a start timeout long enough for worker 1 to start (torch) on a busy machine
    job = job_factory(command=worker_command("noop"), start_timeout=20,
                      role_env={"worker-1": {pc.SECRET: "77" * 32}}).start()
    codes = job.wait(60)
    assert codes["worker-1"] not in (None, 0)
    assert ("cannot authenticate with the scheduler at 127.0.0.1" in job.output("worker-1")
            and "PSLAUNCH_SECRET" in job.output("worker-1")), job.output("worker-1")
    assert only_cause(job, "worker-1")[:2] == ("worker", 1)
    # the job cannot start without worker 1: a timeout naming it, not a hang
    assert codes["scheduler"] == 1
    assert "waiting for worker 1 (task 1)" in job.output("scheduler")
    assert only_cause(job, "scheduler")[:2] == ("worker", 1)


@pytest.mark.parametrize("how", ["connection refused", "timed out"])
def test_an_unreachable_scheduler_is_reported_while_waiting(job_factory, how: str) -> None:
    """Nothing listens (refused), or a listener that never accepts (a full backlog: the
    connection attempts time out, as behind a firewall that drops them)."""
    blocker = held = None
    if how == "timed out":
        blocker = socket.socket()
        blocker.bind(("127.0.0.1", 0))
        blocker.listen(0)
        held = socket.create_connection(blocker.getsockname())  # fills the backlog
    try:
        job = job_factory(command=worker_command("noop"), workers=1, start_timeout=7,
                          skip=["scheduler", "server-0"], env={pc.VERBOSE: "1"})
        if blocker is not None:
            job.port = blocker.getsockname()[1]
        job.start()
        codes = job.wait(40)
    finally:
        for s in (held, blocker):
            if s is not None:
                s.close()
    assert codes["worker-0"] not in (None, 0)
    text = job.output("worker-0")
    where = f"the scheduler at 127.0.0.1:{job.port}"
    assert f"W[?] connecting to {where} (PS_START_TIMEOUT 7 s)" in text, text  # level 1
    assert f"W[?] cannot reach {where}: {how}" in text, text  # level 1, at once
    assert re.search(rf"W\[\?\] still cannot reach {re.escape(where)} \(\d s of 7 s\): {how}",
                     text), text  # every 5 s, at any level
    role, rank, reason = only_cause(job, "worker-0")
    assert (role, rank) == ("worker", 0)
    assert reason.startswith(f"cannot reach {where} from host {socket.gethostname()} "
                             f"(127.0.0.1) within 7 s (PS_START_TIMEOUT): {how}"), reason


def test_still_cannot_reach_is_said_at_level_0(job_factory) -> None:
    job = job_factory(command=worker_command("noop"), workers=1, start_timeout=6,
                      skip=["scheduler", "server-0"]).start()
    job.wait(40)
    text = job.output("worker-0")
    assert "connecting to" not in text  # the level-1 line
    assert re.search(r"still cannot reach the scheduler at 127\.0\.0\.1:\d+ \(\d s of 6 s\): "
                     "connection refused", text), text
