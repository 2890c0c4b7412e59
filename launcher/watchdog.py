"""The dead-man switch: kills the job's process groups if the launcher dies.

The launcher starts this file as a separate process (own session, stdin a pipe
from the launcher) before it starts anything else, and tells it about every
process group it creates. If the pipe reaches EOF without a ``done`` line, the
launcher is gone (``kill -9``, a crash): the watchdog sends SIGTERM to every
group, waits the grace period, sends SIGKILL to what is left, and runs the
registered cleanup commands (``qdel``-style) before it exits.

Protocol, one line each: ``grace SECONDS``, ``pgid N``, ``forget N``,
``cmd JSON-ARGV``, ``done``. Standard library only; run with ``python -S``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    grace = 10.0
    groups: set[int] = set()
    commands: list[list[str]] = []
    stdin = sys.stdin.buffer
    while True:
        line = stdin.readline()
        if not line:
            break  # the launcher is gone
        word, _, arg = line.decode(errors="replace").strip().partition(" ")
        try:
            if word == "done":
                return 0
            if word == "grace":
                grace = float(arg)
            elif word == "pgid":
                groups.add(int(arg))
            elif word == "forget":
                groups.discard(int(arg))
            elif word == "cmd":
                commands.append([str(a) for a in json.loads(arg)])
        except ValueError:
            continue
    for pgid in groups:
        _signal(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(g) for g in groups):
        time.sleep(0.05)
    for pgid in groups:
        _signal(pgid, signal.SIGKILL)
    for argv in commands:
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
