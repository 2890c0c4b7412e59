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


# ZMTP 3.0's greeting with the NULL mechanism: a ZeroMQ peer that does not run the gate.
ZMTP_NULL_GREETING = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32)


def _dealer(ctx: zmq.Context, port: int, token: bytes | None) -> zmq.Socket:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    if token is not None:  # ZeroMQ's PLAIN handshake, as the job's own processes do it
        d.setsockopt(zmq.PLAIN_USERNAME, b"pslaunch")
        d.setsockopt(zmq.PLAIN_PASSWORD, token)
    d.connect(f"tcp://127.0.0.1:{port}")
    return d


def test_hostile_peers_are_never_served(job, tmp_path: Path) -> None:
    """Bare TCP connections, garbage, strangers at the gate, and a peer that has the
    gate's token but not the secret (as if it had read the token off the wire), against
    the scheduler and a server of a running job: all refused, the job still succeeds."""
    j = job(command=worker_command("gate", "--out", str(tmp_path)),
            env={pc.VERBOSE: "1"}).start()
    for rank in range(2):
        end = time.monotonic() + 90
        while not (tmp_path / f"ready-{rank}").exists():
            assert time.monotonic() < end, j.outputs()
            time.sleep(0.05)
    server_port = int(re.search(r"Bind to role=server, ip=127\.0\.0\.1, port=(\d+)",
                                j.output("server-0")).group(1))
    fake = P.Session(os.urandom(32), os.urandom(32))
    forged = [[fake.seal(P.PULL, count=0), b""], [fake.seal(P.FINALIZE)], [b"\x01" * 68, b"x"]]
    for port in (j.port, server_port):
        # the launcher's probe: connect and close; then raw garbage
        socket.create_connection(("127.0.0.1", port)).close()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(os.urandom(4096))
        with socket.create_connection(("127.0.0.1", port)) as s:  # ZeroMQ without the gate
            s.sendall(ZMTP_NULL_GREETING)
            s.recv(64)
        ctx = zmq.Context()
        # strangers: no PLAIN handshake at all, or another job's token
        for token in (None, P.gate_token(P.secret_key("77" * 32))):
            d = _dealer(ctx, port, token)
            for frames in forged:
                d.send_multipart(frames)
            d.send_multipart(P.ClientHandshake(P.secret_key("77" * 32)).hello())
            assert not d.poll(1000), "a stranger got an answer"
            d.close(0)
        # the right token, the wrong secret: forged messages, a handshake, a forged proof
        d = _dealer(ctx, port, P.gate_token(P.secret_key(SECRET)))
        for frames in forged:
            d.send_multipart(frames)
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
        assert "refused or dropped a connection from 127.0.0.1" in text, text
        counts = re.search(r"refused or dropped \d+ connections or messages \((.*)\)", text)
        assert counts, text
        for reason in ("auth-failed: 1", "gate-refused: 1", "gate-failed: ", "unauthenticated: "):
            assert reason in counts.group(1), text
        # the last line at PS_VERBOSE=1 says what happened before authentication
        assert re.search(r"is stopped \(\d+ connections accepted, \d+ authenticated, \d+ closed "
                         r"during ZeroMQ's handshake; refused or dropped: .*gate-refused: 1", text)
