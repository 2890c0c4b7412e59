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
def test_a_world_size_other_than_the_jobs_fails_it(xgb20: str, tmp_path: Path) -> None:
    child, env = rabit_child(xgb20, 2, tmp_path)
    try:
        header(int(env["DMLC_TRACKER_PORT"]), -1, 3, "0", "start").close()
        failed = child.until("failed")
        assert child.proc.wait(10) == 1
    finally:
        child.close()
    assert failed["error"] == ("the worker with task id 0 (127.0.0.1) expects a world of 3 workers but this job has "
                               "2: remove rabit_world_size or make it match -n")


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
