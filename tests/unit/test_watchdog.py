"""The dead-man switch kills registered process groups when the launcher disappears."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from support.helpers import REPO, assert_no_orphans, pid_alive, wait_for

from launcher.node.watchdog import Client as Watchdog


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def test_eof_without_done_kills_groups_and_runs_commands(tmp_path) -> None:
    marker = tmp_path / "cleanup-ran"
    wd = Watchdog(grace=1)
    a, b = sleeper(), sleeper()
    wd.watch(a.pid)
    wd.watch(b.pid)
    wd.on_abandon(["touch", str(marker)])
    wd._proc.stdin.close()  # what a SIGKILLed launcher leaves behind
    wd._proc.wait(timeout=10)
    # checked before anything reaps them (a reaped pid is gone whoever stopped it): dead means a
    # zombie here, and only the watchdog can have killed them
    assert_no_orphans([a.pid, b.pid], timeout=5)
    assert a.wait(timeout=5) == -15 and b.wait(timeout=5) == -15  # SIGTERM did it, within the grace
    assert marker.exists()


def test_what_a_killed_process_leaves_is_removed_after_it_is_killed(tmp_path) -> None:
    """``remove GLOB`` runs once the group is dead: a process that ignores SIGTERM and keeps
    writing into its session directory (as mpirun does) cannot recreate it afterwards."""
    session = tmp_path / "ompi.host.0" / "pid.123"
    other = tmp_path / "ompi.other.0" / "pid.9"
    other.mkdir(parents=True)
    writer = subprocess.Popen(
        [sys.executable, "-c", "import os, signal, sys, time\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "while True:\n"
         "    os.makedirs(sys.argv[1], exist_ok=True); open(sys.argv[1] + '/f', 'w').close(); time.sleep(0.01)",
         str(session)], start_new_session=True)
    wd = Watchdog(grace=1)
    wd.watch(writer.pid)
    wd.remove_after_kill(str(tmp_path / "ompi.*.0" / "pid.123"))
    while not (session / "f").exists():
        time.sleep(0.01)
    wd._proc.stdin.close()
    wd._proc.wait(timeout=10)
    assert writer.wait(timeout=5) == -9  # it outlived SIGTERM's grace
    assert not session.exists() and not session.parent.exists()  # its parent too, once empty
    assert other.exists()  # what the pattern does not match stays


def test_done_leaves_everything_alone(tmp_path) -> None:
    marker = tmp_path / "cleanup-ran"
    kept = tmp_path / "session"
    kept.mkdir()
    wd = Watchdog(grace=1)
    a = sleeper()
    wd.watch(a.pid)
    wd.on_abandon(["touch", str(marker)])
    wd.remove_after_kill(str(kept))
    wd.close()
    assert wd._proc.wait(timeout=10) == 0  # it read "done" and exited on its own
    assert pid_alive(a.pid) and not marker.exists() and kept.exists()
    a.kill()
    a.wait()


def test_forgotten_group_is_not_killed() -> None:
    wd = Watchdog(grace=1)
    a = sleeper()
    wd.watch(a.pid)
    wd.forget(a.pid)
    wd._proc.stdin.close()
    wd._proc.wait(timeout=10)
    assert pid_alive(a.pid)
    a.kill()
    a.wait()


def test_the_watchdog_process_imports_only_what_reading_commands_needs() -> None:
    # it starts with every job, and a job that ends at once waits for it to read "done"
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); import launcher.node.watchdog; "
            "print(sorted(m for m in ('json', 'subprocess', 'threading') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


FORKED_OWNER = """
import os, subprocess, sys, time
sys.path.insert(0, {repo!r})
from launcher.node.watchdog import Client
keep = os.open(os.devnull, os.O_RDONLY)  # a descriptor of the owner's: the fork must not hold it
wd = Client(1, fork=True)
sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
wd.watch(sleeper.pid)
print(wd.pid, sleeper.pid, flush=True)
if sys.argv[1] == "die":
    sys.stdin.readline()  # (the test looks at the watchdog first)
    os.kill(os.getpid(), 9)
wd.close()
print("closed", flush=True)
"""


def _forked_owner(how: str) -> tuple[subprocess.Popen, int, int]:
    owner = subprocess.Popen([sys.executable, "-c", FORKED_OWNER.format(repo=str(REPO)), how],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    wd_pid, sleeper_pid = map(int, owner.stdout.readline().split())
    return owner, wd_pid, sleeper_pid


def test_a_forked_watchdog_keeps_only_its_pipe_and_kills_groups_when_its_owner_is_killed() -> None:
    owner, wd_pid, sleeper_pid = _forked_owner("die")
    try:
        # its own session; standard input the pipe, stdout and stderr /dev/null, nothing else open
        # (a copy of the owner's output pipe would keep it open after the owner has gone). The fork
        # sets itself up while its owner goes on: on a busy machine, after the owner printed.
        def open_fds() -> dict[int, str]:
            fds = {}
            for fd in os.listdir(f"/proc/{wd_pid}/fd"):
                try:
                    fds[int(fd)] = os.readlink(f"/proc/{wd_pid}/fd/{fd}")
                except FileNotFoundError:  # closed meanwhile: the fork is closing what it inherited
                    pass
            return fds

        try:
            wait_for(lambda: os.getsid(wd_pid) == wd_pid and sorted(open_fds()) == [0, 1, 2], 10,
                     what="the watchdog's own session and descriptors")
        except AssertionError as e:
            raise AssertionError(f"{e}: session {os.getsid(wd_pid)}, descriptors {open_fds()}") from None
        fds = open_fds()
        assert fds[0].startswith("pipe:"), fds
        assert fds[1] == fds[2] == os.devnull
        with open(f"/proc/{wd_pid}/cmdline", "rb") as f:  # a fork: no second interpreter started
            assert f.read() == open(f"/proc/{owner.pid}/cmdline", "rb").read()
        owner.stdin.write("go\n")
        owner.stdin.flush()
        assert owner.wait(timeout=10) == -9
        assert owner.stdout.read() == ""  # EOF at once: the fork held no copy of this pipe
        assert_no_orphans([sleeper_pid], timeout=5)  # only the watchdog can have stopped it
    finally:
        for pid in (sleeper_pid, wd_pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


def test_a_forked_watchdog_told_done_exits_and_is_reaped_leaving_groups_alone() -> None:
    owner, wd_pid, sleeper_pid = _forked_owner("close")
    try:
        assert owner.stdout.readline().strip() == "closed"
        assert not pid_alive(wd_pid)  # exited on "done", and reaped by close() (no zombie)
        assert not os.path.exists(f"/proc/{wd_pid}")
        assert pid_alive(sleeper_pid)
        assert owner.wait(timeout=10) == 0
    finally:
        os.kill(sleeper_pid, 9)
