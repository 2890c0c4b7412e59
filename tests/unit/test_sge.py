"""The sge backend's pure parts: native specification and job templates (golden), the
task file, exit codes, the DRMAA environment checks and the dry run. No Grid Engine needed."""

from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
import sys

import pytest
from support.helpers import REPO

from launcher.backends import batch, sge
from launcher.backends.sge import SGEOptions
from launcher.errors import BackendUnavailableError, ConfigError
from launcher.spec.job import JobSpec
from launcher.spec.plan import build_plan

PY = "/opt/venv/bin/python3"
WRAPPER = [PY, "-S", "-c", "<the task wrapper>"]


def make_spec(**kw) -> JobSpec:
    base = dict(
        command=("python", "train.py", "--kv-store", "dist_sync"), num_workers=2, num_servers=1,
        launcher="sge", queue="all.q", jobname="mnist", worker_cores=2, worker_memory_mb=4096,
        workdir="/shared/job",
        environ=(("HOME", "/root"), ("PATH", "/opt/venv/bin:/usr/bin"), ("PS_VERBOSE", "1")),
        env=(("XLA_FLAGS", "--a=1 --b=2"),),
        options=SGEOptions(native="-l h_rt=3600", log_dir="logs"),
    )
    base.update(kw)
    return JobSpec(**base)


def make_plan(spec: JobSpec):
    return build_plan(spec, root_uri="10.1.0.5", root_port=9091, secret="5" * 64, job_id="abc123",
                      inherit_environ=False)


# --- native specification --------------------------------------------------------------


@pytest.mark.parametrize("kw, expected", [
    (dict(queue=None, cores=1, memory_mb=None, pe="smp", native=None), ""),
    (dict(queue="default", cores=1, memory_mb=None, pe="smp", native=None), ""),  # dmlc's default: no -q
    (dict(queue="gpu.q", cores=1, memory_mb=None, pe="smp", native=None), "-q gpu.q"),
    (dict(queue=None, cores=4, memory_mb=None, pe="orte", native=None), "-pe orte 4"),
    (dict(queue=None, cores=1, memory_mb=2048, pe="smp", native=None), "-l h_vmem=2048M"),
    # h_vmem is per slot: 3000 MB over 4 slots -> 750M each; rounded up
    (dict(queue=None, cores=4, memory_mb=3000, pe="smp", native=None), "-pe smp 4 -l h_vmem=750M"),
    (dict(queue=None, cores=3, memory_mb=1000, pe="smp", native=None), "-pe smp 3 -l h_vmem=334M"),
    (dict(queue="all.q", cores=2, memory_mb=4096, pe="smp", native="  -l h_rt=3600 -P ml  "),
     "-q all.q -pe smp 2 -l h_vmem=2048M -l h_rt=3600 -P ml"),
])
def test_native_specification(kw, expected) -> None:
    assert sge.build_native_specification(**kw) == expected


@pytest.mark.parametrize("kw, message", [
    (dict(queue="a q", cores=1, memory_mb=None, pe="smp", native=None), "--queue 'a q': a queue name has no spaces"),
    (dict(queue=None, cores=2, memory_mb=None, pe="", native=None), "--sge-pe '': give the name of a parallel"),
])
def test_native_specification_errors(kw, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        sge.build_native_specification(**kw)


@pytest.mark.parametrize("name", ["1job", "a b", "a/b", "a:b", "a@b", "a*b", "a?b", "a\\b", ""])
def test_bad_job_names_are_refused(name) -> None:
    with pytest.raises(ConfigError, match="Grid Engine job names"):
        sge.check_job_name(name)


def test_good_job_names() -> None:
    for name in ("mnist", "pslaunch-python", "run_1.x", "a=b,c"):
        assert sge.check_job_name(name) == name


# --- job templates (golden) --------------------------------------------------------------


def test_job_templates_golden() -> None:
    spec = make_spec()
    plan = make_plan(spec)
    log_dir = sge.log_dir_for(spec)
    assert log_dir == "/shared/job/logs"
    task_file = sge.task_file_path(log_dir, "abc123")
    assert task_file == "/shared/job/logs/.pslaunch-abc123.task.json"
    templates = sge.build_job_templates(spec, plan.procs, wrapper=WRAPPER, task_file=task_file,
                                        log_dir=log_dir, job_id="abc123")
    assert [(t.role, t.count) for t in templates] == [("server", 1), ("worker", 2)]  # servers first
    common_args = ["-S", "-c", "<the task wrapper>", "--task-file", task_file]
    assert templates[0].attributes() == {
        "jobName": "mnist",
        "remoteCommand": PY,
        "args": [*common_args, "--role", "server", "--index", "sge", "--report-dir", log_dir],
        "workingDirectory": "/shared/job",
        "outputPath": ":/shared/job/logs/server.$drmaa_incr_ph$.out",
        "errorPath": ":/shared/job/logs/server.$drmaa_incr_ph$.err",
        "joinFiles": False,
        "jobEnvironment": {"PSLAUNCH_JOB_ID": "abc123"},
        "nativeSpecification": "-q all.q -l h_rt=3600",
    }
    assert templates[1].attributes() == {
        "jobName": "mnist",
        "remoteCommand": PY,
        "args": [*common_args, "--role", "worker", "--index", "sge", "--report-dir", log_dir],
        "workingDirectory": "/shared/job",
        "outputPath": ":/shared/job/logs/worker.$drmaa_incr_ph$.out",
        "errorPath": ":/shared/job/logs/worker.$drmaa_incr_ph$.err",
        "joinFiles": False,
        "jobEnvironment": {"PSLAUNCH_JOB_ID": "abc123"},
        "nativeSpecification": "-q all.q -pe smp 2 -l h_vmem=2048M -l h_rt=3600",
    }
    assert templates[1].task_files(2) == ("/shared/job/logs/worker.2.out", "/shared/job/logs/worker.2.err")


def test_templates_carry_no_secret_no_equals_and_no_dash_V() -> None:
    """The three DRMAA limits: values cut at '=', no environment without -V (and -V would
    copy everything, secrets included), everything in a template shows in qstat -j."""
    spec = make_spec(options=SGEOptions(native=None))
    plan = make_plan(spec)
    for t in sge.build_job_templates(spec, plan.procs, wrapper=WRAPPER, task_file="/x/t.json",
                                     log_dir="/x", job_id="abc123"):
        text = repr(t.attributes())
        assert "5" * 64 not in text and "PSLAUNCH_SECRET" not in text
        assert all("=" not in v for v in t.job_environment.values())
        assert "-V" not in t.native_specification.split()
        assert t.remote_command == PY and os.path.isabs(t.remote_command)


def test_no_server_job_with_s0() -> None:
    spec = make_spec(num_servers=0)
    templates = sge.build_job_templates(spec, make_plan(spec).procs, wrapper=WRAPPER,
                                        task_file="/x/t.json", log_dir="/x", job_id="j")
    assert [t.role for t in templates] == ["worker"]


def test_default_log_dir_is_jobname_log() -> None:
    assert sge.log_dir_for(make_spec(options=SGEOptions())) == "/shared/job/mnist.log"
    assert sge.log_dir_for(make_spec(jobname=None, options=SGEOptions())) == "/shared/job/pslaunch-python.log"
    assert sge.log_dir_for(make_spec(options=SGEOptions(log_dir="/abs/l"))) == "/abs/l"


# --- the task file ---------------------------------------------------------------------------


def test_task_file() -> None:
    spec = make_spec()
    plan = make_plan(spec)
    doc = batch.build_task_file(spec, plan.procs)
    assert doc["version"] == 2 and doc["grace"] == 10.0 and "hub" not in doc
    assert batch.build_task_file(spec, plan.procs, hub=("10.1.0.5", 9092))["hub"] == ["10.1.0.5", 9092]
    assert doc["argv"] == ["python", "train.py", "--kv-store", "dist_sync"]
    assert doc["env"] == {"PATH": "/opt/venv/bin:/usr/bin"}  # the launcher's PATH, not SGE's
    assert sorted(doc["roles"]) == ["server", "worker"]
    server, worker = doc["roles"]["server"], doc["roles"]["worker"]
    assert (server["first_task_id"], server["count"]) == (2, 1)
    assert (worker["first_task_id"], worker["count"]) == (0, 2)
    for role, r in doc["roles"].items():
        env = r["env"]
        assert env["DMLC_ROLE"] == role and env["DMLC_JOB_CLUSTER"] == "sge"
        assert env["DMLC_PS_ROOT_URI"] == "10.1.0.5" and env["DMLC_PS_ROOT_PORT"] == "9091"
        assert env["DMLC_NUM_WORKER"] == "2" and env["DMLC_NUM_SERVER"] == "1"
        assert env["PSLAUNCH_SECRET"] == "5" * 64          # only in the 0600 file
        assert env["XLA_FLAGS"] == "--a=1 --b=2"            # '=' survives: not a jobEnvironment value
        assert env["PS_VERBOSE"] == "1"                    # forwarded
        assert "HOME" not in env                           # not forwarded (no -V semantics)
        # per task (the wrapper) or unknowable here
        assert not {"DMLC_TASK_ID", "DMLC_NODE_HOST", "PSLAUNCH_LOCAL_PROCS"} & set(env)


def test_task_file_resolves_a_program_in_the_working_directory(tmp_path) -> None:
    prog = tmp_path / "run.sh"
    prog.write_text("#!/bin/sh\n")
    prog.chmod(0o755)
    spec = make_spec(command=("run.sh",), workdir=str(tmp_path), environ=(("PATH", "/nonexistent"),))
    assert batch.build_task_file(spec, make_plan(spec).procs)["argv"] == ["./run.sh"]


def test_qdel_command() -> None:
    assert sge.qdel_command(["12", "13"], "/usr/bin/qdel") == ["/usr/bin/qdel", "12", "13"]
    assert sge.qdel_command(["12"], None) is None
    assert sge.qdel_command([], "/usr/bin/qdel") is None


# --- exit codes -------------------------------------------------------------------------------


def _code(**kw):
    base = dict(has_exited=False, exit_status=0, has_signal=False, signal_name="", was_aborted=False,
                ran=True, terminated=False)
    base.update(kw)
    return sge.exit_code_of(**base)


def test_exit_codes() -> None:
    assert _code(has_exited=True, exit_status=0) == (0, "")
    assert _code(has_exited=True, exit_status=3) == (3, "")
    assert _code(has_signal=True, signal_name="SIGTERM") == (143, "killed by SIGTERM")
    assert _code(has_signal=True, signal_name="SIGSEGV")[0] == 139
    assert _code(has_signal=True, signal_name="SIGNOPE")[0] == 137  # unknown name: as SIGKILL
    # DRMAA after control(TERMINATE) of a running task: wasAborted, neither exited nor signalled
    assert _code(was_aborted=True, terminated=True) == (137, "deleted by the launcher")
    assert _code(was_aborted=True, terminated=True, ran=False) == (137, "deleted by the launcher before it started")
    assert _code(was_aborted=True) == (137, "deleted while running (qdel?)")
    code, why = _code(was_aborted=True, ran=False)
    assert code == 1 and "could not start it" in why


# --- the DRMAA environment ----------------------------------------------------------------------


def _env_problem(env: dict, files=(), dirs=()):
    return sge.environment_problem(env, exists=lambda p: p in files or p in dirs, isdir=lambda p: p in dirs)


def test_environment_problems_say_what_to_set() -> None:
    lib, root = sge.DEBIAN_DRMAA_LIBRARY, sge.DEBIAN_SGE_ROOT
    msg = _env_problem({}, files=[lib], dirs=[root])
    assert msg == f"DRMAA_LIBRARY_PATH is not set: export DRMAA_LIBRARY_PATH=<path of libdrmaa.so> (Debian: {lib})"
    msg = _env_problem({"DRMAA_LIBRARY_PATH": "/nope.so"}, files=[lib])
    assert msg.startswith("DRMAA_LIBRARY_PATH=/nope.so: no such file; set it to the path of libdrmaa.so")
    msg = _env_problem({"DRMAA_LIBRARY_PATH": lib}, files=[lib], dirs=[root])
    assert msg == f"SGE_ROOT is not set (libdrmaa needs it): export SGE_ROOT=<Grid Engine's root> (Debian: {root})"
    msg = _env_problem({"DRMAA_LIBRARY_PATH": lib, "SGE_ROOT": "/x"}, files=[lib])
    assert msg == "SGE_ROOT=/x: no such directory"
    assert _env_problem({"DRMAA_LIBRARY_PATH": lib, "SGE_ROOT": root}, files=[lib], dirs=[root]) is None
    for m in (msg,):
        assert "\n" not in m


def test_missing_drmaa_package(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BackendUnavailableError,
                       match=r"pip install '\.\[sge\]' in your clone of pslaunch \(drmaa==0.7.9\)"):
        sge.load_drmaa({})


def test_static_tls_error_names_the_tunable(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(sge, "environment_problem", lambda environ: None)

    def fail(name):
        raise OSError("/lib/x86_64-linux-gnu/libjemalloc.so.2: cannot allocate memory in static TLS block")
    monkeypatch.setattr(importlib, "import_module", fail)
    with pytest.raises(BackendUnavailableError) as e:
        sge.load_drmaa({"DRMAA_LIBRARY_PATH": "/l.so", "GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert str(e.value).endswith(
        "start pslaunch with GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.rtld.optional_static_tls=8192")


def test_a_library_that_is_not_libdrmaa_is_one_line(tmp_path) -> None:
    """DRMAA_LIBRARY_PATH naming some other shared library: drmaa's import fails with an
    AttributeError (undefined symbol); that is a one-line error too, not a traceback."""
    lib = next((p for p in ("/lib/x86_64-linux-gnu/libz.so.1", "/usr/lib/x86_64-linux-gnu/libz.so.1",
                            "/lib/aarch64-linux-gnu/libz.so.1") if os.path.exists(p)), None)
    if lib is None or importlib.util.find_spec("drmaa") is None:
        pytest.skip("needs the drmaa package and libz")
    r = subprocess.run([sys.executable, "-m", "launcher", "--launcher", "sge", "--host-ip", "127.0.0.1",
                        "-n", "1", "-s", "0", "true"], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(REPO), "DRMAA_LIBRARY_PATH": lib,
                            "SGE_ROOT": str(tmp_path)})
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"DRMAA_LIBRARY_PATH={lib} is not a DRMAA library" in lines[0], r.stderr


# --- dry run: no drmaa, no Grid Engine ------------------------------------------------------------


def test_dry_run_needs_no_drmaa(tmp_path) -> None:
    code = ("import sys; sys.modules['drmaa'] = None\n"  # importing drmaa would now fail
            "from launcher.cli import main\n"
            "sys.exit(main(sys.argv[1:]))")
    r = subprocess.run(
        [sys.executable, "-c", code, "--launcher", "sge", "-n", "2", "-s", "1", "--dry-run", "--host-ip", "10.1.0.5",
         "--jobname", "mnist", "--queue", "all.q", "--worker-cores", "2", "--worker-memory", "4g",
         "--sge-native", "-l h_rt=600", "python", "train.py"],
        capture_output=True, text=True, timeout=30, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO), "DRMAA_LIBRARY_PATH": "", "PSLAUNCH_SECRET": "x"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Grid Engine (DRMAA): one bulk job per role, servers first:" in out
    assert "  servers: runBulkJobs(template, 1, 1, 1)" in out and "  workers: runBulkJobs(template, 1, 2, 1)" in out
    assert '    nativeSpecification: "-q all.q -pe smp 2 -l h_vmem=2048M -l h_rt=600"' in out
    assert f'    outputPath: ":{tmp_path}/mnist.log/worker.$drmaa_incr_ph$.out"' in out
    assert "workers: DMLC_TASK_ID = 0 + SGE_TASK_ID - 1" not in out  # roles are named singular
    assert "  worker: DMLC_TASK_ID = 0 + SGE_TASK_ID - 1" in out
    assert "  server: DMLC_TASK_ID = 2 + SGE_TASK_ID - 1" in out
    assert "0" * 64 not in out
    assert not (tmp_path / "mnist.log").exists()  # a dry run creates nothing


def test_task_file_mode_is_0600(tmp_path) -> None:
    path = tmp_path / "t.json"
    path.write_text("old")  # a stale one is replaced, never reused with its old mode
    path.chmod(0o644)
    batch.write_private_json(str(path), {"version": 1})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == '{"version": 1}'
