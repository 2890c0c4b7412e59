"""--sync-dst-dir helpers: excludes, the rsync command line and its statistics, the local tree."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from launcher.spec.job import Host
from launcher.transport.ssh import Target
from launcher.transport.sync import (
    is_excluded,
    local_tree,
    parse_rsync_stats,
    rsync_argv,
    ssh_command_for_rsync,
)

TARGET = Target(host=Host("node1"), hostname="10.0.0.5", port=2222, user="alice",
                key_files=("/home/a/.ssh/id key",), known_hosts=("/home/a/.ssh/known_hosts", "/etc/kh"),
                config_file="/home/a/.ssh/config")


def test_ssh_command_uses_the_jobs_settings_and_strict_host_keys() -> None:
    assert ssh_command_for_rsync(TARGET, 7.6, TARGET.config_file) == [
        "ssh", "-F", "/home/a/.ssh/config", "-p", "2222", "-l", "alice", "-i", "/home/a/.ssh/id key",
        "-o", "IdentitiesOnly=no", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
        "-o", "ConnectTimeout=8", "-o", "UserKnownHostsFile=/home/a/.ssh/known_hosts /etc/kh"]


def test_rsync_argv_golden() -> None:
    argv = rsync_argv("/src/proj/", "/tmp/job", TARGET, excludes=(".git", "__pycache__", "*.log"), delete=True,
                      connect_timeout=10, config_file=None)
    assert argv == [
        "rsync", "-az", "-s", "--stats", "--timeout=60", "--delete", "--exclude=.git", "--exclude=__pycache__",
        "--exclude=*.log", "-e",
        "ssh -F /dev/null -p 2222 -l alice -i '/home/a/.ssh/id key' -o IdentitiesOnly=no -o BatchMode=yes "
        "-o StrictHostKeyChecking=yes -o ConnectTimeout=10 -o 'UserKnownHostsFile=/home/a/.ssh/known_hosts /etc/kh'",
        "/src/proj/", "10.0.0.5:/tmp/job/"]
    assert "StrictHostKeyChecking=no" not in " ".join(argv)


def test_rsync_argv_ipv6_and_no_delete() -> None:
    t = Target(host=Host("fe80::1"), hostname="fe80::1", port=22, user="u")
    argv = rsync_argv("/s", "rel/dir", t, excludes=(), delete=False, connect_timeout=5, config_file=None)
    assert "--delete" not in argv and argv[-2:] == ["/s/", "[fe80::1]:rel/dir/"]


RSYNC_32 = """
Number of files: 7 (reg: 5, dir: 2)
Number of created files: 6 (reg: 5, dir: 1)
Number of deleted files: 0
Number of regular files transferred: 5
Total file size: 200,033 bytes
Total transferred file size: 200,033 bytes
Literal data: 200,033 bytes
Matched data: 0 bytes
File list size: 0
Total bytes sent: 200,612
Total bytes received: 136
"""

RSYNC_30 = """Number of files: 4
Number of files transferred: 2
Total file size: 10 bytes
Total bytes sent: 321
Total bytes received: 42
"""


def test_parse_rsync_stats_of_several_versions() -> None:
    assert parse_rsync_stats(RSYNC_32) == (5, 200612)
    assert parse_rsync_stats(RSYNC_30) == (2, 321)
    assert parse_rsync_stats("") == (0, 0)


@pytest.mark.parametrize("rel, is_dir, patterns, expected", [
    (".git", True, (".git",), True),
    ("sub/.git", True, (".git",), True),
    ("sub/__pycache__", True, ("__pycache__",), True),
    ("a.log", False, ("*.log",), True),
    ("deep/er/a.log", False, ("*.log",), True),
    ("a.txt", False, ("*.log",), False),
    ("build", False, ("build/",), False),  # trailing /: directories only
    ("build", True, ("build/",), True),
    ("data/raw", True, ("/data/raw",), True),  # anchored
    ("x/data/raw", True, ("/data/raw",), False),
    ("x/data/raw", True, ("data/raw",), True),  # unanchored with a /: any depth
    ("gitignore", False, (".git",), False),
])
def test_is_excluded(rel: str, is_dir: bool, patterns: tuple, expected: bool) -> None:
    assert is_excluded(rel, is_dir, patterns) is expected


def test_local_tree_skips_excluded_directories_and_keeps_links(tmp_path) -> None:
    (tmp_path / ".git" / "objects").mkdir(parents=True)
    (tmp_path / ".git" / "objects" / "x").write_text("x")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "m.py").write_text("print()")
    (tmp_path / "src" / "m.pyc").write_text("")
    os.symlink("src/m.py", tmp_path / "link")
    tree = local_tree(str(tmp_path), (".git", "*.pyc"))
    assert sorted(tree) == ["link", "src", "src/m.py"]
    assert tree["link"].kind == "link" and tree["link"].link == "src/m.py"
    assert tree["src/m.py"].kind == "file" and tree["src/m.py"].size == 7


def test_rsync_remote_path_never_reaches_a_shell(tmp_path, monkeypatch) -> None:
    """The destination goes through rsync's protocol (-s), so even the old argument handling
    (an rsync before 3.2.4, or RSYNC_OLD_ARGS=1) cannot let the remote shell run $(...)."""
    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    fake_ssh = tmp_path / "fake-ssh"  # as ssh does: drop the host, run the rest with a shell
    fake_ssh.write_text('#!/bin/sh\nshift\nexec sh -c "$*"\n')
    fake_ssh.chmod(0o755)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("hi")
    marker = tmp_path / "PWNED"
    dst = tmp_path / "dst $(touch PWNED); x"  # the fake ssh runs in tmp_path
    dst.mkdir()  # the backend creates it first (prepare_dir_command)
    argv = rsync_argv(str(src), str(dst), Target(host=Host("h"), hostname="h", port=22, user="u"), excludes=(),
                      delete=False, connect_timeout=5, config_file=None)
    argv[argv.index("-e") + 1] = str(fake_ssh)
    monkeypatch.setenv("RSYNC_OLD_ARGS", "1")
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert not marker.exists(), "the remote shell ran part of --sync-dst-dir"
    assert r.returncode == 0, r.stderr
    assert (dst / "f").read_text() == "hi"


# --- what is sent: .gitignore, virtual environments, the size warning ---------------------------------


def _git_project(tmp_path):
    """A git work tree with ignored files, a virtual environment and a conda environment."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    src = tmp_path / "proj"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "train.py").write_text("print(1)\n")
    (src / "untracked.py").write_text("x = 1\n")            # untracked but not ignored: sent
    (src / ".gitignore").write_text("build/\n*.log\n/data/\n!keep.log\n")
    (src / "build" / "lib").mkdir(parents=True)
    (src / "build" / "lib" / "x.so").write_bytes(b"\0" * 1000)
    (src / "run.log").write_text("log\n")
    (src / "keep.log").write_text("kept\n")
    (src / "data").mkdir()
    (src / "data" / "big.bin").write_bytes(b"\0" * 5000)
    (src / "odd*name[1].log").write_text("wild\n")
    venv = src / "myenv"                                        # not in .gitignore: found by its pyvenv.cfg
    (venv / "lib").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "lib" / "site.py").write_text("#\n")
    (src / "envs" / "conda1" / "conda-meta").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(src)], check=True)
    subprocess.run(["git", "-C", str(src), "add", ".gitignore", "pkg"], check=True)
    return src


def test_plan_honours_gitignore_and_skips_virtual_environments(tmp_path) -> None:
    from launcher.transport.sync import plan_sync

    src = _git_project(tmp_path)
    plan = plan_sync(str(src), (".git", "__pycache__"))
    assert plan.gitignore == "honoured"
    assert plan.ignored == ("build/", "data/", "odd*name[1].log", "run.log")
    assert plan.venvs == ("envs/conda1/", "myenv/")
    sent = set(local_tree(str(src), plan.excludes, plan.skip_set()))
    assert sent == {".gitignore", "keep.log", "pkg", "pkg/train.py", "untracked.py", "envs"}
    assert plan.files == 4 and plan.bytes == sum((src / f).stat().st_size for f in
                                                 (".gitignore", "keep.log", "pkg/train.py", "untracked.py"))
    # rsync gets the same list, anchored and NUL-terminated, its wildcards escaped
    assert plan.exclude_from().split(b"\0")[:-1] == [
        b"/build/", b"/data/", b"/envs/conda1/", b"/myenv/", b"/odd\\*name\\[1].log", b"/run.log"]
    # the switch: only the virtual environments stay out
    off = plan_sync(str(src), (".git",), gitignore=False)
    assert off.gitignore.startswith("off") and off.ignored == () and off.venvs == ("envs/conda1/", "myenv/")
    assert {"build/lib/x.so", "run.log", "data/big.bin"} <= set(local_tree(str(src), off.excludes, off.skip_set()))


def test_rsync_honours_the_plan(tmp_path) -> None:
    """A real rsync (local to local) given the plan's stdin sends exactly what the SFTP path would."""
    from launcher.transport.sync import plan_sync

    if shutil.which("rsync") is None:
        pytest.skip("rsync is not installed")
    src = _git_project(tmp_path)
    plan = plan_sync(str(src), (".git", "__pycache__"))
    dst = tmp_path / "dst"
    argv = rsync_argv(str(src), str(dst), Target(host=Host("h"), hostname="h", port=22, user="u"),
                      excludes=plan.excludes, delete=False, connect_timeout=5, config_file=None,
                      exclude_from_stdin=True)
    assert argv[argv.index("--from0"):argv.index("--from0") + 2] == ["--from0", "--exclude-from=-"]
    local = [a for a in argv if a not in ("-e",) and not a.startswith("ssh ")][:-1] + [str(dst) + "/"]
    subprocess.run(local, input=plan.exclude_from(), check=True, capture_output=True)
    got = {str(p.relative_to(dst)) for p in dst.rglob("*")}
    assert got == set(local_tree(str(src), plan.excludes, plan.skip_set()))


def test_a_large_sync_warns_with_the_largest_directories(tmp_path, monkeypatch) -> None:
    from launcher.transport import sync

    src = tmp_path / "p"
    for name, size in (("data", 3000), ("models", 2000), ("code", 10)):
        (src / name).mkdir(parents=True)
        (src / name / "f.bin").write_bytes(b"\0" * size)
    (src / "top.bin").write_bytes(b"\0" * 500)
    plan = sync.plan_sync(str(src), ())
    assert plan.warning(2) is None and plan.gitignore == "not a git work tree"
    monkeypatch.setattr(sync, "WARN_BYTES", 4000)
    w = sync.plan_sync(str(src), ()).warning(2)
    assert w is not None and w.startswith(f"--sync-dst-dir will copy 5.4 KiB in 4 files from {src} to each of 2 hosts")
    assert "largest: data/ 2.9 KiB, models/ 2.0 KiB, top.bin 500 B, code/ 10 B" in w
    monkeypatch.setattr(sync, "WARN_BYTES", 10 ** 9)
    monkeypatch.setattr(sync, "WARN_FILES", 3)
    assert "4 files" in sync.plan_sync(str(src), ()).warning(1)
