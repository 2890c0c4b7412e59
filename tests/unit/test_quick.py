"""The click-free parser of a plain job's options (``launcher.cli.quick``) reads exactly what click
reads, or declines: its table is click's declarations, and both parsers give the same parameters."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from support.helpers import REPO

from launcher.cli import clickutil, quick, run

CORE = [p for p in run.run_command.params[:run._CORE_PARAMS]
        if isinstance(p, click.Option) and p.name not in ("config", "version", "help")]
CORE_NAMES = {p.name for p in CORE}


def click_params(args: list[str], environ: dict[str, str]) -> dict:
    with pytest.MonkeyPatch.context() as mp:
        for name in ("DMLC_SUBMIT_CLUSTER",):
            mp.delenv(name, raising=False)
        for name, value in environ.items():
            mp.setenv(name, value)
        params = run.run_command.make_context("pslaunch", list(args)).params
    # (only the core options: other tests may have added every backend's to the command)
    return {name: value for name, value in params.items() if name in CORE_NAMES or name == "command"}


def test_the_table_is_clicks_declarations() -> None:
    table = {name: (flags, kind, default) for name, flags, kind, default in quick.OPTIONS}
    assert sorted(table) == sorted(p.name for p in CORE)  # every core option is read without click
    defaults = click_params(["-n", "1", "true"], {})  # (what click gives for an option not given)
    for p in CORE:
        flags, kind, default = table[p.name]
        assert set(flags) == set(p.opts) | set(p.secondary_opts), p.name
        assert (p.name in quick.REQUIRED) == p.required, p.name
        assert p.required or default == defaults[p.name], p.name
        if p.is_flag:
            assert kind == "flag", p.name
        elif p.multiple:
            assert kind == "multiple", p.name
        elif isinstance(p.type, click.Choice):
            if p.name == "launcher":
                assert kind == "launcher" and p.envvar == "DMLC_SUBMIT_CLUSTER"
            elif p.type.case_sensitive:
                assert tuple(kind) == tuple(p.type.choices), p.name
            else:
                assert kind == "log_level" and tuple(quick.LOG_LEVELS) == tuple(p.type.choices)
        else:
            expected = {clickutil.BoundedInt: "int", clickutil.FiniteFloat: "float",
                        type(click.STRING): "str"}[type(p.type)]
            assert kind == expected, p.name


# (arguments, environment): each is read by quick, and must give click's parameters
READ = [
    (["-n", "2", "-s", "1", "python", "train.py", "--kv-store", "dist_sync"], {}),
    (["-n2", "-s1", "--launcher", "local", "--kill-grace", "2", "./job.sh"], {}),
    (["--num-workers=4", "--num-servers", "0", "--tracker", "rabit", "python", "x.py", "-n", "5"], {}),
    (["-n", "1", "--env", "A=1", "--env", "B", "--env-server", "C:2", "--env-worker=D=3", "true"], {}),
    (["-n", "1", "--log-level", "debug", "--no-progress", "--p3", "--dry-run", "true"], {}),
    (["-n", "1", "--log-level=Warning", "--timeout", "1.5", "--start-timeout", "30", "true"], {}),
    (["-n", "3", "-H", "hosts", "--sync-dst-dir", "/tmp/job", "--host-ip", "auto", "python", "t.py"], {}),
    (["-n", "1", "--cluster", "sge", "--queue", "q", "--jobname", "j", "--worker-cores", "4",
      "--worker-memory", "2g", "--server-cores", "2", "--server-memory", "1g", "true"], {}),
    (["-n", "1", "--port-range", "9000-9100", "--log-dir", "logs", "--summary-json", "s.json",
      "--log-file", "l.txt", "--tracker-python", "python3", "true"], {}),
    (["-n", "007", "-n", "2", "true"], {}),  # (the last one counts)
    (["-n", "1", "true"], {"DMLC_SUBMIT_CLUSTER": "mpi"}),
    (["-n", "1", "--launcher", "local", "true"], {"DMLC_SUBMIT_CLUSTER": "mpi"}),
    (["-n", "1", "true"], {"DMLC_SUBMIT_CLUSTER": ""}),
    (["-n", "0", "true"], {}),  # (read; the spec refuses it, with click's path's message)
]


@pytest.mark.parametrize("args, environ", READ)
def test_quick_reads_what_click_reads(args, environ) -> None:
    got = quick.parse(args, environ)
    assert got is not None, "quick declined a plain job"
    assert got == click_params(args, environ)


DECLINED = [
    ["-n", "1", "--help"], ["--help"], ["-h"], ["--version"], ["-n", "1", "--config", "job.yaml", "true"],
    ["-n", "1", "--ssh-key", "k", "true"],  # a backend's option
    ["-n", "1", "--num-worker", "2", "true"],  # a typo: click suggests the right one
    ["-n", "-1", "true"], ["-n", "1_0", "true"], ["-n", "+2", "true"], ["-n", "1234567890", "true"],
    ["-n", "٣", "true"],  # (a digit, but not ASCII)
    ["-n", "1", "--timeout", "1e3", "true"], ["-n", "1", "--timeout", "nan", "true"],
    ["-n", "1", "--start-timeout", "1" * 400, "true"],  # (digits only, but float() makes it inf)
    ["-n", "1", "--env", "-x", "true"], ["-n", "1", "-H", "-", "true"],
    ["-n", "1", "--", "true"], ["-n", "1", "-", "true"], ["-n", "1"], ["-n"], [], ["true"],
    ["-n", "1", "--dry-run=yes", "true"], ["-n", "1", "--log-level", "verbose", "true"],
    ["-n", "1", "--launcher", "nosuch", "true"], ["-n", "1", "--tracker", "PS", "true"], ["-n=1", "true"],
]


@pytest.mark.parametrize("args", DECLINED)
def test_quick_declines_what_only_click_reads_or_explains(args) -> None:
    assert quick.parse(args, {}) is None


def test_an_unknown_backend_in_the_environment_is_clicks_to_explain() -> None:
    assert quick.parse(["-n", "1", "true"], {"DMLC_SUBMIT_CLUSTER": "nosuch"}) is None


def test_a_plain_job_never_imports_click() -> None:
    code = ("import sys; from launcher import cli; from launcher.cli import job; "
            "job.execute = lambda spec: print(spec.launcher, spec.num_workers, spec.command) or 0; "
            "rc = cli.main(['-n', '2', '-s', '1', '--env', 'A=1', 'python', 'x.py']); "
            "print(rc, 'click' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.splitlines() == ["local 2 ('python', 'x.py')", "0 False"], out.stdout + out.stderr


def test_the_same_mistake_gets_the_same_line_from_either_parser(capsys) -> None:
    from launcher import cli

    assert cli.main(["-n", "0", "true"]) == 2  # read by quick; the spec refuses it
    quick_err = capsys.readouterr().err
    assert cli.main(["-n", "0", "--ssh-key", "k", "true"]) == 2  # click reads this one
    click_err = capsys.readouterr().err
    assert quick_err == click_err == "pslaunch: error: -n/--num-workers must be at least 1, got 0\n"


@pytest.mark.parametrize("args, environ", READ + [(a, {}) for a in DECLINED if a[-3:-1] != ["-H", "-"]] + [
    (["-n", "1", "--start-timeout", "1" * 100_000, "true"], {}),
    (["-n", "1", "--port-range", "9-8", "true"], {}), (["-n", "1", "--env", "1BAD=x", "true"], {}),
    (["-n", "1", "--kill-grace", "0.5", "--env", "MISSING_IN_SHELL", "true"], {}),
])
def test_either_parser_gives_the_same_outcome(args, environ, capsys, monkeypatch) -> None:
    from launcher import cli
    from launcher.cli import job

    monkeypatch.delenv("DMLC_SUBMIT_CLUSTER", raising=False)
    monkeypatch.delenv("MISSING_IN_SHELL", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    outcomes = []
    for through_click in (False, True):
        with monkeypatch.context() as mp:
            mp.setattr(job, "execute", lambda spec: print(repr(spec)) or 0)
            if through_click:
                mp.setattr(quick, "parse", lambda args, environ: None)
            code = cli.main(list(args))
        captured = capsys.readouterr()
        outcomes.append((code, captured.out, captured.err))
    assert outcomes[0] == outcomes[1]
