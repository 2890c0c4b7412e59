"""A local child (``launcher.runtime.local.LocalProcess``): its own session, stdin from /dev/null, its
output on pipes, no descriptor of the launcher, the job's PATH, and the 127/126 one-line errors;
checked against real processes."""

from __future__ import annotations

import io
import os
import signal
import time

import pytest

from launcher.errors import LaunchError
from launcher.runtime.local import LocalProcess
from launcher.runtime.output import Console, PipePump
from launcher.spec.job import Role
from launcher.spec.plan import ProcSpec

REPORT = """#!/bin/sh
echo "sid=$(cut -d' ' -f6 /proc/self/stat) pid=$$"
echo "fds=$(ls /proc/self/fd | sort -n | tr '\\n' ' ')"
echo "stdin=$(readlink /proc/self/fd/0)"
grep SigIgn /proc/self/status
echo "to stderr" >&2
"""


def _run(argv: list[str], env: dict[str, str], cwd: str | None = None) -> tuple[int, list[str]]:
    """Run ``argv`` as a local job's worker 0: its exit code and the lines it printed."""
    out = io.BytesIO()
    console = Console(stdout=out, stderr=out, color=False)
    output = console.proc("worker-0", "worker 0", "worker")
    pump = PipePump()
    try:
        proc = LocalProcess(ProcSpec(Role.WORKER, 0, 0, None, tuple(argv)), output, pump, None, env, cwd)
        assert output.stdout.done.wait(10) and output.stderr.done.wait(10)
        deadline = time.monotonic() + 10
        while (code := proc.poll()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        pump.stop()
    return code, [line.removeprefix("[worker 0] ") for line in out.getvalue().decode().splitlines()]


@pytest.fixture
def report(tmp_path) -> str:
    path = tmp_path / "report"
    path.write_text(REPORT)
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("elsewhere", [False, True])
def test_a_child_leads_its_session_reads_dev_null_and_holds_no_inherited_descriptor(report, tmp_path,
                                                                                     elsewhere) -> None:
    leaked_r, leaked_w = os.pipe()
    os.set_inheritable(leaked_w, True)  # (as a descriptor this launcher inherited would be)
    try:
        code, out = _run([report], dict(os.environ), cwd=str(tmp_path) if elsewhere else None)
    finally:
        os.close(leaked_r)
        os.close(leaked_w)
    assert code == 0, out
    lines = dict(line.split("=", 1) for line in out if "=" in line)
    sid, pid = lines["sid"].split(" pid=")
    assert sid == pid  # its own session (and process group)
    assert lines["fds"].split() == ["0", "1", "2", "3"], lines["fds"]  # 0, 1, 2 and ls's own directory
    assert lines["stdin"] == "/dev/null"
    assert "to stderr" in out  # stderr went where it was told
    ignored = int(next(line for line in out if line.startswith("SigIgn:")).split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))  # back at its default (Popen's restore_signals)


def test_the_program_is_found_on_the_jobs_path(tmp_path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "prog").write_text("#!/bin/sh\necho first\n")  # not executable: skipped
    (second / "prog").write_text("#!/bin/sh\necho second\n")
    (second / "prog").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'nowhere'}:{first}:{second}:/usr/bin:/bin")
    assert _run(["prog"], env) == (0, ["second"])
    with pytest.raises(LaunchError) as e:
        _run(["prog"], dict(os.environ, PATH="/usr/bin:/bin"))  # the job's PATH, not this process's
    assert e.value.exit_code == 127 and str(e.value) == ("worker 0: cannot run 'prog': no such program or "
                                                         "directory (is it on PATH? give a path such as ./prog)")
    (second / "prog").chmod(0o644)
    with pytest.raises(LaunchError) as e:  # only found where it cannot run: that error, not "not found"
        _run(["prog"], env)
    assert e.value.exit_code == 126 and str(e.value) == "worker 0: cannot run 'prog': permission denied " \
                                                        "(is it executable?)"


def test_a_signal_is_the_shells_code(tmp_path) -> None:
    assert _run(["sh", "-c", "kill -TERM $$"], dict(os.environ))[0] == 128 + signal.SIGTERM


def test_a_bare_name_not_on_path_but_executable_here_runs_as_dot_slash(tmp_path) -> None:
    from launcher.node.procgroup import resolve_program

    (tmp_path / "bin").mkdir()
    for path in (tmp_path / "bin" / "onpath", tmp_path / "here", tmp_path / "notexec"):
        path.write_text("#!/bin/sh\n")
        path.chmod(0o644 if path.name == "notexec" else 0o755)
    env = {"PATH": str(tmp_path / "bin")}
    assert resolve_program("onpath", env, str(tmp_path)) == "onpath"
    assert resolve_program("here", env, str(tmp_path)) == "./here"  # (dmlc's rule)
    assert resolve_program("notexec", env, str(tmp_path)) == "notexec"
    assert resolve_program("sub/here", env, str(tmp_path)) == "sub/here"
    assert resolve_program("nosuch", env, str(tmp_path)) == "nosuch"
