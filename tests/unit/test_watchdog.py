"""The dead-man switch kills registered process groups when the launcher disappears."""

from __future__ import annotations

import subprocess
import sys

from support.helpers import REPO, assert_no_orphans, pid_alive

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


def test_done_leaves_everything_alone(tmp_path) -> None:
    marker = tmp_path / "cleanup-ran"
    wd = Watchdog(grace=1)
    a = sleeper()
    wd.watch(a.pid)
    wd.on_abandon(["touch", str(marker)])
    wd.close()
    assert wd._proc.wait(timeout=10) == 0  # it read "done" and exited on its own
    assert pid_alive(a.pid) and not marker.exists()
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
            "print(sorted(m for m in ('json', 'subprocess', 'threading', 'typing') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
