"""Real XGBoost against the trackers of launcher/trackers/, workers started by hand.

* XGBoost 2.0.3 (rabit reads DMLC_TRACKER_URI/PORT and DMLC_TASK_ID itself)
  against launcher/trackers/rabit.py, with the variables of ``worker_env()``
  and those the launcher adds.
* XGBoost 3.0.x against its own tracker, run by launcher/trackers/xgboost_child.py
  in a child process, as the launcher will.

The venvs come from scripts/deps/70-xgboost.sh (.venv-xgb20, .venv-xgb30, or
PSLAUNCH_XGB20_PYTHON / PSLAUNCH_XGB30_PYTHON). Workers are tests/bin/xgb_worker.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.helpers import BIN, REPO, wait_for

from launcher.trackers.rabit import RabitTracker

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


class Prints:
    def __init__(self) -> None:
        self.lines: list[tuple[int, str]] = []
        self.logs: list[str] = []

    def on_print(self, rank: int, text: str) -> None:
        self.lines.append((rank, text))

    def on_log(self, text: str) -> None:
        self.logs.append(text)


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
            raise AssertionError("a worker hung:\n" + "\n".join(q.log_path.read_text()[-2000:] for q in procs)) from None
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


def rabit_env(tracker: RabitTracker, task_id: int | None) -> dict[str, str]:
    """``worker_env()`` plus what the launcher adds for ``-s 0`` (launch.py's contract)."""
    env = tracker.worker_env(task_id)
    env.update(DMLC_ROLE="worker", DMLC_NUM_SERVER="0", DMLC_JOB_CLUSTER="local")
    return env


# --- XGBoost 2.0.3 and launcher/trackers/rabit.py ------------------------------------


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("n", "api", "task_ids"), [(2, "env", True), (4, "rabit", True), (3, "env", False)],
                         ids=["2-CommunicatorContext", "4-rabit.init", "3-no-task-ids"])
def test_xgboost20_workers_train_one_model(xgb20: str, tmp_path: Path, n: int, api: str, task_ids: bool) -> None:
    prints = Prints()
    tracker = RabitTracker(n, "127.0.0.1", PORTS, on_print=prints.on_print, on_log=prints.on_log).start()
    try:
        procs = []
        for i in range(n):
            env = rabit_env(tracker, i if task_ids else None)
            procs.append(start_worker(xgb20, tmp_path, env, "--api", api, "--name", f"w{i}", name=f"w{i}"))
        assert finish(procs) == [0] * n, logs(procs)
        st = tracker.wait(30)
    finally:
        tracker.close()
    assert st.state == "done", (st, logs(procs))
    assert st.shutdown == tuple(range(n)) and st.rejected == {}
    res = results(tmp_path, [f"w{i}" for i in range(n)])
    assert {r["xgboost"] for r in res} == {"2.0.3"}
    assert [r["world"] for r in res] == [n] * n
    assert sorted(r["rank"] for r in res) == list(range(n))
    if task_ids:
        assert [r["rank"] for r in res] == list(range(n))  # rank == DMLC_TASK_ID
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
    texts = [t for _, t in prints.lines]
    for r in res:
        assert (r["rank"], f"xgb_worker task {r['task_id']}: rank {r['rank']} of {n}") in prints.lines
    assert any(t.startswith("[7]\ttrain-logloss:") for t in texts), texts
    assert any(f"all {n} workers joined" in x for x in prints.logs)


@pytest.mark.timeout(120)
def test_xgboost20_worker_that_exits_before_joining(xgb20: str, tmp_path: Path) -> None:
    # What the launcher sees: worker 1 exits with its code; the tracker knows worker 0
    # asked and waits for the other; close() then lets worker 0 fail instead of waiting.
    tracker = RabitTracker(2, "127.0.0.1", PORTS).start()
    try:
        w0 = start_worker(xgb20, tmp_path, rabit_env(tracker, 0), "--api", "env", name="w0")
        w1 = start_worker(xgb20, tmp_path, rabit_env(tracker, 1), "--api", "env", "--exit-before-join", "3", name="w1")
        assert w1.wait(JOB_DEADLINE) == 3
        wait_for(lambda: tracker.status().asked == 1, 60, what="worker 0 to ask for its rank")
        st = tracker.wait(0.5)
        assert st.state == "waiting" and st.members == () and st.asked == 1
        t0 = time.monotonic()
        assert tracker.close().state == "closed"
        code = w0.wait(30)
        took = time.monotonic() - t0
    finally:
        tracker.close()
    assert code != 0 and took < 15, logs([w0])
    assert "Failed to initialize Rabit" in w0.log_path.read_text(errors="replace")


@pytest.mark.timeout(120)
def test_xgboost20_worker_killed_while_waiting_fails_the_tracker_at_once(xgb20: str, tmp_path: Path) -> None:
    tracker = RabitTracker(3, "127.0.0.1", PORTS).start()
    procs = []
    try:
        procs = [start_worker(xgb20, tmp_path, rabit_env(tracker, i), "--api", "env", name=f"w{i}") for i in range(2)]
        wait_for(lambda: tracker.status().asked == 2, 60, what="two workers to ask for ranks")
        t0 = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        st = tracker.wait(10)
        assert time.monotonic() - t0 < 5
        assert st.state == "failed" and "task id 1" in st.error and "did the worker die?" in st.error
    finally:
        tracker.close()
        codes = finish(procs, 30)
    assert codes[1] == -signal.SIGKILL and codes[0] != 0


@pytest.mark.timeout(60)
def test_a_program_that_never_talks_to_the_tracker_does_not_hang_it(xgb20: str, tmp_path: Path) -> None:
    tracker = RabitTracker(2, "127.0.0.1", PORTS).start()
    try:
        procs = [start_worker(xgb20, tmp_path, rabit_env(tracker, i), "--api", "env", "--no-tracker", "0.2",
                              name=f"w{i}") for i in range(2)]
        assert finish(procs, 30) == [0, 0]
        t0 = time.monotonic()
        st = tracker.wait(1.0)  # the launcher's --timeout, in small
        assert time.monotonic() - t0 < 5
        assert st.state == "waiting" and st.asked == 0
        st = tracker.close()
        assert st.state == "closed" and st.summary() == (
            "closed: 0 of 2 workers joined; 0 shut down; no worker asked for a rank: does the program start "
            "rabit (xgboost.collective.init() or CommunicatorContext())?")
    finally:
        tracker.close()


@pytest.mark.timeout(120)
def test_an_xgboost30_worker_is_told_to_use_the_xgboost_tracker(xgb30: str, tmp_path: Path) -> None:
    tracker = RabitTracker(2, "127.0.0.1", PORTS).start()
    try:
        w = start_worker(xgb30, tmp_path, rabit_env(tracker, 0), "--api", "args", name="w0")
        code = w.wait(60)  # dmlc's tracker leaves this worker hanging
        st = tracker.wait(10)
    finally:
        tracker.close()
    assert code != 0
    assert st.state == "failed" and "--tracker xgboost" in st.error


# --- XGBoost 3.0 and launcher/trackers/xgboost_child.py ------------------------------


class Child:
    """xgboost_child.py as the launcher runs it: stdin a pipe it holds, stdout JSON lines."""

    def __init__(self, python: str, n: int, tmp_path: Path, *extra: str) -> None:
        self.stderr_path = tmp_path / "child.stderr"
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [python, CHILD, "--n-workers", str(n), "--host-ip", "127.0.0.1",
                 "--port-range", f"{PORTS[0]}-{PORTS[1]}", *extra],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)

    def line(self) -> dict:
        text = self.proc.stdout.readline()
        assert text, f"the child ended without a line: {self.stderr()}"
        return json.loads(text)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


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
    import socket

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
