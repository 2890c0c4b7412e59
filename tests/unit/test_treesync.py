"""The tree copy the ssh wrapper does for --sync-dst-dir (launcher.node.treesync), on real directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.node import treesync as ts


def make_tree(root: Path) -> None:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "train.py").write_text("print('hi')\n")
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "sub" / "data.bin").write_bytes(os.urandom(300_000))
    (root / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(root / "run.sh", 0o755)
    os.symlink("train.py", root / "link.py")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref\n")
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"x")
    os.utime(root / "train.py", (1_600_000_000, 1_600_000_000))


def sync(src: Path, dst: Path, excludes=(".git", "__pycache__"), skip=(), delete=False, chunk=65536):
    rows = ts.manifest(ts.scan(str(src), excludes, skip))
    r = ts.Receiver(str(dst), rows, excludes, skip, delete)
    need = r.need()
    for rel in need:
        data = (src / rel).read_bytes()
        pieces = [data[i:i + chunk] for i in range(0, len(data), chunk)] or [b""]
        for i, piece in enumerate(pieces):
            r.write(rel, piece, i == len(pieces) - 1)
    return need, r.finish()


def test_a_fresh_copy_then_an_unchanged_one_sends_nothing(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    make_tree(src)
    need, stats = sync(src, dst)
    assert sorted(need) == ["pkg/__init__.py", "pkg/sub/data.bin", "run.sh", "train.py"]
    assert stats["files"] == 5 and stats["bytes"] == sum((src / r).stat().st_size for r in need)  # + the link
    excludes = (".git", "__pycache__")
    assert ts.scan(str(dst), excludes) == ts.scan(str(src), excludes)  # kinds, sizes, mtimes, modes, links
    assert (dst / "pkg" / "sub" / "data.bin").read_bytes() == (src / "pkg" / "sub" / "data.bin").read_bytes()
    assert os.readlink(dst / "link.py") == "train.py" and os.stat(dst / "run.sh").st_mode & 0o777 == 0o755
    assert not (dst / ".git").exists() and not (dst / "pkg" / "__pycache__").exists()
    need, stats = sync(src, dst)
    assert need == [] and stats["files"] == 0 and stats["bytes"] == 0


def test_changes_modes_and_deletes(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    make_tree(src)
    sync(src, dst)
    (src / "train.py").write_text("print('changed')\n")
    os.chmod(src / "pkg" / "__init__.py", 0o600)
    (src / "run.sh").unlink()
    (dst / ".git").mkdir()
    (dst / ".git" / "keep").write_text("on the host")  # excluded: protected even with delete
    (dst / "skipped").mkdir()
    (dst / "skipped" / "big").write_text("skipped by the launcher: never touched")
    need, stats = sync(src, dst, skip=("skipped/",))
    assert need == ["train.py"] and (dst / "run.sh").exists()  # no delete: it stays
    assert os.stat(dst / "pkg" / "__init__.py").st_mode & 0o777 == 0o600
    need, stats = sync(src, dst, skip=("skipped/",), delete=True)
    assert need == [] and stats["deleted"] == 1 and not (dst / "run.sh").exists()
    assert (dst / ".git" / "keep").exists() and (dst / "skipped" / "big").exists()


def test_kinds_that_change_are_replaced(tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    make_tree(src)
    sync(src, dst)
    (src / "link.py").unlink()
    (src / "link.py").mkdir()  # a link becomes a directory
    (src / "link.py" / "f").write_text("f")
    os.rename(src / "train.py", src / "t")
    (src / "train.py").mkdir()  # a file becomes a directory
    sync(src, dst, delete=True)
    assert (dst / "link.py").is_dir() and not (dst / "link.py").is_symlink() and (dst / "link.py" / "f").exists()
    assert (dst / "train.py").is_dir()


def test_nothing_is_written_outside_the_target(tmp_path: Path) -> None:
    dst, outside = tmp_path / "dst", tmp_path / "outside"
    dst.mkdir()
    outside.mkdir()
    for rel in ("../x", "/etc/x", "a/../../x", "", "a//b", "./a"):
        with pytest.raises(ValueError, match="refusing the path"):
            ts.Receiver(str(dst), [[rel, "f", 1, 0, 0o644, ""]])
    # a directory on the host that is a link to elsewhere is replaced, not written through
    os.symlink(str(outside), dst / "pkg")
    r = ts.Receiver(str(dst), [["pkg", "d", 0, 0, 0o755, ""], ["pkg/f", "f", 2, 0, 0o644, ""]])
    assert r.need() == ["pkg/f"]
    r.write("pkg/f", b"hi", True)
    r.finish()
    assert list(outside.iterdir()) == [] and (dst / "pkg").is_dir() and not (dst / "pkg").is_symlink()


def test_data_out_of_order_is_refused(tmp_path: Path) -> None:
    r = ts.Receiver(str(tmp_path / "d"), [["a", "f", 4, 0, 0o644, ""], ["b", "f", 4, 0, 0o644, ""]])
    r.write("a", b"ab", False)
    with pytest.raises(ValueError, match="ended early"):
        r.write("b", b"cd", True)
    with pytest.raises(ValueError, match="unexpected data"):
        ts.Receiver(str(tmp_path / "e"), [["a", "d", 0, 0, 0o755, ""]]).write("a", b"x", True)


@pytest.mark.parametrize(("rel", "is_dir", "patterns", "expected"), [
    ("a/b/__pycache__", True, ["__pycache__"], True),
    ("a/build", False, ["build/"], False),
    ("a/build", True, ["build/"], True),
    ("data/x.csv", False, ["/data"], False),
    ("data", True, ["/data"], True),
    ("a/data/x.csv", False, ["data/*.csv"], True),
    ("x.log", False, ["*.log"], True),
])
def test_exclude_rules(rel: str, is_dir: bool, patterns: list[str], expected: bool) -> None:
    assert ts.is_excluded(rel, is_dir, patterns) is expected
