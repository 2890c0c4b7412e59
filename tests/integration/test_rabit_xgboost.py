"""Real XGBoost against its own trackers, run by launcher/trackers/xgboost_child.py in a child
process as the launcher runs them, workers started by hand.

* XGBoost 2.0.3 (rabit reads DMLC_TRACKER_URI/PORT and DMLC_TASK_ID itself) against dmlc's
  tracker from its own xgboost/tracker.py (``--tracker rabit``), with the variables of the
  program's ``listening`` event and those the launcher adds.
* XGBoost 3.0.x against its own tracker (``--tracker xgboost``).

The venvs come from scripts/deps/70-xgboost.sh (.venv-xgb20, .venv-xgb30, or
PSLAUNCH_XGB20_PYTHON / PSLAUNCH_XGB30_PYTHON). Workers are tests/bin/xgb_worker.py.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.helpers import BIN, REPO

pytestmark = [pytest.mark.integration, pytest.mark.xgboost]

WORKER = str(BIN / "xgb_worker.py")
CHILD = str(REPO / "launcher" / "trackers" / "xgboost_child.py")
PORTS = (19091, 19999)
JOB_DEADLINE = 150  # liveness only


def _venv_python(var: str, venv: str, what: str) -> str:
    py = os.environ.get(var) or str(REPO / venv / "bin" / "python")
    if not os.path.exists(py):
        pytest.skip(f"{what} venv not found (run scripts/deps/70-xgboost.sh or set {var})")
    return py


@pytest.fixture
def xgb20() -> str:
    return _venv_python("PSLAUNCH_XGB20_PYTHON", ".venv-xgb20", "XGBoost 2.0.3")


@pytest.fixture
def xgb30() -> str:
    return _venv_python("PSLAUNCH_XGB30_PYTHON", ".venv-xgb30", "XGBoost 3.0")


def start_worker(python: str, out: Path, env_extra: dict[str, str], *args: str, name: str = "w") -> subprocess.Popen:
    env = dict(os.environ)
    env.update(env_extra)
    log = open(out / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process below)
    p = subprocess.Popen([python, WORKER, "--out", str(out), *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    p.log_path = out / f"{name}.log"  # type: ignore[attr-defined]
    log.close()
    return p


def finish(procs: list[subprocess.Popen], timeout: float = JOB_DEADLINE) -> list[int]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs = "\n".join(q.log_path.read_text()[-2000:] for q in procs)
            raise AssertionError("a worker hung:\n" + logs) from None
    return codes


def logs(procs: list[subprocess.Popen]) -> str:
    return "\n".join(p.log_path.read_text(errors="replace")[-3000:] for p in procs)


def results(out: Path, names: list[str]) -> list[dict]:
    return [json.loads((out / f"{n}.json").read_text()) for n in names]


def solo(python: str, out: Path, *args: str, name: str) -> dict:
    r = subprocess.run([python, WORKER, "--api", "solo", "--out", str(out), "--name", name, *args],
                       capture_output=True, text=True, timeout=JOB_DEADLINE)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads((out / f"{name}.json").read_text())


class Child:
    """xgboost_child.py as the launcher runs it: stdin a pipe it holds, stdout JSON lines."""

    def __init__(self, python: str, n: int, tmp_path: Path, *extra: str, ports: tuple[int, int] = PORTS) -> None:
        self.stderr_path = tmp_path / "child.stderr"
        self.seen: list[dict] = []
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [python, CHILD, "--n-workers", str(n), "--host-ip", "127.0.0.1",
                 "--port-range", f"{ports[0]}-{ports[1]}", *extra],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)

    def line(self) -> dict:
        text = self.proc.stdout.readline()
        assert text, f"the child ended without a line: {self.stderr()}"
        event = json.loads(text)
        self.seen.append(event)
        return event

    def until(self, name: str) -> dict:
        """The next event called ``name``; the ones before it are in :attr:`seen`."""
        while True:
            event = self.line()
            if event["event"] == name:
                return event

    def events(self, name: str) -> list[dict]:
        return [e for e in self.seen if e["event"] == name]

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def rabit_child(python: str, n: int, tmp_path: Path, *extra: str) -> tuple[Child, dict[str, str]]:
    """The rabit tracker's program and, once it listens, the variables its workers need."""
    child = Child(python, n, tmp_path, "--tracker", "rabit", *extra)
    hello = child.until("listening")
    assert hello["xgboost"] == "2.0.3" and hello["pid"] == child.proc.pid
    return child, hello["env"]


def rabit_env(tracker_env: dict[str, str], n: int, task_id: int | None) -> dict[str, str]:
    """What the launcher gives a worker of ``-s 0`` (launch.py's contract)."""
    env = {**tracker_env, "DMLC_ROLE": "worker", "DMLC_NUM_WORKER": str(n), "DMLC_NUM_SERVER": "0",
           "DMLC_JOB_CLUSTER": "local"}
    if task_id is not None:
        env["DMLC_TASK_ID"] = str(task_id)
    return env


# --- XGBoost 2.0.3 and dmlc's tracker (xgboost_child.py --tracker rabit) ------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("n", "api", "task_ids"), [(2, "env", True), (4, "rabit", True), (3, "env", False)],
                         ids=["2-CommunicatorContext", "4-rabit.init", "3-no-task-ids"])
def test_xgboost20_workers_train_one_model(xgb20: str, tmp_path: Path, n: int, api: str, task_ids: bool) -> None:
    child, env = rabit_child(xgb20, n, tmp_path)
    try:
        assert env["DMLC_TRACKER_URI"] == "127.0.0.1" and PORTS[0] <= int(env["DMLC_TRACKER_PORT"]) <= PORTS[1]
        procs = [start_worker(xgb20, tmp_path, rabit_env(env, n, i if task_ids else None), "--api", api, "--name",
                              f"w{i}", name=f"w{i}") for i in range(n)]
        assert finish(procs) == [0] * n, logs(procs)
        child.until("done")
        assert child.proc.wait(30) == 0
    finally:
        child.close()
    assert child.events("dropped") == [] and child.events("failed") == []
    res = results(tmp_path, [f"w{i}" for i in range(n)])
    assert {r["xgboost"] for r in res} == {"2.0.3"}
    assert [r["world"] for r in res] == [n] * n
    assert sorted(r["rank"] for r in res) == list(range(n))
    if task_ids:
        assert [r["rank"] for r in res] == list(range(n))  # rank == DMLC_TASK_ID
    # the program said who asked and who got which rank
    assert sorted(e["task_id"] for e in child.events("asked")) == sorted(r["task_id"] for r in res)
    (joined,) = child.events("joined")
    assert sorted(tuple(x) for x in joined["ranks"]) == sorted((r["rank"], r["task_id"], "127.0.0.1") for r in res)
    # one model on every worker...
    assert len({r["model_sha256"] for r in res}) == 1
    assert len({r["predictions"] for r in res}) == 1
    assert {r["train_rows"] for r in res} == {600 // n}
    # ...that learnt from every shard: not one shard's model, and here even the same as
    # one process on all the data (exact cuts, one thread, a fixed base_score)
    alone = solo(xgb20, tmp_path, "--shard", f"0/{n}", name="shard0")
    assert alone["predictions"] != res[0]["predictions"]
    everything = solo(xgb20, tmp_path, name="all")
    assert everything["predictions"] == res[0]["predictions"]
    # rabit's print messages reached the tracker: each worker's own, and rank 0's evaluation log
    texts = [e["text"] for e in child.events("print")]
    for r in res:
        assert f"xgb_worker task {r['task_id']}: rank {r['rank']} of {n}" in texts
    assert any(t.startswith("[7]\ttrain-logloss:") for t in texts), texts
    # and its own log records, as events (nothing on stderr)
    assert any("All of" in e["text"] for e in child.events("log")), child.seen
    assert child.stderr() == ""


@pytest.mark.timeout(120)
def test_xgboost20_worker_that_exits_before_joining(xgb20: str, tmp_path: Path) -> None:
    # What the launcher sees: worker 1 exits with its code; worker 0 asked and waits for the
    # other; the launcher closes the program's stdin, which lets worker 0 fail instead of waiting.
    child, env = rabit_child(xgb20, 2, tmp_path)
    try:
        w0 = start_worker(xgb20, tmp_path, rabit_env(env, 2, 0), "--api", "env", name="w0")
        w1 = start_worker(xgb20, tmp_path, rabit_env(env, 2, 1), "--api", "env", "--exit-before-join", "3", name="w1")
        assert w1.wait(JOB_DEADLINE) == 3
        assert child.until("asked")["task_id"] == "0"
        t0 = time.monotonic()
        child.proc.stdin.close()
        assert child.until("stopped") and child.proc.wait(10) == 0
        code = w0.wait(30)
        took = time.monotonic() - t0
    finally:
        child.close()
    assert code != 0 and took < 15, logs([w0])
    assert child.events("joined") == [] and len(child.events("asked")) == 1
    assert "Failed to initialize Rabit" in w0.log_path.read_text(errors="replace")


@pytest.mark.timeout(60)
def test_a_program_that_never_talks_to_the_tracker_does_not_hang_it(xgb20: str, tmp_path: Path) -> None:
    child, env = rabit_child(xgb20, 2, tmp_path)
    try:
        procs = [start_worker(xgb20, tmp_path, rabit_env(env, 2, i), "--api", "env", "--no-tracker", "0.2",
                              name=f"w{i}") for i in range(2)]
        assert finish(procs, 30) == [0, 0]
        t0 = time.monotonic()
        child.proc.stdin.close()  # the job is over
        child.until("stopped")
        assert child.proc.wait(10) == 0 and time.monotonic() - t0 < 5
    finally:
        child.close()
    assert [e["event"] for e in child.seen if e["event"] != "log"] == ["listening", "stopped"]  # nobody asked


@pytest.mark.timeout(120)
def test_an_xgboost30_worker_is_told_to_use_the_xgboost_tracker(xgb20: str, xgb30: str, tmp_path: Path) -> None:
    child, env = rabit_child(xgb20, 2, tmp_path)
    try:
        w = start_worker(xgb30, tmp_path, rabit_env(env, 2, 0), "--api", "args", name="w0")
        failed = child.until("failed")
        assert child.proc.wait(10) == 1
        assert w.wait(60) != 0  # (dmlc's own tracker leaves it hanging)
    finally:
        child.close()
    assert failed["error"] == ("the worker at 127.0.0.1 speaks XGBoost 2.1+'s tracker protocol, which this rabit "
                               "tracker does not: run the job with --tracker xgboost")


def send_int(s: socket.socket, v: int) -> None:
    s.sendall(struct.pack("@i", v))


def send_str(s: socket.socket, text: str) -> None:
    send_int(s, len(text.encode()))
    s.sendall(text.encode())


def header(port: int, rank: int, world: int, task_id: str, cmd: str) -> socket.socket:
    """A connection that says what rabit's workers say first (0xff99, rank, world, task id, command)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    send_int(s, 0xFF99)
    assert struct.unpack("@i", s.recv(4))[0] == 0xFF99
    send_int(s, rank)
    send_int(s, world)
    send_str(s, task_id)
    send_str(s, cmd)
    return s


@pytest.mark.timeout(240)
def test_what_is_not_a_worker_is_dropped_and_the_job_goes_on(xgb20: str, tmp_path: Path) -> None:
    child, env = rabit_child(xgb20, 2, tmp_path, "--header-timeout", "1")
    port = int(env["DMLC_TRACKER_PORT"])
    try:
        socket.create_connection(("127.0.0.1", port)).close()  # a port probe
        with socket.create_connection(("127.0.0.1", port)) as s:  # not rabit
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        header(port, -1, -1, "x", "reboot").close()
        header(port, 5, -1, "x", "shutdown").close()
        with socket.create_connection(("127.0.0.1", port)):  # silent: dropped after the header timeout
            while len(child.events("dropped")) < 5:
                child.line()
        procs = [start_worker(xgb20, tmp_path, rabit_env(env, 2, i), "--api", "env", "--only-rank", "--name",
                              f"w{i}", name=f"w{i}") for i in range(2)]
        assert finish(procs) == [0, 0], logs(procs)
        child.until("done")
    finally:
        child.close()
    assert [(r["rank"], r["world"]) for r in results(tmp_path, ["w0", "w1"])] == [(0, 2), (1, 2)]
    # (each connection is read on its own thread: the order of the first two may vary)
    assert sorted(e["error"] for e in child.events("dropped")) == sorted([
        "a connection from 127.0.0.1: the connection closed",
        "a connection from 127.0.0.1: invalid magic number=542393671 from 127.0.0.1",
        "a connection from 127.0.0.1: unknown command 'reboot'",
        "a connection from 127.0.0.1: a shutdown for rank 5, which has no links or has shut down",
        "a connection from 127.0.0.1: timed out"])


@pytest.mark.timeout(240)
def test_silent_and_slow_connections_hold_up_no_worker(xgb20: str, tmp_path: Path) -> None:
    # a header timeout of 200 s: the tracker would wait that long for each if it read them one by one
    child, env = rabit_child(xgb20, 2, tmp_path, "--header-timeout", "200")
    port = int(env["DMLC_TRACKER_PORT"])
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    slow = socket.create_connection(("127.0.0.1", port))
    send_int(slow, 0xFF99)  # the magic number, then nothing more
    try:
        procs = [start_worker(xgb20, tmp_path, rabit_env(env, 2, i), "--api", "env", "--only-rank", "--name",
                              f"w{i}", name=f"w{i}") for i in range(2)]
        assert finish(procs, 150) == [0, 0], logs(procs)  # (a liveness deadline below one header timeout)
        child.until("done")
    finally:
        for s in [*silent, slow]:
            s.close()
        child.close()
    assert [(r["rank"], r["world"]) for r in results(tmp_path, ["w0", "w1"])] == [(0, 2), (1, 2)]


@pytest.mark.timeout(60)
def test_a_world_size_other_than_the_jobs_is_dropped_with_what_to_fix(xgb20: str, tmp_path: Path) -> None:
    # (a stranger's or a misconfigured worker's: the worker fails without its links, and this says why)
    child, env = rabit_child(xgb20, 2, tmp_path)
    try:
        with header(int(env["DMLC_TRACKER_PORT"]), -1, 3, "0", "start") as s:
            dropped = child.until("dropped")
            assert s.recv(4) == b""
        assert child.proc.poll() is None
    finally:
        child.close()
    assert dropped == {"event": "dropped", "claimed": "0", "error": (
        "a connection from 127.0.0.1: task id 0 expects a world of 3 workers but this job has 2: if it is the "
        "job's worker, remove rabit_world_size or make it match -n")}
    assert child.events("failed") == []


# --- issue 30, item 7: strangers that connect first ---------------------------------------------------


def stranger(port: int, source: str, after_magic: bytes = b"") -> socket.socket:
    """A connection from ``source`` (a loopback address) that sends rabit's magic number and
    ``after_magic`` without waiting for the echo (a door that refuses it reads nothing)."""
    s = socket.socket()
    s.settimeout(20)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    if after_magic:
        try:
            s.sendall(struct.pack("@i", 0xFF99) + after_magic)
        except OSError:  # (closed already)
            pass
    return s


def request(rank: int, world: int, task_id: str, cmd: str) -> bytes:
    """What a worker sends after the magic number: rank, world size, task id, command."""
    return struct.pack("@iii", rank, world, len(task_id)) + task_id.encode() + struct.pack("@i", len(cmd)) + \
        cmd.encode()


def closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def train_two(xgb20: str, env: dict[str, str], tmp_path: Path, *extra: str) -> list[subprocess.Popen]:
    return [start_worker(xgb20, tmp_path, rabit_env(env, 2, i), "--api", "env", "--name", f"w{i}", *extra,
                         name=f"w{i}") for i in range(2)]


def assert_one_model_of_all_the_data(xgb20: str, tmp_path: Path) -> None:
    res = results(tmp_path, ["w0", "w1"])
    assert [(r["rank"], r["world"]) for r in res] == [(0, 2), (1, 2)]
    assert res[0]["predictions"] == res[1]["predictions"] == solo(xgb20, tmp_path, name="all")["predictions"]


@pytest.mark.timeout(240)
def test_strangers_from_another_host_are_dropped_unread_and_the_job_trains(xgb20: str, tmp_path: Path) -> None:
    # The four strangers, connected first from 127.0.0.2, a host that is not the job's
    # (the launcher passes the job's hosts: here 127.0.0.1). Before: (a) a "start" as task 7,
    # then close, failed the job, blaming a "worker with task id 7"; (b) a world size of 99
    # failed it; (d) a claim of task 0 gave it rank 0 and the job hung as long as it held on.
    child, env = rabit_child(xgb20, 2, tmp_path, "--allow-hosts", "127.0.0.1", "--task-ids", "2")
    port = int(env["DMLC_TRACKER_PORT"])
    held = [stranger(port, "127.0.0.2", request(-1, 99, "0", "start")),  # (b)
            stranger(port, "127.0.0.2", request(-1, -1, "0", "start"))]  # (d)
    stranger(port, "127.0.0.2", request(-1, -1, "7", "start")).close()  # (a)
    held += [stranger(port, "127.0.0.2") for _ in range(80)]  # (c) idle
    try:
        while len(child.events("dropped")) < 83:
            child.line()
        assert all(closed(s) for s in held)
        procs = train_two(xgb20, env, tmp_path)
        assert finish(procs) == [0, 0], logs(procs)
        child.until("done")
        assert child.proc.wait(30) == 0
    finally:
        for s in held:
            s.close()
        child.close()
    assert {e["error"] for e in child.events("dropped")} == {
        "a connection from 127.0.0.2: not one of the job's hosts (127.0.0.1); nothing read"}
    assert child.events("failed") == []
    assert [e["task_id"] for e in child.events("asked")] in (["0", "1"], ["1", "0"])
    assert_one_model_of_all_the_data(xgb20, tmp_path)


@pytest.mark.timeout(240)
def test_strangers_on_a_job_host_neither_fail_nor_take_a_rank(xgb20: str, tmp_path: Path) -> None:
    # The same strangers from 127.0.0.1, an address the job's workers use too: a task id that is
    # not the job's, a world of 99, idle connections, a claim that closes before its rank, and,
    # once every worker has its rank, second claims of a task id: each dropped, the job trains.
    child, env = rabit_child(xgb20, 2, tmp_path, "--task-ids", "2", "--header-timeout", "2")
    port = int(env["DMLC_TRACKER_PORT"])
    go = tmp_path / "go"
    header(port, -1, -1, "7", "start").close()  # (a)
    held = [header(port, -1, 99, "0", "start")]  # (b)
    held += [socket.create_connection(("127.0.0.1", port)) for _ in range(80)]  # (c)
    early = header(port, -1, -1, "1", "start")  # asks as task 1, then goes
    try:
        while not (child.events("asked") and len([e for e in child.events("dropped") if "task id" in e["error"]]) == 2):
            child.line()  # (a) and (b) dropped, and the early claim in: it leaves before any worker comes
        assert [e["task_id"] for e in child.events("asked")] == ["1"]
        early.close()
        procs = train_two(xgb20, env, tmp_path, "--wait-for", str(go))
        child.until("joined")
        held += [header(port, -1, -1, "0", "start"), header(port, -1, -1, "1", "start")]  # (d) after the ranks
        while len(child.events("dropped")) < 85:
            child.line()
        go.touch()
        assert finish(procs) == [0, 0], logs(procs)
        child.until("done")
        assert child.proc.wait(30) == 0
    finally:
        for s in held:
            s.close()
        child.close()
    dropped = [e["error"].removeprefix("a connection from 127.0.0.1: ") for e in child.events("dropped")]
    assert dropped.count("timed out") == 80
    assert sorted(e for e in dropped if e != "timed out") == [
        "it asked for a rank as task id 1, then closed before it had one",
        "task id '7' is not one of this job's (0 to 1)",
        "task id 0 expects a world of 99 workers but this job has 2: if it is the job's worker, remove "
        "rabit_world_size or make it match -n",
        f"task id 0 has its rank already (a connection from 127.0.0.1 claimed it first): {SECOND_CLAIM}",
        f"task id 1 has its rank already (a connection from 127.0.0.1 claimed it first): {SECOND_CLAIM}"]
    assert child.events("failed") == []
    assert_one_model_of_all_the_data(xgb20, tmp_path)


SECOND_CLAIM = ("a second claim is refused (rabit has no secret: if this is the job's worker, another program on a "
                "job host connected to the tracker as this task first)")


@pytest.mark.timeout(240)
def test_a_stranger_on_a_job_host_that_claims_a_task_first_makes_that_worker_fail_not_hang(
        xgb20: str, tmp_path: Path) -> None:
    # What remains: rabit has no secret, so the first claim of a task id from a job host is the
    # one that holds. The real worker's claim is refused with a note, and it fails at once.
    child, env = rabit_child(xgb20, 2, tmp_path, "--task-ids", "2")
    first = header(int(env["DMLC_TRACKER_PORT"]), -1, -1, "0", "start")
    try:
        child.until("asked")
        w0 = start_worker(xgb20, tmp_path, rabit_env(env, 2, 0), "--api", "env", "--only-rank", name="w0")
        dropped = child.until("dropped")
        code = w0.wait(JOB_DEADLINE)
    finally:
        first.close()
        child.close()
    assert code != 0, logs([w0])
    assert dropped == {"event": "dropped", "claimed": "0", "error": (
        "a connection from 127.0.0.1: task id 0 was claimed first by a connection from 127.0.0.1, which waits for "
        f"its rank: {SECOND_CLAIM}")}
    assert child.events("failed") == []


@pytest.mark.timeout(60)
def listener_before_a_free_port() -> tuple[socket.socket, int]:
    """A listening socket on a port P whose next port is free at this moment (tests in the other
    worker take ports too), and P."""
    for _ in range(50):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", p + 1))
        except OSError:
            s.close()
            continue
        s.listen()
        return s, p
    raise AssertionError("no port here whose next one is free")


def test_the_first_free_port_of_the_range_and_none_free(xgb20: str, tmp_path: Path) -> None:
    held, p = listener_before_a_free_port()
    with held:
        r = subprocess.run([xgb20, CHILD, "--tracker", "rabit", "--n-workers", "2", "--host-ip", "127.0.0.1",
                            "--port-range", f"{p}-{p}"], capture_output=True, text=True, timeout=30,
                           stdin=subprocess.DEVNULL)
        assert r.returncode == 2
        assert json.loads(r.stdout.splitlines()[-1]) == {
            "event": "failed", "error": f"no free port in {p}-{p} on 127.0.0.1: widen --port-range"}
        child = Child(xgb20, 2, tmp_path, "--tracker", "rabit", ports=(p, p + 1))
        try:
            assert child.until("listening")["env"]["DMLC_TRACKER_PORT"] == str(p + 1)
        finally:
            child.close()
    # (an address of the test networks that no interface here has: the network guard lets it be tried)
    r = subprocess.run([xgb20, CHILD, "--tracker", "rabit", "--n-workers", "2", "--host-ip", "10.200.255.254"],
                       capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert json.loads(r.stdout.splitlines()[-1])["error"].startswith("cannot listen on 10.200.255.254:0: ")


# --- XGBoost 3.0 and launcher/trackers/xgboost_child.py ------------------------------


@pytest.mark.timeout(240)
def test_xgboost30_child_two_workers_predict_as_one_process(xgb30: str, tmp_path: Path) -> None:
    child = Child(xgb30, 2, tmp_path)
    try:
        hello = child.line()
        assert hello["event"] == "listening" and hello["xgboost"].startswith("3.0.")
        args = hello["worker_args"]
        assert args["dmlc_tracker_uri"] == "127.0.0.1" and PORTS[0] <= args["dmlc_tracker_port"] <= PORTS[1]
        assert hello["env"] == {"DMLC_TRACKER_URI": "127.0.0.1", "DMLC_TRACKER_PORT": str(args["dmlc_tracker_port"])}
        procs = [start_worker(xgb30, tmp_path, {**hello["env"], "DMLC_TASK_ID": str(i), "DMLC_NUM_WORKER": "2"},
                              "--api", "args", "--name", f"w{i}", name=f"w{i}") for i in range(2)]
        assert finish(procs) == [0, 0], logs(procs)
        assert child.line() == {"event": "done"}
        assert child.proc.wait(30) == 0
    finally:
        child.close()
    res = results(tmp_path, ["w0", "w1"])
    assert [(r["rank"], r["world"]) for r in res] == [(0, 2), (1, 2)]  # the tracker's order: task ids "0" < "1"
    everything = solo(xgb30, tmp_path, name="all")
    assert res[0]["predictions"] == res[1]["predictions"] == everything["predictions"]
    assert res[0]["model_sha256"] == everything["model_sha256"]
    alone = solo(xgb30, tmp_path, "--shard", "0/2", name="shard0")
    assert alone["predictions"] != everything["predictions"]
    # the workers' communicator_print messages end up on the child's stderr, for the launcher
    err = child.stderr()
    assert "xgb_worker task 0: rank 0 of 2" in err and "[7]\ttrain-logloss:" in err


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_xgboost30_ranks_follow_the_tracker_order_not_the_task_id(xgb30: str, tmp_path: Path) -> None:
    n = 11
    child = Child(xgb30, n, tmp_path)
    try:
        env = child.line()["env"]
        procs = [start_worker(xgb30, tmp_path, {**env, "DMLC_TASK_ID": str(i)}, "--api", "args", "--only-rank",
                              "--name", f"w{i}", name=f"w{i}") for i in range(n)]
        assert finish(procs) == [0] * n, logs(procs)
        assert child.line() == {"event": "done"}
    finally:
        child.close()
    ranks = {r["task_id"]: r["rank"] for r in results(tmp_path, [f"w{i}" for i in range(n)])}
    # one host: sorted by task id as strings, so "10" comes right after "1"
    assert ranks == {t: i for i, t in enumerate(sorted(str(i) for i in range(n)))}
    assert ranks["10"] == 2 and ranks["2"] == 3


@pytest.mark.timeout(120)
def test_xgboost_child_stops_when_its_stdin_closes(xgb30: str, tmp_path: Path) -> None:
    child = Child(xgb30, 2, tmp_path)
    try:
        port = child.line()["worker_args"]["dmlc_tracker_port"]
        t0 = time.monotonic()
        child.proc.stdin.close()  # the launcher died or is done with it
        assert child.line() == {"event": "stopped"}
        assert child.proc.wait(10) == 0
        assert time.monotonic() - t0 < 5
    finally:
        child.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


@pytest.mark.timeout(120)
def test_xgboost_child_refuses_xgboost20_and_a_missing_xgboost(xgb20: str, tmp_path: Path) -> None:
    r = subprocess.run([xgb20, CHILD, "--n-workers", "2", "--host-ip", "127.0.0.1"], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    msg = json.loads(r.stdout)
    assert msg["event"] == "failed" and "xgboost 2.0.3" in msg["error"] and "use --tracker rabit" in msg["error"]
    r = subprocess.run([sys.executable, CHILD, "--n-workers", "2", "--host-ip", "127.0.0.1"], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    msg = json.loads(r.stdout)
    assert msg["event"] == "failed" and "cannot import xgboost" in msg["error"] and "--tracker-python" in msg["error"]


@pytest.mark.timeout(60)
def test_the_rabit_tracker_with_xgboost30_is_a_stand_in(xgb30: str) -> None:
    r = subprocess.run([xgb30, CHILD, "--tracker", "rabit", "--n-workers", "2", "--host-ip", "127.0.0.1"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    listening, stopped = (json.loads(x) for x in r.stdout.splitlines())
    assert listening["event"] == "listening" and listening["xgboost"].startswith("3.0.")
    assert listening["stand_in"] == (f"xgboost {listening['xgboost']} at {xgb30} has only XGBoost 2.1+'s tracker: "
                                     "install xgboost 2.0 or older there (pip install 'xgboost<2.1') or give "
                                     "--tracker-python a Python that has it")
    assert stopped == {"event": "stopped"}
