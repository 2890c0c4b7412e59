"""--sync-dst-dir: excludes, the local tree, and what is sent (.gitignore, virtual environments, size)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from launcher.node import treesync
from launcher.transport.sync import is_excluded


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
    tree = treesync.scan(str(tmp_path), (".git", "*.pyc"))
    assert sorted(tree) == ["link", "src", "src/m.py"]
    assert tree["link"][0] == treesync.LINK and tree["link"][4] == "src/m.py"
    assert tree["src/m.py"][0] == treesync.FILE and tree["src/m.py"][1] == 7


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
    sent = set(treesync.scan(str(src), plan.excludes, plan.skipped))
    assert sent == {".gitignore", "keep.log", "pkg", "pkg/train.py", "untracked.py", "envs"}
    assert plan.files == 4 and plan.bytes == sum((src / f).stat().st_size for f in
                                                 (".gitignore", "keep.log", "pkg/train.py", "untracked.py"))
    # the switch: only the virtual environments stay out
    off = plan_sync(str(src), (".git",), gitignore=False)
    assert off.gitignore.startswith("off") and off.ignored == () and off.venvs == ("envs/conda1/", "myenv/")
    assert {"build/lib/x.so", "run.log", "data/big.bin"} <= set(treesync.scan(str(src), off.excludes, off.skipped))


def test_the_host_gets_what_the_plan_sends_and_keeps_what_it_skips(tmp_path) -> None:
    """The wrapper's half (local to local) given the plan: exactly the planned files arrive, and with
    --sync-delete what the plan skips is not deleted on the host."""
    from launcher.transport.sync import plan_sync
    from launcher.transport.wiresync import TreeSync

    src = _git_project(tmp_path)
    plan = plan_sync(str(src), (".git", "__pycache__"))
    dst = tmp_path / "dst"
    (dst / "data").mkdir(parents=True)
    (dst / "data" / "on-the-host.bin").write_text("skipped by the plan: kept")
    tree = TreeSync(str(src), str(dst), plan.excludes, skip=plan.skipped, delete=True)
    r = treesync.Receiver(str(dst), treesync.manifest(tree.tree), plan.excludes, plan.skipped, delete=True)
    for rel in r.need():
        r.write(rel, (src / rel).read_bytes(), True)
    r.finish()
    got = {str(p.relative_to(dst)) for p in dst.rglob("*")}
    assert got == set(tree.tree) | {"data", "data/on-the-host.bin"}


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
