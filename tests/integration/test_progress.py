"""The live status line, in a real pseudo-terminal: it shows, it never mixes with the labelled
output, and it is off when stdout is not a terminal and with --no-progress."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from support.helpers import REPO, pslaunch_argv

from launcher.run.progress import Latest, parse_line, status_text

pytestmark = pytest.mark.integration

COLUMNS = 160

# A stand-in for an MXNet program: the scheduler listens (the launcher waits for that), the server
# waits, each worker prints MXNet's Speedometer lines on stderr (as MXNet's logging does) and a line
# on stdout, slowly enough for the status line to be drawn between them.
PROGRAM = r"""
import os, socket, sys, time
role = os.environ["DMLC_ROLE"]
if role == "scheduler":
    s = socket.socket()
    s.bind((os.environ["DMLC_PS_ROOT_URI"], int(os.environ["DMLC_PS_ROOT_PORT"])))
    s.listen(8)
    time.sleep(float(sys.argv[1]) + 1)
    sys.exit(0)
if role == "server":
    time.sleep(float(sys.argv[1]) + 0.5)
    sys.exit(0)
rank = os.environ["DMLC_TASK_ID"]
n = int(float(sys.argv[1]) / 0.25)
for i in range(1, n + 1):
    print("Node[%s] Epoch[0] Batch [%d-%d]\tSpeed: %.2f samples/sec\taccuracy=0.%d" % (rank, (i - 1) * 20, i * 20,
          1000 + i, 50 + i), file=sys.stderr, flush=True)
    print("step %d of worker %s" % (i, rank), flush=True)
    time.sleep(0.25)
print("Node[%s] Epoch[0] Validation-accuracy=0.975" % rank, file=sys.stderr, flush=True)
"""


def run_in_pty(args: list[str], env: dict, stdout_pipe: bool = False) -> tuple[int, str, str]:
    """Run pslaunch with its stdout (and stderr) on a pseudo-terminal of COLUMNS columns; returns
    (exit code, what the terminal received, what a stdout pipe received)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLUMNS, 0, 0))
    p = subprocess.Popen(pslaunch_argv(*args), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE if stdout_pipe else slave, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: every writer of the terminal has gone
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    piped = p.stdout.read().decode() if stdout_pipe else ""
    code = p.wait(timeout=30)
    return code, b"".join(chunks).decode("utf-8", "replace"), piped


def screen(data: str) -> tuple[list[str], str]:
    """What a terminal shows: the finished lines and the line the cursor is on (colours dropped;
    carriage return, erase-to-end-of-line and newline interpreted)."""
    data = re.sub(r"\x1b\[[0-9;]*m", "", data)
    lines: list[str] = []
    cur: list[str] = []
    col = i = 0
    while i < len(data):
        if data.startswith("\x1b[K", i):
            del cur[col:]
            i += 3
            continue
        c = data[i]
        if c == "\r":
            col = 0
        elif c == "\n":
            lines.append("".join(cur))
            cur, col = [], 0
        else:
            if col < len(cur):
                cur[col] = c
            else:
                cur.append(c)
            col += 1
        i += 1
    return lines, "".join(cur)


def statuses(data: str) -> list[str]:
    """Every status line drawn: the text after each erase, up to the next control character."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", data)
    return [m.group(1) for m in re.finditer(r"\r\x1b\[K(pslaunch \d+:\d\d[^\r\n\x1b]*)", plain)]


def job_args(tmp_path: Path, seconds: float = 3.0) -> list[str]:
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    return ["-n", "2", "-s", "1", "--kill-grace", "2", sys.executable, str(prog), str(seconds)]


def env() -> dict:
    e = dict(os.environ)
    e["TERM"] = "xterm"
    for name in ("NO_COLOR", "COLUMNS", "LINES"):  # the width is the pseudo-terminal's (pytest-xdist sets COLUMNS)
        e.pop(name, None)
    return e


@pytest.mark.timeout(120)
def test_status_line_on_a_terminal_never_mixes_with_the_output(tmp_path: Path) -> None:
    code, data, _ = run_in_pty(job_args(tmp_path), env())
    assert code == 0, data[-3000:]
    lines, last = screen(data)
    # every finished line on the screen is a whole labelled line or a launcher message
    label = re.compile(r"^(\[(scheduler|server 0|worker [01])\] |pslaunch: )")
    bad = [x for x in lines if not label.match(x) or "samples/s |" in x or re.search(r"pslaunch \d+:\d\d", x)]
    assert not bad, bad[:5]
    assert last == "", repr(last)  # the status line is gone at the end
    for rank in (0, 1):
        assert f"[worker {rank}] step 1 of worker {rank}" in lines
        assert sum(1 for x in lines if x.startswith(f"[worker {rank}] step ")) == 12
    assert any(x.startswith("pslaunch: all 4 processes exited 0") for x in lines)
    # the status line was drawn, with the counts and worker 0's progress
    shown = statuses(data)
    assert shown, data[-2000:]
    assert all(len(s) < COLUMNS for s in shown)
    assert any("scheduler 1/1, server 1/1, worker 2/2" in s for s in shown), shown
    assert any(re.search(r"worker 0: epoch 0 batch \d+, 1,0\d\d samples/s, accuracy 0\.\d+", s) for s in shown), shown
    print("\n".join(sorted(set(shown), key=shown.index)[-3:]))


@pytest.mark.timeout(120)
def test_no_status_line_without_a_terminal_or_with_no_progress(tmp_path: Path) -> None:
    code, data, piped = run_in_pty(job_args(tmp_path, 1.5), env(), stdout_pipe=True)
    assert code == 0, data
    assert "\x1b[K" not in data + piped and not statuses(data + piped)
    assert "[worker 0] step 1 of worker 0" in piped
    code, data, _ = run_in_pty(["--no-progress", *job_args(tmp_path, 1.5)], env())
    assert code == 0, data
    assert "\x1b[K" not in data and not statuses(data)
    assert "[worker 0] step 1 of worker 0" in re.sub(r"\x1b\[[0-9;]*m", "", data)


def test_the_line_itself() -> None:
    latest = parse_line("2024-01-01 Node[0] Epoch[3] Batch [200-300]\tSpeed: 1234.56 samples/sec\taccuracy=0.912")
    assert latest == Latest(epoch=3, batch=300, speed=1234.56, metric=("accuracy", 0.912))
    assert parse_line("Epoch[3] Batch [300]\tSpeed: 10.00 samples/sec") == Latest(3, 300, 10.0)  # MXNet < 1.2
    latest = parse_line("Node[0] Epoch[3] Validation-accuracy=0.981", latest)
    assert latest.validation == ("accuracy", 0.981) and latest.batch == 300
    assert parse_line("[worker 0] something else") is None
    text = status_text({"scheduler": (1, 1), "server": (2, 2), "worker": (3, 4)}, {"h1": 3, "h2": 2}, 62.4,
                       latest, 200)
    assert text == ("pslaunch 1:02 | scheduler 1/1, server 2/2, worker 3/4 | h1: 3, h2: 2 | worker 0: epoch 3 "
                    "batch 300, 1,235 samples/s, accuracy 0.912, validation accuracy 0.981")
    assert status_text({"worker": (1, 1)}, {"localhost": 1}, 3725, None, 200) == "pslaunch 1:02:05 | worker 1/1"
    assert len(status_text({"worker": (1, 1)}, {}, 1, latest, 30)) == 29
    restarted = status_text({"worker": (1, 1)}, {}, 65, None, 200, "restart 1/3")
    assert restarted == "pslaunch 1:05 (restart 1/3) | worker 1/1"
