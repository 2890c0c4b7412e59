"""launcher.external.call: the one way the launcher runs an external command and waits for it."""

from __future__ import annotations

import logging
import time

import pytest

from launcher import external
from launcher.errors import LaunchError


def test_a_command_that_succeeds_gives_its_output() -> None:
    r = external.call(["sh", "-c", "printf 'out\\n'; printf 'err\\n' >&2"], timeout=10)
    assert r == external.Result(("sh", "-c", "printf 'out\\n'; printf 'err\\n' >&2"), 0, "out\n", "err\n")


def test_a_non_zero_exit_raises_with_code_and_both_outputs() -> None:
    argv = ["sh", "-c", "echo partial; echo 'no such job' >&2; echo 'try again' >&2; exit 3"]
    with pytest.raises(external.CommandError) as e:
        external.call(argv, timeout=10)
    err = e.value
    assert (err.argv, err.returncode, err.stdout, err.stderr, err.timed_out) == (
        tuple(argv), 3, "partial\n", "no such job\ntry again\n", False)
    assert str(err) == ("sh -c 'echo partial; echo '\"'\"'no such job'\"'\"' >&2; echo '\"'\"'try again'\"'\"' >&2; "
                        "exit 3' failed (exit code 3): no such job try again")
    assert isinstance(err, LaunchError)  # one line, exit 1, if a caller lets it through


def test_check_false_returns_a_non_zero_exit() -> None:
    r = external.call(["sh", "-c", "echo half; exit 3"], timeout=10, check=False)
    assert (r.returncode, r.stdout, r.stderr) == (3, "half\n", "")


def test_a_failure_without_output_names_the_code_alone() -> None:
    with pytest.raises(external.CommandError, match=r"^false failed \(exit code 1\)$"):
        external.call(["false"], timeout=10)


def test_a_command_past_its_timeout_is_killed_and_says_so() -> None:
    t0 = time.monotonic()
    with pytest.raises(external.CommandError) as e:
        external.call(["sh", "-c", "echo started; exec sleep 30"], timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert str(e.value) == "sh -c 'echo started; exec sleep 30' did not answer within 0.5s"
    assert e.value.timed_out and e.value.returncode is None and e.value.stdout == "started\n"


def test_a_missing_program_is_one_line(tmp_path) -> None:
    with pytest.raises(external.CommandError) as e:
        external.call(["pslaunch-no-such-program", "x"], timeout=10)
    assert str(e.value) == "pslaunch-no-such-program: not found on PATH" and e.value.returncode is None
    with pytest.raises(external.CommandError, match=r"^/.*/nope: no such file$"):
        external.call([str(tmp_path / "nope")], timeout=10)
    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(external.CommandError, match=r"^cannot run /.*/plain: Permission denied$"):
        external.call([str(plain)], timeout=10)


def test_no_shell_reads_the_arguments() -> None:
    r = external.call(["printf", "%s|", "$HOME", "a b", "`id`", ";"], timeout=10)
    assert r.stdout == "$HOME|a b|`id`|;|"


def test_stdin_is_empty() -> None:
    assert external.call(["cat"], timeout=10).stdout == ""


def test_output_that_is_not_utf8_is_kept() -> None:
    r = external.call(["printf", "caf\\351"], timeout=10)
    assert r.stdout.encode("utf-8", "surrogateescape") == b"caf\xe9"


def test_the_command_line_is_logged_at_debug(caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="launcher"):
        external.call(["true", "a b"], timeout=10)
    assert ("launcher.external", logging.DEBUG, "running true 'a b'") in [
        (r.name, r.levelno, r.getMessage()) for r in caplog.records]
