"""Golden tests of everything the ssh backend sends to a host, and of its pure helpers."""

from __future__ import annotations

import ast
import json
import shlex
import struct

import pytest

from launcher import node
from launcher.backends.ssh import (
    SSHBackend,
    hosts_with_processes,
    kill_command,
    netif_command,
    wrapper_command,
    wrapper_header,
    wrapper_payload,
)
from launcher.node.ssh_wire import BOOTSTRAP, HOST_ID, KEEPALIVE, MAGIC, FrameDecoder
from launcher.spec.job import Host, JobSpec, Role
from launcher.spec.plan import ProcSpec, build_plan
from launcher.transport.ssh import SSHOptions, Target
from launcher.transport.sync import Syncer, parse_prepare_dir, prepare_dir_command


def test_wrapper_command_is_the_bootstrap_and_nothing_job_specific() -> None:
    assert wrapper_command() == "exec python3 -S -c " + shlex.quote(BOOTSTRAP)
    assert wrapper_command("/opt/py 3/bin/python3") == "exec '/opt/py 3/bin/python3' -S -c " + shlex.quote(BOOTSTRAP)
    assert shlex.split(wrapper_command())[-1] == BOOTSTRAP
    compile(BOOTSTRAP, "bootstrap", "exec")


#: what a host's python3 runs for the ssh backend: Python 3.5 syntax
OLD_PYTHON_MODULES = ("ssh_loader", "ssh_wrapper", "ssh_wire", "procgroup", "__init__")


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
    kind, length = struct.unpack(">cI", rest[:5])
    assert kind == b"H" and json.loads(rest[5:5 + length]) == header and len(rest) == 5 + length
    assert KEEPALIVE == b"k\0\0\0\0"
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


def test_netif_and_directory_commands_quote_their_arguments() -> None:
    assert netif_command("10.1.0.0/16") == "python3 -S - 10.1.0.0/16"
    assert netif_command("eth0; touch x") == "python3 -S - 'eth0; touch x'"
    assert prepare_dir_command("/tmp/job") == ('mkdir -p -- /tmp/job && cd -- /tmp/job && echo "pslaunch-dir=$(pwd)" '
                                               '&& echo "pslaunch-rsync=$(command -v rsync)"')
    assert prepare_dir_command("my dir/$(id)").startswith("mkdir -p -- 'my dir/$(id)' && cd -- 'my dir/$(id)' && ")
    # a leading ~ is the remote home (not a directory named "~"); the rest stays quoted
    assert prepare_dir_command("~/my job").startswith('mkdir -p -- "$HOME"/\'my job\' && cd -- "$HOME"/\'my job\' && ')
    assert prepare_dir_command("~").startswith('mkdir -p -- "$HOME" && cd -- "$HOME" && ')
    assert prepare_dir_command("~/$(id)").startswith("mkdir -p -- \"$HOME\"/'$(id)' && ")
    assert prepare_dir_command("~other/x").startswith("mkdir -p -- '~other/x' && ")
    # what a login shell prints from its rc files does not confuse the parser
    assert parse_prepare_dir("Welcome!\npslaunch-dir=/home/u/job x\npslaunch-rsync=/usr/bin/rsync\n") == \
        ("/home/u/job x", True)
    assert parse_prepare_dir("pslaunch-dir=/tmp/j\npslaunch-rsync=\n") == ("/tmp/j", False)


def test_frame_decoder_handles_split_and_joined_frames() -> None:
    frames = [(b"p", 0, b'{"pid": 5, "pgid": 5}'), (b"o", 3, b"hello\n"), (b"h", HOST_ID, b""),
              (b"x", 0, b'{"code": 0}')]
    data = b"".join(struct.pack(">cHI", k, n, len(p)) + p for k, n, p in frames)
    stream = b"Welcome to node1\n" + MAGIC + data  # a chatty .bashrc first
    dec = FrameDecoder()
    got = []
    for i in range(0, len(stream), 3):
        got += dec.feed(stream[i:i + 3])
    assert got == frames and dec.pending == 0 and bytes(dec.preamble) == b"Welcome to node1\n"
    assert FrameDecoder().feed(MAGIC + data) == frames
    assert FrameDecoder(expect_marker=False).feed(data) == frames


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


def test_dry_run_shows_hosts_commands_and_sync(monkeypatch) -> None:
    monkeypatch.setattr("getpass.getuser", lambda: "me")
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
    assert ("  rsync -az -s --stats --timeout=60 --delete --exclude=.git --exclude=__pycache__ '--exclude=*.log' -e "
            "'ssh -F /dev/null -p 2222 -l bob -o BatchMode=yes -o StrictHostKeyChecking=yes -o ConnectTimeout=10' "
            "/home/me/job/ B:/tmp/job/") in lines
    assert "0" * 64 not in text


class _Watchdog:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def watch(self, pgid: int) -> None:
        self.calls.append(("watch", pgid))

    def forget(self, pgid: int) -> None:
        self.calls.append(("forget", pgid))


def test_rsync_runs_in_its_own_group_known_to_the_watchdog(tmp_path, monkeypatch) -> None:
    """If the launcher is killed during a sync, the watchdog stops rsync (and its ssh) too."""
    import os
    import types

    fake = tmp_path / "bin" / "rsync"
    fake.parent.mkdir()
    report = tmp_path / "ids"
    fake.write_text(f'#!/bin/sh\necho "$$ $(ps -o pgid= -p $$)" > {report}\n'
                    'echo "Number of regular files transferred: 2"\necho "Total bytes sent: 10"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    watchdog = _Watchdog()
    syncer = Syncer(str(tmp_path), "/tmp/job", SSHOptions(), watchdog)
    session = types.SimpleNamespace(label="A", target=Target(host=Host("A"), hostname="A", port=22, user="me"))
    stats = syncer._rsync(session, "/tmp/job")
    assert (stats.files, stats.bytes) == (2, 10)
    pid, pgid = (int(x) for x in report.read_text().split())
    assert pid == pgid  # a group of its own, which the watchdog can kill whole
    assert watchdog.calls == [("watch", pid), ("forget", pid)]


def test_an_interrupt_during_the_sync_stops_rsync_at_once() -> None:
    """Ctrl-C while hosts sync: the launcher does not wait for the rsyncs to finish (they are in
    groups of their own, so the terminal's SIGINT does not reach them): it kills them."""
    import io
    import signal
    import subprocess
    import time
    import types

    from launcher.runtime.output import Console

    backend = SSHBackend(_spec(sync_dst_dir="/tmp/job"), Console(stdout=io.BytesIO(), stderr=io.BytesIO()), None)
    slow = subprocess.Popen(["sleep", "30"], start_new_session=True)
    backend.syncer = Syncer("/src", "/tmp/job", SSHOptions())
    backend.syncer._rsyncs.add(slow)
    backend.hosts = {("me", "A", 22): types.SimpleNamespace(label="A")}

    class Interrupted(BaseException):
        pass

    def interrupt(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    t0 = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            backend._per_host(lambda host: slow.wait(), "sync")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if slow.poll() is None:
            slow.kill()
    assert slow.wait(timeout=5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 5
