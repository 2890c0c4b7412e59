"""pslaunch doctor's checks on a host (``launcher.node.probe``), run here through the exact remote
command as a host would run them (no ssh), and its table."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.backends.ssh import bootstrap_command
from launcher.run.doctor import WRAPPER_PYTHON, Checks, Row, fill, format_table, probe_input, synced_files
from launcher.spec.job import Host
from launcher.transport.options import SSHOptions


def _run_checks(tmp_path: Path, cwd: str, command: tuple[str, ...] = (), python: str | None = None,
                imports: tuple[str, ...] = (), env: dict | None = None, synced: dict | None = None) -> dict:
    home = tmp_path / "home"
    (home / "job").mkdir(parents=True, exist_ok=True)
    checks = Checks(cwd=cwd, command=command, python=python, imports=imports, env=env or {}, synced=synced or {})
    path = f"{Path(sys.executable).parent}:/usr/bin:/bin"
    with socket.create_server(("127.0.0.1", 0)) as scheduler:  # what "reach" connects to
        args = checks.args("127.0.0.1", ("127.0.0.1", scheduler.getsockname()[1]), 5.0)
        r = subprocess.run(["sh", "-c", bootstrap_command(WRAPPER_PYTHON)], input=probe_input(args),
                           capture_output=True, timeout=60, cwd=home, env={"HOME": str(home), "PATH": path})
    line = next(x for x in r.stdout.decode().splitlines() if x.startswith("PSLAUNCH-DOCTOR "))
    return json.loads(line.split(" ", 1)[1])


def _row(res: dict, checks: Checks) -> Row:
    row = Row(Host("h1"))
    fill(row, res, checks)
    return row


def test_sync_dst_dir_with_a_tilde_is_the_remote_home(tmp_path) -> None:
    """--sync-dst-dir '~/job' (from YAML, or quoted) is looked up below the host's home, as the
    ssh backend's sync and launch use it."""
    home = tmp_path / "home"
    assert _run_checks(tmp_path, "~/job")["cwd"] == {"path": str(home / "job"), "exists": True}
    assert _run_checks(tmp_path, "job")["cwd"]["exists"]  # relative: below the login's home too
    res = _run_checks(tmp_path, "~/missing")
    assert res["cwd"] == {"path": str(home / "missing"), "exists": False}
    # with --sync-dst-dir a missing directory is information; without, a failure
    row = _row(res, Checks(cwd="~/missing", sync=True))
    assert row.ok and row.cells["cwd"] == "ok (synced)" and "--sync-dst-dir creates it" in row.info[0]
    row = _row(res, Checks(cwd="~/missing"))
    assert not row.ok and row.problems[0].startswith(f"h1: cwd: the job's working directory {home}/missing")


def test_a_sync_dst_dir_the_sync_would_refuse_fails_the_cwd_check(tmp_path) -> None:
    """A link at --sync-dst-dir (another user's, planted in /tmp) is what the sync refuses: the
    doctor says so; without --sync-dst-dir the job just runs there."""
    home = tmp_path / "home"
    home.mkdir()
    os.symlink(home / "job", home / "planted")
    res = _run_checks(tmp_path, "~/planted")
    assert res["cwd"]["exists"] and "is a symbolic link" in res["cwd"]["refused"]
    row = _row(res, Checks(cwd="~/planted", sync=True))
    assert row.cells["cwd"] == "FAIL not yours"
    assert row.problems[0].startswith(f"h1: cwd: --sync-dst-dir refuses it: {home}/planted is a symbolic link")
    assert _row(res, Checks(cwd="~/planted")).cells["cwd"] == "ok"


def test_the_commands_program_and_its_python(tmp_path) -> None:
    job = tmp_path / "home" / "job"
    job.mkdir(parents=True)
    (job / "train.py").write_text("print(1)\n")
    py = os.path.basename(sys.executable)  # python3 or python: on the PATH given
    here = ".".join(map(str, sys.version_info[:3]))
    res = _run_checks(tmp_path, str(job), (py, "-u", "train.py", "--lr", "1"))
    assert res["program"]["script"] == {"name": "train.py", "ok": True}
    assert res["interpreter"]["version"] == here
    row = _row(res, Checks(cwd=str(job), command=(py, "train.py")))
    assert row.ok and row.cells["program"] == f"ok {py} python {here}"
    # a missing script, a missing module, a missing program, a file that is not executable
    row = _row(_run_checks(tmp_path, str(job), (py, "nope.py")), Checks(cwd=str(job)))
    assert row.cells["program"] == "FAIL nope.py missing" and f"nope.py: no such file in {job}" in row.problems[0]
    row = _row(_run_checks(tmp_path, str(job), (py, "-m", "no_such_module_xyz")), Checks(cwd=str(job)))
    assert row.cells["program"] == "FAIL -m no_such_module_xyz"
    assert _run_checks(tmp_path, str(job), (py, "-m", "json.tool"))["program"]["module"]["ok"]
    row = _row(_run_checks(tmp_path, str(job), ("no-such-prog-xyz", "a")), Checks(cwd=str(job)))
    assert row.cells["program"] == "FAIL no-such-prog-xyz not found" and "(exit code 127)" in row.problems[0]
    row = _row(_run_checks(tmp_path, str(job), ("./train.py",)), Checks(cwd=str(job)))
    assert row.cells["program"] == "FAIL ./train.py not executable" and "(exit code 126)" in row.problems[0]


def test_a_script_with_a_python_shebang_and_the_dmlc_rule(tmp_path) -> None:
    job = tmp_path / "home" / "job"
    job.mkdir(parents=True)
    script = job / "run_me"
    script.write_text(f"#!/usr/bin/env {os.path.basename(sys.executable)}\nprint(1)\n")
    script.chmod(0o755)
    res = _run_checks(tmp_path, str(job), ("run_me",))  # not on PATH: dmlc runs it as ./run_me
    row = _row(res, Checks(cwd=str(job), command=("run_me",)))
    assert row.ok, row.problems
    assert row.cells["program"] == "ok run_me python " + ".".join(map(str, sys.version_info[:3]))
    assert any("runs as ./run_me" in n for n in row.info)


def test_imports_only_when_asked(tmp_path) -> None:
    job = tmp_path / "home" / "job"
    (job / "mypkg").mkdir(parents=True)
    (job / "mypkg" / "__init__.py").write_text("")
    py = sys.executable
    res = _run_checks(tmp_path, str(job), (py, "-c", "pass"))
    assert res["imports"] == {}
    res = _run_checks(tmp_path, str(job), (py, "-c", "pass"), imports=("mypkg", "nosuchpkg_xyz"))
    row = _row(res, Checks(cwd=str(job), imports=("mypkg", "nosuchpkg_xyz")))
    assert row.cells["imports"] == "FAIL nosuchpkg_xyz"
    assert "import nosuchpkg_xyz in" in row.problems[0] and "No module named 'nosuchpkg_xyz'" in row.problems[0]
    # without a command, --python names the Python to check
    res = _run_checks(tmp_path, str(job), python=py, imports=("mypkg",))
    assert _row(res, Checks(cwd=str(job), python=py, imports=("mypkg",))).cells["imports"] == "ok mypkg"


@pytest.mark.parametrize("with_imports", [False, True])
def test_the_table_shows_imports_only_when_checked(tmp_path, with_imports: bool) -> None:
    res = _run_checks(tmp_path, "job", imports=("json",) if with_imports else (), python=sys.executable)
    checks = Checks(cwd="job", imports=("json",) if with_imports else ())
    row = _row(res, checks)
    text = format_table([row], ("10.0.0.1", 9091), checks, ["no command given: ..."])
    head = text.splitlines()[0].split()
    assert head == ["HOST", "SSH", "PYTHON3", "CWD", "PROGRAM"] + (["IMPORTS"] if with_imports else []) + [
        "INTERFACE", "PORT", "REACH"]
    assert "information:\n  no command given: ..." in text


def test_a_program_the_sync_sends_counts_as_there(tmp_path) -> None:
    """Before the first --sync-dst-dir, the job's directory on a host is missing or old: a script
    or program this directory sends counts as there (a Python one's #! line still names the
    Python that is checked there), and what the sync leaves out (an exclude, .gitignore, a
    virtual environment) still fails, as the job would."""
    src = tmp_path / "src"
    (src / "tools").mkdir(parents=True)
    (src / "data").mkdir()
    (src / "venv").mkdir()
    (src / "venv" / "pyvenv.cfg").write_text("")
    (src / "train.py").write_text("print(1)\n")
    (src / "tools" / "run.sh").write_text(f"#!/usr/bin/env {os.path.basename(sys.executable)}\nprint(1)\n")
    (src / "tools" / "run.sh").chmod(0o755)
    (src / "tools" / "plain").write_text("echo 1\n")  # not executable
    (src / "data" / "gen.py").write_text("")
    (src / "venv" / "x.py").write_text("")
    opts = SSHOptions(sync_exclude=SSHOptions.sync_exclude + ("data",))
    dst = "~/job"
    command = (os.path.basename(sys.executable), "train.py", "tools/run.sh", "data/gen.py", "venv/x.py", "-x",
               "tools/plain", "~/job/train.py", "nosuch.py")
    synced = synced_files(command, str(src), dst, opts)
    assert sorted(synced) == ["tools/plain", "tools/run.sh", "train.py", "~/job/train.py"]
    assert synced["tools/run.sh"]["executable"] and not synced["tools/plain"]["executable"]
    here = ".".join(map(str, sys.version_info[:3]))
    py = os.path.basename(sys.executable)

    def row_for(*cmd: str) -> Row:
        checks = Checks(cwd=dst, command=cmd, sync=True, synced=synced_files(cmd, str(src), dst, opts))
        res = _run_checks(tmp_path, "~/missing", cmd, synced=checks.synced)  # (the directory is not there yet)
        return _row(res, checks)

    row = row_for(py, "train.py", "--lr", "1")
    assert row.ok, row.problems
    assert row.cells["program"] == f"ok {py} python {here}"
    assert any("train.py is not in" in n and "--sync-dst-dir sends it" in n for n in row.info), row.info
    row = row_for("./tools/run.sh")
    assert row.ok and row.cells["program"] == f"ok ./tools/run.sh python {here}", row.problems
    row = row_for("tools/plain")
    assert row.cells["program"] == "FAIL tools/plain not executable"
    row = row_for(py, "data/gen.py")  # excluded: the job would not find it either
    assert row.cells["program"] == "FAIL data/gen.py missing"
    row = row_for(py, "venv/x.py")
    assert row.cells["program"] == "FAIL venv/x.py missing"
    # git's ignores are the sync's too
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    (src / ".gitignore").write_text("train.py\n")
    assert "train.py" not in synced_files((py, "train.py"), str(src), dst, opts)
    assert "train.py" in synced_files((py, "train.py"), str(src), dst, SSHOptions(sync_no_gitignore=True))
