"""launcher/trackers/: which Python runs a tracker program, where the programs are, what the rabit
tracker's program says when it cannot serve, and how the launcher shows what it tells; the torch
store's program across attempts (real torch: the main venv's).

XGBoost's trackers themselves run in tests/integration/test_rabit_xgboost.py (real XGBoost 2.0.3
and 3.0); here the main venv, which has no xgboost, runs the program.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from launcher import node, trackers
from launcher.errors import LaunchError
from launcher.runtime.output import Console
from launcher.spec.job import JobSpec
from launcher.trackers import service

CHILD = node.tracker_command("xgboost_child", sys.executable)


def spec(command: tuple[str, ...], tracker: str = "torch", **kw) -> JobSpec:
    return JobSpec(command=command, num_workers=2, num_servers=0, tracker=tracker, **kw)


@pytest.mark.parametrize("command, expected", [
    (("python", "t.py"), "python"),
    (("python3.11", "-m", "x"), "python3.11"),
    (("/opt/venv/bin/python3", "t.py"), "/opt/venv/bin/python3"),
    ((".venv/bin/python", "t.py"), ".venv/bin/python"),
    (("./train.sh",), "python3"),
    (("pythonic", "x"), "python3"),
    (("torchrun", "x"), "python3"),
])
def test_the_tracker_python_is_the_commands_interpreter_else_python3(command, expected) -> None:
    assert trackers.python_for(spec(command)) == expected
    assert trackers.python_for(spec(command, tracker_python="/usr/bin/python3")) == "/usr/bin/python3"


def test_the_tracker_python_is_found_as_the_command_would_be(tmp_path: Path) -> None:
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    py = venv / "python"
    py.write_text("#!/bin/sh\n")
    py.chmod(py.stat().st_mode | stat.S_IXUSR)
    environ = (("PATH", f"{venv}{os.pathsep}/usr/bin"),)
    assert trackers.resolve_python(spec(("venv/bin/python", "t.py"), workdir=str(tmp_path))) == str(py)
    assert trackers.resolve_python(spec(("python", "t.py"), environ=environ)) == str(py)  # through PATH
    assert trackers.resolve_python(spec(("python", "t.py"), environ=(("PATH", str(tmp_path)),))) is None
    assert trackers.resolve_python(spec(("x",), tracker_python=str(tmp_path / "nope"))) is None


def test_the_tracker_programs_are_files_of_this_installation() -> None:
    for program in node.TRACKER_PROGRAMS:
        argv = node.tracker_command(program, sys.executable)
        assert argv[0] == sys.executable and Path(argv[1]).is_file() and argv[1].endswith(f"/{program}.py")
    with pytest.raises(ValueError):
        node.tracker_command("rabit", sys.executable)


def test_collective_trackers_have_classes_and_ps_has_none() -> None:
    assert sorted(trackers.classes()) == ["rabit", "torch", "xgboost"]
    assert trackers.describe(JobSpec(command=("x",), num_workers=1, num_servers=1), None) == []  # type: ignore[arg-type]


# --- the rabit tracker's program (xgboost_child.py --tracker rabit) -----------------------------------------


def run_child(*args: str, env: dict | None = None) -> tuple[int, list[dict], str]:
    r = subprocess.run([*CHILD, *args, "--n-workers", "2", "--host-ip", "127.0.0.1"], capture_output=True, text=True,
                       timeout=60, stdin=subprocess.DEVNULL, env=env)
    return r.returncode, [json.loads(x) for x in r.stdout.splitlines()], r.stderr


def test_without_xgboost_the_xgboost_tracker_says_what_to_install_in_one_event() -> None:
    code, events, err = run_child("--tracker", "xgboost")
    assert code == 2 and len(events) == 1 and err == ""
    assert events[0]["event"] == "failed"
    assert events[0]["error"].startswith(f"cannot import xgboost with {sys.executable}")
    assert events[0]["error"].endswith("install xgboost>=2.1 there or choose another --tracker-python")


# --- the stand-in: --tracker rabit with a Python that has no xgboost at all ---------------------------------

RABIT_MAGIC = struct.pack("@i", 0xFF99)
NO_XGBOOST = (f"asked for its rank, but {sys.executable} has no XGBoost: install xgboost 2.0 or older there (pip "
              "install 'xgboost<2.1') or give --tracker-python a Python that has it")


def request(rank: int, world: int, task_id: str, command: str) -> bytes:
    """What an XGBoost 2.0 worker sends after the magic number: rank, world size, task id, command."""
    return struct.pack("@iii", rank, world, len(task_id)) + task_id.encode() + struct.pack("@i", len(command)) + \
        command.encode()


class StandIn:
    """``xgboost_child.py --tracker rabit`` run with this venv's Python (no xgboost, unless ``env``
    puts a fake one on the path), stdin a pipe."""

    def __init__(self, *args: str, env: dict | None = None, xgboost: str | None = None) -> None:
        self.proc = subprocess.Popen([*CHILD, "--tracker", "rabit", "--n-workers", "2", "--host-ip", "127.0.0.1",
                                      *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.events: list[dict] = []
        listening = self.next()
        assert listening["event"] == "listening" and listening["xgboost"] == xgboost and listening["stand_in"]
        self.why = listening["stand_in"]  # what the first worker that asks hears
        self.port = int(listening["env"]["DMLC_TRACKER_PORT"])

    def next(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, f"the program ended (code {self.proc.wait(10)}) after {self.events}"
        self.events.append(json.loads(line))
        return self.events[-1]

    def stop(self) -> int:
        """The launcher's end of the job: stdin closes; the program's exit code."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        code = self.proc.wait(10)
        self.events += [json.loads(x) for x in self.proc.stdout.read().splitlines()]
        self.proc.stdout.close()
        return code

    def ask(self, after_magic: bytes) -> socket.socket:
        """A worker's first words: the magic number, echoed, then ``after_magic``."""
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        s.sendall(RABIT_MAGIC)
        assert s.recv(4) == RABIT_MAGIC
        s.sendall(after_magic)
        return s


def closed(s: socket.socket) -> bool:
    """The other end closed ``s`` (a reset when it left unread bytes behind)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_stand_in_holds_the_port_for_workers_that_never_ask() -> None:
    child = StandIn()
    assert child.stop() == 0
    assert [e["event"] for e in child.events] == ["listening", "stopped"]


def test_a_worker_that_asks_the_stand_in_for_its_rank_hears_what_to_install() -> None:
    child = StandIn()
    worker = child.ask(request(-1, 2, "0", "start"))
    failed = child.next()
    assert failed == {"event": "failed", "error": f"the worker at 127.0.0.1 {NO_XGBOOST}"}
    # the worker's connection stays open until the job ends: its failure would otherwise come first
    worker.settimeout(0.5)
    with pytest.raises(socket.timeout):
        worker.recv(1)
    assert child.stop() == 1
    assert closed(worker)
    worker.close()


def test_a_worker_of_xgboost_21_is_told_to_use_the_xgboost_tracker() -> None:
    child = StandIn()
    body = b'{"cmd": "start"}'
    worker = child.ask(struct.pack("@i", len(body)) + body)  # (2.1+: a length, then a JSON object)
    assert child.next()["error"] == ("the worker at 127.0.0.1 speaks XGBoost 2.1+'s tracker protocol, which this "
                                     "rabit tracker does not: run the job with --tracker xgboost")
    assert child.stop() == 1
    worker.close()


def test_strangers_on_the_stand_ins_port_are_dropped_and_hold_up_nobody() -> None:
    child = StandIn("--header-timeout", "30")
    silent = socket.create_connection(("127.0.0.1", child.port))  # (a greeting that never comes)
    socket.create_connection(("127.0.0.1", child.port)).close()  # a port probe
    with socket.create_connection(("127.0.0.1", child.port)) as s:  # not rabit
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert closed(s)
    assert sorted(child.next()["error"] for _ in range(2)) == [
        "a connection from 127.0.0.1: invalid magic number=542393671 from 127.0.0.1",
        "a connection from 127.0.0.1: the connection closed"]
    worker = child.ask(request(0, 2, "0", "start"))  # the silent one does not delay it (30 s of header timeout)
    assert child.next() == {"event": "failed", "error": f"the worker at 127.0.0.1 {NO_XGBOOST}"}
    assert child.stop() == 1
    silent.close()
    worker.close()


def connect_from(source: str, port: int) -> socket.socket:
    """A connection to the program's port on 127.0.0.1 from another loopback address (``source``):
    a host that is not the job's, on this machine."""
    s = socket.socket()
    s.settimeout(10)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def test_a_connection_from_an_address_that_is_not_the_jobs_is_dropped_unread() -> None:
    # issue 30, item 7: only the job's hosts reach the rabit tracker (the launcher passes them)
    child = StandIn("--allow-hosts", "127.0.0.1")
    stranger = connect_from("127.0.0.2", child.port)
    stranger.sendall(RABIT_MAGIC + request(-1, 2, "0", "start"))  # a worker's words: the stand-in would fail on them
    assert closed(stranger)  # (not even the magic number echoed)
    assert child.next() == {"event": "dropped", "error": "a connection from 127.0.0.2: not one of the job's "
                                                         "hosts (127.0.0.1); nothing read"}
    stranger.close()
    worker = child.ask(request(-1, 2, "0", "start"))  # (from 127.0.0.1: the job's)
    assert child.next() == {"event": "failed", "error": f"the worker at 127.0.0.1 {NO_XGBOOST}"}
    assert child.stop() == 1
    worker.close()


def test_local_allows_every_address_of_this_machine_and_only_those() -> None:
    child = StandIn("--allow-hosts", "local,192.0.2.7")  # (192.0.2.7: a documentation address, no host's)
    with connect_from("127.0.0.2", child.port) as s:  # (loopback: this machine's)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert closed(s)
    assert child.next()["error"] == "a connection from 127.0.0.2: invalid magic number=542393671 from 127.0.0.2"
    assert child.stop() == 0


def test_a_task_id_that_is_not_the_jobs_is_dropped() -> None:
    # the launcher numbers DMLC_TASK_ID 0..N-1: "7" (issue 30: blamed as a worker that does not exist),
    # "NULL" (no task id) and "01" are no worker of its
    child = StandIn("--task-ids", "2")
    for task_id in ("7", "NULL", "01", "-1"):
        s = child.ask(request(-1, 2, task_id, "start"))
        assert closed(s)
        s.close()
        assert child.next() == {"event": "dropped", "error": f"a connection from 127.0.0.1: task id {task_id!r} is "
                                                             "not one of this job's (0 to 1)"}
    worker = child.ask(request(-1, 2, "1", "start"))
    assert child.next() == {"event": "failed", "error": f"the worker at 127.0.0.1 {NO_XGBOOST}"}
    assert child.stop() == 1
    worker.close()


def test_bad_allow_hosts_is_one_line() -> None:
    r = subprocess.run([*CHILD, "--tracker", "rabit", "--n-workers", "2", "--host-ip", "127.0.0.1", "--allow-hosts",
                        "10.0.0.1,nohost"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip() == "bad --allow-hosts '10.0.0.1,nohost': 'nohost' does not appear to be an IPv4 or IPv6 " \
                               "address"


def fake_xgboost(site: Path, version: str, tracker_py: str = "") -> dict:
    """A site directory with an installed ``xgboost`` of ``version`` (its metadata, a package and,
    if given, its ``tracker.py``), and the environment that puts it on the path."""
    (site / "xgboost").mkdir(parents=True)
    (site / "xgboost" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    if tracker_py:
        (site / "xgboost" / "tracker.py").write_text(tracker_py)
    info = site / f"xgboost-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: xgboost\nVersion: {version}\n")
    return {**os.environ, "PYTHONPATH": str(site)}


def test_an_xgboost_of_the_new_protocol_runs_the_stand_in(tmp_path: Path) -> None:
    # (a job of workers that never ask runs; one that asks hears what to install, or which tracker)
    child = StandIn(env=fake_xgboost(tmp_path, "3.0.2"), xgboost="3.0.2")
    cannot = (f"xgboost 3.0.2 at {sys.executable} has only XGBoost 2.1+'s tracker: install xgboost 2.0 or older "
              "there (pip install 'xgboost<2.1') or give --tracker-python a Python that has it")
    assert child.why == cannot
    worker = child.ask(request(-1, 2, "1", "start"))
    assert child.next() == {"event": "failed", "error": f"the worker at 127.0.0.1 asked for its rank, but {cannot}"}
    assert child.stop() == 1
    worker.close()


def test_an_xgboost_without_dmlcs_tracker_runs_the_stand_in(tmp_path: Path) -> None:
    # (the version adapter knows XGBoost 2.0's tracker.py: RabitTracker, WorkerEntry, ExSocket)
    env = fake_xgboost(tmp_path, "1.2.0", "class RabitTracker:\n    pass\n")
    child = StandIn(env=env, xgboost="1.2.0")
    assert child.why.startswith(f"xgboost 1.2.0 at {sys.executable} has no rabit tracker this program can run "
                                f"({tmp_path}/xgboost/tracker.py: ")
    assert child.why.endswith("): install xgboost 2.0 there (pip install 'xgboost==2.0.*')")
    assert child.stop() == 0


def rabit_service(console: Console, **kw) -> service.RabitService:
    spec = JobSpec(command=(sys.executable, "x.py"), num_workers=2, num_servers=0, **kw)
    assert spec.tracker == "rabit"
    return service.RabitService(spec, console, None)


def test_the_rabit_tracker_that_cannot_start_is_one_line_and_leaves_nothing() -> None:
    with socket.socket() as taken:  # the whole --port-range
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        tracker = rabit_service(Console(io.BytesIO(), io.BytesIO(), color=False), port_range=(port, port))
        with pytest.raises(LaunchError) as e:
            tracker.start("127.0.0.1")
    assert str(e.value) == (f"the rabit tracker cannot start: no free port in {port}-{port} on 127.0.0.1: widen "
                            "--port-range")
    tracker.close()
    assert tracker.child is not None and tracker.child.popen.returncode == 2  # reaped


def test_the_rabit_tracker_without_xgboost_starts_a_stand_in_that_a_job_can_end_with(caplog) -> None:
    tracker = rabit_service(Console(io.BytesIO(), io.BytesIO(), color=False))
    port = tracker.start("127.0.0.1")
    try:
        assert tracker.stand_in and tracker.failure() is None
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(RABIT_MAGIC)
            assert s.recv(4) == RABIT_MAGIC
            s.sendall(request(-1, 2, "0", "start"))
            assert tracker.child is not None
            assert tracker.child.wait_event(["failed"], 10) is not None
            assert tracker.failure() == f"the worker at 127.0.0.1 {NO_XGBOOST}"
    finally:
        tracker.close()
    assert tracker.child.popen.returncode == 1  # reaped
    assert "no worker asked it for a rank" not in caplog.text


def test_without_python3_here_the_launchers_python_runs_the_rabit_tracker(tmp_path: Path) -> None:
    # (a shell command's tracker Python is python3 through PATH; with none, the job still runs)
    job = JobSpec(command=("./run.sh",), num_workers=2, num_servers=0, environ=(("PATH", str(tmp_path)),))
    tracker = service.RabitService(job, Console(io.BytesIO(), io.BytesIO(), color=False), None)
    tracker.start("127.0.0.1")
    try:
        assert tracker.stand_in and tracker.child is not None and tracker.child.popen.args[0] == sys.executable
    finally:
        tracker.close()
    named = JobSpec(command=("./run.sh",), num_workers=2, num_servers=0, tracker_python=str(tmp_path / "python"))
    with pytest.raises(LaunchError, match="which is not here: give --tracker-python"):
        service.RabitService(named, Console(io.BytesIO(), io.BytesIO(), color=False), None).start("127.0.0.1")


def test_the_rabit_tracker_shows_prints_and_notes_what_it_dropped(caplog) -> None:
    out = io.BytesIO()
    tracker = rabit_service(Console(out, io.BytesIO(), color=False))
    tracker._event({"event": "print", "text": "[7]\ttrain-logloss:0.1\x1b[2J"})
    tracker._event({"event": "print", "text": "two\nlines"})
    assert out.getvalue() == (b"[rabit tracker] [7]\ttrain-logloss:0.1^[[2J\n"
                              b"[rabit tracker] two\n[rabit tracker] lines\n")
    with caplog.at_level("INFO"):
        for i in range(service.DROPS_NOTED + 3):
            tracker._event({"event": "dropped", "error": f"a connection from 10.0.0.{i}: bad"})
    notes = [r.getMessage() for r in caplog.records]
    assert notes[:2] == ["rabit tracker: dropped a connection from 10.0.0.0: bad",
                         "rabit tracker: dropped a connection from 10.0.0.1: bad"]
    assert notes[service.DROPS_NOTED:] == ["rabit tracker: more connections dropped; counting them without a note"]
    assert (tracker.prints, tracker.dropped) == (2, service.DROPS_NOTED + 3)


def test_what_a_worker_sent_reaches_the_console_as_one_line_without_control_characters(caplog) -> None:
    # (a task id or a host name in the tracker's words comes from whoever connected)
    tracker = rabit_service(Console(io.BytesIO(), io.BytesIO(), color=False))
    tracker.port = 9091
    evil = "the worker with task id \x1b]0;owned\x07\x1b[2J\npslaunch: error: forged (10.0.0.1) expects a world of 3"
    with caplog.at_level("DEBUG"):
        tracker._event({"event": "failed", "error": evil})
        tracker._event({"event": "dropped", "error": evil})
        tracker._event({"event": "joined", "seconds": 0.1, "ranks": [[0, "\x1b[31m0", "h"]]})
    for record in caplog.records:
        text = record.getMessage()
        assert "\x1b" not in text and "\x07" not in text and "\n" not in text, text
    assert "task id ^[]0;owned^G^[[2J pslaunch: error: forged" in caplog.records[0].getMessage()


def test_the_rabit_tracker_gets_the_jobs_task_ids_and_hosts() -> None:
    job = JobSpec(command=(sys.executable, "x.py"), num_workers=3, num_servers=0, port_range=(9000, 9010))
    args = service.RabitService._args(job, "10.0.0.1", ("10.0.0.2", "10.0.0.3"))
    assert args == ["--tracker", "rabit", "--n-workers", "3", "--host-ip", "10.0.0.1", "--port-range", "9000-9010",
                    "--task-ids", "3", "--allow-hosts", "10.0.0.2,10.0.0.3"]
    assert service.RabitService._args(job, "10.0.0.1")[-2:] == ["--task-ids", "3"]  # (hosts unknown: any)
    # (XGBoost 2.1+'s tracker is C++ of XGBoost's own: it takes neither)
    assert service.XGBoostService._args(job, "10.0.0.1", ("10.0.0.2",)) == [
        "--n-workers", "3", "--host-ip", "10.0.0.1", "--port-range", "9000-9010"]


def test_dry_run_lines_show_the_program_the_tracker_python_runs() -> None:
    spec = JobSpec(command=("/opt/xgb/bin/python", "x.py"), num_workers=2, num_servers=0)

    class Plan:
        root_uri, root_port = "10.0.0.1", 9091

    (line,) = trackers.describe(spec, Plan)  # type: ignore[arg-type]
    assert f"/opt/xgb/bin/python {node.ROOT}/launcher/trackers/xgboost_child.py --tracker rabit --n-workers 2 " \
           "--host-ip 10.0.0.1 --port-range 9091-9998 --task-ids 2;" in line


# --- the torch store: one program for the job, a fresh store per attempt --------------------------------


def torch_service(console: Console) -> service.TorchService:
    job = JobSpec(command=(sys.executable, "x.py"), num_workers=2, num_servers=0, tracker="torch")
    return service.TorchService(job, console, None)


def serving(tracker: service.TorchService, attempt: int, timeout: float = 90.0) -> dict:
    """The store's ``listening`` event for ``attempt``, once it came (torch's import takes seconds here)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert tracker.child is not None and tracker.failure() is None, tracker.failure()
        event = tracker.child.last("listening")
        if event is not None and event.get("attempt") == attempt:
            return event
        time.sleep(0.05)
    raise AssertionError(f"the store of attempt {attempt} did not serve within {timeout:g}s")


def store_client(port: int):
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_torch_store_serves_each_attempt_afresh_in_one_program() -> None:
    tracker = torch_service(Console(io.BytesIO(), io.BytesIO(), color=False))
    try:
        port0 = tracker.start("127.0.0.1")
        pid = tracker.pid
        serving(tracker, 0)
        client = store_client(port0)
        client.set("attempt-0", "x")
        assert client.check(["attempt-0"])  # (what the check below would see, were the store the same)
        ports = [port0]
        for attempt in (1, 2):
            port = tracker.restart("127.0.0.1")
            event = serving(tracker, attempt)
            assert (tracker.pid, event["pid"], event["port"]) == (pid, pid, port)  # the same program, a new port
            assert port not in ports
            ports.append(port)
            with pytest.raises(ConnectionRefusedError):  # the last attempt's store is closed
                socket.create_connection(("127.0.0.1", ports[-2]), timeout=5).close()
            client = store_client(port)
            assert not client.check([f"attempt-{attempt - 1}"]) and client.num_keys() <= 1  # (its own key)
            client.set(f"attempt-{attempt}", "x")
            assert client.check([f"attempt-{attempt}"])
    finally:
        tracker.close()
    assert tracker.child is not None and tracker.child.popen.returncode == 0  # the leash's end: it exits itself
    assert tracker.child.event("stopped") is not None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_torch_store_that_died_between_attempts_is_started_anew(caplog) -> None:
    tracker = torch_service(Console(io.BytesIO(), io.BytesIO(), color=False))
    try:
        port0 = tracker.start("127.0.0.1")
        first = tracker.child
        assert first is not None and tracker.pid is not None
        serving(tracker, 0)
        os.kill(tracker.pid, signal.SIGKILL)
        first.popen.wait(30)
        assert tracker.failure() is not None  # (said between attempts: the next one starts all the same)
        with caplog.at_level("INFO"):
            port = tracker.restart("127.0.0.1")
        assert tracker.child is not first and tracker.pid == tracker.child.pid != first.pid
        assert f"torch store: starting a new one for attempt 1 (pid {first.pid}: it exited with code 137" \
            in caplog.text
        assert serving(tracker, 1)["port"] == port
        store_client(port).set("k", "v")
        assert tracker.failure() is None and port0 > 0
    finally:
        tracker.close()
    assert tracker.child.popen.returncode == 0
