"""The backend conformance suite: the same scenarios on every backend that can run here.

Each scenario runs once per :class:`~support.clusters.Cluster` (local; ssh on the namespace
testbed; mpi with Open MPI and with MPICH; sge on a real Grid Engine). A backend earns its place
in ``--launcher`` by passing all of them:

* the environment contract, per role;
* a failing process stops the rest, and the launcher exits with its code;
* a process killed by signal N makes the launcher exit 128+N;
* Ctrl-C stops everything (130); a second Ctrl-C kills at once;
* kill -9 of the launcher leaves nothing running or queued;
* kill -9 of a process's node agent (the ssh wrapper, the mpi rank wrapper, the batch task wrapper)
  fails the job, blames that process, and leaves nothing running;
* SIGUSR1 and SIGUSR2 to the launcher (a batch system's notice before a time limit) reach every
  process once, and the job goes on to its normal end;
* a program that does not exist is one line (exit 127), found here or on the nodes;
* a program that is not executable is one line (exit 126), found here or on the nodes;
* ``--timeout`` dumps every Python stack and exits 124;
* a scheduler that fails stops the job before anything else starts;
* a real ps-lite job (MXNet) passes under pslaunch's builtin scheduler (``--scheduler builtin``);
* each tracker of a collective job (rabit, xgboost, torch): its variables per worker (torch's ranks
  host by host), a real worker that exits before joining fails the job fast with its code, and
  a program that never talks to the rabit tracker does not hang the job beyond ``--timeout``.

"Nothing left" is checked independently of the code under test (see ``support.clusters``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.clusters import CLUSTERS, Cluster, make_cluster
from support.helpers import (
    BIN,
    free_port,
    pid_alive,
    read_probes,
    wait_for,
    wait_probes,
    xgboost_python,
)

from launcher.node import procgroup

pytestmark = pytest.mark.integration

CONTRACT = ("DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER",
            "PSLAUNCH_SECRET", "PS_START_TIMEOUT", "PSLAUNCH_JOB_ID")


@pytest.fixture(params=[pytest.param(kind, marks=marks) for kind, marks in CLUSTERS.items()])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Cluster:
    c = make_cluster(request.param, tmp_path, request)
    yield c
    c.close()


def assert_nothing_left(cluster: Cluster, timeout: float = 15.0) -> float:
    """Wait until nothing of the job runs or is queued; returns how long that took."""
    t0 = time.monotonic()
    try:
        wait_for(lambda: not cluster.leftovers(), timeout, interval=0.2, what="nothing left")
    except AssertionError:
        raise AssertionError(f"left after {timeout}s: {cluster.leftovers()}") from None
    return time.monotonic() - t0


def running_job(cluster: Cluster, *args: str, count: int):
    """Start a job and wait until its ``count`` processes have written their probes."""
    p = cluster.start(*args)
    try:
        probes = wait_probes(cluster.out, count, timeout=cluster.start_timeout, alive=True)
    except BaseException:
        p.kill()
        out, err = p.communicate()
        print(err)
        raise
    return p, probes


def the_error_line(stderr: str) -> str:
    """The one ``pslaunch: error:`` line of ``stderr`` (the whole output when there are more)."""
    lines = [x for x in stderr.splitlines() if x.startswith("pslaunch: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


# --- the contract -----------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_env_contract_per_role(cluster: Cluster, monkeypatch) -> None:
    monkeypatch.setenv("PS_VERBOSE", "1")          # forwarded to every node on every backend
    monkeypatch.setenv("DMLC_NODE_HOST", "1.2.3.4")  # the launcher's own value wins
    r = cluster.run("-n", "3", "-s", "2", "--env", "FOO=bar baz", "--env-server", "OMP_NUM_THREADS:3",
                    "--env-worker", "WHO=worker", "--kill-grace", "1",
                    *cluster.probe("--listen", "--child", "--escape"))
    assert r.returncode == 0, r.stderr
    # the escaped grandchildren are stopped at the end, and only they: not the launcher's own helpers
    # (skein's driver, salloc), whose loss made the backend's clean-up fail and wait
    warnings = [x for x in r.stderr.splitlines() if "warning:" in x and "sets DMLC_NODE_HOST itself" not in x]
    assert warnings == [], warnings
    probes = read_probes(cluster.out)
    assert sorted(probes) == ["scheduler", "server-0", "server-1", "worker-0", "worker-1", "worker-2"]
    sched = probes["scheduler"]["env"]
    assert len(sched["PSLAUNCH_SECRET"]) == 64 and int(sched["PSLAUNCH_SECRET"], 16) >= 0
    for name, rec in probes.items():
        env = rec["env"]
        role = name.split("-")[0]
        for key in CONTRACT:
            if key != "DMLC_ROLE":
                assert env[key] == sched[key], (name, key)
        assert env["DMLC_ROLE"] == role
        assert env["DMLC_NUM_WORKER"] == "3" and env["DMLC_NUM_SERVER"] == "2"
        assert env["PS_VERBOSE"] == "1" and env["FOO"] == "bar baz"
        assert rec["pgid"] == rec["pid"] == rec["sid"], name  # its own session and process group
        if role == "scheduler":
            assert "DMLC_TASK_ID" not in env
            continue
        rank = int(name.split("-")[1])
        assert env["DMLC_TASK_ID"] == str(rank if role == "worker" else 3 + rank), name
        assert env["DMLC_JOB_CLUSTER"] == cluster.launcher
        assert env["DMLC_NODE_HOST"] == cluster.node_host(name, rec), name
        assert env["OMP_NUM_THREADS"] == ("3" if role == "server" else "1"), name
        assert (env.get("WHO") == "worker") == (role == "worker"), name
        cluster.check_record(name, rec)
    assert "all 6 processes exited 0" in r.stderr
    assert "PSLAUNCH_SECRET=" not in r.stderr and sched["PSLAUNCH_SECRET"] not in r.stderr + r.stdout
    # the grandchildren too: in the process's group (--child), or gone from it with setsid() or a
    # double fork (--escape): they go with their process
    assert_nothing_left(cluster)


@pytest.mark.timeout(240)
def test_a_300kB_environment_reaches_every_process_and_no_value_shows_in_ps(cluster: Cluster, tmp_path: Path,
                                                                             monkeypatch) -> None:
    """300 variables of 1 kB forwarded by a glob, an env file with a quoted secret and a variable
    forwarded by name: every process gets each value whole (no "Argument list too long" on the
    way: not on ssh's command, mpirun's, srun's or a batch task's), and while the job runs no
    value is in any process's arguments (``ps -eo args``, which every user of a host can read;
    the testbed's hosts share this machine's process table). Each process sleeps 15 s: on YARN the
    first container may have ended a short sleep before the last one starts."""
    wanted = {f"PSLT_BIG_{i:03d}": secrets.token_hex(500) for i in range(300)}
    for k, v in wanted.items():
        monkeypatch.setenv(k, v)
    a, token = secrets.token_hex(20), secrets.token_hex(20)
    env_file = tmp_path / "job.env"
    env_file.write_text(f"# the settings of the job\nexport PSLT_FILE_A='{a} $HOME'\n"
                        f'PSLT_FILE_TOKEN="{token}\\nsecond line"\n')
    wanted["PSLT_FILE_A"] = f"{a} $HOME"
    wanted["PSLT_FILE_TOKEN"] = f"{token}\nsecond line"
    wanted["PSLT_BY_NAME_KEY"] = secrets.token_hex(20)
    monkeypatch.setenv("PSLT_BY_NAME_KEY", wanted["PSLT_BY_NAME_KEY"])
    assert sum(len(k) + len(v) + 2 for k, v in wanted.items()) > 300_000
    p, probes = running_job(cluster, "-n", "2", "-s", "1", "--kill-grace", "1", "--env", "PSLT_BIG_*",
                            "--env-file", str(env_file), "--env", "PSLT_BY_NAME_KEY", "--env", "PSLT_NONE_*",
                            *cluster.probe("--listen", "--sleep", "15"), count=4)
    try:
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, timeout=30).stdout
    finally:
        out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    shown = [k for k, v in wanted.items() if v[:24] in ps or v[-24:] in ps]
    assert shown == [], f"values of {shown[:5]} are in ps -eo args"
    assert sorted(probes) == ["scheduler", "server-0", "worker-0", "worker-1"]
    for name, rec in read_probes(cluster.out).items():
        env = rec["env"]
        missing = [k for k, v in wanted.items() if env.get(k) != v]
        assert missing == [], (name, len(missing), missing[:5])
    assert "warning: --env PSLT_NONE_* matches no variable of this shell" in err, err
    assert "Argument list too long" not in out + err
    assert_nothing_left(cluster)


# --- failures -------------------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_a_failure_stops_the_rest_with_its_exit_code(cluster: Cluster, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    r = cluster.run("-n", "3", "-s", "1", "--kill-grace", "1", "--summary-json", str(summary),
                    *cluster.probe("--listen", "--sleep", "60", "--child", "--escape", "--fail", "worker-1:3:1.0"))
    assert r.returncode == 3, r.stderr
    assert re.search(r"error: worker 1\b.* exited with code 3 first; stopped the other processes", r.stderr), r.stderr
    assert "worker-1 failing with code 3" in r.stderr  # the tail of its output is in the report
    assert_nothing_left(cluster)
    doc = json.loads(summary.read_text())
    assert doc["exit_code"] == 3 and doc["reason"] == "failure" and doc["first_failure"] == "worker-1"
    procs = {p["name"]: p for p in doc["processes"]}
    assert sorted(procs) == ["scheduler", "server-0", "worker-0", "worker-1", "worker-2"]
    assert procs["worker-1"]["exit_code"] == 3 and not procs["worker-1"]["stopped_by_launcher"]
    for name in ("scheduler", "server-0", "worker-0", "worker-2"):
        assert procs[name]["stopped_by_launcher"], procs[name]
        assert procs[name]["exit_code"] not in (None, 0), procs[name]


@pytest.mark.timeout(150)
def test_a_stopped_process_does_not_hold_up_the_teardown(cluster: Cluster) -> None:
    """A process stopped with SIGSTOP (hung, or in a debugger) gets SIGCONT with its SIGTERM: the
    job ends at once, not after --kill-grace."""
    t0 = time.monotonic()
    r = cluster.run("-n", "3", "-s", "1", "--kill-grace", "60",
                    *cluster.probe("--listen", "--sleep", "90", "--stop-self", "worker-2", "--fail", "worker-1:3:2.0"))
    took = time.monotonic() - t0
    assert r.returncode == 3, r.stderr
    assert took < 45, f"the job took {took:.0f}s to end: the stopped worker waited out the 60 s grace"
    assert_nothing_left(cluster)


@pytest.mark.timeout(150)
def test_killed_by_signal_n_reports_128_plus_n(cluster: Cluster) -> None:
    r = cluster.run("-n", "2", "-s", "0", "--kill-grace", "1",
                    *cluster.probe("--sleep", "60", "--kill-self", "worker-0:SEGV"))
    assert r.returncode == 128 + signal.SIGSEGV, r.stderr
    assert re.search(r"error: worker 0\b.* was killed by SIGSEGV \(exit code 139\) first", r.stderr), r.stderr
    assert_nothing_left(cluster)


@pytest.mark.timeout(150)
def test_scheduler_failure_stops_the_job(cluster: Cluster, tmp_path: Path) -> None:
    # everything starts at once; the scheduler fails once the others run: they are all stopped
    summary = tmp_path / "summary.json"
    r = cluster.run("-n", "2", "-s", "1", "--kill-grace", "1", "--summary-json", str(summary),
                    *cluster.probe("--listen", "--sleep", "60", "--fail", "scheduler:5:1.0"))
    assert r.returncode == 5, r.stderr
    assert "error: scheduler (on localhost, pid" in r.stderr and "exited with code 5 first" in r.stderr
    procs = {p["name"]: p for p in json.loads(summary.read_text())["processes"]}
    assert sorted(procs) == ["scheduler", "server-0", "worker-0", "worker-1"]
    assert procs["scheduler"]["exit_code"] == 5
    for name in ("server-0", "worker-0", "worker-1"):
        assert procs[name]["stopped_by_launcher"] and procs[name]["exit_code"] not in (None, 0), procs[name]
    assert_nothing_left(cluster)


@pytest.mark.timeout(200)
@pytest.mark.mxnet
def test_a_ps_lite_job_under_the_builtin_scheduler(cluster: Cluster, mxnet: str, tmp_path: Path) -> None:
    # real MXNet servers and workers on the backend's nodes, pslaunch's own ps-lite scheduler here
    summary = tmp_path / "summary.json"
    r = cluster.run("-n", "2", "-s", "1", "--scheduler", "builtin", "--kill-grace", "1", "--timeout", "150",
                    "--summary-json", str(summary), mxnet, str(BIN / "mxnet_dist_sync.py"), timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    pulled = [x for x in r.stdout.splitlines() if "pulled" in x]
    assert len(pulled) == 2 and all("expected 3.0" in x for x in pulled), r.stdout
    procs = {p["name"]: p for p in json.loads(summary.read_text())["processes"]}
    assert sorted(procs) == ["scheduler", "server-0", "worker-0", "worker-1"]
    assert all(p["exit_code"] == 0 for p in procs.values()), procs
    assert_nothing_left(cluster)


@pytest.mark.timeout(200)
def test_a_lost_port_race_starts_the_whole_job_again(cluster: Cluster, tmp_path: Path) -> None:
    """Everything starts at once; another process takes the scheduler's port before it binds: every
    process of that attempt is stopped and the job starts again on the next port (nothing of the
    lost attempt is reported or left running; what it printed before is said to be its)."""
    port, flag, summary = free_port(), tmp_path / "took-port", tmp_path / "summary.json"
    r = cluster.run("-n", "2", "-s", "1", "--kill-grace", "1", "--port-range", f"{port}-{port + 40}",
                    "--summary-json", str(summary),
                    *cluster.probe("--listen", "--sleep", "1", "--take-port-once", str(flag)))
    assert r.returncode == 0, r.stderr
    assert flag.exists()
    probes = read_probes(cluster.out)
    assert sorted(probes) == ["scheduler", "server-0", "worker-0", "worker-1"]
    ports = {rec["env"]["DMLC_PS_ROOT_PORT"] for rec in probes.values()}
    assert len(ports) == 1 and int(ports.pop()) > port, probes
    # output is never held for the port's verdict: what the lost attempt printed before the port
    # was taken (each process its port, once it started) was shown as it came, and the warning
    # counts those lines as the stopped attempt's; nothing of it after. The attempt that ran is
    # shown once per process
    said = sorted(re.findall(r"^\[[^]]*\] (\S+) started on port (\d+)$", r.stdout, re.M))
    final = probes["worker-0"]["env"]["DMLC_PS_ROOT_PORT"]
    assert [x for x in said if x[1] == final] == [("server-0", final), ("worker-0", final), ("worker-1", final)]
    # the lost attempt's port is the first free one of the range when it started: `port` itself,
    # unless another job on this machine (a test beside this one) held or had claimed it then
    warning = re.search(r"port (\d+) was taken before the scheduler could bind it; starting the job again on the "
                        r"next port(?: \(the (\d+) lines? above came from the stopped attempt\))?$", r.stderr, re.M)
    assert warning, r.stderr
    lost = warning.group(1)
    assert port <= int(lost) < int(final), r.stderr
    early = [x for x in said if x[1] != final]
    assert len(early) <= 3 and all(p == lost for _, p in early), r.stdout
    assert int(warning.group(2) or 0) >= len(early), r.stderr
    doc = json.loads(summary.read_text())
    assert doc["reason"] == "success" and sorted(p["name"] for p in doc["processes"]) == sorted(probes)
    assert_nothing_left(cluster)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("servers", ["1", "0"], ids=["found-here", "found-on-the-node"])
def test_missing_program_is_one_line(cluster: Cluster, servers: str) -> None:
    # with a scheduler, this machine finds out first; without one, the node that runs worker 0 does
    r = cluster.run("-n", "2", "-s", servers, "no-such-program-xyz")
    assert r.returncode == 127, r.stderr
    line = the_error_line(r.stderr)
    assert "'no-such-program-xyz'" in line and "no such program" in line, line
    assert "Traceback" not in r.stderr and not re.search(r"^\[", r.stderr, re.M), r.stderr
    assert_nothing_left(cluster)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("servers", ["1", "0"], ids=["found-here", "found-on-the-node"])
def test_a_program_that_is_not_executable_is_126(cluster: Cluster, servers: str) -> None:
    # the shell's convention, as for 127: the file exists (here and on the nodes) but lacks the x bit
    prog = cluster.out / "not-executable.sh"
    prog.write_text("#!/bin/sh\necho ran\n")
    prog.chmod(0o644)
    r = cluster.run("-n", "2", "-s", servers, str(prog))
    assert r.returncode == 126, r.stderr
    line = the_error_line(r.stderr)
    assert "not-executable.sh" in line and "permission denied" in line, line
    assert "Traceback" not in r.stderr and "ran" not in r.stdout, r.stderr
    assert_nothing_left(cluster)


# --- stopping ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(150)
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["INT", "TERM"])
def test_a_signal_stops_everything(cluster: Cluster, sig: int, code: int) -> None:
    p, probes = running_job(cluster, "-n", "2", "-s", "1", "--kill-grace", "2",
                            *cluster.probe("--listen", "--sleep", "60", "--child", "--escape"), count=4)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == code, err
    named = "SIGINT (Ctrl-C)" if sig == signal.SIGINT else "SIGTERM"
    assert f"pslaunch: error: stopped by {named} after" in err and "stopped by a signal" not in err, err
    assert_nothing_left(cluster)


def notices(out: Path) -> dict[str, list[tuple[str, int]]]:
    """What each probe recorded with ``--notices``: its name -> ``[(signal, pid), ...]``, in order."""
    found = {}
    for f in out.glob("*.notices"):
        found[f.name[:-len(".notices")]] = [(w[0], int(w[1])) for w in map(str.split, f.read_text().splitlines())]
    return found


@pytest.mark.timeout(150)
def test_usr1_and_usr2_reach_every_process_once_and_the_job_goes_on(cluster: Cluster) -> None:
    p, probes = running_job(cluster, "-n", "2", "-s", "1",
                            *cluster.probe("--listen", "--sleep", "25", "--notices"), count=4)
    want = {name: [("USR1", rec["pid"])] for name, rec in probes.items()}
    p.send_signal(signal.SIGUSR1)
    # (generous: a loaded 2-core CI once took longer than 10 s on Slurm)
    wait_for(lambda: notices(cluster.out) == want, 20, interval=0.1, what="SIGUSR1 in every process")
    time.sleep(0.5)
    p.send_signal(signal.SIGUSR2)
    want = {name: [*pids, ("USR2", probes[name]["pid"])] for name, pids in want.items()}
    wait_for(lambda: notices(cluster.out) == want, 20, interval=0.1, what="SIGUSR2 in every process")
    assert p.poll() is None
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "SIGUSR1 received: passing it on to every process" in err, err
    assert notices(cluster.out) == want  # once each, not more
    assert_nothing_left(cluster)


@pytest.mark.timeout(150)
def test_a_second_ctrl_c_kills_at_once(cluster: Cluster) -> None:
    p, probes = running_job(cluster, "-n", "2", "-s", "1", "--kill-grace", "60",
                            *cluster.probe("--listen", "--sleep", "90", "--ignore-term"), count=4)
    p.send_signal(signal.SIGINT)
    time.sleep(2.0)
    assert p.poll() is None, p.communicate()[1]  # SIGTERM is ignored: the launcher waits out the grace
    assert all(pid_alive(rec["pid"]) for rec in probes.values())  # (one pid namespace for every host)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    took = time.monotonic() - t0
    assert p.returncode == 130, err
    assert "killing every process" in err
    assert took < 15, f"the second Ctrl-C took {took:.1f}s to end the job"
    assert_nothing_left(cluster)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("behaviour", ["--child", "--escape", "--ignore-term"],
                         ids=["grandchildren", "escaped-grandchildren", "ignoring-SIGTERM"])
def test_kill_9_of_the_launcher_leaves_nothing(cluster: Cluster, behaviour: str) -> None:
    p, _ = running_job(cluster, "-n", "2", "-s", "1", "--kill-grace", "1",
                       *cluster.probe("--listen", "--sleep", "60", behaviour), count=4)
    p.kill()
    p.communicate()
    took = assert_nothing_left(cluster, timeout=30)
    print(f"{cluster.launcher}: nothing left {took:.1f}s after kill -9 of the launcher")


@pytest.mark.timeout(150)
def test_kill_9_of_a_node_agent_fails_the_job_and_leaves_nothing(cluster: Cluster) -> None:
    """Issue 30, 11 and 14 (b): nothing on a node depends on its agent staying alive, and the
    launcher blames the process whose agent was killed."""
    if cluster.launcher == "local":
        pytest.skip("the local backend runs its processes without a node agent")
    p, probes = running_job(cluster, "-n", "2", "-s", "1", "--kill-grace", "1",
                            *cluster.probe("--listen", "--sleep", "60", "--child", "--escape", "--ignore-term"),
                            count=4)
    st = procgroup.stat(probes["worker-1"]["pid"])  # (one pid namespace for every host)
    assert st is not None and st.ppid > 1, probes["worker-1"]
    agent = procgroup.stat(st.ppid)
    t0 = time.monotonic()
    os.kill(st.ppid, signal.SIGKILL)
    _, err = p.communicate(timeout=90)
    failed_after = time.monotonic() - t0
    assert p.returncode != 0, err
    first = [x for x in err.splitlines() if " first" in x and x.startswith("pslaunch: error:")]
    assert first and "worker 1" in first[0], err
    # (the agent's end is seen at once, not when the batch system gets round to it: 61 s on Slurm)
    assert failed_after < 30, f"the job failed {failed_after:.0f}s after worker 1's agent was killed"
    took = assert_nothing_left(cluster, timeout=30)
    print(f"{cluster.launcher}: kill -9 of worker 1's agent ({agent}): the job failed after {failed_after:.1f}s "
          f"(rc {p.returncode}; {first[0]}); nothing left {took:.1f}s later")


@pytest.mark.timeout(150)
def test_timeout_dumps_python_stacks_and_exits_124(cluster: Cluster) -> None:
    r = cluster.run("-n", "1", "-s", "1", "--timeout", str(cluster.timeout), "--kill-grace", "1",
                    *cluster.probe("--listen", "--sleep", "90"))
    assert r.returncode == 124, r.stderr
    assert f"longer than --timeout {cluster.timeout:g}s" in r.stderr
    # faulthandler's dump of the sleeping worker, under its label
    assert re.search(r"^\[worker 0\b[^\]]*\] Fatal Python error: Aborted", r.stderr, re.M), r.stderr
    assert re.search(r"^\[worker 0\b[^\]]*\] Current thread", r.stderr, re.M) and "probe.py" in r.stderr
    assert_nothing_left(cluster)


# --- collective jobs: the trackers (rabit, xgboost, torch) ------------------------------------------------

# (rabit and xgboost: XGBoost's own trackers, run with XGBoost 2.0.3's and 3.0's Python; the workers that
# join are real XGBoost)
TRACKERS = (pytest.param("rabit", marks=pytest.mark.xgboost), pytest.param("xgboost", marks=pytest.mark.xgboost),
            "torch")
JOINING = (pytest.param("rabit", marks=pytest.mark.xgboost), pytest.param("xgboost", marks=pytest.mark.xgboost),
           "torch")


def tracker_options(tracker: str) -> list[str]:
    """How a job selects ``tracker`` (rabit: as launch.py, by -s 0)."""
    if tracker == "rabit":
        return ["-s", "0", "--tracker-python", xgb_python("2.0")]
    if tracker == "xgboost":
        return ["--tracker", "xgboost", "--tracker-python", xgb_python("3.0")]
    return ["--tracker", "torch"]  # (the store runs with the command's Python: this one, which has torch)


def xgb_python(version: str) -> str:
    python = xgboost_python(version)
    if python is None:
        pytest.skip(f"the XGBoost {version} venv is missing (run scripts/deps/70-xgboost.sh)")
    return python


def host_key(rec: dict) -> tuple[str, str]:
    """Which machine a probe ran on: its network namespace (a testbed host) and its host name."""
    return rec["netns"], rec["host"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tracker", TRACKERS)
def test_tracker_variables_per_worker(cluster: Cluster, tracker: str) -> None:
    # (a probe reaches rabit's tracker and torch's store; XGBoost's tracker takes any connection for a worker)
    reach = () if tracker == "xgboost" else ("--reach-tracker",)
    r = cluster.run("-n", "3", *tracker_options(tracker), "--kill-grace", "1", *cluster.probe(*reach))
    assert r.returncode == 0, r.stderr
    probes = read_probes(cluster.out)
    assert sorted(probes) == ["worker-0", "worker-1", "worker-2"]  # no scheduler, no servers
    envs = {name: rec["env"] for name, rec in probes.items()}
    service = ("MASTER_ADDR", "MASTER_PORT") if tracker == "torch" else ("DMLC_TRACKER_URI", "DMLC_TRACKER_PORT")
    assert len({(e[service[0]], e[service[1]]) for e in envs.values()}) == 1, envs  # one tracker for all
    for name, rec in probes.items():
        env, rank = rec["env"], int(name.split("-")[1])
        assert (env["DMLC_ROLE"], env["DMLC_NUM_WORKER"], env["DMLC_NUM_SERVER"]) == ("worker", "3", "0"), name
        assert env["DMLC_TASK_ID"] == str(rank) and env["DMLC_JOB_CLUSTER"] == cluster.launcher, name
        assert "DMLC_PS_ROOT_URI" not in env and "DMLC_PS_ROOT_PORT" not in env, name
        assert env["DMLC_NODE_HOST"] == cluster.node_host(name, rec), name
        if reach:
            assert rec["tracker"] == "ok", (name, rec["tracker"])  # the address works from where it runs
        other = ("DMLC_TRACKER_URI",) if tracker == "torch" else ("MASTER_ADDR", "RANK", "WORLD_SIZE")
        assert not any(k in env for k in other), name
        cluster.check_record(name, rec)
    if tracker == "torch":
        hosts: dict[tuple, list[dict]] = {}
        for name in sorted(probes):
            hosts.setdefault(host_key(probes[name]), []).append(envs[name])
        ranks = []
        for group, members in enumerate(sorted(hosts.values(), key=lambda m: int(m[0]["RANK"]))):
            local = sorted(members, key=lambda e: int(e["RANK"]))
            # host by host: each host's ranks consecutive, LOCAL_RANK their order there (cuda:LOCAL_RANK)
            assert [e["LOCAL_RANK"] for e in local] == [str(i) for i in range(len(local))]
            assert {(e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"], e["GROUP_WORLD_SIZE"]) for e in local} == \
                {(str(len(local)), str(group), str(len(hosts)))}
            ranks += [int(e["RANK"]) for e in local]
        assert ranks == [0, 1, 2]
        for e in envs.values():
            assert e["WORLD_SIZE"] == e["ROLE_WORLD_SIZE"] == "3" and e["ROLE_RANK"] == e["RANK"]
            assert e["TORCHELASTIC_USE_AGENT_STORE"] == "True" and e["TORCHELASTIC_RUN_ID"]
            if cluster.launcher not in ("sge", "yarn", "slurm", "ray"):  # (placed by the launcher: RANK = its number)
                assert e["RANK"] == e["DMLC_TASK_ID"]
    assert "all 3 processes exited 0" in r.stderr
    assert_nothing_left(cluster)  # the tracker included (its child process carries the job's mark)


def joining_worker(tracker: str, out: Path) -> list[str]:
    """A real program that joins through ``tracker``, whose worker 1 exits with 3 before joining."""
    if tracker == "torch":
        return [sys.executable, str(BIN / "ddp_worker.py"), "--out", str(out), "--exit-before-join", "1:3"]
    python = xgb_python("2.0" if tracker == "rabit" else "3.0")
    return [python, str(BIN / "xgb_worker.py"), "--api", "env" if tracker == "rabit" else "args", "--out", str(out),
            "--exit-before-join", "1:3"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tracker", JOINING)
def test_a_worker_that_exits_before_joining_fails_the_job_fast(cluster: Cluster, tracker: str,
                                                               tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    r = cluster.run("-n", "3", *tracker_options(tracker), "--kill-grace", "2", "--summary-json", str(summary),
                    *joining_worker(tracker, cluster.out))
    assert r.returncode == 3, r.stdout + r.stderr
    assert re.search(r"error: worker 1\b.* exited with code 3 first; stopped the other processes", r.stderr), r.stderr
    doc = json.loads(summary.read_text())
    procs = {p["name"]: p for p in doc["processes"]}
    assert doc["first_failure"] == "worker-1" and procs["worker-1"]["exit_code"] == 3
    took = doc["end_time"] - procs["worker-1"]["end_time"]
    # the others wait to join for ever: without fail-fast the job would end only at the test's timeout
    # (a liveness bound, generous for a loaded 2-core CI: a Ray job took 5.8 s there once)
    assert took < 30, f"the job ended {took:.1f}s after worker 1 exited"
    assert all(procs[w]["stopped_by_launcher"] for w in ("worker-0", "worker-2")), procs
    assert_nothing_left(cluster)


@pytest.mark.xgboost
@pytest.mark.timeout(200)
def test_a_program_that_never_talks_to_the_rabit_tracker_does_not_hang_the_job(cluster: Cluster) -> None:
    # it exits: the job ends with it (launch.py's tracker waited forever for the shutdowns)
    t0 = time.monotonic()
    r = cluster.run("-n", "2", *tracker_options("rabit"), "--kill-grace", "1", *cluster.probe())
    assert r.returncode == 0, r.stderr
    assert "rabit tracker: no worker asked it for a rank" in r.stderr
    first = time.monotonic() - t0
    # it hangs: --timeout ends the job
    t0 = time.monotonic()
    r = cluster.run("-n", "2", *tracker_options("rabit"), "--kill-grace", "1", "--timeout", str(cluster.timeout),
                    *cluster.probe("--sleep", "90"))
    took = time.monotonic() - t0
    assert r.returncode == 124, r.stderr
    assert took < first + cluster.timeout + 30, f"--timeout {cluster.timeout:g}s took {took:.1f}s to end the job"
    assert_nothing_left(cluster)


# --- restarts (--max-restarts) ----------------------------------------------------------------------


def _history(cluster: Cluster) -> dict[int, dict[str, dict]]:
    """Every attempt's probe records: ``{attempt: {name: record}}``."""
    out: dict[int, dict[str, dict]] = {}
    for f in sorted((cluster.out / "history").glob("*.json")):
        name, attempt = f.stem.rsplit(".", 1)
        out.setdefault(int(attempt), {})[name] = json.loads(f.read_text())
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("victim", ["worker-1", "server-0", "scheduler"])
def test_a_killed_process_restarts_the_whole_job(cluster: Cluster, tmp_path: Path, victim: str) -> None:
    """kill -9 of any role in attempt 0: every role starts again as attempt 1, after every process
    of attempt 0 (grandchildren and escapees included) is gone, on every host; the job exits 0."""
    summary = tmp_path / "summary.json"
    r = cluster.run("-n", "2", "-s", "1", "--kill-grace", "1", "--max-restarts", "2", "--restart-delay", "0",
                    "--summary-json", str(summary),
                    *cluster.probe("--listen", "--sleep", "3", "--child", "--escape", "--kill-self", f"{victim}:KILL",
                                   "--on-attempts", "0"), timeout=200)
    assert r.returncode == 0, r.stderr
    label = victim.replace("-", " ")
    assert re.search(rf"attempt 1/3 failed: {label} on \S+ \(pid \d+\) killed by SIGKILL; restarting every process "
                     r"in 0\.0s \(restart 1/2\)", r.stderr), r.stderr
    assert "exited 0" in r.stderr and "(after 1 restart)" in r.stderr
    doc = json.loads(summary.read_text())
    assert [(a["attempt"], a["reason"]) for a in doc["attempts"]] == [(0, "failure"), (1, "success")]
    cause = doc["attempts"][0]["cause"]
    assert cause["process"] == victim and cause["signal"] == "SIGKILL" and cause["exit_code"] == 137
    history = _history(cluster)
    names = ["scheduler", "server-0", "worker-0", "worker-1"]
    assert sorted(history[1]) == names, sorted(history[1])
    assert victim in history[0]
    first, second = history[0][victim]["env"], history[1]["worker-0"]["env"]
    for name, rec in history[1].items():
        env = rec["env"]
        assert env["PSLAUNCH_ATTEMPT"] == "1" and env["DMLC_NUM_ATTEMPT"] == "1", name
        assert env["PSLAUNCH_MAX_RESTARTS"] == "2", name
        assert env["PSLAUNCH_RUN_ID"] == first["PSLAUNCH_RUN_ID"] == env["PSLAUNCH_JOB_ID"], name
        assert env["PSLAUNCH_SECRET"] != first["PSLAUNCH_SECRET"], name  # fresh per attempt
        assert rec["previous_alive"] == [], (name, rec["previous_alive"])  # nothing of attempt 0 ran on
    assert second["DMLC_PS_ROOT_PORT"] != first["DMLC_PS_ROOT_PORT"]  # a fresh port too
    assert_nothing_left(cluster)


@pytest.mark.timeout(240)
def test_a_job_that_fails_every_time_ends_with_its_code_after_n_restarts(cluster: Cluster, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    # (--host-cooldown 0: the same host's process fails first every time, which would leave that
    # host out after two attempts, test_host_health.py; this is about the budget)
    r = cluster.run("-n", "2", "-s", "0", "--kill-grace", "1", "--max-restarts", "2", "--restart-delay", "0.2",
                    "--host-cooldown", "0", "--summary-json", str(summary),
                    *cluster.probe("--sleep", "30", "--fail", "worker-1:3:0.5"), timeout=200)
    assert r.returncode == 3, r.stderr
    last = [x for x in r.stderr.splitlines() if "attempt 3/3 failed" in x]
    assert len(last) == 1 and re.search(r"error: attempt 3/3 failed: worker 1 on \S+ \(pid \d+\) exited with code 3; "
                                        r"2/2 restarts used$", last[0]), r.stderr
    assert r.stderr.rstrip().splitlines()[-1] == last[0]  # the last word
    doc = json.loads(summary.read_text())
    assert [a["attempt"] for a in doc["attempts"]] == [0, 1, 2] and doc["exit_code"] == 3
    delays = [a["delay"] for a in doc["attempts"]]
    assert 0.18 <= delays[0] <= 0.22 and 0.36 <= delays[1] <= 0.44 and delays[2] is None
    for a in doc["attempts"]:
        assert a["cause"]["process"] == "worker-1" and a["cause"]["exit_code"] == 3
        assert "worker-1 failing with code 3" in a["cause"]["last_lines"]
    history = _history(cluster)
    assert sorted(history) == [0, 1, 2]
    for attempt, records in history.items():
        assert {rec["env"]["PSLAUNCH_ATTEMPT"] for rec in records.values()} == {str(attempt)}
        assert all(rec["previous_alive"] == [] for rec in records.values()), records
    assert_nothing_left(cluster)


@pytest.mark.timeout(200)
def test_torch_jobs_get_torchruns_restart_variables(cluster: Cluster, tmp_path: Path) -> None:
    r = cluster.run("-n", "2", "-s", "0", "--tracker", "torch", "--kill-grace", "1", "--max-restarts", "1",
                    "--restart-delay", "0", *cluster.probe("--sleep", "1", "--fail", "worker-0:3:1.5",
                                                           "--on-attempts", "0"), timeout=160)
    assert r.returncode == 0, r.stderr
    history = _history(cluster)
    assert sorted(history[0]) == sorted(history[1]) == ["worker-0", "worker-1"]  # (worker-0 failed 1.5 s in)
    for attempt in (0, 1):
        for name, rec in history[attempt].items():
            env = rec["env"]
            assert env["TORCHELASTIC_RESTART_COUNT"] == env["PSLAUNCH_ATTEMPT"] == str(attempt), name
            assert env["TORCHELASTIC_MAX_RESTARTS"] == "1" and env["TORCHELASTIC_RUN_ID"] == env["PSLAUNCH_RUN_ID"]
    assert history[0]["worker-1"]["env"]["TORCHELASTIC_RUN_ID"] == history[1]["worker-1"]["env"]["TORCHELASTIC_RUN_ID"]
    # a fresh store on a port of its own in each attempt (the store's program is the same)
    assert history[0]["worker-1"]["env"]["MASTER_PORT"] != history[1]["worker-1"]["env"]["MASTER_PORT"]
    assert_nothing_left(cluster)


_ROW = re.compile(r'<tr data-name="([\w-]+)" class="state-(\w+)">(.*?)</tr>')
_CELL = re.compile(r'<td class="(\w+)[^"]*">(.*?)</td>')


@pytest.mark.timeout(150)
def test_the_job_page_and_its_report_show_every_process_with_its_memory(cluster: Cluster, tmp_path: Path) -> None:
    """``--ui`` and ``--report`` on every backend (issue 33): one row per process with its host, pid,
    state and exit code, the RSS its node reported (the ``u`` frames of a node agent, or the
    launcher's own look for local processes), the first failure named, and the page's address
    (never its token) in the summary."""
    report, summary = tmp_path / "job.html", tmp_path / "summary.json"
    r = cluster.run("-n", "2", "-s", "1", "--kill-grace", "1", "--ui", "--report", str(report),
                    "--summary-json", str(summary),
                    *cluster.probe("--listen", "--sleep", "60", "--fail", "worker-1:3:6.0"))
    assert r.returncode == 3, r.stderr
    token = re.search(r"job page http://127\.0\.0\.1:\d+/#token=([\w-]+)", r.stderr)
    assert token, r.stderr
    doc = json.loads(summary.read_text())
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", doc["ui"]) and token.group(1) not in summary.read_text()
    html = report.read_text()
    rows = {name: (state, dict(_CELL.findall(cells))) for name, state, cells in _ROW.findall(html)}
    assert sorted(rows) == ["scheduler", "server-0", "worker-0", "worker-1"], rows
    assert rows["worker-1"][0] == "failed" and rows["worker-1"][1]["exit"] == "3", rows["worker-1"]
    for name, (state, cells) in rows.items():
        assert cells["pid"].isdigit() and cells["host"] not in ("", "-"), (name, cells)
        assert re.fullmatch(r"[\d.]+ [KMG]iB", cells["rss"]), (name, cells, "the RSS its node reported")
        if name != "worker-1":
            assert state == "stopped", (name, state)
    assert 'id="failure"' in html and "worker 1" in html and "exited with code 3" in html
    assert_nothing_left(cluster)


@pytest.mark.timeout(200)
def test_a_lost_worker_is_replaced_in_place_where_the_backend_can(cluster: Cluster, tmp_path: Path) -> None:
    """``--restart-scope process`` (issue 34): kill -9 of worker 1 starts a replacement with its
    environment and ``PSLAUNCH_REPLACEMENT=1`` where it ran, while the scheduler, the server and
    worker 0 run on (each once, its pid unchanged); the job exits 0 in its first attempt. A
    backend that cannot start one process into a running job refuses the option in one line."""
    from launcher import backends

    summary = tmp_path / "summary.json"
    args = ("-n", "2", "-s", "1", "--kill-grace", "1", "--max-restarts", "2", "--restart-scope", "process",
            "--summary-json", str(summary),
            *cluster.probe("--listen", "--sleep", "8", "--kill-self", "worker-1:KILL:2", "--on-replacements", "0"))
    if not backends.get(cluster.launcher).can_replace:
        r = cluster.run(*args, timeout=60)
        assert r.returncode == 2 and "cannot replace a lost worker in place" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not list(cluster.out.glob("*.json")), r.stderr
        return
    r = cluster.run(*args, timeout=180)
    assert r.returncode == 0, r.stderr
    assert re.search(r"worker 1 on \S+ \(pid \d+\) killed by SIGKILL; replacing it in place \(restart 1/2\)",
                     r.stderr), r.stderr
    doc = json.loads(summary.read_text())
    assert [(a["attempt"], a["reason"]) for a in doc["attempts"]] == [(0, "success")], doc["attempts"]
    assert doc["restarts"]["done"] == 1 and doc["restarts"]["scope"] == "process"
    (rep,) = doc["replacements"]
    history = _history(cluster)
    assert sorted(history) == [0] and sorted(history[0]) == ["scheduler", "server-0", "worker-0", "worker-1",
                                                             "worker-1~1"], sorted(history[0])
    lost, new = history[0]["worker-1"], history[0]["worker-1~1"]
    assert rep["process"] == "worker-1" and rep["signal"] == "SIGKILL" and rep["pid"] == lost["pid"]
    assert rep["new_pid"] == new["pid"] != lost["pid"] and new["host"] == lost["host"] and new["netns"] == lost["netns"]
    assert new["env"]["PSLAUNCH_REPLACEMENT"] == "1" and "PSLAUNCH_REPLACEMENT" not in lost["env"]
    for name in ("DMLC_TASK_ID", "DMLC_ROLE", "DMLC_PS_ROOT_PORT", "PSLAUNCH_SECRET", "PSLAUNCH_ATTEMPT",
                 "PSLAUNCH_RESTART_SCOPE", "PS_HEARTBEAT_TIMEOUT"):
        assert new["env"].get(name) == lost["env"].get(name) is not None, name
    # every other process ran once, to its end, with the pid it started with
    procs = {(p["name"], p["pid"]): p for p in doc["processes"]}
    for name in ("scheduler", "server-0", "worker-0"):
        assert procs[(name, history[0][name]["pid"])]["exit_code"] == 0, name
        assert sum(1 for p in doc["processes"] if p["name"] == name) == 1, name
    assert procs[("worker-1", lost["pid"])]["replaced"] and procs[("worker-1", new["pid"])]["exit_code"] == 0
    assert_nothing_left(cluster)
