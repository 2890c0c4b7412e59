"""The launcher's messages read the same written straight to stderr and through ``logging``."""

from __future__ import annotations

import logging

import pytest

from launcher import logs

MESSAGES = [(logs.DEBUG, "looked at %d things", (3,)), (logs.INFO, "starting %s", ("2 workers",)),
            (logs.WARNING, "the launcher sets %s itself", ("DMLC_ROLE",)), (logs.ERROR, "failed: 100%", ())]


def _say(log: logs.Logger) -> None:
    log.debug("looked at %d things", 3)
    log.info("starting %s", "2 workers")
    log.warning("the launcher sets %s itself", "DMLC_ROLE")
    log.error("failed: 100%")


@pytest.mark.parametrize("level", ["DEBUG", "INFO", "WARNING", "ERROR"])
def test_direct_lines_are_the_logging_lines(level, tmp_path, capsys) -> None:
    log = logs.getLogger("launcher.run.supervisor")
    logs.configure(level)  # straight to stderr
    assert log.isEnabledFor(logs.DEBUG) == (level == "DEBUG")
    _say(log)
    direct = capsys.readouterr().err
    logs.configure(level, str(tmp_path / "launcher.log"))  # through logging (and the file)
    _say(log)
    through_logging = capsys.readouterr().err
    logging.getLogger("launcher").handlers.clear()
    expected = [logs.line(lv, "launcher.run.supervisor", msg % args if args else msg)
                for lv, msg, args in MESSAGES if lv >= logs.LEVELS[level]]
    assert direct.splitlines() == through_logging.splitlines() == expected
    assert expected[-1] == "pslaunch: error: failed: 100%"
    if level == "DEBUG":
        assert expected[0] == "pslaunch: [launcher.run.supervisor] looked at 3 things"
    written = (tmp_path / "launcher.log").read_text().splitlines()
    assert len(written) == len(expected) and written[-1].endswith("ERROR launcher.run.supervisor: failed: 100%")


def test_an_unconfigured_launcher_logs_through_logging(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="launcher"):
        logs.getLogger("launcher.x").warning("through %s", "logging")
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("launcher.x", logging.WARNING, "through logging")]


def test_node_sig_is_signals_names_without_enum() -> None:
    import signal

    from launcher.node import sig

    for name in ("SIGTERM", "SIGKILL", "SIGINT", "SIGHUP", "SIGALRM", "SIGPIPE", "SIG_IGN", "SIG_DFL", "SIG_SETMASK",
                 "ITIMER_REAL"):
        assert getattr(sig, name) == getattr(signal, name), name
    for fn in ("signal", "pthread_sigmask", "setitimer", "getsignal"):
        assert callable(getattr(sig, fn)), fn
    assert sig.name(9) == "SIGKILL" and sig.name(sig.SIGTERM) == "SIGTERM"
    with pytest.raises(ValueError):
        sig.name(1000)
