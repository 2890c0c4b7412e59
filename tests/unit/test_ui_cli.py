"""``--ui``, ``--ui-linger`` and ``--report`` on the command line and in YAML: the frozen spec, the
one-line errors (exit 2), the dry run's lines, and the address line kept out of ``--log-file``."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from support.helpers import spec_of

from launcher import cli, logs
from launcher.cli.run import command_for, run_command, with_backend_options


def run_err(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(args)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, ui", [
    (["--ui", "--", "python", "t.py"], ("127.0.0.1", 0)),
    (["--ui", "python", "t.py"], ("127.0.0.1", 0)),  # (the command, not an address)
    (["--ui", "[::1]:8080", "python", "t.py"], ("::1", 8080)),
    (["--ui", "localhost:8080", "python", "t.py"], ("localhost", 8080)),
    (["--ui", "-s", "0", "python", "t.py"], ("127.0.0.1", 0)),
    (["--ui", "0", "python", "t.py"], ("127.0.0.1", 0)),
    (["--ui", "8080", "python", "t.py"], ("127.0.0.1", 8080)),
    (["--ui=0.0.0.0:8080", "python", "t.py"], ("0.0.0.0", 8080)),
    (["python", "t.py"], None),
])
def test_ui_on_the_command_line(args: list[str], ui: tuple[str, int] | None) -> None:
    spec = spec_of(["-n", "2", *args])
    assert spec.ui == ui and spec.command == ("python", "t.py")
    assert command_for(["-n", "2", *args]) is run_command  # (core options: no backend module imported)


def test_ui_linger_and_report_in_yaml(tmp_path: Path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: 1\nui: true\nui-linger: 30s\nreport: out.html\ncommand: [python, t.py]\n")
    spec = spec_of(["--config", str(cfg)])
    assert (spec.ui, spec.ui_linger, spec.report) == (("127.0.0.1", 0), 30.0, "out.html")
    cfg.write_text("num-workers: 1\nui: 127.0.0.1:9000\ncommand: [python, t.py]\n")
    assert spec_of(["--config", str(cfg)]).ui == ("127.0.0.1", 9000)
    cfg.write_text("num-workers: 1\nui: 9001\ncommand: [python, t.py]\n")
    assert spec_of(["--config", str(cfg)]).ui == ("127.0.0.1", 9001)


@pytest.mark.parametrize("args, message", [
    (["--ui=python", "t.py"], "--ui python: not [HOST:]PORT; write --ui alone"),
    (["--ui", "99999", "python", "t.py"], "--ui 99999: '99999' is not a port"),
    (["--ui-linger", "5", "python", "t.py"], "--ui-linger keeps the job page up after the job; it needs --ui"),
    (["--report", "/no/such/dir/r.html", "python", "t.py"], "--report /no/such/dir/r.html: the directory /no/such/dir "
                                                             "does not exist"),
])
def test_ui_mistakes_are_one_line_usage_errors(args: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_err(["-n", "1", "-s", "0", *args], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_yaml_ui_false_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: 1\nui: false\ncommand: [python, t.py]\n")
    code, err = run_err(["--config", str(cfg)], capsys)
    assert code == 2 and "ui is false; remove the key for no ui" in err


def test_the_dry_run_says_the_page_would_be_served(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["-n", "1", "-s", "0", "--ui", "8080", "--report", "r.html", "--dry-run", "python", "t.py"]) == 0
    out = capsys.readouterr().out
    assert "job page: would be served on 127.0.0.1:8080" in out and "job report: would be written to r.html" in out


def test_the_address_line_reaches_the_terminal_and_never_the_log_file(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    log_file = tmp_path / "launcher.log"
    stream = open(log_file, "a", encoding="utf-8")
    logs.configure("ERROR", stream)  # (the line shows whatever --log-level)
    try:
        logs.terminal_only("launcher.ui.page", "job page %s", "http://127.0.0.1:1/#token=SECRET")
        logging.getLogger("launcher.x").error("an error")
    finally:
        logs.configure("INFO")
    assert capsys.readouterr().err.splitlines()[0] == "pslaunch: job page http://127.0.0.1:1/#token=SECRET"
    text = log_file.read_text()
    assert "an error" in text and "SECRET" not in text


def test_the_full_command_knows_the_options_too() -> None:
    names = {p.name for p in with_backend_options().params}
    assert {"ui", "ui_linger", "report"} <= names
