"""Peers without the job's secret against a running job: they cannot keep a real node out,
nor make a KV process hold more than 64 MB (issue 12). Loopback only; every attack is
bounded in connections, bytes and seconds (``tests/bin/kv_attack.py``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.helpers import BIN, free_port
from support.kvjob import SECRET, KVJob, worker_command

import pscontract as pc
from trainer.kv import protocol as P

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BOUND_MB = 64
TOKEN = P.gate_token(P.secret_key(SECRET)).decode()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Sampler(threading.Thread):
    """The peak RSS of some processes, sampled every 10 ms."""

    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.base = {n: rss_mb(p) for n, p in pids.items()}
        self.peak = dict(self.base)
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            for n, p in self.pids.items():
                try:
                    self.peak[n] = max(self.peak[n], rss_mb(p))
                except OSError:
                    pass
            time.sleep(0.01)

    def growth(self) -> dict[str, float]:
        self.stopped.set()
        self.join(5)
        return {n: round(self.peak[n] - self.base[n], 1) for n in self.pids}


def attack(mode: str, port: int, *args: str, timeout: float = 60) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(BIN / "kv_attack.py"), mode, "--port", str(port),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def result(proc: subprocess.Popen, timeout: float = 60) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def wait_files(paths: list[Path], timeout: float, job: KVJob) -> None:
    end = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < end, job.outputs()
        job.poll()
        assert not job.exit_times, job.outputs()  # nobody may fail meanwhile
        time.sleep(0.02)


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


def started_job(make, tmp_path: Path, scenario: str, **kw) -> tuple[KVJob, int]:
    """A job whose server listens on a known port (so an attacker can aim at it first)."""
    server_port = free_port()
    env = {pc.PORT_RANGE: f"{server_port}-{server_port}", pc.VERBOSE: "1", **kw.pop("env", {})}
    job = make(command=worker_command(scenario, "--out", str(tmp_path)), env=env, **kw)
    return job, server_port


def test_memory_before_authentication_stays_bounded(job_factory, tmp_path: Path) -> None:
    job, server_port = started_job(job_factory, tmp_path, "big", start_timeout=60)
    job.start()
    wait_files([tmp_path / f"ready-{r}" for r in range(job.workers)], 120, job)
    victims = {"scheduler": job.port, "server-0": server_port}
    sampler = Sampler({n: job.procs[n].pid for n in victims})
    sampler.start()
    attacks = [("null-frame", ()), ("big-frame", ()), ("big-frame", ("--token", TOKEN)),
               ("null-stream", ()), ("slow-frames", ("--count", "200", "--seconds", "4"))]
    report = []
    for name, port in victims.items():
        for mode, extra in attacks:
            got = result(attack(mode, port, "--seconds", "4", *extra))
            report.append((name, mode, "token" if extra[:1] == ("--token",) else "", got))
    growth = sampler.growth()
    print("\nattacks before authentication (peak RSS growth, MB):", growth)
    for row in report:
        print("  ", *row)
    for name, mb in growth.items():
        assert mb <= BOUND_MB, (name, growth, report)
    for name, mode, _, got in report:
        if mode == "slow-frames":  # the connections over the bound were dropped
            assert got["still_open"] <= 32, (name, got)
        else:  # nothing near the announced 4 GiB got in
            assert got["bytes"] < 256 << 20, (name, mode, got)
    # the job goes on: a 256 MB array pushed and pulled by both workers
    (tmp_path / "go").write_text("")
    codes = job.wait(180)
    assert set(codes.values()) == {0}, job.outputs()
    for r in range(job.workers):
        done = json.loads((tmp_path / f"worker-{r}.json").read_text())
        assert done["big"] == [3.0, 3.0, 64 << 20]
    for name in victims:
        text = job.output(name)
        assert re.search(r"refused or dropped \d+ connections or messages \(.*gate-failed", text)
        assert "connection-evicted" in text or "connection-expired" in text, text


@pytest.mark.parametrize("token", [False, True], ids=["strangers", "token-holders"])
def test_a_handshake_flood_keeps_no_node_out(job_factory, tmp_path: Path, token: bool) -> None:
    """The issue's floods (500 DEALERs sending HELLO once, 300 sending it for seconds) on the
    scheduler's and the server's ports, from before the job starts until after: every node
    gets in, the job's result is right. Strangers are refused at ZeroMQ's gate; token holders
    (a peer that read the gate's token off the wire) reach our handshake and lose there."""
    job, server_port = started_job(job_factory, tmp_path, "sync", start_timeout=60,
                                   env={pc.BIGARRAY_BOUND: "100"})
    extra = ("--token", TOKEN) if token else ()
    floods = []
    for port in (job.port, server_port):
        floods.append(attack("hello-burst", port, "--count", "500", "--seconds", "12", *extra))
        floods.append(attack("hello-flood", port, "--count", "300", "--seconds", "12", *extra))
    time.sleep(2)  # the flood is on before the first node starts
    t0 = time.monotonic()
    job.start()
    codes = job.wait(120)
    elapsed = time.monotonic() - t0
    stats = [result(f) for f in floods]
    print(f"\nhandshake flood ({'token holders' if token else 'strangers'}): the job ran in "
          f"{elapsed:.1f} s; floods: {stats}")
    assert set(codes.values()) == {0}, job.outputs()
    results = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())
               for p in tmp_path.glob("worker-*.json")}
    assert sorted(results) == [0, 1] and results[0]["sum"] == [6.0] * 4
    # liveness: a node kept out past PS_START_TIMEOUT (60 s) fails the job, which the codes show;
    # the whole job (its start under the flood, its work, its stop) ends well within 60 + 30 s
    assert elapsed < 90, job.outputs()
    sched = job.output("scheduler")
    print("scheduler: " + " | ".join(line for line in sched.splitlines() if "refused or dropped" in line))
    if token:
        # The flood reached our handshake: the scheduler counted what it dropped there. (The
        # flood's own count of answers is no proof either way: on a busy machine every HELLO can
        # be dropped unanswered, which is the defence working.)
        assert re.search(r"refused or dropped \d+ .*(flood|handshake-evicted|connection-)", sched), sched
    else:
        assert sum(s["answers"] for s in stats) == 0  # strangers never hear a word
        # The scheduler refused the flood before our handshake: at ZeroMQ's gate, or evicted by the
        # limit on connections that have not authenticated. Which of the two takes a stranger
        # depends on the machine's speed (fresh CI runs: 51 of 5,229 and 0 of 6,563 at the gate;
        # hundreds before), never anything of ours beyond them. A few drops may come from our
        # handshake all the same: the job's own nodes connect from the flood's address, so the
        # limit can evict a real node's connection between its HELLO and its AUTH, and that AUTH
        # then arrives on the new connection ("unauthenticated": AUTH without HELLO; seen once
        # in a fresh CI run, 1 of 23,863). Strangers cannot pass the gate to send one, so such
        # drops stay at the nodes' few retries, never near the flood's hundreds.
        m = re.search(r"refused or dropped (\d+) connections or messages \(([^)]*)\)", sched)
        assert m and int(m[1]) >= 100, sched
        counts = {part.split(": ")[0]: int(part.split(": ")[1]) for part in m[2].split(", ")}
        assert counts.get("gate-failed", 0) + counts.get("connection-evicted", 0) >= 100, sched
        beyond = {k: n for k, n in counts.items() if k not in ("gate-failed", "connection-evicted")}
        assert set(beyond) <= {"unauthenticated"} and sum(beyond.values()) <= 8, sched
