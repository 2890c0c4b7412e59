"""``--only``: the selector grammar, the job-size checks, and a console that shows the selected
processes' lines while the log files, the tails and the observers get every line."""

from __future__ import annotations

import io

import pytest
from support.helpers import spec_of

from launcher import cli
from launcher.errors import ConfigError
from launcher.runtime.output import Console
from launcher.spec.only import check_only, parse_only, shows


def names(*items: str) -> list[str]:
    return [str(s) for s in parse_only(items)]


@pytest.mark.parametrize("items, expected", [
    (["worker:0-3"], ["worker:0-3"]),
    (["server"], ["server"]),
    (["scheduler"], ["scheduler"]),
    (["worker:2"], ["worker:2"]),
    (["rank:0"], ["worker:0"]),
    (["worker:0-3,server", "scheduler"], ["worker:0-3", "server", "scheduler"]),
    (["worker:0,2,4-5"], ["worker:0", "worker:2", "worker:4-5"]),
    ([" worker:1 , server:0 "], ["worker:1", "server:0"]),
    (["rank:1-2,7"], ["worker:1-2", "worker:7"]),
])
def test_the_selector_forms(items, expected) -> None:
    assert names(*items) == expected


@pytest.mark.parametrize("item, says", [
    ("workers", "unknown role 'workers'"),
    ("worker:", "a rank is a number (R) or a range (A-B)"),
    ("worker:x", "a rank is a number (R) or a range (A-B)"),
    ("worker:3-1", "the range 3-1 runs backwards"),
    ("worker:-1", "a rank is a number"),
    ("scheduler:0", "there is one scheduler; it has no rank"),
    ("2", "a bare rank continues a server:R or worker:R before it"),
    ("server,2", "a bare rank continues"),
    ("worker:0,,1", "an empty selector"),
    ("", "an empty selector"),
    ("role:worker", "unknown role 'role'"),
    ("Worker:0", "unknown role 'Worker'"),
])
def test_a_bad_selector_is_one_line_that_names_the_forms(item, says) -> None:
    with pytest.raises(ConfigError) as e:
        parse_only([item])
    message = str(e.value)
    assert says in message and "\n" not in message
    assert "expected scheduler, server, worker, server:R, worker:R, worker:A-B or rank:R" in message


@pytest.mark.parametrize("item, workers, servers, says", [
    ("worker:5", 2, 0, "--only worker:5: this job has workers 0-1"),
    ("worker:0-3", 2, 2, "--only worker:0-3: this job has workers 0-1"),
    ("rank:1", 1, 0, "--only rank:1: this job has worker 0"),
    ("server", 2, 0, "--only server: this job has no servers (-s 0)"),
    ("server:2", 2, 2, "--only server:2: this job has servers 0-1"),
    ("scheduler", 2, 0, "--only scheduler: this job has no scheduler (-s 0)"),
])
def test_a_selector_of_processes_the_job_lacks_is_refused(item, workers, servers, says) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        check_only(parse_only([item]), workers, servers)


def test_which_processes_are_shown() -> None:
    sel = parse_only(["worker:1-2,server:0"])
    assert [n for n in ("scheduler", "server-0", "server-1", "worker-0", "worker-1", "worker-2", "worker-3")
            if shows(sel, n)] == ["server-0", "worker-1", "worker-2"]
    assert shows((), "worker-7")  # (no --only: everyone)
    assert shows(parse_only(["scheduler"]), "scheduler") and not shows(parse_only(["server"]), "scheduler")
    # pslaunch's own helpers are no selectable process: always shown
    assert shows(sel, "torch-store") and shows(sel, "rabit-tracker") and shows(sel, "mpirun")


class Sink(io.BytesIO):
    def fileno(self) -> int:  # not a tty
        raise OSError


def test_the_console_shows_the_selected_lines_and_the_files_and_tails_keep_all(tmp_path) -> None:
    out, err = Sink(), Sink()
    console = Console(stdout=out, stderr=err, log_dir=str(tmp_path), color=False, only=parse_only(["worker:1"]))
    seen: list[str] = []
    console.observe("worker-0", seen.append)
    w0, w1 = console.proc("worker-0", "worker 0", "worker"), console.proc("worker-1", "worker 1", "worker")
    tracker = console.proc("torch-store", "torch store", "tracker")
    w0.stdout.feed(b"zero says\n")
    w0.stderr.feed(b"zero fails\n")
    w1.stdout.feed(b"one says\n")
    tracker.stderr.feed(b"store line\n")
    for p in (w0, w1, tracker):
        p.close()
    assert out.getvalue().decode() == "[worker 1] one says\n"
    assert err.getvalue().decode() == "[torch store] store line\n"
    assert (tmp_path / "worker-0.log").read_text() == "zero says\nzero fails\n"
    assert (tmp_path / "worker-1.log").read_text() == "one says\n"
    assert w0.lines() == ["zero says", "zero fails"]  # (the failure report's tail)
    assert seen == ["zero says", "zero fails"]  # (the status line still reads worker 0)


def test_a_traceback_left_out_by_only_is_not_what_a_shown_one_is_said_to_repeat(tmp_path) -> None:
    """The console says a traceback once for many processes; one that --only left out was never
    on the screen, so the first shown copy is shown whole, and the hidden one's lines stay
    out of the failure report's 'shown above'."""
    out, err = Sink(), Sink()
    console = Console(stdout=out, stderr=err, log_dir=str(tmp_path), color=False, only=parse_only(["worker:1"]))
    w0, w1 = console.proc("worker-0", "worker 0", "worker"), console.proc("worker-1", "worker 1", "worker")
    trace = b'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\nValueError: boom\n'
    w0.stderr.feed(trace)
    w1.stderr.feed(trace)
    for p in (w0, w1):
        p.close()
    assert err.getvalue().decode().splitlines() == [
        "[worker 1] Traceback (most recent call last):", '[worker 1]   File "x.py", line 1, in <module>',
        "[worker 1] ValueError: boom"]
    assert (tmp_path / "worker-0.log").read_bytes() == trace
    assert not w0.shown_above(40) and w1.shown_above(40)



def test_the_option_repeats_takes_lists_and_a_yaml_key(tmp_path) -> None:
    s = spec_of(["-n", "4", "-s", "1", "--only", "worker:0-1,server", "--only", "worker:3", "python", "t.py"])
    assert [str(x) for x in s.only] == ["worker:0-1", "server", "worker:3"]
    assert spec_of(["-n", "2", "--tracker", "torch", "--only", "rank:1", "true"]).only == parse_only(["worker:1"])
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: 2\nonly: [worker:1, scheduler]\ncommand: [python, t.py]\n")
    assert [str(x) for x in spec_of(["--config", str(cfg)]).only] == ["worker:1", "scheduler"]
    cfg.write_text("num-workers: 2\nonly: worker:0\ncommand: [python, t.py]\n")
    assert [str(x) for x in spec_of(["--config", str(cfg)]).only] == ["worker:0"]


@pytest.mark.parametrize("args, says", [
    (["-n", "2", "--only", "wrker:0", "true"], "--only 'wrker:0': unknown role 'wrker'; expected scheduler, server"),
    (["-n", "2", "--only", "worker:2", "true"], "--only worker:2: this job has workers 0-1"),
    (["-n", "2", "-s", "0", "--only", "server", "true"], "--only server: this job has no servers"),
])
def test_a_bad_only_is_a_usage_error(args, says, capsys) -> None:
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1


def test_the_dry_run_says_what_the_console_shows(capsys) -> None:
    assert cli.main(["-n", "2", "--only", "worker:1,scheduler", "--dry-run", "python", "t.py"]) == 0
    assert "console: only worker:1, scheduler (--only; --log-dir files get every line)" in capsys.readouterr().out
