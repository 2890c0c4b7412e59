from __future__ import annotations

import io
import os
import time

import pytest

from launcher.runtime.output import Console, PipePump


class Sink(io.BytesIO):
    def fileno(self) -> int:  # not a tty
        raise OSError


def make(log_dir=None):
    out, err = Sink(), Sink()
    console = Console(stdout=out, stderr=err, log_dir=log_dir, color=False)
    return console, out, err


def test_lines_are_prefixed_whole_and_split_multibyte_survives() -> None:
    console, out, err = make()
    p = console.proc("worker-0", "worker 0", "worker")
    data = "naïve ✓ line\nsecond".encode()
    cut = data.index("✓".encode()) + 1  # split inside the 3-byte character
    p.stdout.feed(data[:cut])
    assert out.getvalue() == b""
    p.stdout.feed(data[cut:])
    assert out.getvalue() == "[worker 0] naïve ✓ line\n".encode()
    p.stdout.close()
    assert out.getvalue().decode().splitlines()[-1] == "[worker 0] second"
    assert p.lines() == ["naïve ✓ line", "second"]


def test_carriage_returns_and_crlf() -> None:
    console, out, err = make()
    p = console.proc("server-1", "server 1", "server")
    p.stderr.feed(b"10%\r20%\r\ndone\r\n")
    assert err.getvalue().decode().splitlines() == ["[server 1] 10%", "[server 1] 20%", "[server 1] done"]


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    console, out, err = make()
    p = console.proc("w", "worker 0", "worker")
    p.stdout.feed(b"bad \xff\xfe bytes\n")
    assert out.getvalue().decode() == "[worker 0] bad \ufffd\ufffd bytes\n"


def test_long_line_without_newline_is_chunked() -> None:
    console, out, err = make()
    p = console.proc("w", "worker 0", "worker")
    p.stdout.feed(b"x" * 200_000)
    lines = out.getvalue().decode().splitlines()
    assert len(lines) == 3 and all(len(x) == len("[worker 0] ") + 65536 for x in lines)


def test_tail_keeps_last_20_lines() -> None:
    console, out, err = make()
    p = console.proc("w", "worker 0", "worker")
    p.stdout.feed("".join(f"line {i}\n" for i in range(50)).encode())
    assert p.lines() == [f"line {i}" for i in range(30, 50)]


def test_log_dir_gets_raw_lines(tmp_path) -> None:
    console, out, err = make(log_dir=str(tmp_path / "logs"))
    p = console.proc("worker-3", "worker 3", "worker")
    p.stdout.feed(b"a\n")
    p.stderr.feed(b"b\n")
    p.close()
    assert (tmp_path / "logs" / "worker-3.log").read_text() == "a\nb\n"


def test_pipe_pump_delivers_and_closes() -> None:
    console, out, err = make()
    p = console.proc("w", "worker 0", "worker")
    pump = PipePump()
    r, w = os.pipe()
    pump.add(r, p.stdout.feed, p.stdout.close)
    os.write(w, b"one\ntw")
    time.sleep(0.05)
    os.write(w, b"o\n")
    os.close(w)
    assert p.stdout.done.wait(5)
    pump.stop()
    assert out.getvalue().decode().splitlines() == ["[worker 0] one", "[worker 0] two"]


def test_pipe_pump_says_when_a_process_ends_not_when_its_output_does() -> None:
    # a process that closes its output and goes on running: no word until it really ends; then
    # at once (a pidfd), and its exit status is still there for the supervisor's poll
    import subprocess
    import sys
    import threading

    child = subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.close(1); os.close(2); "
                              "sys.stdin.read(); sys.exit(7)"], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ended = threading.Event()
    pump = PipePump()
    try:
        pump.watch_exit(child.pid, ended.set)
        assert not ended.wait(0.3)
        assert child.stdin is not None
        child.stdin.close()
        t0 = time.monotonic()
        assert ended.wait(10)
        took = time.monotonic() - t0
        assert child.poll() == 7
        assert took < 5, took  # liveness: the moment it ends, not at some later look
    finally:
        child.kill()
        child.wait()
        pump.stop()


def test_redaction_covers_console_log_file_and_tail(tmp_path) -> None:
    from launcher.spec.env import Redactor

    console, out, err = make(log_dir=str(tmp_path))
    console.redact = Redactor(["hunter2-long-secret", "pw"])
    p = console.proc("worker-0", "worker 0", "worker")
    p.stdout.feed(b"token hunter2-long-secret and pw, pwd stays\n")
    p.stderr.feed(b"pw\n")
    p.close()
    shown = "token <redacted> and <redacted>, pwd stays"
    assert out.getvalue().decode() == f"[worker 0] {shown}\n"
    assert err.getvalue().decode() == "[worker 0] <redacted>\n"
    logged = (tmp_path / "worker-0.log").read_text()
    assert "hunter2" not in logged and shown in logged
    assert p.lines() == [shown, "<redacted>"]


def test_a_cause_line_is_kept() -> None:
    console, out, err = make()
    p = console.proc("scheduler", "scheduler", "scheduler")
    p.stderr.feed(b"starting\npslaunch-cause: worker 1: no heartbeat for 10.0s\npslaunch-cause: - later\n")
    assert p.cause == ("worker", 1, "no heartbeat for 10.0s")


def test_the_status_line_width(monkeypatch) -> None:
    import pty

    from launcher.run import progress

    monkeypatch.setenv("COLUMNS", "57")
    assert progress._terminal_columns() == 57
    monkeypatch.delenv("COLUMNS")
    master, slave = pty.openpty()
    try:
        import fcntl
        import struct
        import sys
        import termios

        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 133, 0, 0))
        monkeypatch.setattr(sys, "__stdout__", os.fdopen(os.dup(slave), "w"))
        assert progress._terminal_columns() == 133
        sys.__stdout__.close()
        monkeypatch.setattr(sys, "__stdout__", open(os.devnull, "w"))
        assert progress._terminal_columns() == 100  # no terminal
        sys.__stdout__.close()
    finally:
        os.close(master)
        os.close(slave)


# -- an attempt's output (while the scheduler may still lose its port) -------------------------


def test_an_attempts_lines_are_shown_logged_and_observed_as_they_come(tmp_path) -> None:
    # never held for the port's verdict: a program that never listens is seen at once
    console, out, err = make(str(tmp_path))
    seen: list[str] = []
    console.observe("worker-0", seen.append)
    console.begin_attempt()
    w, s = console.proc("worker-0", "worker 0", "worker"), console.proc("server-0", "server 0", "server")
    w.stdout.feed(b"w1\n")
    assert out.getvalue() == b"[worker 0] w1\n" and seen == ["w1"]
    assert (tmp_path / "worker-0.log").read_bytes() == b"w1\n"
    s.stderr.feed(b"s1\n")
    assert err.getvalue() == b"[server 0] s1\n"


def test_a_discarded_attempt_says_how_much_it_showed_then_shows_and_logs_nothing_more(tmp_path) -> None:
    console, out, err = make(str(tmp_path))
    console.begin_attempt()
    lost, other = console.proc("worker-0", "worker 0", "worker"), console.proc("server-0", "server 0", "server")
    lost.stdout.feed(b"first attempt\n")
    other.stderr.feed(b"first attempt too\n")
    assert console.discard() == 2
    lost.stdout.feed(b"dying words\n")  # what it prints while it is stopped
    lost.stderr.close()
    console.log_banner = "--- the next attempt ---"
    console.begin_attempt()  # the next attempt
    again = console.proc("worker-0", "worker 0", "worker")
    again.stdout.feed(b"second attempt\n")
    lost.stdout.feed(b"late\n")
    assert out.getvalue() == b"[worker 0] first attempt\n[worker 0] second attempt\n"
    assert err.getvalue() == b"[server 0] first attempt too\n"
    assert (tmp_path / "worker-0.log").read_bytes() == b"first attempt\n--- the next attempt ---\nsecond attempt\n"


def test_a_discard_without_an_attempt_or_lines_counts_none() -> None:
    console, out, _ = make()
    assert console.discard() == 0  # (no attempt began)
    console.begin_attempt()
    console.proc("worker-0", "worker 0", "worker")
    assert console.discard() == 0 and out.getvalue() == b""


# --- terminal escapes from the processes -----------------------------------------------------------

#: a window title (OSC 0), a clipboard write (OSC 52), a cleared screen (CSI 2J), and the cursor
#: moved up a line and the line erased to fake pslaunch's last line; then the 8-bit CSI (U+009B),
#: a bell and a DEL
ATTACK = ("\x1b]0;owned\x07" "\x1b]52;c;ZWNobyBvd25lZA==\x07" "\x1b[2J" "\x1b[1A\x1b[2K"
          "pslaunch: all processes exited 0" "\u009b31m" "\x07" "\x7f")
SHOWN = ("^[]0;owned^G" "^[]52;c;ZWNobyBvd25lZA==^G" "^[[2J" "^[[1A^[[2K"
         "pslaunch: all processes exited 0" "M-^[31m" "^G" "^?")


def _controls(data: bytes) -> list[str]:
    """The control characters in ``data`` (UTF-8) but the tab and the newline."""
    return [c for c in data.decode() if (ord(c) < 0x20 and c not in "\t\n") or 0x7F <= ord(c) <= 0x9F]


def test_escapes_from_a_process_are_shown_not_obeyed(tmp_path) -> None:
    console, out, err = make(log_dir=str(tmp_path))
    p = console.proc("worker-0", "worker 0", "worker")
    p.stdout.feed((ATTACK + "\n" + "naïve ✓\tcolumn\n").encode())
    p.stderr.feed(("\x1b[31m" + "error\n").encode())
    p.close()
    assert _controls(out.getvalue() + err.getvalue()) == []  # 8 of 8 escape bytes passed before
    assert out.getvalue().decode().splitlines() == ["[worker 0] " + SHOWN, "[worker 0] naïve ✓\tcolumn"]
    assert err.getvalue().decode() == "[worker 0] error\n"  # (not a coloured console: its colours are dropped)
    assert p.lines() == [SHOWN, "naïve ✓\tcolumn", "^[[31merror"]  # (the failure report's tail)
    assert (tmp_path / "worker-0.log").read_text() == SHOWN + "\nnaïve ✓\tcolumn\n^[[31merror\n"


def test_log_raw_keeps_the_bytes_in_the_log_file_only(tmp_path) -> None:
    out, err = Sink(), Sink()
    console = Console(stdout=out, stderr=err, log_dir=str(tmp_path), color=False, log_raw=True)
    p = console.proc("worker-0", "worker 0", "worker")
    p.stdout.feed((ATTACK + "\nplain\n").encode())
    p.close()
    assert out.getvalue().decode() == f"[worker 0] {SHOWN}\n[worker 0] plain\n"
    assert (tmp_path / "worker-0.log").read_bytes() == (ATTACK + "\nplain\n").encode()


def test_our_own_colours_still_reach_a_terminal() -> None:
    out, err = Sink(), Sink()
    console = Console(stdout=out, stderr=err, color=True)
    p = console.proc("worker-0", "worker 0", "worker")
    p.stdout.feed(b"\x1b[32mgreen\n")
    assert out.getvalue() == b"\x1b[32m[worker 0]\x1b[0m \x1b[32mgreen\x1b[0m\n"


# --- a process's own colours ---------------------------------------------------------------------------

#: colours a logging library, rich or tqdm writes: bold green, a 256-colour orange, an RGB background,
#: faint cyan, bright red, italic, underline, their ends, the defaults, an empty reset
COLOURED = ("\x1b[1;32mINFO\x1b[0m \x1b[38;5;208mepoch\x1b[39m 3 \x1b[48;2;0;0;255mloss\x1b[49m "
            "\x1b[2;36m12:00\x1b[22m \x1b[91;3;4mwarn\x1b[23;24m\x1b[m")
COLOURED_SHOWN = ("^[[1;32mINFO^[[0m ^[[38;5;208mepoch^[[39m 3 ^[[48;2;0;0;255mloss^[[49m "
                  "^[[2;36m12:00^[[22m ^[[91;3;4mwarn^[[23;24m^[[m")
#: what is never let through: conceal, blink, reverse, the 8-bit CSI, malformed or incomplete colours
#: (256 out of range, 38;5 without N, RGB short of B, colon sub-params, too many digits, no final m)
NOT_COLOURS = ("\x1b[8mhidden" "\x1b[5mblink" "\x1b[7mreverse" "\u009b32m" "\x1b[38;5;256m" "\x1b[38;5m"
               "\x1b[38;2;1;2m" "\x1b[38:5:1m" "\x1b[0032m" "\x1b[32;8m" "\x1b[32")
NOT_COLOURS_SHOWN = ("^[[8mhidden" "^[[5mblink" "^[[7mreverse" "M-^[32m" "^[[38;5;256m" "^[[38;5m"
                     "^[[38;2;1;2m" "^[[38:5:1m" "^[[0032m" "^[[32;8m" "^[[32")


def _coloured(color: bool, tmp_path):
    out, err = Sink(), Sink()
    console = Console(stdout=out, stderr=err, log_dir=str(tmp_path), color=color)
    return console, out, err


def test_a_process_s_colours_reach_a_coloured_console_and_end_with_its_line(tmp_path) -> None:
    console, out, err = _coloured(True, tmp_path)
    p = console.proc("worker-0", "worker 0", "worker")
    p.stdout.feed((COLOURED + "\n" + "\x1b[31mno reset here\nplain\n").encode())
    p.stderr.feed(b"\x1b[33mwarning\n")
    p.close()
    label = "\x1b[32m[worker 0]\x1b[0m "
    assert out.getvalue().decode().splitlines() == [
        label + COLOURED + "\x1b[0m",
        label + "\x1b[31mno reset here\x1b[0m",  # (the red ends with its line: the next label is not red)
        label + "plain"]  # (a line without colours gets no reset)
    assert err.getvalue().decode() == label + "\x1b[33mwarning\x1b[0m\n"
    # the failure report's tail and the log file show them, as before
    assert p.lines() == [COLOURED_SHOWN, "^[[31mno reset here", "plain", "^[[33mwarning"]
    assert (tmp_path / "worker-0.log").read_text().splitlines()[0] == COLOURED_SHOWN


def test_a_process_s_colours_are_dropped_on_a_console_without_colours(tmp_path) -> None:
    console, out, err = _coloured(False, tmp_path)
    p = console.proc("worker-0", "worker 0", "worker")
    p.stdout.feed((COLOURED + "\n").encode())
    p.close()
    assert out.getvalue().decode() == "[worker 0] INFO epoch 3 loss 12:00 warn\n"
    assert p.lines() == [COLOURED_SHOWN]
    assert (tmp_path / "worker-0.log").read_text() == COLOURED_SHOWN + "\n"


@pytest.mark.parametrize("color", [True, False], ids=["coloured", "not-coloured"])
def test_only_colours_pass_the_attack_and_other_sequences_are_shown(tmp_path, color: bool) -> None:
    """The issue's attack line, anything that is not a colour, and both mixed with colours: not one
    control character but the colours' own ESC reaches the console, coloured or not."""
    console, out, err = _coloured(color, tmp_path)
    p = console.proc("worker-0", "worker 0", "worker")
    p.stdout.feed((ATTACK + "\n" + NOT_COLOURS + "\n" + "\x1b[32m" + ATTACK + NOT_COLOURS + "\x1b[0m\n").encode())
    p.stderr.feed((ATTACK + "\n").encode())
    p.close()
    label = "\x1b[32m[worker 0]\x1b[0m " if color else "[worker 0] "
    assert out.getvalue().decode().splitlines() == [
        label + SHOWN, label + NOT_COLOURS_SHOWN,
        label + ("\x1b[32m" + SHOWN + NOT_COLOURS_SHOWN + "\x1b[0m\x1b[0m" if color else SHOWN + NOT_COLOURS_SHOWN)]
    assert err.getvalue().decode() == label + SHOWN + "\n"
    shown = (out.getvalue() + err.getvalue()).replace(label.encode(), b"")
    assert _controls(shown.replace(b"\x1b[32m", b"").replace(b"\x1b[0m", b"")) == []
    assert p.lines() == [SHOWN, NOT_COLOURS_SHOWN, "^[[32m" + SHOWN + NOT_COLOURS_SHOWN + "^[[0m", SHOWN]
