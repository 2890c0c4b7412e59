"""launcher/trackers/: which Python runs a tracker program, and where the programs are."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from launcher import node, trackers
from launcher.spec.job import JobSpec


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
