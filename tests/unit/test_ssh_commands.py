"""Golden tests of everything the ssh backend sends to a host, and of its pure helpers."""

from __future__ import annotations

import ast
import json
import re
import shlex
import struct

import pytest

from launcher import node
from launcher.backends.ssh import (
    SSHBackend,
    hosts_with_processes,
    kill_command,
    wrapper_command,
    wrapper_header,
    wrapper_payload,
)
from launcher.node.protocol import BOOTSTRAP, HEAD, HEADER, NODE
from launcher.spec.job import Host, JobSpec, Role
from launcher.spec.plan import ProcSpec, build_plan
from launcher.transport.ssh import SSHOptions


def test_wrapper_command_is_the_bootstrap_and_nothing_job_specific() -> None:
    assert wrapper_command() == "exec python3 -S -c " + shlex.quote(BOOTSTRAP)
    assert wrapper_command("/opt/py 3/bin/python3") == "exec '/opt/py 3/bin/python3' -S -c " + shlex.quote(BOOTSTRAP)
    assert shlex.split(wrapper_command())[-1] == BOOTSTRAP
    compile(BOOTSTRAP, "bootstrap", "exec")


#: what a host's python3 runs for the ssh backend (the wrapper, doctor's probe): Python 3.5 syntax
OLD_PYTHON_MODULES = ("ssh_loader", "ssh_wrapper", "protocol", "agent", "errorfile", "probe", "procgroup", "treesync",
                      "safefiles", "watchdog", "__init__")


def test_the_old_python_modules_are_what_the_ssh_wrapper_and_the_probe_import() -> None:
    """Every node module that the wrapper or the probe imports on a host is in OLD_PYTHON_MODULES
    (what they import only with Python 3.7, netif, or only once the processes start, the watchdog,
    is imported where it is used)."""
    import subprocess
    import sys

    code = ("import sys; import launcher.node.ssh_wrapper, launcher.node.probe; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('launcher.node'))))")
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=node.ROOT, check=True)
    loaded = {m.rpartition(".")[2] for m in r.stdout.split()}
    assert loaded - {"node"} <= set(OLD_PYTHON_MODULES) and "watchdog" not in loaded


@pytest.mark.parametrize("name", OLD_PYTHON_MODULES)
def test_what_the_ssh_wrapper_runs_is_python_35_syntax(name: str) -> None:
    with open(node.path(name), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    newer = (ast.JoinedStr, ast.NamedExpr, ast.AnnAssign)  # f-strings 3.6, := 3.8, annotations 3.6
    assert [type(n).__name__ for n in ast.walk(tree) if isinstance(n, newer)] == []
    assert not any(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in ast.walk(tree))
    assert all(a.annotation is None for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
               for a in n.args.args) and all(n.returns is None for n in ast.walk(tree)
                                            if isinstance(n, ast.FunctionDef))
    with open(node.path(name), encoding="utf-8") as f:  # 1_000 (3.6) parses to a plain int
        assert not re.search(r"\b\d+_\d", f.read())


def test_wrapper_payload_layout() -> None:
    proc = ProcSpec(Role.WORKER, 1, 1, Host("h"), ("python", "x.py", "a b", "$(id)"),
                    {"PSLAUNCH_SECRET": "s3cr3t", "DMLC_ROLE": "worker"})
    header = wrapper_header([(4, proc)], "/work dir", keepalive=2.0, grace=3.0)
    assert header == {"procs": [{"id": 4, "argv": ["python", "x.py", "a b", "$(id)"],
                                 "env": {"PSLAUNCH_SECRET": "s3cr3t", "DMLC_ROLE": "worker"}, "cwd": "/work dir"}],
                      "keepalive": 2.0, "lost_after": 8.0, "grace": 3.0}
    payload = wrapper_payload(header, bundle=b"ZIP")
    with open(node.path("ssh_loader"), "rb") as f:
        loader = f.read()
    n = len(loader)
    assert payload[:10] == b"%010d" % n and payload[10:10 + n] == loader  # what BOOTSTRAP runs
    assert payload[10 + n:20 + n] == b"0000000003" and payload[20 + n:23 + n] == b"ZIP"  # what the loader imports
    rest = payload[23 + n:]
    kind, ident, length = struct.unpack(">cHI", rest[:7])
    assert (kind, ident) == (HEADER, NODE) and json.loads(rest[7:7 + length]) == header and len(rest) == 7 + length
    assert HEAD.size == 7
    # the secret travels on stdin only: the command line is the same for every host and job
    assert "s3cr3t" not in wrapper_command() and "DMLC" not in wrapper_command()


def test_kill_command_signals_process_groups_only() -> None:
    # a stopped (SIGSTOP) process gets SIGTERM only once resumed: SIGCONT follows at once
    assert kill_command("TERM", [4242, 17]) == \
        "kill -s TERM -- -17 -4242 2>/dev/null; kill -s CONT -- -17 -4242 2>/dev/null; exit 0"
    assert kill_command("KILL", [5, 5]) == "kill -s KILL -- -5 2>/dev/null; exit 0"
    # -1 would be every process of the user, -0 the shell's own group
    assert kill_command("ABRT", [1, 0, -3, 99]) == "kill -s ABRT -- -99 2>/dev/null; exit 0"
    with pytest.raises(ValueError):
        kill_command("TERM", [1, 0])
    with pytest.raises(ValueError):
        kill_command("TERM; rm -rf /", [99])


def _spec(**kw) -> JobSpec:
    base = dict(command=("python", "train.py"), num_workers=3, num_servers=2, launcher="ssh",
                hosts=(Host("A"), Host("B", port=2222, user="bob"), Host("C"), Host("D")), workdir="/home/me/job")
    base.update(kw)
    return JobSpec(**base)


def test_hosts_with_processes_in_hostfile_order() -> None:
    assert [h.name for h in hosts_with_processes(_spec())] == ["A", "B", "C", "D"]
    assert [h.name for h in hosts_with_processes(_spec(num_workers=1, num_servers=1))] == ["A", "B"]


def test_interface_env_option_wins_over_the_environment() -> None:
    assert _spec().interface == ""
    assert _spec(environ=(("DMLC_INTERFACE", "eth0"),)).interface == "eth0"
    assert _spec(environ=(("DMLC_INTERFACE", "eth0"),), env=(("DMLC_INTERFACE", "10.1.0.0/16"),)).interface \
        == "10.1.0.0/16"


def test_dry_run_shows_hosts_commands_and_sync(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr("getpass.getuser", lambda: "me")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ssh/config: the job's defaults, as a run resolves them
    spec = _spec(num_workers=2, num_servers=1, hosts=(Host("A"), Host("B", port=2222, user="bob")),
                 sync_dst_dir="/tmp/job", options=SSHOptions(sync_exclude=(".git", "__pycache__", "*.log"),
                                                             sync_delete=True))
    plan = build_plan(spec, root_uri="10.0.0.1", root_port=9091, secret="0" * 64, job_id="x",
                      addresses={Host("A"): "A", Host("B", port=2222, user="bob"): "B"}, inherit_environ=False)
    lines = SSHBackend.dry_run(spec, plan)
    text = "\n".join(lines)
    assert "each process's argv, environment and directory from the channel's stdin (never a command line)" \
        in lines[0]
    assert "  A: me@A:22, cwd /tmp/job: server 0, worker 1" in lines
    assert "  bob@B:2222: bob@B:2222, cwd /tmp/job: worker 0" in lines
    assert ("sync to /tmp/job on each host, through its wrapper on the job's connection (files that differ in size "
            "or modification time; 0 to compare; what is gone here is deleted there):") in lines
    assert "0" * 64 not in text


def test_an_interrupt_while_hosts_prepare_returns_at_once() -> None:
    """Ctrl-C while the hosts' wrappers sync: the launcher does not wait for them (close() then ends
    the connections, and each wrapper stops with its channel)."""
    import io
    import signal
    import threading
    import time
    import types

    from launcher.runtime.output import Console

    backend = SSHBackend(_spec(sync_dst_dir="/tmp/job"), Console(stdout=io.BytesIO(), stderr=io.BytesIO()), None)
    backend.hosts = {("me", "A", 22): types.SimpleNamespace(label="A")}
    never = threading.Event()

    class Interrupted(BaseException):
        pass

    def interrupt(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            backend._per_host(lambda host: never.wait(30), "prepare")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        never.set()
    assert time.monotonic() - t0 < 5


def test_dry_run_without_paramiko_says_the_config_was_not_applied(tmp_path) -> None:
    """Without paramiko (None in sys.modules: Python's own way to make an import fail) the dry run
    still shows the plan, and says that ~/.ssh/config was not applied to it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['paramiko'] = None; from launcher.cli import main; "
            "main(['-n', '1', '-s', '0', '-H', 'A,B', '--sync-dst-dir', '/tmp/j', '--dry-run', 'true'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "  note: ~/.ssh/config not applied (paramiko is not installed)" in r.stdout
    assert "through its wrapper on the job's connection" in r.stdout
