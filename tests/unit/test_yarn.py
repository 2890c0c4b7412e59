"""The yarn backend's pure side and its logic: golden application specs, validation errors, status
parsing on documented examples, the missing-dependency errors, the container-side node bundle,
and the submit/follow/kill logic against a stand-in skein client (synthetic, its signatures
checked against skein's own). The real skein client, driver and application master run in
tests/integration/test_yarn_testbed.py."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import time
import types
import zipfile

import pytest
from support.helpers import REPO

from launcher import node
from launcher.backends import yarn
from launcher.backends.yarn import YarnOptions
from launcher.errors import BackendUnavailableError, ConfigError, LaunchError
from launcher.runtime.output import Console
from launcher.spec.job import JobSpec
from launcher.spec.plan import build_plan

pytestmark = pytest.mark.yarn

ENVIRON = (("HOME", "/home/u"), ("PATH", "/usr/bin"), ("PS_VERBOSE", "1"))


def make_spec(tmp_path, **kw) -> JobSpec:
    base = dict(command=("python", "train.py", "--data", "data.csv", "--lr", "0.1"), num_workers=2, num_servers=1,
                launcher="yarn", queue="ml", jobname="mnist", worker_cores=2, worker_memory_mb=4096,
                server_memory_mb=2048, workdir=str(tmp_path), environ=ENVIRON,
                env=(("GREETING", 'say "hi" to $USER'),), options=YarnOptions(("conf.json",), ("env.tar.gz",)))
    files, archives = kw.pop("files", None), kw.pop("archives", None)
    if files is not None or archives is not None:
        base["options"] = YarnOptions(files or (), archives or ())
    base.update(kw)
    return JobSpec(**base)


def make_procs(spec: JobSpec, root_uri: str = "10.1.0.5"):
    return build_plan(spec, root_uri=root_uri, root_port=9091, secret="5" * 64, job_id="abc123",
                      inherit_environ=False).procs


@pytest.fixture
def job_dir(tmp_path):
    for name in ("train.py", "data.csv", "conf.json", "env.tar.gz"):
        (tmp_path / name).write_text("x")
    return tmp_path


# --- golden specs -------------------------------------------------------------------------------


def _role_env(role: str, task_base: int) -> dict:
    return {"PS_VERBOSE": "1", "DMLC_ROLE": role, "DMLC_PS_ROOT_URI": "10.1.0.5", "DMLC_PS_ROOT_PORT": "9091",
            "DMLC_NUM_WORKER": "2", "DMLC_NUM_SERVER": "1", "PSLAUNCH_JOB_ID": "abc123", "PS_START_TIMEOUT": "60",
            "DMLC_JOB_CLUSTER": "yarn", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
            "PSLAUNCH_ATTEMPT": "0", "PSLAUNCH_MAX_RESTARTS": "0", "PSLAUNCH_RUN_ID": "abc123", "DMLC_NUM_ATTEMPT": "0"}


def test_app_spec_golden(job_dir) -> None:
    spec = make_spec(job_dir)
    yp = yarn.build_yarn_plan(spec, make_procs(spec), wrapper_zip="/tmp/x/pslaunch-task.zip",
                              task_file="/tmp/x/pslaunch-task.json")
    files = {
        "pslaunch-task.zip": {"source": "/tmp/x/pslaunch-task.zip", "type": "file"},
        "pslaunch-task.json": {"source": "/tmp/x/pslaunch-task.json", "type": "file"},
        "conf.json": {"source": f"{job_dir}/conf.json", "type": "file"},
        "env.tar.gz": {"source": f"{job_dir}/env.tar.gz", "type": "archive"},
        "data.csv": {"source": f"{job_dir}/data.csv", "type": "file"},
        "train.py": {"source": f"{job_dir}/train.py", "type": "file"},
    }
    tail = "-- python ./train.py --data ./data.csv --lr 0.1"
    assert yp.app_spec == {
        "name": "mnist", "queue": "ml", "max_attempts": 1, "tags": ["pslaunch"],
        "services": {
            "server": {
                "instances": 1, "max_restarts": 0, "allow_failures": False,
                "resources": {"memory": 2048, "vcores": 1},
                "env": _role_env("server", 2), "files": files,
                "script": "exec python3 pslaunch-task.zip --task-file pslaunch-task.json --role server "
                          f"--index skein {tail}",
            },
            "worker": {
                "instances": 2, "max_restarts": 0, "allow_failures": False,
                "resources": {"memory": 4096, "vcores": 2},
                "env": _role_env("worker", 0), "files": files,
                "script": "exec python3 pslaunch-task.zip --task-file pslaunch-task.json --role worker "
                          f"--index skein {tail}",
            },
        },
    }
    # the secret and the value bash would mangle travel in the 0600 task file instead
    assert yp.task_file == {"version": 2, "env": {}, "grace": 10.0, "argv": list(spec.command), "roles": {
        "server": {"first_task_id": 2, "count": 1,
                   "env": {"GREETING": 'say "hi" to $USER', "PSLAUNCH_SECRET": "5" * 64}},
        "worker": {"first_task_id": 0, "count": 2,
                   "env": {"GREETING": 'say "hi" to $USER', "PSLAUNCH_SECRET": "5" * 64}},
    }}
    assert "5" * 64 not in json.dumps(yp.app_spec)


def test_app_spec_defaults_and_no_servers(tmp_path) -> None:
    spec = JobSpec(command=("./run.sh",), num_workers=3, num_servers=0, launcher="yarn", workdir=str(tmp_path),
                   environ=ENVIRON)
    yp = yarn.build_yarn_plan(spec, make_procs(spec), wrapper_zip="/w.zip", task_file="/t.json")
    assert yp.app_spec["name"] == "pslaunch-run.sh" and yp.app_spec["queue"] == "default"
    assert list(yp.app_spec["services"]) == ["worker"]
    worker = yp.app_spec["services"]["worker"]
    assert worker["instances"] == 3 and worker["resources"] == {"memory": 1024, "vcores": 1}
    assert worker["script"].endswith("--role worker --index skein -- ./run.sh")


def test_service_script_quotes_the_command() -> None:
    script = yarn.build_service_script("worker", ["python", "-c", "print('a b')", "$HOME", "x;y"])
    assert script == ("exec python3 pslaunch-task.zip --task-file pslaunch-task.json --role worker --index skein "
                      "-- python -c 'print('\"'\"'a b'\"'\"')' '$HOME' 'x;y'")


def test_hostile_variable_names_never_reach_the_launch_script(tmp_path) -> None:
    """YARN writes each service env entry as `export NAME="VALUE"` into a bash script."""
    spec = make_spec(tmp_path, environ=ENVIRON + (("PS_A$(touch pwned)", "1"), ("DMLC_B;id", "1")),
                     env=(), files=(), archives=())
    yp = yarn.build_yarn_plan(spec, make_procs(spec), wrapper_zip="/w.zip", task_file="/t.json",
                              isfile=lambda p: False)
    names = [k for svc in yp.app_spec["services"].values() for k in svc["env"]]
    names += [k for r in yp.task_file["roles"].values() for k in r["env"]]
    assert "PS_VERBOSE" in names and all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) for k in names), names


def test_split_env() -> None:
    spec_env, file_env = yarn.split_env({"A": "plain value", "PSLAUNCH_SECRET": "s", "AWS_SECRET_ACCESS_KEY": "k",
                                         "Q": 'has "quotes"', "D": "$HOME", "B": "back`tick", "S": "a\\b",
                                         "N": "two\nlines", "EQ": "a=b"})
    assert spec_env == {"A": "plain value", "EQ": "a=b"}
    assert sorted(file_env) == ["AWS_SECRET_ACCESS_KEY", "B", "D", "N", "PSLAUNCH_SECRET", "Q", "S"]


def test_ship_command(tmp_path) -> None:
    (tmp_path / "train.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "cfg.yaml").write_text("")
    argv, files = yarn.ship_command(["python", "train.py", "--config", "sub/cfg.yaml", "--flag", "missing.txt"],
                                    str(tmp_path))
    assert argv == ["python", "./train.py", "--config", "./cfg.yaml", "--flag", "missing.txt"]
    assert files == {"train.py": str(tmp_path / "train.py"), "cfg.yaml": str(tmp_path / "sub" / "cfg.yaml")}
    # the program itself is never shipped, even when it is a file here
    argv, files = yarn.ship_command([sys.executable, "x"], str(tmp_path))
    assert argv == [sys.executable, "x"] and files == {}


# --- validation errors ------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, message", [
    (dict(files=("nope.txt",)), "--files nope.txt: no such file"),
    (dict(archives=("conf.json",)), "--archives conf.json: YARN unpacks only .zip, .tar.gz, .tgz, .tar, .jar archives"),
    (dict(files=("conf.json", "sub/conf.json")),
     "--files sub/conf.json and --files conf.json would both be localized as 'conf.json'"),
    (dict(files=("pslaunch-task.json",)), "--files pslaunch-task.json and the task file would both be localized"),
    (dict(command=("python", "a/data.csv", "b/data.csv")), "the command names two files called data.csv"),
    (dict(queue="my queue"), "--queue 'my queue': a queue name has no spaces"),
])
def test_spec_validation_errors(job_dir, kw, message) -> None:
    for d in ("sub", "a", "b"):
        (job_dir / d).mkdir(exist_ok=True)
        for name in ("conf.json", "data.csv"):
            (job_dir / d / name).write_text("x")
    (job_dir / "pslaunch-task.json").write_text("{}")
    spec = make_spec(job_dir, **kw)
    with pytest.raises(ConfigError) as e:
        yarn.build_yarn_plan(spec, make_procs(spec), wrapper_zip="/w.zip", task_file="/t.json")
    assert message in str(e.value)


def test_skein_accepts_the_spec(job_dir) -> None:
    skein = pytest.importorskip("skein")
    spec = make_spec(job_dir)
    yp = yarn.build_yarn_plan(spec, make_procs(spec), wrapper_zip="/tmp/x/pslaunch-task.zip",
                              task_file="/tmp/x/pslaunch-task.json")
    app = skein.ApplicationSpec.from_dict(yp.app_spec)
    back = app.to_dict()
    assert (back["name"], back["queue"], back["max_attempts"], back["tags"]) == ("mnist", "ml", 1, ["pslaunch"])
    for role, ours in yp.app_spec["services"].items():
        theirs = back["services"][role]
        assert theirs["instances"] == ours["instances"] and theirs["script"] == ours["script"]
        assert (theirs["resources"]["memory"], theirs["resources"]["vcores"]) == \
            (ours["resources"]["memory"], ours["resources"]["vcores"])
        assert theirs["env"] == ours["env"] and theirs["max_restarts"] == 0
        assert {k: (v["source"], v["type"]) for k, v in theirs["files"].items()} == \
            {k: ("file://" + v["source"], v["type"].upper()) for k, v in ours["files"].items()}
    # and skein's own checks still bite on what we would get wrong
    bad = json.loads(json.dumps(yp.app_spec))
    bad["services"]["worker"]["files"]["dir/x"] = {"source": "/x", "type": "file"}
    with pytest.raises(ValueError, match="filenames only"):
        skein.ApplicationSpec.from_dict(bad)


def test_kill_command() -> None:
    assert yarn.kill_command("application_1476912658570_0002") == \
        ["yarn", "application", "-kill", "application_1476912658570_0002"]


def test_watchdog_kill_uses_the_yarn_of_hadoop_home(tmp_path) -> None:
    """The watchdog runs with the PATH the launcher had at start, before $HADOOP_HOME/bin was
    added: its kill command must name yarn by its full path."""
    yarn_bin = tmp_path / "hadoop" / "bin" / "yarn"
    yarn_bin.parent.mkdir(parents=True)
    yarn_bin.write_text("#!/bin/sh\n")
    yarn_bin.chmod(0o755)
    env = {"PATH": "/nonexistent", "HADOOP_HOME": str(tmp_path / "hadoop")}
    assert yarn.yarn_program(env) == str(yarn_bin)
    env = {"PATH": str(yarn_bin.parent), "HADOOP_HOME": "/elsewhere"}
    assert yarn.yarn_program(env) == str(yarn_bin)
    assert yarn.yarn_program({"PATH": "/nonexistent"}) == "yarn"  # nothing better to offer
    assert yarn.kill_command("application_1_0002", str(yarn_bin)) == \
        [str(yarn_bin), "application", "-kill", "application_1_0002"]


# --- status parsing ------------------------------------------------------------------------------------

# From the Hadoop docs, ResourceManager REST API, "Cluster Applications API", JSON response example
# (https://hadoop.apache.org/docs/stable/hadoop-yarn/hadoop-yarn-site/ResourceManagerRest.html), trimmed
# to the fields we read. skein's ApplicationReport carries the same YARN state/finalStatus values.
REST_APPS_EXAMPLE = {"apps": {"app": [{
    "id": "application_1476912658570_0002", "user": "user2", "name": "word count", "queue": "default",
    "state": "FINISHED", "finalStatus": "SUCCEEDED", "progress": 100, "diagnostics": "...",
    "applicationType": "MAPREDUCE",
}]}}


def test_app_outcome_on_the_yarn_rest_example() -> None:
    (app,) = REST_APPS_EXAMPLE["apps"]["app"]
    assert yarn.app_outcome(app["state"], app["finalStatus"]) == 0


@pytest.mark.parametrize("state, final, outcome", [
    # every YarnApplicationState (skein API docs: skein.model.ApplicationState) ...
    ("NEW", "UNDEFINED", None), ("NEW_SAVING", "UNDEFINED", None), ("SUBMITTED", "UNDEFINED", None),
    ("ACCEPTED", "UNDEFINED", None), ("RUNNING", "UNDEFINED", None),
    # ... and the final ones with each FinalApplicationStatus (skein.model.FinalStatus)
    ("FINISHED", "SUCCEEDED", 0), ("FINISHED", "FAILED", 1), ("FINISHED", "KILLED", 143),
    ("FAILED", "FAILED", 1), ("KILLED", "KILLED", 143),
])
def test_app_outcome(state, final, outcome) -> None:
    assert yarn.app_outcome(state, final) == outcome


def test_every_skein_state_is_understood() -> None:
    model = pytest.importorskip("skein.model")
    assert sorted(str(s) for s in model.ContainerState) == sorted(yarn.CONTAINER_STATES)
    assert sorted(str(s) for s in model.ApplicationState) == sorted(yarn.APP_RUNNING_STATES + yarn.APP_FINAL_STATES)
    for s in model.ContainerState:
        yarn.container_exit_code(str(s), "")
    for s in model.ApplicationState:
        for f in model.FinalStatus:
            yarn.app_outcome(str(s), str(f))


# skein's Container.exit_message is YARN's ContainerStatus diagnostics. These texts use the
# NodeManager's own message strings (Hadoop source: LinuxContainerExecutor "Container killed on
# request. Exit code is N"; ContainerLaunch "Container exited with a non-zero exit code N.";
# ContainerExecutor "Exception from container-launch ... Exit code: N"), in the layout of
# Hadoop 3 diagnostics (timestamped lines). The compositions and ids are SYNTHETIC.
KILLED_DIAG = ("[2020-04-04 22:56:04.519]Container killed on request. Exit code is 143\n"
               "[2020-04-04 22:56:04.549]Container exited with a non-zero exit code 143.\n")
FAILED_DIAG = ("Exception from container-launch.\nContainer id: container_1476912658570_0002_01_000003\n"
               "Exit code: 3\nStack trace: ExitCodeException exitCode=3:\n")
NONZERO_DIAG = ("[2021-12-15 23:57:46.370]Container exited with a non-zero exit code 127. Error file: "
                "prelaunch.err.\nLast 4096 bytes of prelaunch.err :\n")
MEMORY_DIAG = ("Container [pid=4242,containerID=container_1476912658570_0002_01_000002] is running beyond "
               "physical memory limits. Current usage: 1.1 GB of 1 GB physical memory used. Killing container.\n"
               "Container killed on request. Exit code is 143\n")  # synthetic numbers


@pytest.mark.parametrize("state, message, code", [
    ("WAITING", "", None), ("REQUESTED", "", None), ("RUNNING", "", None),
    ("SUCCEEDED", "", 0),
    ("FAILED", FAILED_DIAG, 3),
    ("FAILED", NONZERO_DIAG, 127),
    ("FAILED", "", 1),                        # no diagnostics: still a failure
    ("FAILED", "Exit code: -100", 1),         # YARN's negative ContainerExitStatus (ABORTED)
    ("KILLED", KILLED_DIAG, 143),
    ("KILLED", MEMORY_DIAG, 143),
    ("KILLED", "", 143),
])
def test_container_exit_code(state, message, code) -> None:
    assert yarn.container_exit_code(state, message) == code


def test_unknown_states_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown container state 'LOST'"):
        yarn.container_exit_code("LOST", "")
    with pytest.raises(ValueError, match="unknown application state 'PAUSED'"):
        yarn.app_outcome("PAUSED", "UNDEFINED")


# --- missing dependencies ------------------------------------------------------------------------------


def _problem(environ, has_skein=True, java=True, files=()):
    return yarn.dependency_problem(environ, has_skein=has_skein,
                                   which=lambda name: "/usr/bin/java" if java and name == "java" else None,
                                   exists=lambda p: p in files)


def test_dependency_problems_are_one_line() -> None:
    ok_env = {"HADOOP_HOME": "/opt/hadoop"}
    ok_files = ["/opt/hadoop/bin/yarn"]
    assert _problem(ok_env, files=ok_files) is None
    assert _problem(ok_env, has_skein=False, files=ok_files) == \
        "the yarn backend needs skein: pip install '.[yarn]' in your clone of pslaunch (skein>=0.8)"
    assert _problem(ok_env, java=False, files=ok_files).startswith(
        "skein's driver needs Java: install a JDK (the one your Hadoop supports) and put java on PATH or set JAVA_HOME")
    assert _problem({**ok_env, "JAVA_HOME": "/opt/jdk"}, java=True, files=ok_files) == \
        "JAVA_HOME=/opt/jdk has no bin/java; point it at a JDK or unset it"
    assert _problem({**ok_env, "JAVA_HOME": "/opt/jdk"}, java=False, files=ok_files + ["/opt/jdk/bin/java"]) is None
    assert _problem({}, files=ok_files).startswith(
        "HADOOP_HOME is not set: export HADOOP_HOME=<your Hadoop installation>")
    assert _problem(ok_env) == "HADOOP_HOME=/opt/hadoop has no bin/yarn; point it at a Hadoop installation"


@pytest.mark.timeout(60)
def test_missing_dependency_from_the_command_line(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HADOOP_HOME", "HADOOP_CONF_DIR")}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-m", "launcher", "--launcher", "yarn", "-n", "1", "--host-ip", "127.0.0.1",
                        "python", "x.py"], capture_output=True, text=True, timeout=50, env=env, cwd=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    import importlib.util
    expected = yarn.dependency_problem(env, has_skein=importlib.util.find_spec("skein") is not None)
    assert lines[0] == f"pslaunch: error: {expected}"


@pytest.mark.timeout(60)
def test_dry_run_needs_no_skein(tmp_path) -> None:
    code = "import sys; sys.modules['skein'] = None\nfrom launcher.cli import main\nsys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "--launcher", "yarn", "-n", "2", "-s", "1", "--dry-run",
                        "--host-ip", "10.1.0.5", "--jobname", "mnist", "python", "train.py"],
                       capture_output=True, text=True, timeout=50, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert "YARN (skein): this application spec is submitted (skein.ApplicationSpec.from_dict):" in r.stdout
    assert "      script: exec python3 pslaunch-task.zip --task-file pslaunch-task.json --role worker " \
           "--index skein -- python train.py" in r.stdout
    assert "&id" not in r.stdout and "*id" not in r.stdout           # no YAML anchors
    assert "yarn application -kill '<application id>'" in r.stdout
    assert "0" * 64 not in r.stdout


# --- the container side: the wrapper zip --------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_node_bundle_runs_in_a_bare_container_directory(tmp_path) -> None:
    data = node.bundle("task")
    assert data == node.bundle("task")  # deterministic
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert names[0] == "__main__.py" and "launcher/node/task.py" in names and "pscontract/netif.py" in names
    assert all(n == "__main__.py" or n.startswith(("launcher/node/", "pscontract/")) or n == "launcher/__init__.py"
               for n in names)  # nothing else of the launcher
    (tmp_path / yarn.WRAPPER_ZIP).write_bytes(data)
    (tmp_path / yarn.TASK_FILE).write_text(json.dumps({"version": 2, "env": {}, "roles": {
        "worker": {"first_task_id": 0, "count": 2, "env": {"PSLAUNCH_SECRET": "s3", "Q": "$x"}}}}))
    # what YARN gives a container (synthetic values): skein's id, the service env from the spec
    env = {"PATH": os.environ["PATH"], "SKEIN_CONTAINER_ID": "worker_1", "DMLC_ROLE": "worker",
           "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9091"}
    script = yarn.build_service_script("worker", [sys.executable, "-c",
                                                  "import os, json; print(json.dumps(dict(os.environ)))"])
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["DMLC_TASK_ID"] == "1" and got["DMLC_NODE_HOST"] == "127.0.0.1"
    assert got["PSLAUNCH_SECRET"] == "s3" and got["Q"] == "$x"


# --- submit, follow, kill: against a stand-in for skein (SYNTHETIC: no YARN behind it) --------------------


class FakeContainer(types.SimpleNamespace):
    pass


class FakeSkein:
    """The parts of skein the backend calls, scripted by the test."""

    def __init__(self) -> None:
        self.app_state, self.final = "ACCEPTED", "UNDEFINED"
        self.diagnostics = "Application is added to the scheduler and is not yet activated."
        self.containers: dict[tuple[str, int], tuple[str, str]] = {}
        self.calls: list[str] = []
        self.submitted = None
        fake = self

        class ApplicationSpec:
            @staticmethod
            def from_dict(d):
                fake.submitted = d
                return d

        class App:
            def get_containers(self, states=None):
                return [FakeContainer(service_name=s, instance=i, state=st, exit_message=msg,
                                      yarn_container_id=f"container_1_0001_01_{n:06d}",
                                      yarn_node_http_address="node7:8042")
                        for n, ((s, i), (st, msg)) in enumerate(sorted(fake.containers.items()))]

            def close(self):
                pass

        class Client:
            def __init__(self, log=None):
                fake.calls.append("driver")

            def submit(self, spec):
                fake.calls.append("submit")
                return "application_1_0001"

            def application_report(self, app_id):
                return types.SimpleNamespace(state=fake.app_state, final_status=fake.final,
                                             diagnostics=fake.diagnostics)

            def connect(self, app_id, wait=True):
                return App()

            def kill_application(self, app_id):
                fake.calls.append(f"kill {app_id}")
                fake.app_state, fake.final = "KILLED", "KILLED"
                for k, (st, _) in fake.containers.items():
                    if st in ("RUNNING", "REQUESTED", "WAITING"):
                        fake.containers[k] = ("KILLED", KILLED_DIAG)

            def close(self):
                fake.calls.append("close")

        self.ApplicationSpec, self.Client = ApplicationSpec, Client


class FakeWatchdog:
    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def on_abandon(self, argv) -> None:
        self.commands.append(list(argv))


def _backend(tmp_path, fake, **kw):
    spec = JobSpec(command=("python", "x.py"), num_workers=2, num_servers=1, launcher="yarn",
                   workdir=str(tmp_path), environ=ENVIRON, start_timeout=kw.pop("start_timeout", 5))
    console = Console(stdout=io.BytesIO(), stderr=io.BytesIO())
    backend = yarn.YarnBackend(spec, console, FakeWatchdog())
    backend._skein = fake
    backend.prepare()
    return backend, make_procs(spec, root_uri="127.0.0.1")  # (the hub listens there: loopback only)


def _wait(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@pytest.fixture
def fast_poll(monkeypatch):
    monkeypatch.setattr(yarn.YarnBackend, "poll_every", 0.02)


@pytest.mark.timeout(30)
def test_lifecycle_failure_kills_the_application(tmp_path, fast_poll, monkeypatch) -> None:
    monkeypatch.delenv("HADOOP_HOME", raising=False)   # no Hadoop here, even where a testbed's is exported
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    fake = FakeSkein()
    backend, procs = _backend(tmp_path, fake)
    fake.app_state = "RUNNING"
    fake.containers = {("server", 0): ("RUNNING", ""), ("worker", 0): ("RUNNING", ""), ("worker", 1): ("RUNNING", "")}
    handles = backend.start(procs).handles
    assert [h.name for h in handles] == [p.name for p in procs]
    assert backend.watchdog.commands[-1] == ["yarn", "application", "-kill", "application_1_0001"]
    assert fake.submitted["services"]["worker"]["instances"] == 2
    task_file = fake.submitted["services"]["worker"]["files"]["pslaunch-task.json"]["source"]
    assert os.stat(task_file).st_mode & 0o777 == 0o600 and "PSLAUNCH_SECRET" in open(task_file).read()
    assert os.stat(os.path.dirname(task_file)).st_mode & 0o777 == 0o700
    assert all(h.poll() is None for h in handles)
    fake.containers[("worker", 1)] = ("FAILED", FAILED_DIAG)
    worker1 = handles[[h.name for h in handles].index("worker-1")]
    _wait(lambda: worker1.poll() is not None)
    assert worker1.poll() == 3 and worker1.host == "node7"
    assert "Exception from container-launch." in worker1.describe()
    for h in handles:                      # what the supervisor does next
        h.terminate()
    assert fake.calls.count("kill application_1_0001") == 1   # one kill takes the whole app down
    backend.close()
    assert {h.name: h.poll() for h in handles} == {"server-0": 143, "worker-0": 143, "worker-1": 3}
    assert fake.calls[-1] == "close" and backend._tmp is None


@pytest.mark.timeout(30)
def test_watchdog_gets_the_full_path_of_yarn(tmp_path, fast_poll, monkeypatch) -> None:
    yarn_bin = tmp_path / "hadoop" / "bin" / "yarn"
    yarn_bin.parent.mkdir(parents=True)
    yarn_bin.write_text("#!/bin/sh\n")
    yarn_bin.chmod(0o755)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setenv("HADOOP_HOME", str(tmp_path / "hadoop"))
    fake = FakeSkein()
    backend, procs = _backend(tmp_path, fake)
    fake.app_state = "RUNNING"
    fake.containers = {("server", 0): ("RUNNING", ""), ("worker", 0): ("RUNNING", ""), ("worker", 1): ("RUNNING", "")}
    backend.start(procs)
    assert backend.watchdog.commands[-1] == [str(yarn_bin), "application", "-kill", "application_1_0001"]
    backend.close()


@pytest.mark.timeout(30)
def test_success_needs_no_kill(tmp_path, fast_poll) -> None:
    fake = FakeSkein()
    backend, procs = _backend(tmp_path, fake)
    fake.app_state = "RUNNING"
    fake.containers = {("server", 0): ("RUNNING", ""), ("worker", 0): ("SUCCEEDED", ""), ("worker", 1): ("RUNNING", "")}
    handles = backend.start(procs).handles
    fake.containers[("worker", 1)] = ("SUCCEEDED", "")
    fake.containers[("server", 0)] = ("SUCCEEDED", "")
    _wait(lambda: all(h.poll() is not None for h in handles))   # the supervisor waits for this
    assert [h.poll() for h in handles] == [0, 0, 0]
    fake.app_state, fake.final = "FINISHED", "SUCCEEDED"   # skein's master ends the app when all are done
    backend.close()
    assert not any(c.startswith("kill") for c in fake.calls)  # no kill of an app that ends by itself


@pytest.mark.timeout(30)
def test_containers_not_running_after_start_timeout(tmp_path, fast_poll) -> None:
    fake = FakeSkein()
    backend, procs = _backend(tmp_path, fake, start_timeout=1)
    with pytest.raises(LaunchError) as e:
        backend.start(procs)
    msg = str(e.value)
    assert msg.startswith("3 of 3 containers not running after --start-timeout 1s "
                          "(application application_1_0001 ACCEPTED; server 0: WAITING")
    assert msg.endswith("YARN says: Application is added to the scheduler and is not yet activated.")
    backend.close()
    assert "kill application_1_0001" in fake.calls


def test_check_reports_missing_dependencies(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    spec = JobSpec(command=("x",), num_workers=1, num_servers=0, launcher="yarn", workdir=str(tmp_path))
    backend = yarn.YarnBackend(spec, Console(stdout=io.BytesIO(), stderr=io.BytesIO()), None)
    with pytest.raises(BackendUnavailableError,
                       match=r"needs skein: pip install '\.\[yarn\]' in your clone of pslaunch"):
        backend.check()


def test_the_stand_in_has_skeins_real_signatures() -> None:
    """The stand-in is only worth its tests while it takes what skein's client takes."""
    skein = pytest.importorskip("skein")
    import inspect

    fake = FakeSkein()
    for name in ("submit", "application_report", "connect", "kill_application", "close"):
        real = inspect.signature(getattr(skein.Client, name))
        ours = inspect.signature(getattr(fake.Client, name))
        assert list(ours.parameters)[:len(ours.parameters)] == list(real.parameters)[:len(ours.parameters)], name
    assert "log" in inspect.signature(skein.Client).parameters
    assert "states" in inspect.signature(skein.ApplicationClient.get_containers).parameters
    assert "wait" in inspect.signature(skein.Client.connect).parameters
