"""``launcher.runtime.local.spawn`` starts a process as ``subprocess.Popen(..., start_new_session=True,
close_fds=True, stdin=DEVNULL)`` would, with ``posix_spawn``; checked against real processes."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from launcher.runtime import local

REPORT = """#!/bin/sh
echo "sid=$(cut -d' ' -f6 /proc/self/stat) pid=$$"
echo "fds=$(ls /proc/self/fd | sort -n | tr '\\n' ' ')"
echo "stdin=$(readlink /proc/self/fd/0)"
grep SigIgn /proc/self/status
echo "to stderr" >&2
"""


def _run(argv: list[str], env: dict[str, str], cwd: str | None = None) -> tuple[int, str]:
    r, w = os.pipe()
    try:
        pid = local.spawn(argv, env, cwd, w, w)
    finally:
        os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    if pid is None:
        return -1, out
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out


@pytest.fixture
def report(tmp_path) -> str:
    path = tmp_path / "report"
    path.write_text(REPORT)
    path.chmod(0o755)
    return str(path)


def test_a_spawned_process_leads_its_session_reads_dev_null_and_holds_no_inherited_descriptor(report) -> None:
    leaked_r, leaked_w = os.pipe()
    os.set_inheritable(leaked_w, True)  # (as a descriptor this launcher inherited would be)
    local._sealed = False
    try:
        code, out = _run([report], dict(os.environ))
    finally:
        os.close(leaked_r)
        os.close(leaked_w)
    assert code == 0, out
    lines = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    sid, pid = lines["sid"].split(" pid=")
    assert sid == pid  # its own session (and process group)
    assert lines["fds"].split()[:3] == ["0", "1", "2"] and str(leaked_w) not in lines["fds"].split()[:4]
    assert len(lines["fds"].split()) == 4, lines["fds"]  # 0, 1, 2 and ls's own directory
    assert lines["stdin"] == "/dev/null"
    assert "to stderr" in out  # stderr went where it was told
    ignored = int(out.split("SigIgn:")[1].split()[0], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))  # back at its default, as Popen's restore_signals


def test_the_program_is_found_on_the_jobs_path_as_popen_finds_it(tmp_path, report) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "prog").write_text("#!/bin/sh\necho first\n")  # not executable: skipped, as by Popen
    (second / "prog").write_text("#!/bin/sh\necho second\n")
    (second / "prog").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'nowhere'}:{first}:{second}:/usr/bin:/bin")
    assert _run(["prog"], env) == (0, "second\n")
    assert subprocess.run(["prog"], env=env, capture_output=True, text=True).stdout == "second\n"
    with pytest.raises(FileNotFoundError):
        _run(["prog"], dict(os.environ, PATH="/usr/bin:/bin"))  # the job's PATH, not this process's
    (second / "prog").chmod(0o644)
    with pytest.raises(PermissionError):  # only found where it cannot run: that error, not "not found"
        _run(["prog"], env)


def test_another_working_directory_is_left_to_popen(tmp_path, report) -> None:
    assert _run([report], dict(os.environ), cwd=str(tmp_path)) == (-1, "")
    assert _run([report], dict(os.environ), cwd=os.getcwd())[0] == 0
