"""Argument parsing, YAML config, errors and the dry run, in-process (nothing is started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from support.helpers import REPO, spec_of

from launcher import backends, cli
from launcher.cli import common, run
from launcher.errors import BackendUnavailableError, ConfigError
from launcher.run.addresses import scheduler_address


def test_command_starts_at_first_non_option() -> None:
    s = spec_of(["-n", "3", "python", "train.py", "-n", "5", "-s", "2", "--env", "X", "--sync", "d", "--", "z"])
    assert s.command == ("python", "train.py", "-n", "5", "-s", "2", "--env", "X", "--sync", "d", "--", "z")
    assert s.num_workers == 3 and s.num_servers == 3  # -s defaults to -n, as launch.py


def test_double_dash_before_command_is_consumed() -> None:
    s = spec_of(["-n", "1", "--", "-weird-program", "--flag"])
    assert s.command == ("-weird-program", "--flag")


def test_defaults_local_without_hostfile_ssh_with(tmp_path) -> None:
    assert spec_of(["-n", "1", "true"]).launcher == "local"
    hosts = tmp_path / "hosts"
    hosts.write_text("a\nb:2222\n")
    s = spec_of(["-n", "1", "-H", str(hosts), "true"])
    assert s.launcher == "ssh" and [h.name for h in s.hosts] == ["a", "b"]
    assert spec_of(["-n", "1", "--host-file", str(hosts), "--cluster", "mpi", "true"]).launcher == "mpi"


def test_submit_cluster_env_var(monkeypatch) -> None:
    monkeypatch.setenv("DMLC_SUBMIT_CLUSTER", "sge")
    assert spec_of(["-n", "1", "true"]).launcher == "sge"


def test_env_options(monkeypatch) -> None:
    monkeypatch.setenv("MYVAR", "from shell")
    s = spec_of(["-n", "1", "--env", "MYVAR", "--env", "A=1=2", "--env-server", "OMP_NUM_THREADS:3",
                 "--env-worker", "B=x:y", "--env-worker", "C:d=e", "true"])
    assert dict(s.env) == {"MYVAR": "from shell", "A": "1=2"}
    assert dict(s.env_server) == {"OMP_NUM_THREADS": "3"}
    assert dict(s.env_worker) == {"B": "x:y", "C": "d=e"}


def test_memory_and_cores() -> None:
    s = spec_of(["-n", "1", "--worker-memory", "2g", "--server-memory", "512m", "--worker-cores", "4", "true"])
    assert (s.worker_memory_mb, s.server_memory_mb, s.worker_cores) == (2048, 512, 4)


@pytest.mark.parametrize("args, environ, expected", [
    (["-n", "2", "-s", "1", "python", "train.py", "--kv-store", "dist_sync"], {},
     dict(num_workers=2, num_servers=1, command=("python", "train.py", "--kv-store", "dist_sync"))),
    (["-n2", "-s1", "--launcher", "local", "--kill-grace", "2", "./job.sh"], {},
     dict(num_workers=2, num_servers=1, launcher="local", kill_grace=2.0, command=("./job.sh",))),
    (["--num-workers=4", "--num-servers", "0", "--tracker", "rabit", "python", "x.py", "-n", "5"], {},
     dict(num_workers=4, num_servers=0, tracker="rabit", command=("python", "x.py", "-n", "5"))),
    (["-n", "1", "--env", "A=1", "--env-server", "C:2", "--env-worker=D=3", "true"], {},
     dict(env=(("A", "1"),), env_server=(("C", "2"),), env_worker=(("D", "3"),))),
    (["-n", "1", "--log-level=Warning", "--timeout", "1.5", "--start-timeout", "30", "--dry-run", "--p3", "true"], {},
     dict(log_level="WARNING", timeout=1.5, start_timeout=30.0, dry_run=True, p3=True)),
    (["-n", "1", "--no-progress", "--port-range", "9000-9100", "true"], {},
     dict(progress=False, port_range=(9000, 9100))),
    (["-n", "007", "-n", "2", "true"], {}, dict(num_workers=2)),  # (the last one counts)
    (["-n", "1", "-", "true"], {}, dict(command=("-", "true"))),  # (a lone dash is the command)
    (["-n", "1", "true"], {"DMLC_SUBMIT_CLUSTER": "sge"}, dict(launcher="sge")),
    (["-n", "1", "--launcher", "local", "true"], {"DMLC_SUBMIT_CLUSTER": "sge"}, dict(launcher="local")),
    (["-n", "1", "true"], {"DMLC_SUBMIT_CLUSTER": ""}, dict(launcher="local")),
])
def test_how_options_and_the_command_are_read(args, environ, expected, monkeypatch) -> None:
    monkeypatch.delenv("DMLC_SUBMIT_CLUSTER", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    s = spec_of(args)
    assert {name: getattr(s, name) for name in expected} == expected


def run_err(args: list[str], capsys) -> tuple[int, str]:
    code = cli.main(args)
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("args, message", [
    (["-n", "2"], "no command given"),
    (["-n", "0", "true"], "-n/--num-workers must be at least 1, got 0"),
    (["-n", "1", "-s", "-1", "true"], "-s/--num-servers must be 0 or more"),
    (["-n", "x", "true"], "Invalid value for '-n' / '--num-workers'"),
    (["true"], "Missing option '-n' / '--num-workers'"),
    (["-n", "1", "--env", "1BAD=x", "true"], "--env '1BAD=x': expected NAME, NAME=VALUE or NAME:VALUE"),
    (["-n", "1", "--env", "NOT_SET_ANYWHERE_123", "true"],
     "--env NOT_SET_ANYWHERE_123: NOT_SET_ANYWHERE_123 is not set"),
    (["-n", "1", "--env-worker", "JUSTNAME", "true"], "--env-worker 'JUSTNAME': expected NAME=VALUE"),
    # a malformed name that looks secret: its value is not echoed
    (["-n", "1", "--env", "MY-TOKEN=hunter2", "true"],
     "--env 'MY-TOKEN=<redacted>': expected NAME, NAME=VALUE or NAME:VALUE"),
    (["-n", "1", "--env-worker", "DB PASSWORD:hunter2", "true"],
     "--env-worker 'DB PASSWORD:<redacted>': expected NAME=VALUE"),
    (["-n", "1", "-H", "/nonexistent/hosts", "true"], "cannot read hostfile /nonexistent/hosts"),
    (["-n", "1", "--launcher", "ssh", "true"], "--launcher ssh needs hosts"),
    (["-n", "1", "--launcher", "nope", "true"], "Invalid value for '--launcher'"),
    (["-n", "1", "--port-range", "10-5", "true"], "--port-range: bad port range '10-5'"),
    (["-n", "1", "--worker-memory", "lots", "true"], "--worker-memory 'lots': give a size ending in g or m"),
    (["-n", "1", "--bogus", "true"], "No such option '--bogus'"),
    (["-n", "1", "--kill-grace", "-1", "true"], "--kill-grace must not be negative"),
    (["-n", "1", "--timeout", "0", "true"], "--timeout must be positive"),
    (["-n", "1", "--sync-dst-dir", "/tmp/x", "true"], "--launcher local has none"),
    (["-n", "1", "--env", "PS_HEARTBEAT_TIMEOUT=0.5", "true"],
     "PS_HEARTBEAT_TIMEOUT=0.5 must be longer than PS_HEARTBEAT_INTERVAL=1 (a node would count as dead"),
    (["-n", "1", "--env-server", "PS_HEARTBEAT_INTERVAL=20", "true"], "must be longer than PS_HEARTBEAT_INTERVAL=20"),
    # click's own messages, each with where to read more
    (["-n"], "Option '-n' requires an argument. (see pslaunch --help)"),
    (["-n=1", "true"], "Invalid value for '-n' / '--num-workers': '=1' is not a valid integer."),
    (["-n", "1234567890", "true"], "Invalid value for '-n' / '--num-workers': a number of 10 digits is far too large"),
    (["-n", "1", "--timeout", "nan", "true"], "Invalid value for '--timeout': 'nan' is not a finite number"),
    (["-n", "1", "--start-timeout", "1" * 400, "true"],
     "Invalid value for '--start-timeout': a 400-character value is not a finite number"),
    (["-n", "1", "--dry-run=yes", "true"], "Option '--dry-run' does not take a value."),
    (["-n", "1", "--log-level", "verbose", "true"],
     "Invalid value for '--log-level': 'verbose' is not one of 'debug', 'info', 'warning', 'error'."),
    (["-n", "1", "--num-worker", "2", "true"], "No such option '--num-worker'. (Did you mean one of: "),
    (["-n", "1", "--env", "-x", "true"], "--env '-x': expected NAME, NAME=VALUE or NAME:VALUE"),
    (["-n", "1", "--max-restarts", "-1", "true"], "--max-restarts must be a whole number from 0 to 10000, got -1"),
    (["-n", "1", "--restart-window", "soon", "true"],
     "Invalid value for '--restart-window': 'soon' is not a length of time; give seconds or a number with s, m, h"),
    (["-n", "1", "--restart-delay", "-2", "true"], "Invalid value for '--restart-delay': '-2' is not a length of time"),
    (["-n", "1", "--restart-window", "0", "true"], "--restart-window must be longer than 0s"),
])
def test_user_errors_are_one_line_exit_2(args, message, capsys) -> None:
    code, err = run_err(args, capsys)
    assert code == 2, err
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("pslaunch: error: ")
    assert message in err
    assert "hunter2" not in err  # never a value of a secret-looking name


def test_an_unknown_backend_in_the_environment_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setenv("DMLC_SUBMIT_CLUSTER", "nosuch")
    code, err = run_err(["-n", "1", "true"], capsys)
    assert code == 2 and err.startswith("pslaunch: error: Invalid value for '--launcher' / '--cluster' (env var: "
                                        "'DMLC_SUBMIT_CLUSTER'): 'nosuch' is not one of ") and "\n" not in err


def test_bad_hostfile_line_exit_2(tmp_path, capsys) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("good\n\nbad:port\n")
    code, err = run_err(["-n", "1", "-H", str(hosts), "true"], capsys)
    assert code == 2 and err == f"pslaunch: error: {hosts}:3: port 'port' is not a number from 1 to 65535"


def test_local_with_hostfile_is_refused(tmp_path, capsys) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("a\n")
    code, err = run_err(["-n", "1", "-H", str(hosts), "--launcher", "local", "true"], capsys)
    assert code == 2 and "--launcher local does not use a hostfile" in err


# --- YAML ---------------------------------------------------------------------------


def test_yaml_config_and_cli_wins(tmp_path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: 4\nnum_servers: 2\nenv: {A: '1', B: '2'}\nkill-grace: 3\n"
                   "command: [python, x.py, --lr, '0.1']\nport-range: 9500-9600\n")
    s = spec_of(["--config", str(cfg)])
    assert (s.num_workers, s.num_servers, s.kill_grace, s.port_range) == (4, 2, 3.0, (9500, 9600))
    assert s.command == ("python", "x.py", "--lr", "0.1") and dict(s.env) == {"A": "1", "B": "2"}
    s = spec_of(["--config", str(cfg), "-n", "1", "--kill-grace", "7", "python", "y.py"])
    assert (s.num_workers, s.num_servers, s.kill_grace, s.command) == (1, 2, 7.0, ("python", "y.py"))


def test_yaml_command_as_string(tmp_path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: 1\ncommand: python 'a b.py' --x\n")
    assert spec_of(["--config", str(cfg)]).command == ("python", "a b.py", "--x")


@pytest.mark.parametrize("text, message", [
    ("num_worker: 2\n", "unknown key 'num_worker' (did you mean 'num-workers'?)"),
    ("bogus: 1\n", "unknown key 'bogus'"),
    ("- a\n- b\n", "expected a mapping of option names"),
    ("num-workers: [1, 2]\n", "num-workers takes a single value"),
    ("num-workers: 2\n  bad: indent\n", "job.yaml:2"),
    ("num-workers: 1\nport-range: 5-1\ncommand: [x]\n", "--port-range: bad port range"),
    # a YAML string may hold a NUL byte, which no environment can (Popen raised a traceback)
    ('num-workers: 1\nenv:\n  API_TOKEN: "x\\0y"\n', "--env API_TOKEN: contains a NUL byte"),
    ('num-workers: 1\nenv-worker: ["A=x\\0y"]\n', "--env-worker A: contains a NUL byte"),
])
def test_yaml_errors(tmp_path, text, message, capsys) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text(text)
    code, err = run_err(["--config", str(cfg), "true"], capsys)
    assert code == 2, err
    assert message in err and "\n" not in err


def test_yaml_command_with_a_nul_byte_is_one_line(tmp_path, capsys) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text('num-workers: 1\ncommand: ["echo", "a\\0b"]\n')
    code, err = run_err(["--config", str(cfg)], capsys)
    assert code == 2 and "\n" not in err and "the command contains a NUL byte" in err


def test_missing_config_file(capsys) -> None:
    code, err = run_err(["--config", "/nonexistent.yaml", "-n", "1", "true"], capsys)
    assert code == 2 and "cannot read --config /nonexistent.yaml" in err


# --- dry run ------------------------------------------------------------------------


def test_dry_run_table_and_redaction(capsys, monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "supersecretvalue")
    monkeypatch.setenv("PS_VERBOSE", "1")
    code = cli.main(["-n", "2", "-s", "1", "--dry-run", "--env", "MY_TOKEN=hunter2", "python", "t.py", "a b"])
    out = capsys.readouterr().out
    assert code == 0
    assert "supersecretvalue" not in out and "hunter2" not in out
    assert "AWS_SECRET_ACCESS_KEY='<redacted>'" in out and "PSLAUNCH_SECRET='<redacted>'" in out
    assert "command (every role): python t.py 'a b'" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("scheduler  ", "server  ", "worker  "))]
    assert rows == [["scheduler", "-", "-", "localhost", "-"], ["server", "0", "2", "localhost", "127.0.0.1"],
                    ["worker", "0", "0", "localhost", "127.0.0.1"], ["worker", "1", "1", "localhost", "127.0.0.1"]]
    assert "PS_VERBOSE=1" in out


def test_yaml_scheduler_key(tmp_path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: 2\nscheduler: builtin\ncommand: [python, t.py]\n")
    assert spec_of(["--config", str(cfg)]).scheduler == "builtin"
    assert spec_of(["--config", str(cfg), "--scheduler", "command"]).scheduler == "command"  # the command line wins


def test_dry_run_of_the_builtin_scheduler(capsys) -> None:
    assert spec_of(["-n", "2", "true"]).scheduler == "command"
    assert spec_of(["-n", "2", "--scheduler", "builtin", "--p3", "true"]).scheduler == "builtin"
    assert cli.main(["-n", "2", "--scheduler", "builtin", "--dry-run", "python", "t.py"]) == 0
    out = capsys.readouterr().out
    assert "command (servers and workers): python t.py" in out
    assert "scheduler: pslaunch's builtin ps-lite scheduler (--scheduler builtin)" in out


def test_an_unknown_backend_is_one_line_naming_the_available_ones() -> None:
    with pytest.raises(BackendUnavailableError, match="unknown launcher 'nope': choose one of k8s, local, mpi, "):
        backends.get("nope")


def test_every_backend_option_is_a_cli_option_and_a_yaml_key() -> None:
    params = {p.name for p in run.with_backend_options().params}
    for cls in backends.classes():
        for o in cls.options:
            assert o.param in params, (cls.name, o.param)


CORE_ONLY = [
    ["-n", "2", "python", "train.py", "--ssh-user", "x"],   # the job's own options are not ours
    ["-n2", "-s", "1", "--launcher=local", "--", "./job.sh"],
    ["--num-workers", "2", "--kill-grace", "3", "-H", "h1,h2", "sleep", "1"],
    ["-n", "1", "--dry-run", "true"],
]
MAY_NAME_A_BACKEND_OPTION = [
    ["-n", "2", "--ssh-user", "alice", "-H", "h1", "true"],
    ["-n", "2", "--slurm-nodes=2", "true"],
    ["--config", "job.yaml"],
    ["--help"],
    ["-h"],
    ["-n", "2", "--num-worker", "3", "true"],                 # a typo: click names the real option
]


def _loads_backend_options(args: list[str]) -> bool:
    """Whether ``command_for(args)`` adds the backends' options, in a fresh interpreter (in
    this one, other tests have added them already)."""
    code = (f"from launcher.cli import run; run.command_for({args!r}); "
            "print(len(run.run_command.params) > run._CORE_PARAMS)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout.strip() in ("True", "False"), out.stderr
    return out.stdout.strip() == "True"


@pytest.mark.parametrize("args", CORE_ONLY)
def test_a_job_without_backend_options_skips_importing_them(args) -> None:
    assert not _loads_backend_options(args)
    # and the core options alone parse these arguments as every option would
    full = run.with_backend_options()
    backend_params = {o.param for cls in backends.classes() for o in cls.options}
    core = click.Command("pslaunch", params=[p for p in full.params if p.name not in backend_params],
                         context_settings=full.context_settings)
    core_values = core.make_context("pslaunch", list(args)).params
    full_values = full.make_context("pslaunch", list(args)).params
    assert {k: v for k, v in full_values.items() if k not in backend_params} == core_values


@pytest.mark.parametrize("args", MAY_NAME_A_BACKEND_OPTION)
def test_arguments_that_may_name_a_backend_option_get_every_option(args) -> None:
    assert _loads_backend_options(args)


def test_a_local_job_imports_no_other_backend() -> None:
    code = ("import sys; from launcher.cli import main; rc = main(['-n', '1', '-s', '1', '--dry-run', 'true']); "
            "print(rc, sorted(m for m in sys.modules if m.startswith('launcher.backends.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO).stdout.strip().splitlines()[-1]
    assert out == "0 ['launcher.backends.base', 'launcher.backends.local']", out


@pytest.mark.parametrize("extra, page", [((), False), (("--report", "{tmp}/r.html"), True)], ids=["plain", "report"])
def test_the_job_page_is_imported_only_by_a_job_that_asks_for_it(tmp_path: Path, extra: tuple, page: bool) -> None:
    # its HTTP server and renderer are a fifth of the CLI's import time, before the first process
    args = ["-n", "1", "-s", "0", *(a.format(tmp=tmp_path) for a in extra), "true"]
    code = (f"import sys; from launcher.cli import main; rc = main({args!r}); "
            "print(rc, 'launcher.ui.page' in sys.modules, 'http.server' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO).stdout.strip().splitlines()[-1]
    assert out == f"0 {page} {page}", out


def test_a_backend_option_after_the_shortcut_is_still_an_option_not_a_command() -> None:
    # the same process first parses a core-only job, then one with a backend option
    assert cli.main(["-n", "1", "-s", "0", "--dry-run", "true"]) == 0
    assert cli.main(["-n", "1", "-s", "0", "--launcher", "ssh", "-H", "h1,h2", "--ssh-user", "alice",
                     "--accept-new-host-keys", "--dry-run", "true"]) == 0


def test_help_teaches(capsys) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for needle in ("COMMAND", "--num-workers", "--hostfile", "DMLC_ROLE", "Examples", "Exit code"):
        assert needle in out


def test_parse_env_item_rules() -> None:
    assert common.parse_env_item("A=b", "--env", {}, True) == ("A", "b")
    assert common.parse_env_item("A:b", "--env-server", {}, False) == ("A", "b")
    assert common.parse_env_item("A:b", "--env", {}, True) == ("A", "b")  # launch.py's form
    with pytest.raises(ConfigError, match="expected NAME, NAME=VALUE or NAME:VALUE"):
        common.parse_env_item("1A:b", "--env", {}, True)
    assert isinstance(run.run_command, click.Command)


# --- the scheduler's address: DMLC_INTERFACE, then --host-ip (the order) -----------------


@pytest.mark.parametrize("iface, host_ip, expected", [
    ("lo", None, "127.0.0.1"),
    ("lo", "10.9.9.9", "127.0.0.1"),  # the interface comes first
    ("127.0.0.0/8", "10.9.9.9", "127.0.0.1"),  # as a CIDR too
    ("nosuch9", "10.9.9.9", "10.9.9.9"),  # not on this host: the address given stands in
    (None, "10.9.9.9", "10.9.9.9"),
])
def test_scheduler_address_order(monkeypatch, iface, host_ip, expected) -> None:
    monkeypatch.delenv("DMLC_INTERFACE", raising=False)
    if iface:
        monkeypatch.setenv("DMLC_INTERFACE", iface)
    spec = spec_of(["--launcher", "sge", *(["--host-ip", host_ip] if host_ip else []), "-n", "1", "x"])
    assert scheduler_address(spec, {}, backends.get("sge")) == expected


def test_an_interface_this_host_lacks_is_an_error_without_host_ip(monkeypatch) -> None:
    monkeypatch.setenv("DMLC_INTERFACE", "nosuch9")
    spec = spec_of(["--launcher", "sge", "-n", "1", "x"])
    with pytest.raises(ConfigError, match="nosuch9"):
        scheduler_address(spec, {}, backends.get("sge"))


def test_dry_run_puts_the_interface_before_host_ip(capsys, monkeypatch) -> None:
    monkeypatch.setenv("DMLC_INTERFACE", "lo")
    monkeypatch.setenv("PSLAUNCH_SECRET", "x")
    code = cli.main(["--launcher", "yarn", "--host-ip", "10.9.9.9", "-n", "1", "-s", "1", "--dry-run", "x"])
    out = capsys.readouterr().out
    assert code == 0
    assert "scheduler address 127.0.0.1," in out and "10.9.9.9" not in out


def test_yaml_aliases_are_measured_expanded(tmp_path) -> None:
    from launcher.cli.config import MAX_NODES, parse_yaml

    ok = "env: &e {A: 1}\nenv-server: *e\n"
    assert parse_yaml(ok, "j.yaml") == {"env": {"A": 1}, "env-server": {"A": 1}}
    levels = ["a: &a0 [x, x, x, x]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 4)}]" for i in range(1, 8)]
    assert 4 ** 8 > MAX_NODES
    with pytest.raises(ConfigError, match="once its aliases"):
        parse_yaml("\n".join(levels) + "\n", "j.yaml")


def test_yaml_env_forms(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FROM_SHELL", "s")
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: 1\nenv: {A: 1, B: x, FROM_SHELL: null, C: 0.5}\ncommand: [echo, 1, 2.5]\n")
    s = spec_of(["--config", str(cfg)])
    assert dict(s.env) == {"A": "1", "B": "x", "FROM_SHELL": "s", "C": "0.5"}
    assert s.command == ("echo", "1", "2.5")


def test_per_role_interface_on_local_is_a_warning(capsys) -> None:
    code = cli.main(["-n", "1", "--env-worker", "DMLC_INTERFACE=eth0", "--dry-run", "true"])
    out = capsys.readouterr().out
    assert code == 0
    assert "warning: --env-worker DMLC_INTERFACE=eth0 is ignored on --launcher local" in out
    code = cli.main(["-n", "1", "--env", "DMLC_INTERFACE=lo", "--dry-run", "true"])
    assert "is ignored" not in capsys.readouterr().out


def test_env_takes_launch_py_name_colon_value(monkeypatch) -> None:
    s = spec_of(["-n", "1", "--env", "A:1", "--env", "B=x:y", "--env", "C:d=e", "true"])
    assert dict(s.env) == {"A": "1", "B": "x:y", "C": "d=e"}


def test_hosts_inline_in_the_dry_run(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = cli.main(["-n", "3", "-s", "0", "-H", "h1,h2:2222,alice@h3 slots=1", "--dry-run", "true"])
    out = capsys.readouterr().out
    assert code == 0
    assert "hosts (3, from the -H list): h1, h2:2222, alice@h3 slots=1" in out
    assert "worker  0     0        h1" in out and "worker  2     2        alice@h3" in out
    (tmp_path / "h1,h2").write_text("fromfile\n")  # an existing file of that name stays a file
    assert cli.main(["-n", "1", "-s", "0", "-H", "h1,h2", "--dry-run", "true"]) == 0
    assert "hosts (1, from hostfile h1,h2): fromfile" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert "-H h1,h2:2222,alice@h3" in " ".join(capsys.readouterr().out.split())


# --- --tracker -------------------------------------------------------------------------------------------


def test_tracker_defaults_and_servers() -> None:
    assert spec_of(["-n", "2", "true"]).tracker == "ps"
    assert spec_of(["-n", "2", "-s", "0", "true"]).tracker == "rabit"  # launch.py's -s 0
    s = spec_of(["-n", "2", "--tracker", "torch", "python", "t.py"])
    assert (s.tracker, s.num_servers, s.tracker_python) == ("torch", 0, None)  # no servers unless asked for
    s = spec_of(["-n", "2", "--tracker", "xgboost", "--tracker-python", "/opt/py", "python", "t.py"])
    assert (s.tracker, s.tracker_python) == ("xgboost", "/opt/py")


@pytest.mark.parametrize("args, message", [
    (["-n", "2", "-s", "1", "--tracker", "torch", "true"], "--tracker torch runs workers only; drop -s 1"),
    (["-n", "2", "-s", "0", "--tracker", "ps", "true"], "--tracker ps needs servers (-s 1 or more)"),
    (["-n", "2", "--tracker", "mpi", "true"], "Invalid value for '--tracker'"),
    (["-n", "2", "-s", "1", "--tracker-python", "python3", "true"], "--tracker-python is the Python of"),
])
def test_tracker_errors_are_one_line(args, message, capsys) -> None:
    code, err = run_err(args, capsys)
    assert code == 2 and "\n" not in err and err.startswith("pslaunch: error: ") and message in err, err


@pytest.mark.parametrize("args, message", [
    (["-n", "2", "-s", "0", "--scheduler", "builtin", "true"], "--scheduler builtin is a ps-lite scheduler; "
                                                              "--tracker rabit runs none"),
    (["-n", "2", "--scheduler", "builtin", "--env", "DMLC_PS_VAN_TYPE=ibverbs", "true"],
     "DMLC_PS_VAN_TYPE=ibverbs: --scheduler builtin speaks ps-lite's zmq van only; use --scheduler command"),
    (["-n", "2", "--scheduler", "builtin", "--env", "DMLC_LOCAL=1", "true"], "DMLC_LOCAL=1 (ipc sockets)"),
    (["-n", "2", "--scheduler", "builtin", "--env", "PS_RESEND=1", "true"], "PS_RESEND=1: --scheduler builtin does "
                                                                          "not acknowledge messages"),
    (["-n", "2", "--scheduler", "mxnet", "true"], "Invalid value for '--scheduler'"),
])
def test_scheduler_errors_are_one_line(args, message, capsys) -> None:
    code, err = run_err(args, capsys)
    assert code == 2 and "\n" not in err and err.startswith("pslaunch: error: ") and message in err, err


def test_yaml_tracker_key(tmp_path) -> None:
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: 3\ntracker: torch\ntracker-python: /usr/bin/python3\ncommand: [python, t.py]\n")
    s = spec_of(["--config", str(cfg)])
    assert (s.tracker, s.num_servers, s.num_workers, s.tracker_python) == ("torch", 0, 3, "/usr/bin/python3")


def test_help_names_the_trackers(capsys) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for needle in ("--tracker", "rabit", "xgboost", "torch", "--tracker-python", "LOCAL_RANK"):
        assert needle in out


def dry_rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.startswith("worker  ")]


def test_dry_run_shows_the_tracker_and_each_workers_variables(tmp_path, capsys) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("10.0.0.11 slots=2\n10.0.0.12 slots=2\n")
    assert cli.main(["-n", "4", "-H", str(hosts), "--tracker", "torch", "--host-ip", "10.0.0.1", "--dry-run",
                     "python", "ddp.py"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("pslaunch dry run (ssh): 4 worker(s) and the torch tracker (no scheduler, "
                                   "no servers); nothing is started")
    assert "tracker: torch, a torch.distributed TCPStore on 10.0.0.1, port: the first free one of 9091-9998" in out
    assert [r[:4] for r in dry_rows(out)] == [["worker", "0", "0", "10.0.0.11"], ["worker", "1", "1", "10.0.0.11"],
                                              ["worker", "2", "2", "10.0.0.12"], ["worker", "3", "3", "10.0.0.12"]]
    assert "  MASTER_ADDR=10.0.0.1" in out and "  WORLD_SIZE=4" in out and "  GROUP_WORLD_SIZE=2" in out
    own = {line.split(":")[0].strip(): line.split(": ")[1].split() for line in out.splitlines()
           if line.startswith("  worker ")}
    assert own["worker 3 @ 10.0.0.12"] == ["DMLC_NODE_HOST=10.0.0.12", "DMLC_TASK_ID=3", "GROUP_RANK=1",
                                            "LOCAL_RANK=1", "PSLAUNCH_PROCESS=dry-run/worker-3", "RANK=3",
                                            "ROLE_RANK=3"]
    assert "GROUP_RANK=0" in own["worker 1 @ 10.0.0.11"] and "LOCAL_RANK=1" in own["worker 1 @ 10.0.0.11"]
    assert "DMLC_PS_ROOT" not in out
    # torchrun's defaults, shown with the variables every worker gets
    assert "\n  TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT\n" in out
    assert "\n  TORCH_NCCL_ASYNC_ERROR_HANDLING=1\n" in out


def test_dry_run_of_a_rabit_job(capsys) -> None:
    assert cli.main(["-n", "2", "-s", "0", "--dry-run", "python", "xgb.py"]) == 0
    out = capsys.readouterr().out
    assert "tracker: rabit (dmlc's protocol, XGBoost up to 2.0), XGBoost's own, a child process on this machine: " \
           "python " in out and "xgboost_child.py --tracker rabit --n-workers 2 --host-ip 127.0.0.1" in out
    assert "  DMLC_TRACKER_URI=127.0.0.1" in out and "  DMLC_TRACKER_PORT=9091" in out
    assert "DMLC_NUM_SERVER=0" in out and "DMLC_PS_ROOT" not in out
    assert [r[:3] for r in dry_rows(out)] == [["worker", "0", "0"], ["worker", "1", "1"]]


def test_dry_run_of_a_torch_job_on_a_batch_system_says_where_ranks_come_from(capsys) -> None:
    assert cli.main(["-n", "2", "--tracker", "torch", "--launcher", "sge", "--host-ip", "10.0.0.1", "--dry-run",
                     "python", "ddp.py"]) == 0
    out = capsys.readouterr().out
    assert "RANK, ROLE_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE: sent to each task once " \
           "every task has said which host it runs on" in out
    assert "\n  MASTER_ADDR=10.0.0.1\n" in out and "LOCAL_RANK=" not in out.split("RANK, ROLE_RANK")[1]


def test_restart_options_and_the_dry_runs_policy(tmp_path, capsys) -> None:
    s = spec_of(["-n", "2", "--max-restarts", "3", "--restart-delay", "0.5",
                 "--restart-window", "2h", "python", "t.py"])
    assert (s.max_restarts, s.restart_delay, s.restart_window) == (3, 0.5, 7200.0)
    assert spec_of(["-n", "1", "--restart-window", "90", "true"]).restart_window == 90.0
    assert spec_of(["-n", "1", "--restart-window", "1.5m", "true"]).restart_window == 90.0
    plain = spec_of(["-n", "1", "true"])
    assert (plain.max_restarts, plain.restart_delay, plain.restart_window) == (0, 1.0, None)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("max-restarts: 2\nrestart-delay: 3\nrestart-window: 1h\n")
    s = spec_of(["--config", str(cfg), "-n", "1", "true"])
    assert (s.max_restarts, s.restart_delay, s.restart_window) == (2, 3.0, 3600.0)
    code = cli.main(["-n", "1", "-s", "0", "--tracker", "torch", "--max-restarts", "2", "--dry-run", "python", "t.py"])
    out = capsys.readouterr().out
    assert code == 0
    assert "restarts: up to 2 for the whole job, every role at once, after 1.0s doubling" in out
    for var in ("PSLAUNCH_ATTEMPT=0", "PSLAUNCH_MAX_RESTARTS=2", "TORCHELASTIC_RESTART_COUNT=0",
                "TORCHELASTIC_MAX_RESTARTS=2", "DMLC_NUM_ATTEMPT=0"):
        assert var in out, var
    assert cli.main(["-n", "1", "--dry-run", "true"]) == 0
    assert "restarts: none (--max-restarts 0)" in capsys.readouterr().out


def test_restart_scope_process_replaces_ps_workers_out_of_the_budget(tmp_path, capsys) -> None:
    s = spec_of(["-n", "2", "-s", "1", "--max-restarts", "2", "--restart-scope", "process", "python", "t.py"])
    assert s.restart_scope == "process" and s.replaces_workers
    assert spec_of(["-n", "2", "-s", "1", "python", "t.py"]).restart_scope == "job"
    cfg = tmp_path / "job.yaml"
    cfg.write_text("max-restarts: 1\nrestart-scope: process\n")
    assert spec_of(["--config", str(cfg), "-n", "2", "-s", "1", "true"]).replaces_workers
    assert cli.main(["-n", "2", "-s", "1", "--max-restarts", "2", "--restart-scope", "process", "--dry-run",
                     "python", "t.py"]) == 0
    out = capsys.readouterr().out
    assert "a lost worker is replaced in place" in out
    for var in ("PSLAUNCH_RESTART_SCOPE=process", "PS_HEARTBEAT_INTERVAL=1", "PS_HEARTBEAT_TIMEOUT=2"):
        assert f"\n  {var}\n" in out, var  # (every process's: the dry run shows what they share once)
    # the user's heartbeats win (ps-lite reads them on every node)
    assert cli.main(["-n", "1", "-s", "1", "--max-restarts", "1", "--restart-scope", "process", "--env",
                     "PS_HEARTBEAT_TIMEOUT=9", "--dry-run", "true"]) == 0
    out = capsys.readouterr().out
    assert "PS_HEARTBEAT_TIMEOUT=9" in out and "PS_HEARTBEAT_TIMEOUT=2" not in out
    assert cli.main(["-n", "2", "-s", "1", "--dry-run", "true"]) == 0
    out = capsys.readouterr().out
    assert "PSLAUNCH_RESTART_SCOPE" not in out and "PS_HEARTBEAT" not in out


@pytest.mark.parametrize("args, says", [
    (["-s", "1", "--restart-scope", "process"], "give it one: --max-restarts N"),
    (["-s", "0", "--max-restarts", "1", "--restart-scope", "process"], "a --tracker rabit job's workers form one"),
    (["--tracker", "torch", "--max-restarts", "1", "--restart-scope", "process"], "drop --restart-scope"),
    (["-s", "1", "--max-restarts", "1", "--restart-scope", "rank"], "'rank' is not one of 'job', 'process'"),
    (["-s", "1", "--max-restarts", "1", "--restart-scope", "process", "--launcher", "mpi"],
     "--launcher mpi cannot start one process into a running job"),
    (["-s", "1", "--max-restarts", "1", "--restart-scope", "process", "--launcher", "sge", "--host-ip", "10.0.0.1"],
     "--launcher sge cannot start one process into a running job"),
])
def test_restart_scope_errors_are_one_line(capsys, args: list[str], says: str) -> None:
    assert cli.main(["-n", "2", *args, "python", "t.py"]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("value, first", [("2", 2), ("", 0), ("x", 0), ("99999999", 0)])
def test_a_requeued_slurm_job_goes_on_counting(monkeypatch, value: str, first: int) -> None:
    monkeypatch.setenv("SLURM_RESTART_COUNT", value)
    assert spec_of(["-n", "1", "true"]).first_attempt == first


@pytest.mark.parametrize("args, message", [
    (["-n", "2:4", "true"], "-n 2:4: a parameter-server job runs a fixed number of workers; give -n 4, or run a "
                            "collective job (--tracker torch, rabit or xgboost, -s 0)"),
    (["-n", "2:4", "-s", "1", "--tracker", "ps", "true"], "-n 2:4: a parameter-server job runs a fixed number"),
    (["-n", "4:2", "-s", "0", "true"], "'4:2': MIN:MAX needs 1 <= MIN <= MAX, e.g. -n 2:4"),
    (["-n", "0:2", "-s", "0", "true"], "'0:2': MIN:MAX needs 1 <= MIN <= MAX"),
    (["-n", "2:", "-s", "0", "true"], "'2:' is not N or MIN:MAX (whole numbers, e.g. -n 4 or -n 2:4)"),
    (["-n", "a:b", "-s", "0", "true"], "'a:b' is not N or MIN:MAX"),
    (["-n", "1:2:3", "-s", "0", "true"], "'1:2:3' is not N or MIN:MAX"),
    (["-n", "1:1234567890", "-s", "0", "true"], "is not N or MIN:MAX"),
    (["-n", "2", "--host-cooldown", "soon", "true"], "--host-cooldown 'soon': give LOWER[:UPPER] as durations"),
    (["-n", "2", "--host-cooldown", "1h:1m", "true"], "--host-cooldown 1h:1m: LOWER is longer than UPPER"),
    (["-n", "2", "--host-cooldown", "-1", "true"], "--host-cooldown '-1': give LOWER[:UPPER]"),
])
def test_elastic_option_errors_are_one_line_exit_2(args, message, capsys) -> None:
    code, err = run_err(args, capsys)
    assert code == 2, err
    assert "\n" not in err and "Traceback" not in err and err.startswith("pslaunch: error: ")
    assert message in err, err


def test_min_max_spares_and_the_cooldown_reach_the_spec(tmp_path, capsys) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("h1\nh2 slots=2\nh3 spare\nh4 slots=2 spare\n")
    s = spec_of(["-n", "2:4", "--tracker", "torch", "-H", str(hosts), "--host-cooldown", "30s:10m", "python", "t.py"])
    assert (s.min_workers, s.num_workers, s.num_servers) == (2, 4, 0)
    assert [h.name for h in s.hosts] == ["h1", "h2"] and [(h.name, h.slots) for h in s.spares] == [("h3", None),
                                                                                                    ("h4", 2)]
    assert s.host_cooldown == (30.0, 600.0)
    plain = spec_of(["-n", "3", "-s", "0", "true"])
    assert (plain.min_workers, plain.num_workers, plain.spares, plain.host_cooldown) == (None, 3, (), (60.0, 3600.0))
    assert spec_of(["-n", "1", "--host-cooldown", "2h", "true"]).host_cooldown == (7200.0, 7200.0)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: '2:3'\ntracker: rabit\nhost-cooldown: 1m\n")
    s = spec_of(["--config", str(cfg), "true"])
    assert (s.min_workers, s.num_workers, s.host_cooldown) == (2, 3, (60.0, 3600.0))
    code = cli.main(["-n", "2:4", "--tracker", "torch", "-H", str(hosts), "--max-restarts", "2", "--dry-run",
                     "python", "t.py"])
    out = capsys.readouterr().out
    assert code == 0
    assert "spares (2, used only in the place of a host that is left out): h3, h4 slots=2" in out
    assert "workers: 4 at first; at least 2 when hosts are left out and no spare is left (-n 2:4)" in out
    assert "is left out for 1.0m doubling up to 1.0h (--host-cooldown)" in out


def test_yaml_base_60_stays_text_so_min_max_workers_read_as_written(tmp_path) -> None:
    """YAML 1.1 reads a plain ``2:4`` as the number 124: the config's loader keeps such values text
    (YAML 1.2), so ``num-workers: 2:4`` is ``-n 2:4``."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text("num-workers: 2:4\ntracker: torch\n")
    s = spec_of(["--config", str(cfg), "python", "t.py"])
    assert (s.min_workers, s.num_workers) == (2, 4)
