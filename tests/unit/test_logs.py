"""The launcher's messages: ``pslaunch: ...`` lines on stderr (and the ``--log-file`` lines), through
``logging``, and around the live status line on a terminal."""

from __future__ import annotations

import io
import logging

import pytest

from launcher import logs
from launcher.runtime.output import Console

LINES = [(logging.DEBUG, "pslaunch: [launcher.run.supervisor] looked at 3 things"),
         (logging.INFO, "pslaunch: starting 2 workers"),
         (logging.WARNING, "pslaunch: warning: the launcher sets DMLC_ROLE itself"),
         (logging.ERROR, "pslaunch: error: failed: 100%")]


def _say(log: logging.Logger) -> None:
    log.debug("looked at %d things", 3)
    log.info("starting %s", "2 workers")
    log.warning("the launcher sets %s itself", "DMLC_ROLE")
    log.error("failed: 100%")


@pytest.mark.parametrize("level", ["DEBUG", "info", "WARNING", "ERROR"])
def test_the_lines_on_stderr_and_in_the_log_file(level, tmp_path, capsys) -> None:
    log = logging.getLogger("launcher.run.supervisor")
    expected = [text for lv, text in LINES if lv >= logs.LEVELS[level.upper()]]
    logs.configure(level)
    assert log.isEnabledFor(logging.DEBUG) == (level == "DEBUG")
    _say(log)
    assert capsys.readouterr().err.splitlines() == expected
    logs.configure(level, open(tmp_path / "launcher.log", "a"))  # the same on stderr, and the file
    _say(log)
    assert capsys.readouterr().err.splitlines() == expected
    written = (tmp_path / "launcher.log").read_text().splitlines()
    assert len(written) == len(expected) and written[-1].endswith(" ERROR launcher.run.supervisor: failed: 100%")
    assert written[-1][:4].isdigit()  # (a timestamp first)


def test_an_unconfigured_launcher_logs_through_logging(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="launcher"):
        logging.getLogger("launcher.x").warning("through %s", "logging")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("launcher.x", logging.WARNING, "through logging")]


def test_a_message_is_written_around_the_status_line(capsys) -> None:
    stdout = io.BytesIO()
    console = Console(stdout=stdout, stderr=io.BytesIO(), color=False)
    logs.configure("INFO")
    console.set_status("2 running")
    try:
        logging.getLogger("launcher.x").warning("a message")
        assert stdout.getvalue() == b"\r\x1b[K2 running" + b"\r\x1b[K" + b"2 running"  # erased, drawn again
        assert capsys.readouterr().err == "pslaunch: warning: a message\n"
    finally:
        console.clear_status()


def test_text_from_outside_in_a_message_cannot_act_on_the_terminal(tmp_path, capsys) -> None:
    """A host name, a remote's error or an ssh banner quoted in a message: its escapes are shown
    as cat -v shows them, and its line breaks cannot start a line of their own."""
    log = logging.getLogger("launcher.backends.ssh")
    logs.configure("INFO", open(tmp_path / "launcher.log", "a", encoding="utf-8"))
    banner = "Welcome\x1b]0;owned\x07\x1b[2J\n\x1b[1A\x1b[2Kpslaunch: all processes exited 0\u009b"
    log.warning("host %s said: %s", "node\x1b[31m1", banner)
    log.info("two lines of our own:\n  %s", "x\x1b[K")
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "pslaunch: warning: host node^[[31m1 said: Welcome^[]0;owned^G^[[2J^J^[[1A^[[2Kpslaunch: all processes "
        "exited 0M-^[",
        "pslaunch: two lines of our own:",
        "  x^[[K"]
    written = (tmp_path / "launcher.log").read_text()
    assert "\x1b" not in written and "\x07" not in written and "\u009b" not in written
    assert "said: Welcome^[]0;owned^G^[[2J^J^[[1A" in written


def test_printable_passes_text_as_it_is() -> None:
    text = "épreuve ✓ 日本語\tcolumn"
    assert logs.printable(text) is text
    assert logs.printable("a\u0085b\u00a0c") == "aM-^Eb\u00a0c"  # C1 NEL shown; a no-break space is text


def test_printable_colors_keeps_or_drops_only_the_listed_colours() -> None:
    colours = ["\x1b[m", "\x1b[0m", "\x1b[;1m", "\x1b[1;2;3;4m", "\x1b[22;23;24m", "\x1b[30;37;39m", "\x1b[40;47;49m",
               "\x1b[90;97m", "\x1b[100;107m", "\x1b[38;5;0m", "\x1b[48;5;255m", "\x1b[38;2;0;128;255m",
               "\x1b[48;2;255;255;255;1m"]
    for sgr in colours:
        assert logs.printable_colors(f"a{sgr}b", keep=True) == (f"a{sgr}b", True), sgr
        assert logs.printable_colors(f"a{sgr}b", keep=False) == ("ab", False), sgr
    others = ["\x1b[5m", "\x1b[7m", "\x1b[8m", "\x1b[6m", "\x1b[9m", "\x1b[21m", "\x1b[38m", "\x1b[38;5m",
              "\x1b[38;5;256m", "\x1b[38;2;1;2m", "\x1b[38;2;1;2;300m", "\x1b[38;3;1m", "\x1b[38:5:1m",
              "\x1b[0001m", "\x1b[1;5m", "\x1b[?25l", "\x1b[2J", "\x1b[1A", "\x1b[31", "\x1b]0;t\x07",
              "\x1b[" + "1;" * 40 + "1m"]  # (64 characters of params at most)
    for sgr in others:
        assert logs.printable_colors(f"a{sgr}b", keep=True) == (logs.printable(f"a{sgr}b"), False), sgr
        assert logs.printable_colors(f"a{sgr}b", keep=False) == (logs.printable(f"a{sgr}b"), False), sgr
    assert logs.printable_colors("\u009b32mx", keep=True) == ("M-^[32mx", False)  # the 8-bit CSI
    # a colour inside an escape that is shown is still a colour, and the escape stays shown
    assert logs.printable_colors("\x1b]0;\x1b[31mt\x07", keep=True) == ("^[]0;\x1b[31mt^G", True)
    assert logs.printable_colors("\x1b[1;\x1b[32mx", keep=False) == ("^[[1;x", False)
    text = "épreuve ✓\tcolumn"
    assert logs.printable_colors(text, keep=True) == (text, False)
