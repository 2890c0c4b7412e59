"""The hub and the node agents' channels, with the mpi backend's job behind them: each rank
wrapper sends its frames to the launcher over its own TCP connection, after both sides proved
they hold the job secret, and takes the launcher's signals on it. Real sockets, a real pump and
real wrapper processes (no mpirun: the wrapper takes its rank from the environment)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from support.helpers import REPO, pid_alive, wait_for

from launcher import node
from launcher.backends.mpi import command as mc
from launcher.backends.mpi import job as mj
from launcher.node import mpi_wire, protocol
from launcher.node.agent import connect
from launcher.node.protocol import EXIT, STARTED, STDERR, STDOUT
from launcher.runtime import hub as hub_module
from launcher.runtime.hub import Hub
from launcher.runtime.output import Console, PipePump
from launcher.spec.job import Role
from launcher.spec.plan import ProcSpec

SECRET = "5e" * 32


class Job:
    """A real MPIJob of ``n`` workers printing to in-memory consoles, and its hub."""

    def __init__(self, n: int) -> None:
        self.out, self.err = io.BytesIO(), io.BytesIO()
        console = Console(self.out, self.err, color=False)
        self.procs = [ProcSpec(Role.WORKER, i, i, None, ("x",), {}) for i in range(n)]
        self.job = mj.MPIJob([], console.proc("mpirun", "mpirun", "mpirun"), None)
        self.job.attach([mj.MPIRank(p, console.proc(p.name, p.label, "worker"), self.job, i)
                         for i, p in enumerate(self.procs)])
        self.pump = PipePump()
        self.channels = self.job.hub = Hub(self.pump, SECRET, socket.create_server(("127.0.0.1", 0)), range(n),
                                           self.job.by_rank)

    def stdout(self) -> str:
        return self.out.getvalue().decode()

    def close(self) -> None:
        self.channels.stop()
        self.pump.stop()


@pytest.fixture
def job():
    j = Job(3)
    yield j
    j.close()


def test_a_rank_that_proves_the_secret_is_heard_in_order(job: Job) -> None:
    ch = connect(job.channels.address, 1, SECRET)
    ch.send(STARTED, 1, json.dumps({"pid": 4242, "host": "h"}).encode())
    long = b"y" * (3 * protocol.LINE_PAYLOAD)
    for i in range(200):
        ch.send(STDOUT, 1, b"line %d\n" % i)
    ch.send(STDOUT, 1, long[:5000])
    ch.send(STDOUT, 1, long[5000:] + b"\n")
    ch.send(STDERR, 1, b"oops")  # (no newline: the line is whole when the stream ends)
    ch.send(EXIT, 1, b"3")
    ch.close()
    rank = job.job.ranks[1]
    wait_for(lambda: rank.channel == "closed", 5, what="the connection to end")
    assert rank.reported == 3 and rank.pid == 4242
    job.job.close(False)
    job.job.close(True)  # mpirun's streams end: the rank's streams close, partial lines flushed
    lines = job.stdout().splitlines()
    assert lines[:200] == [f"[worker 1] line {i}" for i in range(200)]
    assert lines[200] == "[worker 1] " + long.decode()
    assert job.err.getvalue().decode() == "[worker 1] oops\n"
    assert job.job.ranks[0].channel == "none" and job.job.ranks[0].reported is None


def test_a_wrong_secret_is_refused_and_never_served(job: Job, caplog) -> None:
    with pytest.raises(ConnectionError):
        connect(job.channels.address, 0, "0" * 64)
    assert job.job.ranks[0].channel == "none"
    assert "does not hold the job's secret" in caplog.text
    # Frames without a handshake are not frames of anyone.
    with socket.create_connection(job.channels.address, timeout=5) as s:
        s.sendall(b"0 " + b"00" * 16 + b" " + b"ab" * 32 + b"\n" + protocol.frame(EXIT, 0, b"0"))
        assert s.recv(4096).startswith(protocol.HELLO)
        assert s.recv(4096) == b""  # refused: closed without an answer
    assert job.job.ranks[0].reported is None
    assert SECRET not in caplog.text


def test_each_rank_connects_once_and_only_with_its_own_records(job: Job) -> None:
    ch = connect(job.channels.address, 0, SECRET)
    with pytest.raises(ConnectionError):
        connect(job.channels.address, 0, SECRET)  # rank 0 is taken
    with pytest.raises(ConnectionError):
        connect(job.channels.address, 7, SECRET)  # no such rank
    ch.send(EXIT, 2, b"9")  # rank 0 speaking for rank 2
    ch.send(EXIT, 0, b"0")
    ch.close()
    wait_for(lambda: job.job.ranks[0].channel == "closed", 5, what="the connection to end")
    assert job.job.ranks[0].reported == 0 and job.job.ranks[2].reported is None


def test_a_connection_that_never_finishes_the_handshake_is_dropped(job: Job, monkeypatch) -> None:
    monkeypatch.setattr(hub_module, "HANDSHAKE_WAIT", 0.5)
    with socket.create_connection(job.channels.address, timeout=10) as s:
        assert s.recv(4096).startswith(protocol.HELLO)
        assert s.recv(4096) == b""  # closed by the launcher, within seconds
    wait_for(lambda: not job.channels.pending, 5, what="the connection to be forgotten")


def test_the_wrapper_refuses_a_listener_that_cannot_prove_the_secret() -> None:
    srv = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = srv.accept()
        with conn:
            conn.sendall(protocol.HELLO + b"00" * 16 + b"\n")
            conn.recv(4096)
            conn.sendall(b"ok " + b"ab" * 32 + b"\n")
            conn.recv(4096)

    t = threading.Thread(target=impostor, daemon=True)
    t.start()
    with pytest.raises(ConnectionError, match="did not prove"):
        connect(srv.getsockname(), 0, SECRET)
    t.join(5)
    srv.close()


def _run_wrapper(table: dict, tmp_path, *command: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3",
           "PSLAUNCH_SECRET": SECRET, "DMLC_PS_ROOT_URI": "127.0.0.1",
           "PSLAUNCH_MPI_TABLE": mpi_wire.encode_table(table)}
    return subprocess.run([*node.command("mpirank"), "--", *command],
                          capture_output=True, timeout=60, env=env, cwd=tmp_path)


def _table(job: Job, output) -> dict:
    procs = [ProcSpec(Role.WORKER, i, i, None, ("x",), {"DMLC_ROLE": "worker", "DMLC_NODE_HOST": "127.0.0.1"})
             for i in range(3)]
    return mc.rank_table(procs, mc.rank_layout(procs), grace=1.0, hub=output)[1]


PRINTER = ("import sys\n"
           "for i in range(300): print('x' * 5000, i)\n"
           "print('bye', file=sys.stderr)\n"
           "sys.exit(5)\n")


def test_a_wrapper_sends_everything_on_its_connection(job: Job, tmp_path) -> None:
    r = _run_wrapper(_table(job, job.channels.address), tmp_path, sys.executable, "-c", PRINTER)
    assert r.returncode == 5
    assert r.stdout == b"" and r.stderr == b""  # nothing went through "mpirun"
    rank = job.job.ranks[1]
    wait_for(lambda: rank.channel == "closed", 5, what="the connection to end")
    assert rank.reported == 5 and isinstance(rank.pid, int)
    job.job.close(False)
    job.job.close(True)
    assert job.stdout().splitlines() == [f"[worker 1] {'x' * 5000} {i}" for i in range(300)]
    assert job.err.getvalue() == b"[worker 1] bye\n"


def test_a_wrapper_that_cannot_connect_falls_back_to_mpiruns_output(tmp_path) -> None:
    with socket.socket() as s:  # a port with nobody listening (held bound: nobody else takes it meanwhile)
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()
        r = _run_wrapper(_table(None, dead), tmp_path, sys.executable, "-c", PRINTER)  # type: ignore[arg-type]
    assert r.returncode == 5
    out = [protocol.unwrap(line) for line in r.stdout.splitlines()]
    assert all(p is not None and p[1] == 1 for p in out)
    assert [p[0] for p in out][0] == STARTED and [p[0] for p in out][-1] == EXIT
    lines = b"".join(p[2] for p in out if p[0] == STDOUT).decode().splitlines()
    assert lines == [f"{'x' * 5000} {i}" for i in range(300)]
    err = [protocol.unwrap(line) for line in r.stderr.splitlines()]
    warning = err[0][2].decode()
    assert "cannot send this rank's output to the launcher at 127.0.0.1:" in warning
    assert "goes through mpirun's output" in warning
    # (the program's stderr in the pieces the agent read it in: "bye" and "\n" may be two)
    assert b"".join(p[2] for p in err[1:] if p[0] == STDERR) == b"bye\n" and err[-1][0] == EXIT


# --- the launcher's commands, and the agent on its own ----------------------------------------------


def _start_wrapper(table: dict, tmp_path, *command: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3",
           "PSLAUNCH_SECRET": SECRET, "DMLC_PS_ROOT_URI": "127.0.0.1", "PYTHONFAULTHANDLER": "1",
           "PSLAUNCH_MPI_TABLE": mpi_wire.encode_table(table)}
    return subprocess.Popen([*node.command("mpirank"), "--", *command], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, cwd=tmp_path)


SLEEPER = ("import signal, sys, time\n"
           "def term(*a): print('got TERM', flush=True); sys.exit(3)\n"
           "signal.signal(signal.SIGTERM, term)\n"
           "print('ready', flush=True)\n"
           "time.sleep(60)\n")


def _ready(job: Job) -> None:
    wait_for(lambda: "[worker 1] ready" in job.stdout(), 20, what="the command to start")


@pytest.mark.timeout(60)
def test_term_from_the_launcher_reaches_the_command(job: Job, tmp_path) -> None:
    p = _start_wrapper(_table(job, job.channels.address), tmp_path, sys.executable, "-c", SLEEPER)
    try:
        _ready(job)
        assert job.channels.send(1, "TERM")
        assert p.wait(timeout=20) == 3
        wait_for(lambda: job.job.ranks[1].reported == 3, 5, what="the exit record")
        assert "[worker 1] got TERM" in job.stdout()
    finally:
        p.kill()


@pytest.mark.timeout(60)
def test_abrt_from_the_launcher_dumps_the_python_stacks(job: Job, tmp_path) -> None:
    p = _start_wrapper(_table(job, job.channels.address), tmp_path, sys.executable, "-c",
                       "print('ready', flush=True); import time; time.sleep(60)")
    try:
        _ready(job)
        assert job.channels.send(1, "ABRT")
        assert p.wait(timeout=20) == 128 + 6
        wait_for(lambda: "Fatal Python error: Aborted" in job.err.getvalue().decode(), 5, what="the dump")
        assert "[worker 1] Current thread" in job.err.getvalue().decode()
    finally:
        p.kill()


@pytest.mark.timeout(60)
def test_the_agent_stops_its_command_when_the_launcher_is_gone(job: Job, tmp_path) -> None:
    p = _start_wrapper(_table(job, job.channels.address), tmp_path, sys.executable, "-c", SLEEPER)
    try:
        _ready(job)
        job.channels.stop()  # the connection ends while the command runs
        assert p.wait(timeout=20) == 3  # the command got SIGTERM, and the wrapper its code
    finally:
        p.kill()


@pytest.mark.timeout(60)
def test_a_command_that_cannot_start_is_one_failure_record(job: Job, tmp_path) -> None:
    r = _run_wrapper(_table(job, job.channels.address), tmp_path, "no-such-program-xyz")
    assert r.returncode == 127 and r.stdout == b"" and r.stderr == b""
    rank = job.job.ranks[1]
    wait_for(lambda: rank.reported == 127, 5, what="the failure record")
    assert rank.failure.startswith("cannot run 'no-such-program-xyz': no such program or directory")
    assert rank.node.get("host")


@pytest.mark.timeout(60)
def test_a_descendant_that_left_the_process_group_is_stopped_with_the_command(job: Job, tmp_path) -> None:
    """The agent is a child subreaper: a grandchild that called setsid() is still found and stopped."""
    escape = ("import os, subprocess, sys\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
              "print(p.pid, flush=True)\n")
    r = _run_wrapper(_table(job, job.channels.address), tmp_path, sys.executable, "-c", escape)
    assert r.returncode == 0
    wait_for(lambda: job.job.ranks[1].reported == 0, 5, what="the exit record")
    pid = int(job.stdout().split()[-1])
    try:
        wait_for(lambda: not pid_alive(pid), 10, what="the escaped grandchild to be stopped")
    finally:
        if pid_alive(pid):
            os.kill(pid, 9)


# --- strangers holding the unauthenticated slots ------------------------------------------------------


class Stranger:
    """Idle connections to the hub from ``source`` that never say a word: ``n`` held at once, each
    one the hub closes opened again at once (at most ``budget`` opens in all)."""

    def __init__(self, address, source: str, n: int, budget: int = 2000) -> None:
        self.address, self.source, self.budget = address, source, budget
        self.socks: list[socket.socket] = []
        self.opened = self.greeted = 0
        for _ in range(n):
            self.open()

    def open(self) -> None:
        if self.opened >= self.budget:
            return
        self.opened += 1
        s = socket.create_connection(self.address, timeout=10, source_address=(self.source, 0))
        s.setblocking(False)
        self.socks.append(s)

    def refill(self) -> int:
        """Read what the hub sent; open a new connection for each one it closed; the number held."""
        for s in list(self.socks):
            try:
                data = s.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data.startswith(protocol.HELLO):
                self.greeted += 1
            if not data:
                self.socks.remove(s)
                s.close()
                self.open()
        return len(self.socks)

    def close(self) -> None:
        for s in self.socks:
            s.close()


def test_strangers_holding_every_slot_do_not_keep_a_rank_out(job: Job) -> None:
    """100 idle connections from the ranks' own address (a local mpi job's ranks come from
    127.0.0.1 too): a rank that connects after them still gets in, at once, every time."""
    stranger = Stranger(job.channels.address, "127.0.0.1", 100)
    try:
        wait_for(lambda: stranger.refill() and stranger.greeted >= 64, 10, what="the stranger to be greeted")
        for rank in range(3):
            stranger.refill()
            ch = connect(job.channels.address, rank, SECRET)  # refused before: "the launcher closed the connection"
            ch.send(EXIT, rank, b"0")
            ch.close()
        wait_for(lambda: all(r.reported == 0 for r in job.job.ranks), 5, what="the exit records")
        assert len(job.channels.pending) <= hub_module.PENDING_PER_SOURCE
    finally:
        stranger.close()


def test_strangers_at_another_address_cannot_evict_a_ranks_handshake(job: Job) -> None:
    """A rank's connection that has been greeted and not answered yet (a slow node) survives a
    stranger at another address that churns through many more connections than the hub holds."""
    with socket.create_connection(job.channels.address, timeout=10, source_address=("127.0.0.1", 0)) as slow:
        hello = slow.recv(4096)
        assert hello.startswith(protocol.HELLO)
        stranger = Stranger(job.channels.address, "127.0.0.2", hub_module.PENDING_PER_SOURCE)
        try:
            for _ in range(3 * hub_module.PENDING_MAX):  # each new one evicts one of its own
                stranger.open()
            wait_for(lambda: stranger.refill() and stranger.opened >= 3 * hub_module.PENDING_MAX, 10,
                     what="the stranger's connections")
        finally:
            stranger.close()
        # the slow rank answers now, and is served
        server_nonce = bytes.fromhex(hello[len(protocol.HELLO):].strip().decode())
        client_nonce = os.urandom(16)
        mac = protocol.channel_mac(SECRET, "client", server_nonce, client_nonce, 2)
        slow.sendall(f"2 {client_nonce.hex()} {mac}\n".encode())
        assert slow.recv(4096).startswith(b"ok ")
        wait_for(lambda: job.job.ranks[2].channel == "open", 5, what="the rank's channel")


def test_a_rank_whose_frames_come_through_mpirun_is_named_in_the_launchers_words(job: Job, caplog) -> None:
    """A rank that could not reach the hub falls back to mpirun's output: the launcher says so
    itself, not only the rank's own line among the job's output."""
    job.job.feed(False, protocol.envelope(STDOUT, 1, b"hello\n") + protocol.envelope(STDOUT, 2, b"hi\n"))
    job.job.feed(False, protocol.envelope(STDOUT, 1, b"again\n"))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [f"worker 1 could not reach the launcher's hub at 127.0.0.1:{job.channels.address[1]} (its "
                        "wrapper says why): its output comes through mpirun's, where long lines of different ranks "
                        "may be broken"]
    assert job.job.in_band == {1, 2}


def test_a_wrapper_whose_connection_is_dropped_in_the_handshake_tries_again() -> None:
    """The hub drops the oldest unauthenticated connection when strangers crowd it: a rank's own
    connection may be that one; the rank connects again rather than fall back to mpirun's output."""
    from launcher.node import mpirank

    srv = socket.create_server(("127.0.0.1", 0))

    def hub() -> None:
        first, _ = srv.accept()
        first.sendall(protocol.HELLO + b"00" * 16 + b"\n")
        first.close()  # dropped before the rank could answer
        conn, _ = srv.accept()
        with conn:
            nonce = os.urandom(16)
            conn.sendall(protocol.HELLO + nonce.hex().encode() + b"\n")
            ident, client_hex, _mac = conn.recv(4096).decode().split()
            proof = protocol.channel_mac(SECRET, "server", nonce, bytes.fromhex(client_hex), int(ident))
            conn.sendall(f"ok {proof}\n".encode())
            conn.recv(4096)

    t = threading.Thread(target=hub, daemon=True)
    t.start()
    channel = mpirank._connect({"hub": list(srv.getsockname())}, 1, {"PSLAUNCH_SECRET": SECRET})
    assert channel is not None  # before: None, and the rank's output went through mpirun's
    channel.close()
    t.join(5)
    srv.close()


def test_a_rank_whose_wrapper_is_killed_is_the_first_failure(job: Job) -> None:
    """Issue 30, 14 (b): a wrapper killed with SIGKILL closes its connection without an exit frame;
    mpirun then stops the other ranks (143). The killed rank failed first, killed, not the next."""
    ch = connect(job.channels.address, 2, SECRET)
    ch.send(STARTED, 2, json.dumps({"pid": 4242, "host": "h"}).encode())
    assert ch.sock is not None
    ch.sock.close()  # (what the kernel does for a killed wrapper: no exit frame)
    killed = job.job.ranks[2]
    wait_for(lambda: killed.channel == "closed", 5, what="the connection to end")
    other = connect(job.channels.address, 0, SECRET)
    other.send(EXIT, 0, b"143")  # (mpirun's SIGTERM, reported by a rank's wrapper afterwards)
    other.close()
    wait_for(lambda: job.job.ranks[0].reported == 143, 5, what="rank 0's exit frame")
    assert killed.poll() == 137, killed.describe()
    assert job.job.ranks[0].poll() == 143
    assert "its wrapper was killed" in killed.describe()
    assert killed.end_time is not None and killed.end_time <= (job.job.ranks[0].end_time or 0)


def test_ranks_whose_connections_end_after_mpirun_exited_are_dated_by_their_connections_end(job: Job) -> None:
    """MPICH kills every other rank when one dies and exits at once: on a busy machine the hub can
    see all the wrappers' connections end after mpirun exited (a fresh CI run: the killed worker 1
    and the server that mpirun killed after it were both 'ended without reporting', and the report
    blamed the server, the first in the list). The first connection to end is the first failure."""
    chans = {}
    for rank in (0, 2):
        chans[rank] = connect(job.channels.address, rank, SECRET)
        chans[rank].send(STARTED, rank, json.dumps({"pid": 4240 + rank, "host": "h"}).encode())
    wait_for(lambda: all(job.job.ranks[r].pid for r in (0, 2)), 5, what="the start frames")
    job.job.code = 137  # mpirun has exited (as MPICH does once a rank died)
    job.job._out_closed.set()
    for rank in (2, 0):  # rank 2's wrapper was killed first, rank 0's by mpirun after it
        sock = chans[rank].sock
        assert sock is not None
        sock.close()
        wait_for(lambda r=job.job.ranks[rank]: r.channel == "closed", 5, what="the connection to end")
        time.sleep(0.05)
    first, second = job.job.ranks[2], job.job.ranks[0]
    assert second.poll() == 137 and first.poll() == 137  # (seen in this order: the launcher's look)
    assert "ended without reporting" in first.describe()
    assert first.end_time is not None and second.end_time is not None and first.end_time < second.end_time
