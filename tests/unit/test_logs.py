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
