"""The local backend with real processes: env per role, exit codes, teardown, orphans, quoting."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from support.helpers import (
    REPO,
    all_pids,
    assert_no_orphans,
    probe_argv,
    pslaunch_argv,
    read_probes,
    run_pslaunch,
    start_pslaunch,
    wait_probes,
)

pytestmark = pytest.mark.integration

CONTRACT = ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER",
            "PSLAUNCH_SECRET", "PS_START_TIMEOUT", "PSLAUNCH_JOB_ID")


@pytest.mark.timeout(60)
def test_env_contract_per_role(probe, monkeypatch) -> None:
    monkeypatch.setenv("PS_VERBOSE", "1")
    monkeypatch.setenv("DMLC_ROLE", "worker")  # overridden, with a warning
    monkeypatch.setenv("UNRELATED_VAR", "kept locally")
    r = run_pslaunch("-n", "3", "-s", "2", "--env", "FOO=bar", "--env-server", "OMP_NUM_THREADS:3",
                     "--env-worker", "WHO=worker", "--kill-grace", "1", *probe())
    assert r.returncode == 0, r.stderr
    assert "the launcher sets DMLC_ROLE itself" in r.stderr
    probes = read_probes(probe.dir)
    assert sorted(probes) == ["scheduler", "server-0", "server-1", "worker-0", "worker-1", "worker-2"]
    sched = probes["scheduler"]["env"]
    port = sched["DMLC_PS_ROOT_PORT"]
    secret = sched["PSLAUNCH_SECRET"]
    assert len(secret) == 64 and int(secret, 16) >= 0
    for name, rec in probes.items():
        env = rec["env"]
        role = name.split("-")[0]
        assert env["DMLC_ROLE"] == role
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1" and env["DMLC_PS_ROOT_PORT"] == port
        assert env["DMLC_NUM_WORKER"] == "3" and env["DMLC_NUM_SERVER"] == "2"
        assert env["PSLAUNCH_SECRET"] == secret and env["PS_START_TIMEOUT"] == "60"
        assert env["PS_VERBOSE"] == "1" and env["FOO"] == "bar" and env["UNRELATED_VAR"] == "kept locally"
        assert rec["pgid"] == rec["pid"] and rec["sid"] == rec["pid"]  # own session and group
        assert rec["cwd"] == str(REPO)
        if role == "scheduler":
            assert "DMLC_TASK_ID" not in env and "DMLC_NODE_HOST" not in env
            continue
        rank = int(name.split("-")[1])
        assert env["DMLC_TASK_ID"] == str(rank if role == "worker" else 3 + rank)
        assert env["DMLC_JOB_CLUSTER"] == "local" and env["DMLC_NODE_HOST"] == "127.0.0.1"
        assert env["PSLAUNCH_LOCAL_PROCS"] == "5"
        if role == "server":
            assert env["OMP_NUM_THREADS"] == "3" and "WHO" not in env
        else:
            assert env["WHO"] == "worker" and env["OMP_NUM_THREADS"] == "1"
    assert "all 6 processes exited 0" in r.stderr


@pytest.mark.timeout(60)
def test_output_is_labelled_and_logged(probe, tmp_path) -> None:
    logs = tmp_path / "logs"
    r = run_pslaunch("-n", "2", "-s", "1", "--log-dir", str(logs), *probe("--print", "héllo wörld ✓"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for label in ("scheduler", "server 0", "worker 0", "worker 1"):
        assert f"[{label}] héllo wörld ✓" in lines
    assert sorted(p.name for p in logs.iterdir()) == ["scheduler.log", "server-0.log", "worker-0.log",
                                                      "worker-1.log"]
    assert (logs / "worker-1.log").read_text(encoding="utf-8") == "héllo wörld ✓\n"


@pytest.mark.timeout(60)
def test_quoting_round_trip(probe) -> None:
    hostile = ["a b", "'", '"', "$HOME", ";", "$(id)", "`id`", "*", "\\", "", "--", "-n", "3", "ünï"]
    r = run_pslaunch("-n", "1", "-s", "0", *probe("--", *hostile))
    assert r.returncode == 0, r.stderr
    rec = read_probes(probe.dir)["worker-0"]
    assert rec["rest"][-len(hostile):] == hostile


@pytest.mark.timeout(60)
def test_all_success_exits_zero_and_no_scheduler_with_s0(probe) -> None:
    r = run_pslaunch("-n", "2", "-s", "0", *probe())
    assert r.returncode == 0, r.stderr
    probes = read_probes(probe.dir)
    assert sorted(probes) == ["worker-0", "worker-1"]
    assert all(p["env"]["DMLC_NUM_SERVER"] == "0" for p in probes.values())


def start_launcher(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(pslaunch_argv(*args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.timeout(60)
def test_leftover_grandchildren_are_swept_after_success(probe) -> None:
    r = run_pslaunch("-n", "2", "-s", "0", "--kill-grace", "1", *probe("--child"))
    assert r.returncode == 0, r.stderr
    assert_no_orphans([p["child"] for p in read_probes(probe.dir).values()], timeout=10)


@pytest.mark.timeout(60)
def test_busy_port_is_skipped(probe, free_port) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", free_port))
    holder.listen()
    try:
        r = run_pslaunch("-n", "1", "-s", "1", "--port-range", f"{free_port}-{free_port + 20}", *probe("--listen"))
    finally:
        holder.close()
    assert r.returncode == 0, r.stderr
    port = int(read_probes(probe.dir)["scheduler"]["env"]["DMLC_PS_ROOT_PORT"])
    assert free_port < port <= free_port + 20


@pytest.mark.timeout(60)
def test_port_lost_between_probe_and_bind_is_retried(probe, free_port, tmp_path) -> None:
    # Everything starts at once; the scheduler of the first attempt loses its port to another
    # process: the whole job starts again on the next port, and only that attempt is reported.
    flag, summary = tmp_path / "took-port", tmp_path / "s.json"
    r = run_pslaunch("-n", "2", "-s", "1", "--kill-grace", "1", "--port-range", f"{free_port}-{free_port + 20}",
                     "--summary-json", str(summary), *probe("--listen", "--sleep", "0.5",
                                                            "--take-port-once", str(flag)))
    assert r.returncode == 0, r.stderr
    assert flag.exists()
    # (the first attempt's port is free_port unless a test beside this one held it at that moment)
    lost = re.search(r"port (\d+) was taken before the scheduler could bind it", r.stderr)
    assert lost and free_port <= int(lost.group(1)) <= free_port + 20, r.stderr
    probes = read_probes(probe.dir)
    ports = {rec["env"]["DMLC_PS_ROOT_PORT"] for rec in probes.values()}
    assert len(probes) == 4 and len(ports) == 1 and int(ports.pop()) > int(lost.group(1))
    doc = json.loads(summary.read_text())
    assert doc["reason"] == "success" and len(doc["processes"]) == 4
    assert all(p["exit_code"] == 0 for p in doc["processes"])


@pytest.mark.timeout(60)
def test_two_jobs_started_together_never_pick_the_same_port(free_port, tmp_path) -> None:
    # The first job's scheduler binds its port a while after it starts (a ps-lite program imports
    # first); a second job started meanwhile with the same --port-range finds that port free, but
    # claimed by the first launcher: it takes the next one, and neither job loses a port race.
    ports = f"{free_port}-{free_port + 20}"
    first_out, second_out = tmp_path / "first", tmp_path / "second"
    first_out.mkdir()
    second_out.mkdir()
    first = start_pslaunch("-n", "1", "-s", "1", "--kill-grace", "1", "--port-range", ports,
                           *probe_argv(first_out, "--listen-after", "2", "--sleep", "0.5"))
    try:
        wait_probes(first_out, 2, timeout=20)  # the server and the worker run: its port is chosen
        second = run_pslaunch("-n", "1", "-s", "1", "--kill-grace", "1", "--port-range", ports,
                              *probe_argv(second_out, "--listen"))
        out, err = first.communicate(timeout=30)
    finally:
        first.kill()
    assert first.returncode == 0 and second.returncode == 0, err + second.stderr
    assert "was taken before the scheduler could bind it" not in err + second.stderr, err + second.stderr
    got = [{rec["env"]["DMLC_PS_ROOT_PORT"] for rec in read_probes(d).values()} for d in (first_out, second_out)]
    assert got[0] == {str(free_port)} and len(got[1]) == 1 and got[1] != got[0], got


def timed_lines(*args: str, timeout: float) -> tuple[int, list[tuple[float, str]]]:
    """Run pslaunch to the end: its exit code and every line of its stdout and stderr, each with
    the seconds from the launcher's start to the line's arrival, in the order they came."""
    lines: list[tuple[float, str]] = []
    start = time.monotonic()
    p = start_pslaunch(*args)

    def read(stream: Any) -> None:
        for line in stream:
            lines.append((time.monotonic() - start, line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(s,), daemon=True) for s in (p.stdout, p.stderr)]
    for t in readers:
        t.start()
    try:
        code = p.wait(timeout=timeout)
    finally:
        p.kill()
    for t in readers:
        t.join(5)
    return code, sorted(lines)


NOT_PSLITE = "import os, time; print('hello from', os.environ['DMLC_ROLE'], flush=True); time.sleep(60)"


@pytest.mark.timeout(60)
def test_a_program_that_is_not_ps_lite_is_shown_at_once_with_a_hint(free_port) -> None:
    # pslaunch -n 2 python x.py with x.py no ps-lite program: its scheduler never listens. What
    # each process prints is shown as it comes (not held until --start-timeout for a port race),
    # and a few seconds on, one hint names -s 0 and --tracker torch; the timeout's error does too
    code, lines = timed_lines("-n", "2", "--start-timeout", "12", "--kill-grace", "1",
                              "--port-range", f"{free_port}-{free_port + 20}", sys.executable, "-c", NOT_PSLITE,
                              timeout=45)
    text = "\n".join(f"{t:6.2f} {x}" for t, x in lines)
    assert code == 1, text
    hello = [t for t, x in lines if "hello from" in x]
    assert len(hello) == 5 and max(hello) < 5.0, text  # (main: all at 12 s, with the timeout's error)
    hints = [(t, x) for t, x in lines if x.startswith("pslaunch: hint: ")]
    assert len(hints) == 1 and 5.0 <= hints[0][0] < 9.0, text
    assert "-s 0" in hints[0][1] and "--tracker torch" in hints[0][1], text
    error = [x for _, x in lines if x.startswith("pslaunch: error: ")]
    assert len(error) == 1 and "--start-timeout 12s" in error[0] and "-s 0" in error[0], text


LISTENS_LATE = ("import os, socket, time, zmq\n"
                "if os.environ['DMLC_ROLE'] == 'scheduler':\n"
                "    time.sleep(6.5)\n"
                "    s = socket.create_server((os.environ['DMLC_PS_ROOT_URI'], int(os.environ['DMLC_PS_ROOT_PORT'])))\n"
                "    time.sleep(0.5)\n"
                "print('hello from', os.environ['DMLC_ROLE'], flush=True)\n")


@pytest.mark.timeout(60)
def test_a_ps_lite_program_that_listens_late_gets_no_hint(free_port) -> None:
    # a scheduler that has loaded libzmq (as a ps-lite program has: MXNet's library, pyzmq) and
    # listens after the hint's few seconds is importing, not wrong: no hint; its output is shown at once
    pytest.importorskip("zmq")
    code, lines = timed_lines("-n", "1", "-s", "1", "--kill-grace", "1",
                              "--port-range", f"{free_port}-{free_port + 20}", sys.executable, "-c", LISTENS_LATE,
                              timeout=45)
    text = "\n".join(f"{t:6.2f} {x}" for t, x in lines)
    assert code == 0, text
    assert not [x for _, x in lines if "hint" in x], text
    hello = {x.split("]")[0]: t for t, x in lines if "hello from" in x}
    assert sorted(hello) == ["[scheduler", "[server 0", "[worker 0"], text
    assert hello["[worker 0"] < 5.0 and hello["[scheduler"] > 6.5, text


@pytest.mark.timeout(60)
def test_program_in_cwd_runs_as_dot_slash(tmp_path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\necho \"ran $DMLC_ROLE\"\n")
    script.chmod(0o755)
    r = run_pslaunch("-n", "1", "-s", "0", "job.sh", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "[worker 0] ran worker" in r.stdout


@pytest.mark.timeout(60)
def test_seed_usage_line_through_scripts_launch_py(probe) -> None:
    r = subprocess.run([sys.executable, "scripts/launch.py", "-n", "2", "-s", "1", "--launcher", "local",
                        *probe()], cwd=REPO, capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    assert sorted(read_probes(probe.dir)) == ["scheduler", "server-0", "worker-0", "worker-1"]


@pytest.mark.timeout(60)
def test_summary_written_on_success(probe, tmp_path) -> None:
    summary = tmp_path / "s.json"
    r = run_pslaunch("-n", "1", "-s", "1", "--summary-json", str(summary), *probe())
    assert r.returncode == 0
    doc = json.loads(summary.read_text())
    assert doc["exit_code"] == 0 and doc["reason"] == "success" and doc["first_failure"] is None
    assert {p["name"]: p["exit_code"] for p in doc["processes"]} == {"scheduler": 0, "server-0": 0, "worker-0": 0}
    assert all(p["signal"] is None for p in doc["processes"])


@pytest.mark.timeout(30)
def test_env_reaches_children_unchanged_through_os_environ(probe) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="7")
    r = run_pslaunch("-n", "1", "-s", "0", *probe(), env=env)
    assert r.returncode == 0
    assert read_probes(probe.dir)["worker-0"]["env"]["OMP_NUM_THREADS"] == "7"


@pytest.mark.timeout(60)
def test_timeout_bounds_the_wait_for_the_scheduler(probe) -> None:
    # The scheduler never listens: before, the launcher waited PS_START_TIMEOUT (62 s), then exited 1.
    t0 = time.monotonic()
    r = run_pslaunch("-n", "1", "-s", "1", "--timeout", "3", *probe("--sleep", "120"))
    assert r.returncode == 124, r.stderr
    assert time.monotonic() - t0 < 20  # (liveness only: the timeout is 3 s)
    assert "--timeout 3s" in r.stderr


@pytest.mark.timeout(60)
def test_the_report_names_the_process_the_scheduler_blames(probe, tmp_path) -> None:
    summary = tmp_path / "s.json"
    r = run_pslaunch("-n", "2", "-s", "1", "--summary-json", str(summary),
                     *probe("--listen", "--sleep", "30", "--cause", "worker-1:no heartbeat for 10.0s"))
    assert r.returncode == 1, r.stderr
    errors = [x for x in r.stderr.splitlines() if "error" in x.lower()]
    assert any("worker 1" in x and "no heartbeat for 10.0s" in x and "reported by the scheduler" in x
               for x in errors), r.stderr
    doc = json.loads(summary.read_text())
    assert doc["first_failure"] == "scheduler"
    assert doc["cause"] == {"process": "worker-1", "reason": "no heartbeat for 10.0s", "reported_by": "scheduler"}


@pytest.mark.timeout(60)
def test_secret_values_never_reach_the_console_logs_or_summary(probe, tmp_path) -> None:
    token, password = "tok-" + "7f3a" * 6, "pq"  # a short one too: hidden where it stands alone
    logs, summary = tmp_path / "logs", tmp_path / "s.json"
    env = dict(os.environ, API_TOKEN=token, DB_PASSWORD=password)
    r = run_pslaunch("-n", "1", "-s", "0", "--env", "API_TOKEN", "--env", "DB_PASSWORD", "--log-dir", str(logs),
                     "--summary-json", str(summary),
                     *probe("--print", f"token={token} password={password} pqrs stays", "--exit", "3"), env=env)
    assert r.returncode == 3, r.stderr
    assert read_probes(probe.dir)["worker-0"]["env"]["API_TOKEN"] == token  # the program gets it
    written = {"stdout": r.stdout, "stderr": r.stderr, "log": (logs / "worker-0.log").read_text(),
               "summary": summary.read_text()}
    for where, text in written.items():
        assert token not in text and f"={password} " not in text, where
    assert "token=<redacted> password=<redacted> pqrs stays" in r.stdout
    assert "| token=<redacted> password=<redacted> pqrs stays" in r.stderr  # the failure report's tail


@pytest.mark.timeout(60)
def test_a_scheduler_that_never_listens_is_an_error_after_the_start_timeout(probe) -> None:
    t0 = time.monotonic()
    r = run_pslaunch("-n", "1", "-s", "1", "--start-timeout", "2", *probe("--sleep", "60"))
    assert r.returncode == 1, r.stderr
    assert time.monotonic() - t0 < 20  # (liveness only)
    assert "the scheduler did not listen on 127.0.0.1:" in r.stderr and "--start-timeout 2s" in r.stderr
    assert_no_orphans(all_pids(read_probes(probe.dir)), timeout=10)


#: a window title (OSC 0), a clipboard write (OSC 52), a cleared screen (CSI 2J), the cursor moved up
#: a line and the line erased to fake pslaunch's last line, the 8-bit CSI (U+009B)
ESCAPES = ("\x1b]0;owned\x07\x1b]52;c;ZWNobyBvd25lZA==\x07\x1b[2J\x1b[1A\x1b[2K"
           "pslaunch: all 1 processes exited 0 in 0.1s\u009b31m")
SHOWN = ("^[]0;owned^G^[]52;c;ZWNobyBvd25lZA==^G^[[2J^[[1A^[[2K"
         "pslaunch: all 1 processes exited 0 in 0.1sM-^[31m")


def _controls(text: str) -> list[str]:
    return [c for c in text if (ord(c) < 0x20 and c not in "\t\n") or 0x7F <= ord(c) <= 0x9F]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("raw", [False, True], ids=["logs-shown", "log-raw"])
def test_terminal_escapes_from_a_process_are_shown_not_obeyed(tmp_path, raw: bool) -> None:
    logs = tmp_path / "logs"
    line = ESCAPES + "\x1b[1;32mok\x1b[0m"  # (and a colour of the program's own)
    prog = f"import sys; print({line!r}); sys.stderr.write({line!r} + '\\n'); sys.exit(3)"
    r = run_pslaunch("-n", "1", "-s", "0", "--log-dir", str(logs), *(["--log-raw"] if raw else []),
                     sys.executable, "-c", prog)
    assert r.returncode == 3, r.stderr
    assert _controls(r.stdout + r.stderr) == []  # before: 8 of 8 escapes reached the terminal
    # (a pipe is not a coloured console: the program's colours are dropped there, the rest is shown)
    assert f"[worker 0] {SHOWN}ok" in r.stdout.splitlines()
    assert f"[worker 0] {SHOWN}ok" in r.stderr.splitlines()
    assert f"pslaunch: error:   | {SHOWN}^[[1;32mok^[[0m" in r.stderr.splitlines()  # the failure report's tail
    assert (logs / "worker-0.log").read_text() == ((line if raw else SHOWN + "^[[1;32mok^[[0m") + "\n") * 2


# --- restarts: what never restarts, and the log files across attempts --------------------------------


@pytest.mark.timeout(60)
def test_timeout_is_the_whole_jobs_across_attempts(probe) -> None:
    # attempt 0 fails after 1 s; attempt 1 would run 30 s: --timeout 4 ends the job 4 s after its start
    t0 = time.monotonic()
    r = run_pslaunch("-n", "1", "-s", "0", "--max-restarts", "3", "--restart-delay", "0.5", "--timeout", "4",
                     "--kill-grace", "1", *probe("--sleep", "30", "--fail", "worker-0:3:1", "--on-attempts", "0"))
    took = time.monotonic() - t0
    assert r.returncode == 124, r.stderr
    assert "restarting every process in 0.5s (restart 1/3)" in r.stderr
    assert 4 <= took < 12, took  # (the dumps of the stacks take 3 s)
    assert "--timeout 4s" in r.stderr


@pytest.mark.timeout(60)
def test_ctrl_c_while_waiting_to_restart_ends_the_job(probe, tmp_path) -> None:
    summary = tmp_path / "s.json"
    p = start_pslaunch("-n", "1", "-s", "0", "--max-restarts", "3", "--restart-delay", "30", "--summary-json",
                       str(summary), *probe("--sleep", "30", "--fail", "worker-0:3:0.2"))
    deadline = time.monotonic() + 20
    seen = ""
    while "restarting every process in" not in seen and time.monotonic() < deadline:
        seen += p.stderr.readline()
    assert "restarting every process in" in seen, seen
    t0 = time.monotonic()
    p.send_signal(2)
    _, err = p.communicate(timeout=15)
    assert p.returncode == 130, seen + err
    assert time.monotonic() - t0 < 5
    assert "stopped by SIGINT (Ctrl-C)" in err
    doc = json.loads(summary.read_text())
    assert [a["attempt"] for a in doc["attempts"]] == [0] and doc["reason"] == "signal"


@pytest.mark.timeout(60)
def test_log_files_go_on_across_attempts(probe, tmp_path) -> None:
    logs = tmp_path / "logs"
    r = run_pslaunch("-n", "2", "-s", "0", "--max-restarts", "1", "--restart-delay", "0", "--log-dir", str(logs),
                     *probe("--print", "hello", "--fail", "worker-1:3:0.5", "--on-attempts", "0"))
    assert r.returncode == 0, r.stderr
    text = (logs / "worker-0.log").read_text()
    assert text.count("hello") == 2, text
    first, banner, second = text.partition("--- pslaunch: attempt 1 (PSLAUNCH_ATTEMPT=1) ---\n")
    assert banner and "hello" in first and "hello" in second, text


# --- --only and --gpus-per-process ----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_only_shows_one_workers_lines_and_the_log_files_keep_everyones(probe, tmp_path) -> None:
    logs = tmp_path / "logs"
    r = run_pslaunch("-n", "3", "-s", "1", "--only", "worker:1", "--log-dir", str(logs),
                     *probe("--print", "hello from a process"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["[worker 1] hello from a process"]
    assert "[worker 0]" not in r.stderr and "[scheduler]" not in r.stderr and "[server 0]" not in r.stderr
    assert "all 5 processes exited 0" in r.stderr  # (pslaunch's own lines are always shown)
    assert sorted(p.name for p in logs.iterdir()) == ["scheduler.log", "server-0.log", "worker-0.log",
                                                      "worker-1.log", "worker-2.log"]
    for log in logs.iterdir():
        assert log.read_text() == "hello from a process\n", log.name


@pytest.mark.timeout(60)
def test_only_still_reports_a_filtered_out_process_that_fails(probe, tmp_path) -> None:
    r = run_pslaunch("-n", "2", "-s", "0", "--only", "worker:1", "--kill-grace", "1",
                     *probe("--sleep", "20", "--fail", "worker-0:3:0.5"))
    assert r.returncode == 3, r.stderr
    assert "[worker 0]" not in r.stdout + r.stderr  # (its line never reached the console as its own)
    assert "  | worker-0 failing with code 3" in r.stderr  # (the failure report shows it all the same)


@pytest.mark.timeout(60)
def test_gpus_per_process_gives_each_worker_its_slice(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    show = "import os; print(os.environ['DMLC_ROLE'], os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'))"
    summary = tmp_path / "s.json"
    r = run_pslaunch("-n", "2", "-s", "1", "--gpus-per-process", "2", "--summary-json", str(summary),
                     sys.executable, "-c", show)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == ["[scheduler] scheduler unset", "[server 0] server unset",
                                             "[worker 0] worker 0,1", "[worker 1] worker 2,3"]
    doc = json.loads(summary.read_text())
    assert {p["name"]: p["gpus"] for p in doc["processes"]} == {"scheduler": None, "server-0": None,
                                                               "worker-0": "0,1", "worker-1": "2,3"}


@pytest.mark.timeout(120)
def test_a_builtin_scheduler_left_alone_by_nodes_that_are_not_ps_lite_is_stopped() -> None:
    """Before: servers and workers that are not ps-lite programs (`sleep 1`) exited 0 and the
    builtin scheduler waited for them to register forever (stopped by hand after 604 s). Now it
    may outlive them by SCHEDULER_OUTLIVES (10 s), then it is stopped with a warning that names
    the fix, and the job ends 0: the nodes' work is done."""
    t0 = time.monotonic()
    r = run_pslaunch("-n", "2", "-s", "1", "--scheduler", "builtin", "--no-progress", "sleep", "1", timeout=100)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert "the scheduler still ran 10s later" in r.stderr and "-s 0" in r.stderr, r.stderr
    assert "all 3 processes exited 0" in r.stderr and "the scheduler was stopped" in r.stderr, r.stderr
    assert took < 60, took  # (a liveness deadline: 10 s of grace and the start)
