"""The task wrapper (launcher/node/task.py) that sge, yarn and slurm run in each task: index translation,
environment, node address, and the real wrapper running a command (no batch system needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pscontract as pc
from launcher import node
from launcher.node import protocol, task

DOC = {
    "version": 2,
    "argv": [sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
    # a job id of this process's own: a wrapper's end stops every process that carries its job's
    # marks (PSLAUNCH_PROCESS), and the other pytest worker runs wrappers of this document too
    "env": {"PATH": "/opt/venv/bin:/usr/bin:/bin", pc.JOB_ID: f"test-task-{os.getpid()}"},
    "roles": {
        "server": {"first_task_id": 3, "count": 2, "env": {"DMLC_ROLE": "server", "A": "s=1"}},
        "worker": {"first_task_id": 0, "count": 3,
                   "env": {"DMLC_ROLE": "worker", "DMLC_PS_ROOT_URI": "127.0.0.1", "A": "w=1"}},
    },
}


@pytest.mark.parametrize("source, environ, index", [
    ("sge", {"SGE_TASK_ID": "1"}, 0),
    ("sge", {"SGE_TASK_ID": "12"}, 11),
    ("skein", {"SKEIN_CONTAINER_ID": "worker_0"}, 0),
    ("skein", {"SKEIN_CONTAINER_ID": "my_server_7"}, 7),
    ("slurm", {"SLURM_PROCID": "0"}, 0),
    ("slurm", {"SLURM_PROCID": "5"}, 5),
    ("ray", {"PSLAUNCH_RAY_INDEX": "0"}, 0),
    ("ray", {"PSLAUNCH_RAY_INDEX": "3"}, 3),
    ("k8s", {"PSLAUNCH_K8S_INDEX": "0"}, 0),
    ("k8s", {"PSLAUNCH_K8S_INDEX": "3"}, 3),
])
def test_task_index(source, environ, index) -> None:
    assert task.task_index(source, environ) == index


@pytest.mark.parametrize("source, environ, message", [
    # Grid Engine sets "undefined" in a job that is not an array job
    ("sge", {"SGE_TASK_ID": "undefined"}, "SGE_TASK_ID='undefined': not a task of an array job"),
    ("sge", {}, "SGE_TASK_ID='': not a task of an array job"),
    ("sge", {"SGE_TASK_ID": "0"}, "SGE_TASK_ID='0'"),
    ("skein", {"SKEIN_CONTAINER_ID": "worker"}, "expected <service>_<instance>"),
    ("slurm", {}, "SLURM_PROCID='': not a task of a Slurm job step"),
    ("ray", {}, "PSLAUNCH_RAY_INDEX='': not a task of a pslaunch Ray actor"),
    ("k8s", {}, "PSLAUNCH_K8S_INDEX='': not a pslaunch Pod"),
    ("k8s", {"PSLAUNCH_K8S_INDEX": "-1"}, "PSLAUNCH_K8S_INDEX='-1'"),
    ("lsf", {}, "unknown index source 'lsf'"),
])
def test_task_index_errors(source, environ, message) -> None:
    with pytest.raises(task.TaskError, match=message.replace("(", r"\(")):
        task.task_index(source, environ)


def test_task_environment_layers() -> None:
    environ = {"HOME": "/home/u", "PATH": "/tmp/123.1.all.q:/usr/bin", "A": "from-sge", "SGE_TASK_ID": "2"}
    env = task.task_environment(DOC, "server", 1, environ)
    assert env["DMLC_TASK_ID"] == "4" and env["DMLC_ROLE"] == "server"
    assert env["A"] == "s=1"                          # the job's value wins over the task's own
    assert env["PATH"] == "/opt/venv/bin:/usr/bin:/bin"  # the launcher's PATH, not Grid Engine's
    assert env["HOME"] == "/home/u" and env["SGE_TASK_ID"] == "2"  # the batch system's stay
    assert task.task_environment(DOC, "worker", 2, environ)["DMLC_TASK_ID"] == "2"


def test_task_environment_errors() -> None:
    with pytest.raises(task.TaskError, match="worker index 3 is out of range: the job has 3 worker"):
        task.task_environment(DOC, "worker", 3, {})
    with pytest.raises(task.TaskError, match="role 'server' is not in the task file"):
        task.task_environment({"version": 1, "roles": {"worker": DOC["roles"]["worker"]}}, "server", 0, {})


def test_node_address() -> None:
    assert task.node_address({"DMLC_INTERFACE": "lo"}) == "127.0.0.1"
    assert task.node_address({"DMLC_INTERFACE": "127.0.0.0/8"}) == "127.0.0.1"
    assert task.node_address({"DMLC_PS_ROOT_URI": "127.0.0.1"}) == "127.0.0.1"  # the route to the scheduler
    with pytest.raises(task.TaskError, match="cannot work out this node's address: DMLC_INTERFACE=nosuch0"):
        task.node_address({"DMLC_INTERFACE": "nosuch0"})


def test_load_task_file_errors(tmp_path) -> None:
    with pytest.raises(task.TaskError, match="cannot read the task file .*shared with this host"):
        task.load_task_file(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(task.TaskError, match="not valid JSON"):
        task.load_task_file(str(bad))
    bad.write_text('{"version": 99}')
    with pytest.raises(task.TaskError, match="unsupported version 99"):
        task.load_task_file(str(bad))


def _run(tmp_path, doc, args, environ, cwd=None) -> subprocess.CompletedProcess:
    f = tmp_path / "task.json"
    f.write_text(json.dumps(doc))
    return subprocess.run([*node.command("task"), "--task-file", str(f), *args],
                          capture_output=True, text=True, timeout=30, env=environ, cwd=cwd or tmp_path)


@pytest.mark.timeout(60)
def test_wrapper_runs_the_command_with_the_contract(tmp_path) -> None:
    environ = {"SGE_TASK_ID": "2", "JOB_ID": "77", "PATH": "/usr/bin:/bin"}
    r = _run(tmp_path, DOC, ["--role", "worker", "--index", "sge", "--report-dir", str(tmp_path)], environ)
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    assert env["DMLC_TASK_ID"] == "1" and env["DMLC_ROLE"] == "worker" and env["A"] == "w=1"
    assert env["DMLC_NODE_HOST"] == "127.0.0.1" and env["JOB_ID"] == "77"
    started = json.loads((tmp_path / "worker-1.started").read_text())
    assert started["node_host"] == "127.0.0.1" and started["pid"] > 0


@pytest.mark.timeout(60)
def test_wrapper_is_transparent_for_exit_codes(tmp_path) -> None:
    doc = dict(DOC, argv=[sys.executable, "-c", "import sys; sys.exit(7)"])
    r = _run(tmp_path, doc, ["--role", "worker", "--index", "sge"], {"SGE_TASK_ID": "1"})
    assert r.returncode == 7 and r.stderr == ""
    r = _run(tmp_path, doc, ["--role", "worker", "--index", "skein", "--", "sh", "-c", "exit 5"],
             {"SKEIN_CONTAINER_ID": "worker_0", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 5  # argv after -- (yarn) wins over the task file's


@pytest.mark.timeout(60)
def test_wrapper_errors_are_one_line(tmp_path) -> None:
    doc = dict(DOC, argv=["no-such-program-xyz"])
    r = _run(tmp_path, doc, ["--role", "worker", "--index", "sge"], {"SGE_TASK_ID": "1"})
    assert r.returncode == 127
    assert r.stderr.strip().startswith("pslaunch task: error: cannot run 'no-such-program-xyz': no such program")
    assert len(r.stderr.strip().splitlines()) == 1
    r = _run(tmp_path, DOC, ["--role", "worker", "--index", "sge"], {"SGE_TASK_ID": "undefined"})
    assert r.returncode == 1 and "not a task of an array job" in r.stderr




def test_local_procs_by_index() -> None:
    doc = json.loads(json.dumps(DOC))
    doc["roles"]["worker"]["local_procs"] = [2, 1, 2]
    assert task.task_environment(doc, "worker", 1, {})["PSLAUNCH_LOCAL_PROCS"] == "1"
    assert task.task_environment(doc, "worker", 2, {})["PSLAUNCH_LOCAL_PROCS"] == "2"
    assert "PSLAUNCH_LOCAL_PROCS" not in task.task_environment(DOC, "worker", 1, {})


def test_a_replacement_connects_as_the_id_it_was_given_with_a_marker_of_its_own() -> None:
    # a lost worker's replacement: one task (index 0) with the lost one's task id, connecting as the
    # id the launcher admitted for it, with the marker the launcher gave it (not worker-0's)
    doc = json.loads(json.dumps(DOC))
    doc["roles"]["worker"] = {"first_task_id": 1, "count": 1, "env": {"DMLC_ROLE": "worker", "A": "w=1"},
                              "idents": [7], "processes": ["j/worker-1~1"]}
    env = task.task_environment(doc, "worker", 0, {})
    assert env["DMLC_TASK_ID"] == "1" and env[pc.PROCESS] == "j/worker-1~1"
    assert task.agent_ident(doc, "worker", 0, env) == 7
    # the roles' own steps: the task id, and the marker of the role and index
    env = task.task_environment(DOC, "worker", 2, {})
    assert task.agent_ident(DOC, "worker", 2, env) == 2 and env[pc.PROCESS].endswith("/worker-2")


def test_take_task_env_removes_the_document() -> None:
    environ = {"PSLAUNCH_TASK": json.dumps(DOC), "HOME": "/root"}
    assert task.take_task_env("PSLAUNCH_TASK", environ) == DOC
    assert environ == {"HOME": "/root"}
    with pytest.raises(task.TaskError, match="PSLAUNCH_TASK is not set: the launcher passes the task document in it"):
        task.take_task_env("PSLAUNCH_TASK", environ)
    with pytest.raises(task.TaskError, match="unsupported version 1"):
        task.take_task_env("X", {"X": '{"version": 1}'})


def _run_env(doc, args, environ) -> subprocess.CompletedProcess:
    env = dict(environ, PSLAUNCH_TASK=json.dumps(doc))
    return subprocess.run([*node.command("task"), "--task-env", "PSLAUNCH_TASK", *args],
                          capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.timeout(60)
def test_wrapper_under_srun_takes_the_document_from_its_environment() -> None:
    # as srun runs it: the document in a variable, SLURM_PROCID as the index; the command does not see it
    r = _run_env(DOC, ["--role", "worker", "--index", "slurm", "--no-tee"],
                 {"SLURM_PROCID": "1", "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    assert env["DMLC_TASK_ID"] == "1" and env["A"] == "w=1" and "PSLAUNCH_TASK" not in env


@pytest.mark.timeout(60)
@pytest.mark.parametrize("interface, node_host", [("", "10.9.8.7"), ("lo", "127.0.0.1")])
def test_wrapper_in_a_ray_actor_takes_the_actors_node_address(interface: str, node_host: str) -> None:
    # as the ray backend's actor runs it: its index and its node's address (Ray's) in variables that
    # the command does not see; DMLC_INTERFACE, where set, still chooses the address
    doc = json.loads(json.dumps(DOC))
    if interface:
        doc["env"]["DMLC_INTERFACE"] = interface
    r = _run_env(doc, ["--role", "server", "--index", "ray", "--no-tee"],
                 {"PSLAUNCH_RAY_INDEX": "1", "PSLAUNCH_RAY_NODE_IP": "10.9.8.7", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    assert env["DMLC_TASK_ID"] == "4" and env["DMLC_ROLE"] == "server" and env["DMLC_NODE_HOST"] == node_host
    assert not {"PSLAUNCH_TASK", "PSLAUNCH_RAY_INDEX", "PSLAUNCH_RAY_NODE_IP"} & set(env)


@pytest.mark.timeout(60)
def test_in_band_records_without_a_connection() -> None:
    # no hub in the document: --in-band writes the start, the output and the exit as records on stdout
    doc = dict(DOC, argv=[sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"])
    r = _run_env(doc, ["--role", "worker", "--index", "slurm", "--no-tee", "--in-band"],
                 {"SLURM_PROCID": "2", "SLURM_JOB_ID": "9", "SLURM_STEP_ID": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 3
    frames = {"out": [protocol.unwrap(x.encode()) for x in r.stdout.split("\n") if x],  # (str.splitlines
              "err": [protocol.unwrap(x.encode()) for x in r.stderr.split("\n") if x]}  # would cut at \x1e)
    assert all(frames["out"]) and all(frames["err"]), r.stdout + r.stderr
    kinds = {(stream, ident, kind): payload for stream, found in frames.items() for kind, ident, payload in found}
    assert kinds[("out", 2, protocol.STDOUT)] == b"out\n" and kinds[("err", 2, protocol.STDERR)] == b"err\n"
    assert kinds[("out", 2, protocol.EXIT)] == kinds[("err", 2, protocol.EXIT)]  # on both: the first counts
    assert protocol.parse_code(kinds[("out", 2, protocol.EXIT)]) == 3
    start = json.loads(kinds[("out", 2, protocol.STARTED)])
    assert start["step"] == "9.1" and start["addr"] == "127.0.0.1"
