"""What a torchrun or mpirun user types first, answered in pslaunch's words before anything
starts (``launcher.cli.hints``): their launchers' flags, a Python file as the command, and a
``-H`` that is neither a file nor a host. Parsed in-process (the CLI's own entry point) and, where
what happens depends on the real program, through the real ``pslaunch``."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import pslaunch_argv

from launcher import cli
from launcher.cli import job


def run_err(args: list[str], capsys) -> tuple[int, str]:
    code = cli.main(args)
    return code, capsys.readouterr().err.strip()


def one_line(err: str) -> str:
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("pslaunch: error: "), err
    return err[len("pslaunch: error: "):]


# --- torchrun's and mpirun's flags --------------------------------------------------------------------


@pytest.mark.parametrize("args, answer", [
    (["--nproc-per-node", "4"],
     "--nproc-per-node 4: pslaunch spells this -n 4 (processes per job; with -H the hosts share them)"),
    (["--nproc_per_node=4"], "--nproc_per_node 4: pslaunch spells this -n 4 (processes per job;"),
    (["--nnodes", "2", "--nproc-per-node", "4"],
     "--nnodes 2 --nproc-per-node 4: pslaunch spells this -n 8 -H HOSTS (-n counts the processes of the whole "
     "job, 2 hosts x 4; -H names the hosts, which share them)"),
    (["--nnodes", "2"], "--nnodes 2: pslaunch spells this -H HOSTS (a hostfile or -H h1,h2"),
    (["-n", "2", "--node-rank", "0"], "--node-rank 0: pslaunch needs none: it starts every host's processes"),
    (["--master-addr", "10.0.0.1"], "--master-addr 10.0.0.1: pslaunch spells this --host-ip 10.0.0.1 (the store "
     "runs on this machine; every process gets MASTER_ADDR)"),
    (["--master_port", "29500"], "--master_port 29500: pslaunch spells this --port-range 29500-29500"),
    (["--rdzv-endpoint", "10.0.0.1:29400"],
     "--rdzv-endpoint 10.0.0.1:29400: pslaunch spells this --host-ip 10.0.0.1 --port-range 29400-29400"),
    (["-n", "2", "--standalone"], "--standalone: pslaunch needs none: --tracker torch always runs its own store"),
    (["-np", "4"], "-np 4: pslaunch spells this -n 4 (processes per job; with -H the hosts share them)"),
    (["--np", "4"], "--np 4: pslaunch spells this -n 4"),
    (["-n", "4", "-hostfile", "my hosts"], "-hostfile my hosts: pslaunch spells this -H 'my hosts' (the same lines"),
    (["-n", "4", "--machinefile", "hosts"], "--machinefile hosts: pslaunch spells this -H hosts"),
    (["-n", "4", "--host", "h1:2,h2"],
     "--host h1:2,h2: pslaunch spells this -H 'h1 slots=2,h2' (in -H, ':N' is an ssh port; slots are 'slots=N')"),
    # several at once: one line that answers each
    (["-np", "4", "--host", "h1,h2"], "-np 4: pslaunch spells this -n 4 (processes per job; with -H the hosts "
     "share them); --host h1,h2: pslaunch spells this -H h1,h2"),
])
def test_torchrun_and_mpirun_flags_get_pslaunchs_spelling(args: list[str], answer: str, capsys) -> None:
    code, err = run_err([*args, "python", "train.py"], capsys)
    assert code == 2, err
    assert one_line(err).startswith(answer), err


def test_the_same_flags_after_the_command_are_the_commands(capsys, monkeypatch) -> None:
    """Everything from the command on is the command's, torchrun's spellings too; and a value of
    pslaunch's own options that looks like one is a value."""
    captured = {}
    monkeypatch.setattr(job, "execute", lambda spec: captured.setdefault("spec", spec) and 0)
    tail = ["--nproc-per-node", "4", "--nnodes=2", "-np", "2", "--host", "h1:2", "-hostfile", "f", "--standalone"]
    assert cli.main(["-n", "2", "--env", "X=--np", "python", "train.py", *tail]) == 0
    assert captured["spec"].command == ("python", "train.py", *tail)
    assert dict(captured["spec"].env) == {"X": "--np"}
    # and before the command, the same words are answered (the case)
    code, err = run_err(["-n", "2", "--nproc-per-node", "4", "python", "train.py", *tail], capsys)
    assert code == 2 and one_line(err) == ("--nproc-per-node 4: pslaunch spells this -n 4 (processes per job; "
                                           "with -H the hosts share them)"), err


def test_doctor_answers_them_too(capsys) -> None:
    code, err = run_err(["doctor", "-H", "h1,h2", "--nproc-per-node", "2", "python", "x.py"], capsys)
    assert code == 2 and one_line(err).startswith("--nproc-per-node 2: pslaunch spells this -n 2"), err


# --- a Python file as the command ----------------------------------------------------------------------


def pslaunch(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(pslaunch_argv(*args), capture_output=True, text=True, timeout=60, cwd=cwd,
                          env=env or dict(os.environ))


def test_a_python_file_as_the_command_is_answered_with_python(tmp_path: Path) -> None:
    """torchrun runs ``ddp.py`` with python; pslaunch runs the command as given, so a Python file
    that cannot run as a program is named at once, with the user's own command line to run
    instead (options re-quoted), exit 2, and nothing started."""
    script = tmp_path / "ddp.py"
    script.write_text("open('started', 'w').close()\n")
    python = "python" if any(os.access(os.path.join(d, "python"), os.X_OK)
                             for d in os.environ.get("PATH", "").split(os.pathsep) if d) else "python3"
    for command in (["ddp.py", "--epochs", "3"], ["./ddp.py"]):
        r = pslaunch("-n", "2", "--tracker", "torch", "--env", "NOTE=a b", *command, cwd=tmp_path)
        assert r.returncode == 2, r.stdout + r.stderr
        expect = (f"{command[0]} is a Python file; run: pslaunch -n 2 --tracker torch --env 'NOTE=a b' {python} "
                  f"{shlex.join(command)}")
        assert one_line(r.stderr.strip()) == expect
        assert r.stdout == ""
    # executable but without a #! line: exec cannot run it either
    script.chmod(0o755)
    r = pslaunch("-n", "1", "--dry-run", "ddp.py", cwd=tmp_path)
    assert r.returncode == 2 and "ddp.py is a Python file; run: pslaunch -n 1 --dry-run " in r.stderr, r.stderr
    assert not (tmp_path / "started").exists()
    # what can run is left alone
    assert_runnable_python_files_are_left_alone(tmp_path)


def assert_runnable_python_files_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("#!/usr/bin/env python3\nprint(1)\n")
    (tmp_path / "ok.py").chmod(0o755)
    assert pslaunch("-n", "1", "--dry-run", "./ok.py", cwd=tmp_path).returncode == 0
    assert pslaunch("-n", "1", "--dry-run", "ok.py", cwd=tmp_path).returncode == 0
    # a name on PATH is what the job runs, whatever is in this directory
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tool.py").write_text("#!/usr/bin/env python3\n")
    (bin_dir / "tool.py").chmod(0o755)
    (tmp_path / "tool.py").write_text("print(1)\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    assert pslaunch("-n", "1", "--dry-run", "tool.py", cwd=tmp_path, env=env).returncode == 0
    # and a python with the file is what the answer says
    assert pslaunch("-n", "1", "--dry-run", sys.executable, "tool.py", cwd=tmp_path).returncode == 0


def test_a_python_file_from_the_yaml_command_is_answered_too(tmp_path: Path) -> None:
    (tmp_path / "ddp.py").write_text("print(1)\n")
    (tmp_path / "job.yaml").write_text("num-workers: 2\ncommand: [ddp.py, --lr, '0.1']\n")
    r = pslaunch("--config", "job.yaml", cwd=tmp_path)
    assert r.returncode == 2
    assert one_line(r.stderr.strip()).startswith("ddp.py is a Python file; run: pslaunch --config job.yaml ")
    assert r.stderr.strip().endswith(" ddp.py --lr 0.1")


# --- -H: a file or hosts ---------------------------------------------------------------------------------


def test_h_that_is_neither_a_file_nor_a_host_is_a_usage_error(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/config of the user's
    expect = ("-H nosuchfile: no such file, and no host by that name resolves; give a hostfile path or host "
              "names (-H h1,h2)")
    code, err = run_err(["-n", "1", "-s", "0", "-H", "nosuchfile", "--dry-run", "true"], capsys)
    assert code == 2 and one_line(err) == expect, err
    code, err = run_err(["doctor", "-H", "nosuchfile", "true"], capsys)
    assert code == 2 and one_line(err) == expect, err
    # a name that resolves, an address, several names, a port: hosts, as before
    for value in ("localhost", "127.0.0.1", "nosuchfile,other", "nosuchfile:2222"):
        assert cli.main(["-n", "1", "-s", "0", "-H", value, "--dry-run", "true"]) == 0, value
    # a name ~/.ssh/config gives an address to is a host
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("Host nosuchfile\n  HostName 127.0.0.1\n")
    assert cli.main(["-n", "1", "-s", "0", "-H", "nosuchfile", "--dry-run", "true"]) == 0
    capsys.readouterr()


# --- doctor takes the job's command line ------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_doctor_takes_the_jobs_own_command_line(tmp_path: Path) -> None:
    """The job's options, those doctor does not check included, are accepted: the checks run (and
    fail here: no sshd on that port) instead of a usage error."""
    r = pslaunch("doctor", "-n", "2", "-s", "1", "-H", "127.0.0.1", "--tracker", "torch", "--kill-grace", "1",
                 "--max-restarts", "2", "--log-dir", "logs", "--ssh-port", str(closed_port()),
                 "--ssh-connect-timeout", "2", "python3", "x.py", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "0 of 1 host ready" in r.stdout and "127.0.0.1: ssh: " in r.stdout, r.stdout
    assert not (tmp_path / "logs").exists()  # (accepted, not acted on)


def test_doctor_help_lists_the_launcher_and_the_backend_options(capsys) -> None:
    assert cli.main(["doctor", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for option in ("--launcher", "--queue", "--ssh-user", "--sync-exclude", "-n, --num-workers", "--tracker",
                   "--check-import", "--launcher slurm"):
        assert option in out, option


def test_doctor_without_hosts_or_a_batch_system_is_a_usage_error(capsys) -> None:
    code, err = run_err(["doctor", "-n", "2", "python", "x.py"], capsys)
    assert code == 2 and "give the job's hosts: -H FILE or -H h1,h2 (or --launcher ray|slurm" in one_line(err), err


def test_doctor_launcher_slurm_takes_the_jobs_options_too(tmp_path: Path) -> None:
    """``--launcher slurm`` runs the batch system's checks (here: no Slurm commands on PATH), with
    the job's other options and command accepted; a --launcher in the command is the command's."""
    env = {**os.environ, "PATH": str(tmp_path)}
    r = pslaunch("doctor", "-n", "2", "--launcher", "slurm", "--queue", "q", "--tracker", "torch", "python", "x.py",
                 cwd=tmp_path, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "commands: srun" in r.stdout and "not found on PATH" in r.stdout, r.stdout
    r = pslaunch("doctor", "-H", "127.0.0.1", "--ssh-port", str(closed_port()), "--ssh-connect-timeout", "2",
                 "prog", "--launcher", "slurm", cwd=tmp_path)
    assert r.returncode == 1 and "0 of 1 host ready" in r.stdout, r.stdout + r.stderr
