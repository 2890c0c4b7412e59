"""``--sync-dst-dir``: what is copied from the working directory to every host.

The copy itself goes through each host's ssh wrapper (:mod:`launcher.transport.wiresync`, the
host's half :mod:`launcher.node.treesync`, whose rules are rsync's for what we use: size and
modification time decide, modes and links kept, excludes protected, ``--sync-delete``).

What is sent is decided once, here, before any host (:func:`plan_sync`, a :class:`SyncPlan`):
the excludes (``.git`` and ``__pycache__`` by default, plus ``--sync-exclude``); in a git work
tree, what ``.gitignore`` (and ``.git/info/exclude``, and the user's global excludes) ignores, as
``git ls-files --others --ignored --exclude-standard --directory`` lists it
(``--sync-no-gitignore`` turns that off); always, every virtual environment (a directory with
``pyvenv.cfg`` or ``conda-meta/``). The rest is counted, and above :data:`WARN_BYTES` or
:data:`WARN_FILES` the launcher warns with the largest directories; the dry run shows all of it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
from typing import Iterable, Optional, Sequence

from .. import external
from ..node import treesync

log = logging.getLogger(__name__)

#: above either, the launcher warns before syncing (and the dry run says so)
WARN_BYTES = 100 * 1024 * 1024
WARN_FILES = 10_000
#: how many of the largest directories a warning names
TOP_DIRS = 5
#: a directory holding one of these is a virtual environment (venv/virtualenv; conda)
VENV_MARKERS = ("pyvenv.cfg", "conda-meta")
GIT_TIMEOUT = 30.0


# --- excludes -------------------------------------------------------------------------


def is_excluded(rel: str, is_dir: bool, patterns: Iterable[str]) -> bool:
    """``rel`` (a ``/``-separated path below the synced root) matches an exclude pattern (the
    rules: :func:`launcher.node.treesync.is_excluded`, which the host applies too)."""
    return treesync.is_excluded(rel, is_dir, list(patterns))


# --- what is sent: .gitignore, virtual environments, size ------------------------------------------


def git_ignored(src: str) -> tuple[Optional[tuple[str, ...]], str]:
    """What git ignores below ``src`` (paths relative to it; directories end in ``/``), and why
    not when it cannot say: ``(None, reason)`` outside a work tree or without git."""
    git = shutil.which("git")
    if git is None:
        return None, "git is not installed"
    try:
        p = external.call([git, "-C", src, "ls-files", "--others", "--ignored", "--exclude-standard", "--directory",
                           "-z"], timeout=GIT_TIMEOUT)
    except external.CommandError as e:
        if e.returncode is None:
            return None, f"git failed: {e}"
        err = e.stderr.strip().splitlines()
        if any("not a git repository" in line for line in err):
            return None, "not a git work tree"
        return None, f"git: {err[-1] if err else f'exit code {e.returncode}'}"
    paths = tuple(sorted(x for x in p.stdout.split("\0") if x))
    return paths, "honoured"


def is_venv(path: str) -> bool:
    """A virtual environment: venv/virtualenv's ``pyvenv.cfg``, or conda's ``conda-meta/``."""
    return any(os.path.exists(os.path.join(path, m)) for m in VENV_MARKERS)


@dataclasses.dataclass(frozen=True)
class SyncPlan:
    """What ``--sync-dst-dir`` sends from ``src``: everything but ``excludes`` (patterns) and
    ``skipped`` (anchored paths: what git ignores, and virtual environments).

    ``files``/``bytes`` count what is sent; ``top`` the largest top-level directories (and
    files) by size.
    """

    src: str
    excludes: tuple[str, ...]
    ignored: tuple[str, ...] = ()   # by .gitignore (dirs end in /)
    venvs: tuple[str, ...] = ()     # virtual environments (end in /)
    gitignore: str = "off"          # honoured | off (--sync-no-gitignore) | why not
    files: int = 0
    bytes: int = 0
    top: tuple[tuple[str, int], ...] = ()

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.ignored) | set(self.venvs)))

    def skip_set(self) -> frozenset[str]:
        """The skipped paths without their trailing ``/`` (what :func:`local_tree` compares)."""
        return frozenset(p.rstrip("/") for p in self.skipped)

    @property
    def large(self) -> bool:
        return self.bytes > WARN_BYTES or self.files > WARN_FILES

    def summary(self) -> str:
        return f"{size_text(self.bytes)} in {self.files:,} file{'s' if self.files != 1 else ''}"

    def top_text(self) -> str:
        return ", ".join(f"{name} {size_text(size)}" for name, size in self.top)

    def warning(self, hosts: int) -> Optional[str]:
        """The warning for a large sync (None when it is not large)."""
        if not self.large:
            return None
        each = f"each of {hosts} hosts" if hosts != 1 else "the host"
        return (f"--sync-dst-dir will copy {self.summary()} from {self.src} to {each}; largest: "
                f"{self.top_text()}; leave out what the job does not need with --sync-exclude PATTERN or "
                ".gitignore, or run from a smaller directory")

    def describe(self) -> list[str]:
        """The dry run's account of it, one item a line."""
        out = [f"sends {self.summary()} from {self.src}" + (f"; largest: {self.top_text()}" if self.top else "")]
        out.append(f"excluded by pattern (--sync-exclude): {', '.join(self.excludes) or '-'}")
        if self.gitignore == "honoured":
            out.append(f"skipped by .gitignore: {_list(self.ignored)}")
        else:
            out.append(f".gitignore: {self.gitignore}")
        out.append(f"skipped virtual environments: {_list(self.venvs)}")
        return out


def _excluded_path(rel: str, is_dir: bool, patterns: Sequence[str]) -> bool:
    """``rel`` or one of its parent directories matches a pattern."""
    parts = rel.split("/")
    return any(is_excluded("/".join(parts[:i]), True, patterns) for i in range(1, len(parts))) or \
        is_excluded(rel, is_dir, patterns)


def _list(paths: Sequence[str], limit: int = 12) -> str:
    if not paths:
        return "none"
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit:,} more" if len(paths) > limit else "")


def plan_sync(src: str, excludes: Sequence[str], gitignore: bool = True) -> SyncPlan:
    """Decide what ``src`` sends (see the module docstring); walks the tree once, here."""
    ignored: tuple[str, ...] = ()
    if gitignore:
        found, state = git_ignored(src)
        if found is not None:
            ignored = found
    else:
        state = "off (--sync-no-gitignore)"
    # what a pattern excludes anyway is not listed again (each __pycache__/, say)
    ignored = tuple(p for p in ignored if not _excluded_path(p.rstrip("/"), p.endswith("/"), excludes))
    skip = {p.rstrip("/") for p in ignored}
    venvs: list[str] = []
    files = total = 0
    sizes: dict[str, int] = {}
    for root, dirs, names in os.walk(src):
        rel_root = os.path.relpath(root, src)
        rel_root = "" if rel_root == "." else rel_root.replace(os.sep, "/") + "/"
        keep = []
        for d in sorted(dirs):
            rel = rel_root + d
            path = os.path.join(root, d)
            if rel in skip or is_excluded(rel, True, excludes) or os.path.islink(path):
                continue
            if is_venv(path):
                venvs.append(rel + "/")
                continue
            keep.append(d)
        dirs[:] = keep
        for f in names:
            rel = rel_root + f
            if rel in skip or is_excluded(rel, False, excludes):
                continue
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                files += 1
                total += st.st_size
                head = rel.split("/", 1)[0] + ("/" if "/" in rel else "")
                sizes[head] = sizes.get(head, 0) + st.st_size
    top = tuple(sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_DIRS])
    return SyncPlan(src=src, excludes=tuple(excludes), ignored=ignored, venvs=tuple(sorted(venvs)), gitignore=state,
                    files=files, bytes=total, top=top)


def sends(src: str, rel: str, excludes: Sequence[str], ignored: Iterable[str] = ()) -> bool:
    """Whether the sync of ``src`` sends the file ``rel`` (a ``/``-separated path below it), by
    :func:`plan_sync`'s rules but without walking the tree: a regular file (or a link), in no
    excluded, git-ignored (``ignored``: :func:`git_ignored`'s paths), linked or virtual-environment
    directory, and not excluded itself."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts or not os.path.isfile(os.path.join(src, *parts)):
        return False
    skip = {p.rstrip("/") for p in ignored}
    for i in range(1, len(parts)):
        below = "/".join(parts[:i])
        path = os.path.join(src, *parts[:i])
        if below in skip or is_excluded(below, True, excludes) or os.path.islink(path) or is_venv(path):
            return False
    whole = "/".join(parts)
    return whole not in skip and not is_excluded(whole, False, excludes)


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
