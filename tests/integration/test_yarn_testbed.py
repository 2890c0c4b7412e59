"""The yarn backend end to end: real skein (client, Java driver, application master) on the YARN
testbed (scripts/setup-yarn.sh; CI starts it), over Hadoop's own RPC.

The testbed's containers are local process groups, each with YARN's ``CONTAINER_ID`` in its
environment (inherited by every process it starts): :func:`container_pids` finds whatever is
left of an application by that. Each test checks that nothing is, however the launcher ended,
and asks the testbed (``yarn application -status``, Hadoop's YarnClient) how the application
ended.
"""

from __future__ import annotations

import json
import re
import signal
import stat
import subprocess
import sys
import tarfile
import time
import uuid
from pathlib import Path

import pytest
from support import trainer as H
from support.helpers import (
    BIN,
    all_pids,
    assert_no_orphans,
    free_port,
    pid_alive,
    pslaunch_argv,
    read_probes,
    run_pslaunch,
    wait_for,
)
from support.yarn_testbed import (
    app_status,
    apps_named,
    assert_nothing_left,
    container_pids,
    yarn,
    yarn_problem,
)

pytestmark = [pytest.mark.integration, pytest.mark.yarn]

PROBE = [sys.executable, str(BIN / "probe.py")]
APP_ID = re.compile(r"submitted YARN application (application_\d+_\d+)")


@pytest.fixture(scope="module", autouse=True)
def testbed() -> None:
    problem = yarn_problem()
    if problem:
        pytest.skip(f"no YARN testbed: {problem}")


@pytest.fixture(autouse=True)
def interface(monkeypatch) -> None:
    monkeypatch.setenv("DMLC_INTERFACE", "lo")   # the scheduler's address, as the brief's users give it


@pytest.fixture
def job(tmp_path: Path) -> dict:
    """A unique application name and a probe output directory; kills the application if a test failed."""
    name = f"pslt-{uuid.uuid4().hex[:8]}"
    probes = tmp_path / "probes"
    probes.mkdir()
    yield {"name": name, "probes": probes}
    apps = {rec["env"]["SKEIN_APPLICATION_ID"] for rec in read_probes(probes).values()
            if "SKEIN_APPLICATION_ID" in rec["env"]}
    if not apps:  # none started: ask the ResourceManager (one JVM start) only then
        apps = set(apps_named(name))
    for app_id in apps:
        if container_pids(app_id):
            yarn("application", "-kill", app_id)


def yarn_args(job: dict, *extra: str) -> list[str]:
    return ["--launcher", "yarn", "--jobname", job["name"], *extra]


def probe(job: dict, *args: str) -> list[str]:
    return [*PROBE, "--out", str(job["probes"]), *args]


def app_of(stderr: str) -> str:
    m = APP_ID.search(stderr)
    assert m, stderr
    return m.group(1)


# --- the contract -----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_env_contract_per_container(job, monkeypatch) -> None:
    monkeypatch.setenv("PS_VERBOSE", "1")                    # forwarded
    monkeypatch.setenv("ONLY_IN_LAUNCHER", "must not leak")  # not forwarded
    t0 = time.monotonic()
    r = run_pslaunch("-n", "2", "-s", "2", *yarn_args(job, "--env", "EQ=a=b==c", "--env", "Q=say \"hi\" $HOME",
                                                       "--env-worker", "WHO=w"),
                     *probe(job, "--listen"), timeout=110)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    app_id = app_of(r.stderr)
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
        assert env["DMLC_TASK_ID"] == str(rank if role == "worker" else 2 + rank)
        assert env["DMLC_JOB_CLUSTER"] == "yarn" and env["DMLC_NODE_HOST"] == "127.0.0.1"
        assert env["EQ"] == "a=b==c"
        assert env["Q"] == 'say "hi" $HOME'               # through the task file: bash would expand it
        assert env["PS_VERBOSE"] == "1" and "ONLY_IN_LAUNCHER" not in env
        assert (env.get("WHO") == "w") == (role == "worker")
        # what YARN and skein gave this container
        assert env["SKEIN_CONTAINER_ID"] == f"{role}_{rank}"
        assert env["SKEIN_APPLICATION_ID"] == app_id
        assert env["CONTAINER_ID"].startswith("container_" + app_id.removeprefix("application_") + "_01_")
        assert Path(rec["cwd"]).name == env["CONTAINER_ID"]  # ran in its container's directory
        assert rec["pgid"] == rec["sid"]                  # a session of its own (setsid)
    ids = {probes[n]["env"]["CONTAINER_ID"] for n in probes if n != "scheduler"}
    assert len(ids) == 4                                  # one container each
    assert "all 5 processes exited 0" in r.stderr
    assert app_status(app_id) == ("FINISHED", "SUCCEEDED")
    assert_nothing_left(app_id)
    print(f"\nyarn timing: -n 2 -s 2 probe job, launch to exit {took:.1f}s")


@pytest.mark.timeout(120)
def test_files_archives_and_the_secret_are_staged(job, tmp_path) -> None:
    """--files, --archives and the task file travel through the Hadoop FileSystem into the container;
    the secret stays out of YARN's launch script."""
    (tmp_path / "conf.json").write_text('{"lr": 0.5}')
    data = tmp_path / "data.txt"
    data.write_text("in the archive\n")
    with tarfile.open(tmp_path / "env.tar.gz", "w:gz") as t:
        t.add(data, arcname="sub/data.txt")
    proc = subprocess.Popen(
        pslaunch_argv("-n", "1", "-s", "1",
                      *yarn_args(job, "--files", str(tmp_path / "conf.json"),
                                 "--archives", str(tmp_path / "env.tar.gz")),
                      *probe(job, "--listen", "--sleep", "8")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (job["probes"] / "worker-0.json").exists(), 60, what="the worker to start")
        worker = read_probes(job["probes"])["worker-0"]
        cwd = Path(worker["cwd"])
        secret = worker["env"]["PSLAUNCH_SECRET"]
        assert json.loads((cwd / "conf.json").read_text()) == {"lr": 0.5}
        assert (cwd / "env.tar.gz" / "sub" / "data.txt").read_text() == "in the archive\n"   # unpacked
        assert (cwd / "probe.py").read_bytes() == (BIN / "probe.py").read_bytes()            # the command's file
        assert worker["argv"][:2] == ["--out", str(job["probes"])]
        task_file = cwd / "pslaunch-task.json"
        assert stat.S_IMODE(task_file.stat().st_mode) == 0o500 and secret in task_file.read_text()
        launch = (cwd / "launch_container.sh").read_text()
        assert 'export DMLC_ROLE="worker"' in launch and secret not in launch and "PSLAUNCH_SECRET" not in launch
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    app_id = app_of(err)
    assert app_status(app_id) == ("FINISHED", "SUCCEEDED")
    wait_for(lambda: not cwd.exists(), 15, what="the NodeManager to delete the container's directory")
    assert_nothing_left(app_id)


@pytest.mark.timeout(60)
def test_unknown_queue_is_refused_in_one_line(job) -> None:
    r = run_pslaunch("-n", "1", "-s", "1", *yarn_args(job, "--queue", "no-such-queue"), *probe(job), timeout=50)
    assert r.returncode == 1, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("pslaunch: error:")]
    assert "YARN refused the application" in line and "to unknown queue: no-such-queue" in line
    assert "Traceback" not in r.stderr
    probes = read_probes(job["probes"])
    assert set(probes) <= {"scheduler"}, sorted(probes)   # the local scheduler at most: no container ran
    if probes:
        assert_no_orphans(all_pids(probes), timeout=10)


# --- skein's driver ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_running_global_driver_is_used_and_left_running(job, skein_driver, monkeypatch) -> None:
    """After ``skein driver start`` (the session's driver) a job starts no Java driver of its own."""
    monkeypatch.setenv("SKEIN_CONFIG", skein_driver["SKEIN_CONFIG"])
    driver = json.loads((Path(skein_driver["SKEIN_CONFIG"]) / "driver").read_text())
    r = run_pslaunch("-n", "1", "-s", "1", *yarn_args(job, "--log-level", "debug"), *probe(job), timeout=110)
    assert r.returncode == 0, r.stderr
    assert f"using skein's global driver at {driver['address']}" in r.stderr, r.stderr
    assert "starting one" not in r.stderr
    assert app_status(app_of(r.stderr)) == ("FINISHED", "SUCCEEDED")
    assert pid_alive(driver["pid"])  # not the launcher's to stop


@pytest.mark.timeout(120)
def test_a_stale_global_driver_file_means_a_driver_of_its_own(job, tmp_path, monkeypatch) -> None:
    """A driver file left by a global driver that is gone: the job starts its own and succeeds."""
    config = tmp_path / "skein"
    config.mkdir()
    (config / "driver").write_text(json.dumps({"address": f"127.0.0.1:{free_port()}", "pid": 2 ** 22 + 1}))
    monkeypatch.setenv("SKEIN_CONFIG", str(config))
    r = run_pslaunch("-n", "1", "-s", "1", *yarn_args(job, "--log-level", "debug"), *probe(job), timeout=110)
    assert r.returncode == 0, r.stderr
    assert "no global skein driver" in r.stderr and "using skein's global driver" not in r.stderr, r.stderr
    assert app_status(app_of(r.stderr)) == ("FINISHED", "SUCCEEDED")


# --- failure, Ctrl-C, kill -9 ------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_failing_worker_stops_every_container(job) -> None:
    t0 = time.monotonic()
    r = run_pslaunch("-n", "2", "-s", "1", *yarn_args(job),
                     *probe(job, "--listen", "--sleep", "60", "--fail", "worker-1:3:1"), timeout=110)
    took = time.monotonic() - t0
    app_id = app_of(r.stderr)
    assert r.returncode != 0, r.stderr
    assert re.search(r"pslaunch: error: .* exited with code \d+ first; stopped the other processes", r.stderr)
    assert took < 45, f"the other containers sleep 60 s; stopping them took {took:.0f}s"
    assert app_status(app_id) == ("FINISHED", "FAILED")   # skein's master ended it: FINISHED, not FAILED
    exited_at = time.time()
    assert_nothing_left(app_id)
    assert "worker-1 failing with code 3" in yarn("logs", "-applicationId", app_id)
    failed_at = read_probes(job["probes"])["worker-1"]["time"] + 1.0   # the probe fails 1 s after it wrote
    print(f"\nyarn timing: worker failure to launcher exit {exited_at - failed_at:.1f}s; whole run {took:.1f}s")


@pytest.mark.timeout(120)
def test_failing_worker_exit_code_is_reported(job) -> None:
    r = run_pslaunch("-n", "2", "-s", "1", *yarn_args(job),
                     *probe(job, "--listen", "--sleep", "60", "--fail", "worker-1:3:1"), timeout=110)
    assert r.returncode == 3, r.stderr
    assert re.search(r"error: worker 1 \(YARN container container_\S+ on \S+.*\) exited with code 3 first", r.stderr), \
        r.stderr


@pytest.mark.timeout(120)
def test_ctrl_c_kills_the_application(job) -> None:
    proc = subprocess.Popen(pslaunch_argv("-n", "2", "-s", "1", *yarn_args(job),
                                          *probe(job, "--listen", "--sleep", "60")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(list(job["probes"].glob("*.json"))) == 4, 60, what="every container to start")
        app_id = read_probes(job["probes"])["worker-0"]["env"]["SKEIN_APPLICATION_ID"]
        assert len(container_pids(app_id)) >= 4          # the master and three containers
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    left = assert_nothing_left(app_id)
    # each container's agent stopped its command (SIGTERM: exit 143), so skein's master ended the
    # application as failed; a container that had to be killed makes it KILLED
    assert app_status(app_id) in (("FINISHED", "FAILED"), ("KILLED", "KILLED"))
    print(f"\nyarn timing: Ctrl-C to launcher exit {took:.1f}s, then {left:.1f}s until no container process")


@pytest.mark.timeout(120)
def test_kill_9_of_the_launcher_kills_the_application(job) -> None:
    proc = subprocess.Popen(pslaunch_argv("-n", "2", "-s", "1", *yarn_args(job),
                                          *probe(job, "--listen", "--sleep", "60")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(list(job["probes"].glob("*.json"))) == 4, 60, what="every container to start")
        probes = read_probes(job["probes"])
        app_id = probes["worker-0"]["env"]["SKEIN_APPLICATION_ID"]
        assert container_pids(app_id)
        proc.kill()
        proc.wait(10)
        took = assert_nothing_left(app_id, timeout=30)   # the watchdog ran `yarn application -kill`
    finally:
        if proc.poll() is None:
            proc.kill()
    # the agents saw their connections end and stopped their commands; the watchdog's kill came after
    assert app_status(app_id) in (("FINISHED", "FAILED"), ("KILLED", "KILLED"))
    wait_for(lambda: not pid_alive(probes["scheduler"]["pid"]), 15, what="the local scheduler to end")
    print(f"\nyarn timing: kill -9 of the launcher to no container process: {took:.1f}s")


# --- the trainer --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_dist_sync_on_yarn(job) -> None:
    data = H.mnist_dir()
    t0 = time.monotonic()
    r = subprocess.run(
        pslaunch_argv("-n", "2", "-s", "1", *yarn_args(job), *H.train_argv(
            "--network", "lenet", "--kv-store", "dist_sync", "--num-epochs", "1", "--num-examples", "640",
            "--batch-size", "64", "--disp-batches", "0", "--seed", "3", data_dir=data)),
        capture_output=True, text=True, timeout=280, env=H.child_env(DMLC_INTERFACE="lo"))
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "all 4 processes exited 0" in r.stderr
    app_id = app_of(r.stderr)
    # the containers' output reached the console as it was printed; YARN's logs keep a copy
    s0, s1 = H.summaries(r.stdout)
    assert H.summaries(yarn("logs", "-applicationId", app_id)) == [s0, s1]
    assert s0["batches_per_epoch"] == s1["batches_per_epoch"] == 5
    assert s0["validation_accuracy"] == s1["validation_accuracy"]  # one set of weights on the servers
    assert app_status(app_id) == ("FINISHED", "SUCCEEDED")
    assert_nothing_left(app_id)
    print(f"\nyarn timing: train_mnist dist_sync -n 2 -s 1, 1 epoch of 640 examples: {took:.1f}s")
