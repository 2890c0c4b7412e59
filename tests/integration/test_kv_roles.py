"""``python -m trainer.kv``, role start-up, addresses and ports, and hostile peers."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from support.kvjob import REPO, SECRET, KVJob, free_port, worker_command

import pscontract as pc
from trainer.kv import protocol as P

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROLE_CMD = [sys.executable, "-m", "trainer.kv"]


def role_env(role: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env[pc.PYTHONPATH] = str(REPO)
    env.update(pc.contract(role, root_uri="127.0.0.1", root_port=free_port(),
                                num_workers=1, num_servers=1, secret=SECRET, start_timeout=1,
                                job_id="j", task_id=None if role == "scheduler" else 1,
                                cluster=None if role == "scheduler" else "local",
                                node_host=None if role == "scheduler" else "127.0.0.1"))
    env.update(extra)
    return env


def run_role(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*ROLE_CMD, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def test_worker_role_is_refused() -> None:
    r = run_role(role_env("worker"))
    assert r.returncode == 2
    assert "trainer.kv runs the scheduler and server roles, but DMLC_ROLE=worker" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_missing_secret_is_one_line_and_insecure_waives_it() -> None:
    env = role_env("scheduler")
    del env[pc.SECRET]
    r = run_role(env)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "PSLAUNCH_SECRET is not set" in r.stderr and "--insecure" in r.stderr
    # --insecure: it runs (and times out after PS_START_TIMEOUT=1 s, with nobody there)
    r = run_role(env, "--insecure")
    assert r.returncode == 1, r.stderr
    assert "not authenticated" in r.stderr and "timed out after 1 s" in r.stderr


def test_bad_contract_is_a_usage_error() -> None:
    r = run_role(role_env("server", **{pc.NUM_WORKER: "two"}))
    assert r.returncode == 2 and "DMLC_NUM_WORKER='two' is not an integer" in r.stderr


def test_roles_do_not_import_torch() -> None:
    # python -X importtime lists every import on stderr; the role exits after its timeout
    env = role_env("server")
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import trainer.kvstore"],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1  # no scheduler: a timeout error, then exit
    assert re.search(r"\|\s+trainer\.kv\.server$", r.stderr, re.M)
    assert not re.search(r"\|\s+torch\b", r.stderr)


@pytest.fixture
def job(tmp_path: Path):
    jobs: list[KVJob] = []

    def make(**kw) -> KVJob:
        j = KVJob(tmp_path, **kw)
        jobs.append(j)
        return j

    yield make
    for j in jobs:
        j.cleanup()


def test_python_m_trainer_kv_runs_scheduler_and_server(job) -> None:
    j = job(role_command={"scheduler": ROLE_CMD, "server": ROLE_CMD,
                          "worker": worker_command("noop")}).start()
    codes = j.wait(90)
    assert set(codes.values()) == {0}, j.outputs()


def test_port_range_is_honoured(job, tmp_path: Path) -> None:
    lo = free_port()
    j = job(servers=2, command=worker_command("noop"),
            env={pc.PORT_RANGE: f"{lo}-{lo + 20}", pc.VERBOSE: "1"}).start()
    codes = j.wait(90)
    assert set(codes.values()) == {0}, j.outputs()
    ports = [int(m) for n in ("server-0", "server-1")
             for m in re.findall(r"Bind to role=server, ip=127\.0\.0\.1, port=(\d+)", j.output(n))]
    assert len(ports) == 2 and len(set(ports)) == 2 and all(lo <= p <= lo + 20 for p in ports)


def test_hostile_peers_are_never_served(job, tmp_path: Path) -> None:
    """Bare TCP connections, garbage, a wrong secret and forged messages against the
    scheduler and a server of a running job: all dropped, the job still succeeds."""
    j = job(command=worker_command("gate", "--out", str(tmp_path)),
            env={pc.VERBOSE: "1"}).start()
    for rank in range(2):
        end = time.monotonic() + 90
        while not (tmp_path / f"ready-{rank}").exists():
            assert time.monotonic() < end, j.outputs()
            time.sleep(0.05)
    server_port = int(re.search(r"Bind to role=server, ip=127\.0\.0\.1, port=(\d+)",
                                j.output("server-0")).group(1))
    for port in (j.port, server_port):
        # the launcher's probe: connect and close; then raw garbage
        socket.create_connection(("127.0.0.1", port)).close()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(os.urandom(4096))
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{port}")
        # no handshake: forged data and control messages
        fake = P.Session(os.urandom(32), os.urandom(32))
        d.send_multipart([fake.seal(P.PULL, key=0), b""])
        d.send_multipart([fake.seal(P.FINALIZE)])
        d.send_multipart([b"\x01" * 68, b"x"])
        # a handshake with the wrong secret, then a forged proof
        hs = P.ClientHandshake(P.secret_key("77" * 32))
        d.send_multipart(hs.hello())
        assert d.poll(5000), "no challenge"
        challenge = d.recv_multipart()
        with pytest.raises(P.AuthError):
            hs.answer(challenge)
        d.send_multipart(P.plain(P.AUTH, [os.urandom(32)]))
        assert d.poll(5000), "no answer to a forged proof"
        assert P.plain_command(d.recv_multipart()) == P.AUTH_FAIL
        d.send_multipart([fake.seal(P.STOP)])
        d.close(0)
        ctx.term()
    (tmp_path / "go").write_text("")
    codes = j.wait(60)
    assert set(codes.values()) == {0}, j.outputs()
    for name in ("scheduler", "server-0"):
        text = j.output(name)
        assert "dropped a message from unauthenticated peer" in text, text
        assert re.search(r"dropped \d+ invalid messages \(.*auth-failed: 1", text), text
