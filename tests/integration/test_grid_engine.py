"""The sge backend on a real Grid Engine (scripts/setup-sge.sh; CI starts it itself).

Each test uses its own job name, and checks with ``qstat`` that no job of that name is
left when the launcher has exited, however it ended.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from support import trainer as H
from support.helpers import BIN, REPO, pslaunch_argv, read_probes, run_pslaunch, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.sge]

PROBE = [sys.executable, str(BIN / "probe.py")]


def _drmaa_env_missing() -> str | None:
    for name in ("SGE_ROOT", "DRMAA_LIBRARY_PATH", "GLIBC_TUNABLES"):
        if not os.environ.get(name):
            return f"{name} is not set (eval \"$(scripts/setup-sge.sh env)\" after scripts/setup-sge.sh)"
    if not shutil.which("qstat"):
        return "qstat not found (scripts/setup-sge.sh installs Grid Engine)"
    r = subprocess.run(["qstat"], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return f"qstat fails: {r.stderr.strip()} (start Grid Engine with scripts/setup-sge.sh)"
    return None


@pytest.fixture(scope="module", autouse=True)
def grid_engine() -> None:
    problem = _drmaa_env_missing()
    if problem:
        pytest.skip(f"no Grid Engine: {problem}")


@pytest.fixture
def job(tmp_path: Path) -> dict:
    """A unique job name, its log directory and a probe output directory."""
    name = f"pslt-{uuid.uuid4().hex[:8]}"
    probes = tmp_path / "probes"
    probes.mkdir()
    yield {"name": name, "logs": tmp_path / "logs", "probes": probes}
    left = sge_jobs(name)
    if left:  # never leave jobs behind, even when a test failed
        subprocess.run(["qdel", *left], capture_output=True, timeout=20)


def sge_jobs(name: str) -> list[str]:
    """Numbers of the jobs named ``name`` that Grid Engine still knows (queued, running, deleting)."""
    r = subprocess.run(["qstat", "-u", "*", "-xml"], capture_output=True, text=True, timeout=20, check=True)
    root = ET.fromstring(r.stdout)
    return sorted({j.findtext("JB_job_number") for j in root.iter("job_list") if j.findtext("JB_name") == name})


def sge_args(job: dict, *extra: str) -> list[str]:
    return ["--launcher", "sge", "--host-ip", "127.0.0.1", "--jobname", job["name"],
            "--sge-log-dir", str(job["logs"]), "--kill-grace", "1", *extra]


def probe(job: dict, *args: str) -> list[str]:
    return [*PROBE, "--out", str(job["probes"]), *args]


def assert_no_jobs_left(name: str, timeout: float = 10.0) -> None:
    wait_for(lambda: not sge_jobs(name), timeout, interval=0.25, what=f"Grid Engine to drop the jobs named {name}")


# --- the contract ---------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_env_contract_per_task(job, monkeypatch) -> None:
    monkeypatch.setenv("PS_VERBOSE", "1")                    # forwarded
    monkeypatch.setenv("ONLY_IN_LAUNCHER", "must not leak")  # not forwarded: no -V
    t0 = time.monotonic()
    r = run_pslaunch("-n", "2", "-s", "2", *sge_args(job, "--env", "EQ=a=b==c", "--env-worker", "WHO=w"),
                     *probe(job, "--listen"), timeout=80)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    probes = read_probes(job["probes"])
    assert sorted(probes) == ["scheduler", "server-0", "server-1", "worker-0", "worker-1"]
    sched = probes["scheduler"]["env"]
    secret = sched["PSLAUNCH_SECRET"]
    for name, rec in probes.items():
        env = rec["env"]
        role = name.split("-")[0]
        assert env["DMLC_ROLE"] == role
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1" and env["DMLC_PS_ROOT_PORT"] == sched["DMLC_PS_ROOT_PORT"]
        assert env["DMLC_NUM_WORKER"] == "2" and env["DMLC_NUM_SERVER"] == "2"
        assert env["PSLAUNCH_SECRET"] == secret and env["PS_START_TIMEOUT"] == "60"
        if role == "scheduler":
            continue
        rank = int(name.split("-")[1])
        # SGE's 1-based array index became the core's 0-based numbering
        assert env["SGE_TASK_ID"] == str(rank + 1) and env["JOB_ID"].isdigit()
        assert env["DMLC_TASK_ID"] == str(rank if role == "worker" else 2 + rank)
        assert env["DMLC_JOB_CLUSTER"] == "sge" and env["DMLC_NODE_HOST"] == "127.0.0.1"
        assert env["EQ"] == "a=b==c"                     # jobEnvironment would have cut it at '='
        assert env["PS_VERBOSE"] == "1" and "ONLY_IN_LAUNCHER" not in env
        assert env["PATH"] == os.environ["PATH"]         # the launcher's PATH, not SGE's
        assert "PSLAUNCH_LOCAL_PROCS" not in env
        assert (env.get("WHO") == "w") == (role == "worker")
        assert rec["cwd"] == str(REPO)                   # the launcher's working directory
    # both roles ran as real Grid Engine array jobs, under this job name
    assert probes["server-0"]["env"]["JOB_ID"] != probes["worker-0"]["env"]["JOB_ID"]
    assert probes["worker-0"]["env"]["JOB_ID"] == probes["worker-1"]["env"]["JOB_ID"]
    assert probes["worker-0"]["env"]["JOB_NAME"] == job["name"]
    assert "all 5 processes exited 0" in r.stderr
    logs = sorted(p.name for p in job["logs"].iterdir())
    assert logs == ["server.1.err", "server.1.out", "server.2.err", "server.2.out",
                    "worker.1.err", "worker.1.out", "worker.2.err", "worker.2.out"]  # no task file left
    assert_no_jobs_left(job["name"])
    print(f"\nsge timing: -n 2 -s 2 probe job, launch to exit {took:.1f}s")


@pytest.mark.timeout(90)
def test_output_streams_with_labels_and_secret_stays_out_of_qstat(job) -> None:
    proc = subprocess.Popen(
        pslaunch_argv("-n", "2", "-s", "1", *sge_args(job, "--summary-json", str(job["probes"] / "sum.txt")),
                      *probe(job, "--listen", "--print", "héllo ✓", "--sleep", "6")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for(lambda: len(list(job["probes"].glob("*.json"))) == 4, 40, what="every task to start")
        probes = read_probes(job["probes"])
        secret = probes["worker-0"]["env"]["PSLAUNCH_SECRET"]
        numbers = sorted({probes[n]["env"]["JOB_ID"] for n in ("server-0", "worker-0")})
        qstat = subprocess.run(["qstat", "-j", ",".join(numbers)], capture_output=True, text=True, timeout=20)
        assert qstat.returncode == 0 and job["name"] in qstat.stdout
        assert "PSLAUNCH_JOB_ID" in qstat.stdout            # the template's only variable
        assert secret not in qstat.stdout and "PSLAUNCH_SECRET" not in qstat.stdout
        (task_file,) = job["logs"].glob(".pslaunch-*.task.json")
        assert stat.S_IMODE(task_file.stat().st_mode) == 0o600
        assert secret in task_file.read_text()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    for label in ("scheduler", "server 0", "worker 0", "worker 1"):
        assert f"[{label}] héllo ✓" in lines
    assert not task_file.exists()                             # removed when the launcher ended
    summary = json.loads((job["probes"] / "sum.txt").read_text())
    tasks = {p["name"]: p for p in summary["processes"]}
    assert tasks["worker-1"]["exit_code"] == 0 and tasks["worker-1"]["task_id"] == 1
    assert tasks["worker-1"]["host"] == probes["worker-1"]["host"]   # reported by the task wrapper
    assert tasks["worker-1"]["pid"] == probes["worker-1"]["pid"]
    assert secret not in (job["probes"] / "sum.txt").read_text()
    assert_no_jobs_left(job["name"])


@pytest.mark.timeout(90)
def test_native_specification_reaches_grid_engine(job) -> None:
    """--queue, --worker-cores (a PE), --worker-memory (h_vmem per slot) and --sge-native, as qstat shows them."""
    proc = subprocess.Popen(
        pslaunch_argv("-n", "1", "-s", "1", *sge_args(job, "--queue", "all.q", "--worker-cores", "2",
                                                       "--worker-memory", "3g", "--sge-native", "-l h_rt=600 -p -1"),
                      *probe(job, "--listen", "--sleep", "4")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for(lambda: (job["probes"] / "worker-0.json").exists(), 40, what="the worker to start")
        worker = read_probes(job["probes"])["worker-0"]["env"]
        assert worker["NSLOTS"] == "2" and worker["PE"] == "smp" and worker["QUEUE"] == "all.q"
        text = subprocess.run(["qstat", "-j", worker["JOB_ID"]], capture_output=True, text=True, timeout=20).stdout
        assert re.search(r"hard resource_list:\s+h_vmem=1536M,h_rt=600", text), text
        assert re.search(r"parallel environment:\s+smp range: 2", text), text
        assert re.search(r"hard_queue_list:\s+all.q", text), text
        assert re.search(r"priority:\s+-1", text), text
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "submitted 1 worker task as Grid Engine job" in err
    assert "(-q all.q -pe smp 2 -l h_vmem=1536M -l h_rt=600 -p -1)" in err
    assert_no_jobs_left(job["name"])


# --- failure, Ctrl-C, kill -9, queued too long ------------------------------------------------------


@pytest.mark.timeout(90)
def test_failing_task_exit_code_and_the_others_are_deleted(job) -> None:
    t0 = time.monotonic()
    r = run_pslaunch("-n", "2", "-s", "1", *sge_args(job),
                     *probe(job, "--listen", "--sleep", "60", "--fail", "worker-1:3:1"), timeout=80)
    took = time.monotonic() - t0
    exited_at = time.time()
    assert r.returncode == 3, r.stderr
    assert re.search(r"error: worker 1 \(SGE task \d+\.2 on \S+, pid \d+; output \S+/worker\.2\.out\) "
                     r"exited with code 3 first; stopped the other processes", r.stderr), r.stderr
    # the failed task's last lines: on the console just above the report, which points at them
    # rather than print them again (or, were they not just above, prints them as its tail)
    assert re.search(r"\[worker 1[^\]]*\] worker-1 failing with code 3", r.stderr), r.stderr
    assert ("(the last lines of worker 1 are just above)" in r.stderr
            or "  | worker-1 failing with code 3" in r.stderr), r.stderr
    assert sge_jobs(job["name"]) == []                    # nothing left once the launcher has exited
    assert took < 40, f"the tasks sleep 60 s; deleting them took {took:.0f}s"
    failed_at = read_probes(job["probes"])["worker-1"]["time"] + 1.0  # the probe fails 1 s after it wrote
    print(f"\nsge timing: worker failure to launcher exit (other tasks deleted): {exited_at - failed_at:.1f}s; "
          f"whole run {took:.1f}s")


def notices(out: Path) -> dict[str, list[tuple[str, int]]]:
    """What each probe recorded with ``--notices``: its name -> ``[(signal, pid), ...]``."""
    return {f.name[:-len(".notices")]: [(w[0], int(w[1])) for w in map(str.split, f.read_text().splitlines())]
            for f in out.glob("*.notices")}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("command, notice", [(["qmod", "-sj"], "USR1"), (["qdel"], "USR2")],
                         ids=["suspend", "delete"])
def test_notify_reaches_each_task_once_and_it_may_end_in_time(job, command: list[str], notice: str) -> None:
    # qsub -notify: Grid Engine sends SIGUSR1 before it suspends a job (SIGSTOP) and SIGUSR2 before
    # it kills one (SIGKILL), the queue's notify time (60 s here) apart, to the job, i.e. to the
    # task wrapper, which passes it on; the program checkpoints and exits 0 (--exit-on-notice)
    t0 = time.monotonic()
    proc = subprocess.Popen(pslaunch_argv("-n", "2", "-s", "0", *sge_args(job, "--sge-native", "-notify"),
                                          *probe(job, "--sleep", "50", "--notices", "--exit-on-notice")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for(lambda: len(list(job["probes"].glob("*.json"))) == 2, 40, what="every task to start")
        subprocess.run([*command, *sge_jobs(job["name"])], check=True, capture_output=True, timeout=20)
        _, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - t0
    probes = read_probes(job["probes"])
    assert proc.returncode == 0, err
    assert notices(job["probes"]) == {n: [(notice, rec["pid"])] for n, rec in probes.items()}, err
    assert took < 40, f"the tasks sleep 50 s; they ended after {took:.0f}s"
    assert_no_jobs_left(job["name"])


@pytest.mark.timeout(90)
def test_kill_9_of_the_launcher_deletes_every_job(job) -> None:
    proc = subprocess.Popen(pslaunch_argv("-n", "1", "-s", "1", *sge_args(job),
                                          *probe(job, "--listen", "--sleep", "60")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        wait_for(lambda: len(list(job["probes"].glob("*.json"))) == 3, 40, what="every task to start")
        assert sge_jobs(job["name"])
        proc.kill()
        proc.wait(10)
        t0 = time.monotonic()
        assert_no_jobs_left(job["name"], timeout=20)   # the watchdog ran qdel
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not list(job["logs"].glob(".pslaunch-*.task.json"))  # the secret's file is gone too
    print(f"\nsge timing: kill -9 of the launcher to no job left: {took:.1f}s")


@pytest.mark.timeout(90)
def test_task_still_queued_after_start_timeout_fails_the_launch(job) -> None:
    # -h: submitted on hold, so the tasks stay queued (hqw) whatever the cluster's load
    r = run_pslaunch("-n", "2", "-s", "1", *sge_args(job, "--start-timeout", "3", "--sge-native", "-h"),
                     *probe(job, "--listen"), timeout=80)
    assert r.returncode == 1, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("pslaunch: error:")]
    assert "3 of 3 tasks still queued after --start-timeout 3s" in line
    assert re.search(r"worker 1: SGE task \d+\.2 user_on_hold \(hqw \(user hold\)\)", line), line
    assert "qstat -j" in line
    assert sge_jobs(job["name"]) == []
    assert not [*job["probes"].glob("server-*.json"), *job["probes"].glob("worker-*.json")]  # none ran


@pytest.mark.timeout(60)
def test_program_missing_on_the_node_is_reported(job) -> None:
    r = run_pslaunch("-n", "1", "-s", "0", *sge_args(job), "no-such-program-xyz", timeout=50)
    assert r.returncode == 127, r.stderr
    # the node's agent tells the launcher in one line: where, what and why
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("pslaunch: error:")]
    assert re.match(r"pslaunch: error: worker 0 \(SGE task \d+\.1 on \S+; output \S+\): cannot run "
                    r"'no-such-program-xyz': no such program or directory", line), line
    assert sge_jobs(job["name"]) == []


# --- the DRMAA environment -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("change, expected", [
    ({"DRMAA_LIBRARY_PATH": None}, "DRMAA_LIBRARY_PATH is not set: export DRMAA_LIBRARY_PATH=<path of libdrmaa.so>"),
    ({"DRMAA_LIBRARY_PATH": "/nonexistent/libdrmaa.so"}, "DRMAA_LIBRARY_PATH=/nonexistent/libdrmaa.so: no such file"),
    ({"SGE_ROOT": None}, "SGE_ROOT is not set (libdrmaa needs it): export SGE_ROOT="),
    ({"GLIBC_TUNABLES": None}, "start pslaunch with GLIBC_TUNABLES=glibc.rtld.optional_static_tls=8192"),
])
def test_drmaa_environment_errors_are_one_line(job, change, expected) -> None:
    env = dict(os.environ)
    for k, v in change.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    r = run_pslaunch("-n", "1", *sge_args(job), *probe(job), env=env, timeout=50)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pslaunch: error: ") and expected in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert sge_jobs(job["name"]) == []


@pytest.mark.timeout(30)
def test_scheduler_address_is_required(job) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DMLC_INTERFACE"}
    r = run_pslaunch("-n", "1", "--launcher", "sge", "--jobname", job["name"], *probe(job), env=env)
    assert r.returncode == 2
    assert "--launcher sge cannot tell which address of this host its nodes reach: set DMLC_INTERFACE" in r.stderr


# --- the trainer ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_dist_sync_on_grid_engine(job) -> None:
    data = H.mnist_dir()
    t0 = time.monotonic()
    r = subprocess.run(
        pslaunch_argv("-n", "2", "-s", "1", *sge_args(job), *H.train_argv(
            "--network", "lenet", "--kv-store", "dist_sync", "--num-epochs", "1", "--num-examples", "640",
            "--batch-size", "64", "--disp-batches", "0", "--seed", "3", data_dir=data)),
        capture_output=True, text=True, timeout=280, env=H.child_env(), cwd=REPO)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all 4 processes exited 0" in r.stderr
    s0, s1 = H.summaries(r.stdout)
    assert s0["batches_per_epoch"] == s1["batches_per_epoch"] == 5
    assert s0["validation_accuracy"] == s1["validation_accuracy"]  # one set of weights on the servers
    assert sge_jobs(job["name"]) == []
    print(f"\nsge timing: train_mnist dist_sync -n 2 -s 1, 1 epoch of 640 examples: {took:.1f}s")
