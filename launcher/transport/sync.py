"""``--sync-dst-dir``: copy the working directory to every host before launch.

Two ways, chosen per host:

* **rsync** (when ``rsync`` and ``ssh`` exist here and ``rsync`` on the host):
  ``rsync -az -s --stats`` over OpenSSH with the job's own settings (user, port,
  keys, known_hosts, ``StrictHostKeyChecking=yes``, ``BatchMode=yes``);
  :func:`rsync_argv` builds the command line (pure).
* **SFTP delta** over the job's existing connection otherwise: a file is sent
  when the host lacks it or its size or mtime differ; mtimes and modes are
  kept, so an unchanged second sync sends nothing.

Both honour the excludes (``.git`` and ``__pycache__`` by default, plus
``--sync-exclude``) with rsync's basic rules: a pattern without ``/``
matches a file or directory name at any depth, a pattern with a ``/``
matches the path from the synced root (a leading ``/`` anchors it), a
trailing ``/`` matches directories only. ``--sync-delete`` removes files on
the host that are gone here (excluded files are kept, as rsync does).

What is sent is decided once, here, before any host (:func:`plan_sync`, a
:class:`SyncPlan`): in a git work tree, what ``.gitignore`` (and
``.git/info/exclude``, and the user's global excludes) ignores, as ``git
ls-files --others --ignored --exclude-standard --directory`` lists it
(``--sync-no-gitignore`` turns that off); always, every virtual environment
(a directory with ``pyvenv.cfg`` or ``conda-meta/``); the rest is counted, and
above :data:`WARN_BYTES` or :data:`WARN_FILES` the launcher warns with the
largest directories. These skipped paths reach rsync on its stdin
(``--from0 --exclude-from=-``, anchored paths), so the command line stays
the same whatever they are, and the dry run shows both.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import threading
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

from ..errors import LaunchError
from .ssh import HostSession, SSHOptions, Target

if TYPE_CHECKING:  # pragma: no cover
    import paramiko

log = logging.getLogger(__name__)

#: above either, the launcher warns before syncing (and the dry run says so)
WARN_BYTES = 100 * 1024 * 1024
WARN_FILES = 10_000
#: how many of the largest directories a warning names
TOP_DIRS = 5
#: a directory holding one of these is a virtual environment (venv/virtualenv; conda)
VENV_MARKERS = ("pyvenv.cfg", "conda-meta")
GIT_TIMEOUT = 30.0


@dataclasses.dataclass
class SyncStats:
    """What one host's sync did."""

    method: str  # rsync | sftp
    files: int = 0  # regular files (and links) sent
    bytes: int = 0  # bytes sent (rsync: on the wire, compressed; sftp: file sizes)
    deleted: int = 0
    seconds: float = 0.0


# --- excludes -------------------------------------------------------------------------


def is_excluded(rel: str, is_dir: bool, patterns: Iterable[str]) -> bool:
    """``rel`` (a ``/``-separated path below the synced root) matches an exclude pattern."""
    parts = rel.split("/")
    for pat in patterns:
        dir_only = pat.endswith("/")
        pat = pat.rstrip("/")
        if not pat or (dir_only and not is_dir):
            continue
        if pat.startswith("/"):
            if fnmatch.fnmatchcase(rel, pat[1:]):
                return True
        elif "/" in pat:
            if any(fnmatch.fnmatchcase("/".join(parts[i:]), pat) for i in range(len(parts))):
                return True
        elif fnmatch.fnmatchcase(parts[-1], pat):
            return True
    return False


# --- what is sent: .gitignore, virtual environments, size ------------------------------------------


def git_ignored(src: str) -> tuple[Optional[tuple[str, ...]], str]:
    """What git ignores below ``src`` (paths relative to it; directories end in ``/``), and why
    not when it cannot say: ``(None, reason)`` outside a work tree or without git."""
    git = shutil.which("git")
    if git is None:
        return None, "git is not installed"
    try:
        p = subprocess.run([git, "-C", src, "ls-files", "--others", "--ignored", "--exclude-standard",
                            "--directory", "-z"], stdin=subprocess.DEVNULL, capture_output=True,
                           timeout=GIT_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"git failed: {e}"
    if p.returncode != 0:
        err = p.stderr.decode(errors="replace").strip().splitlines()
        if any("not a git repository" in line for line in err):
            return None, "not a git work tree"
        return None, f"git: {err[-1] if err else f'exit code {p.returncode}'}"
    paths = tuple(sorted(x for x in p.stdout.decode("utf-8", "surrogateescape").split("\0") if x))
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

    def exclude_from(self) -> bytes:
        """rsync's ``--from0 --exclude-from=-`` input: each skipped path anchored at the root,
        NUL-terminated (a name may hold a newline); wildcards escaped where rsync reads them (a
        file named ``a*b`` is that file, not a pattern)."""
        out = []
        for p in self.skipped:
            if any(c in p for c in "*?["):
                p = re.sub(r"([*?\[\\])", r"\\\1", p)
            out.append(("/" + p).encode("utf-8", "surrogateescape") + b"\0")
        return b"".join(out)

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


# --- rsync ------------------------------------------------------------------------------


def ssh_command_for_rsync(target: Target, connect_timeout: float, config_file: Optional[str]) -> list[str]:
    """The OpenSSH client command rsync runs (``-e``), with the job's settings (pure)."""
    argv = ["ssh", "-F", config_file or "/dev/null", "-p", str(target.port), "-l", target.user]
    for key in target.key_files:
        argv += ["-i", key]
    if target.key_files:
        argv += ["-o", "IdentitiesOnly=no"]
    argv += ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
             "-o", "ConnectTimeout=" + str(max(1, int(round(connect_timeout))))]
    if target.known_hosts:
        argv += ["-o", "UserKnownHostsFile=" + " ".join(target.known_hosts)]
    if target.host_key_alias:
        argv += ["-o", "HostKeyAlias=" + target.host_key_alias]
    return argv


def rsync_argv(src: str, dst: str, target: Target, *, excludes: Sequence[str], delete: bool,
               connect_timeout: float, config_file: Optional[str], exclude_from_stdin: bool = False) -> list[str]:
    """``rsync -az`` of the *contents* of ``src`` into ``dst`` on ``target`` (pure).

    Example:
        >>> rsync_argv("/src", "/dst", target, excludes=[".git"], delete=False, ...)
        ['rsync', '-az', '-s', '--stats', '--exclude=.git', '-e', 'ssh -F ... -p 22 ...', '/src/', 'h:/dst/']
    """
    # -s (--protect-args, 3.0+): the remote path goes over rsync's protocol, not through the remote
    # shell; without it, an rsync older than 3.2.4 (or RSYNC_OLD_ARGS=1) lets that shell expand
    # $(...), ; and spaces in --sync-dst-dir.
    argv = ["rsync", "-az", "-s", "--stats", "--timeout=60"]
    if delete:
        argv.append("--delete")
    argv += [f"--exclude={p}" for p in excludes]
    if exclude_from_stdin:  # the skipped paths (SyncPlan.exclude_from), NUL-terminated
        argv += ["--from0", "--exclude-from=-"]
    argv += ["-e", shlex.join(ssh_command_for_rsync(target, connect_timeout, config_file))]
    host = f"[{target.hostname}]" if ":" in target.hostname else target.hostname
    argv += [src.rstrip("/") + "/", f"{host}:{dst.rstrip('/') or '/'}/"]
    return argv


_FILES_RE = re.compile(r"^Number of (?:regular )?files transferred:\s*([\d,.]+)", re.M)
_SENT_RE = re.compile(r"^Total bytes sent:\s*([\d,.]+)", re.M)


def parse_rsync_stats(text: str) -> tuple[int, int]:
    """(files transferred, bytes sent) from ``rsync --stats`` output (rsync 3.0 to 3.4)."""

    def number(rx: re.Pattern, default: int = 0) -> int:
        m = rx.search(text)
        return int(re.sub(r"[,.]", "", m.group(1))) if m else default

    return number(_FILES_RE), number(_SENT_RE)


# --- SFTP delta -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str  # file | dir | link
    size: int = 0
    mtime: int = 0
    mode: int = 0
    link: str = ""


def local_tree(src: str, excludes: Sequence[str], skip: frozenset[str] = frozenset()) -> dict[str, Entry]:
    """Every path below ``src`` (relative, ``/``-separated) that is not excluded or skipped
    (``skip``: exact relative paths, :meth:`SyncPlan.skip_set`)."""
    out: dict[str, Entry] = {}
    for root, dirs, files in os.walk(src):
        rel_root = os.path.relpath(root, src)
        rel_root = "" if rel_root == "." else rel_root.replace(os.sep, "/") + "/"
        keep = []
        for d in sorted(dirs):
            rel = rel_root + d
            path = os.path.join(root, d)
            if rel in skip or is_excluded(rel, True, excludes):
                continue
            if os.path.islink(path):
                out[rel] = Entry("link", link=os.readlink(path))
                continue
            st = os.stat(path)
            out[rel] = Entry("dir", mode=stat.S_IMODE(st.st_mode))
            keep.append(d)
        dirs[:] = keep
        for f in sorted(files):
            rel = rel_root + f
            if rel in skip or is_excluded(rel, False, excludes):
                continue
            path = os.path.join(root, f)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = Entry("link", link=os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = Entry("file", size=st.st_size, mtime=int(st.st_mtime), mode=stat.S_IMODE(st.st_mode))
    return out


def remote_tree(sftp: paramiko.SFTPClient, dst: str, excludes: Sequence[str] = ()) -> dict[str, Entry]:
    """Every path below ``dst`` on the host; excluded directories are listed but not entered."""
    out: dict[str, Entry] = {}
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            items = sftp.listdir_attr(f"{dst}/{rel_dir}" if rel_dir else dst)
        except OSError:
            continue
        for a in items:
            rel = f"{rel_dir}/{a.filename}" if rel_dir else a.filename
            mode = a.st_mode or 0
            if stat.S_ISDIR(mode):
                out[rel] = Entry("dir", mode=stat.S_IMODE(mode))
                if not is_excluded(rel, True, excludes):
                    stack.append(rel)
            elif stat.S_ISLNK(mode):
                out[rel] = Entry("link", link=sftp.readlink(f"{dst}/{rel}") or "")
            else:
                out[rel] = Entry("file", size=a.st_size or 0, mtime=int(a.st_mtime or 0), mode=stat.S_IMODE(mode))
    return out


def sftp_sync(sftp: paramiko.SFTPClient, src: str, dst: str, *, excludes: Sequence[str],
              delete: bool, skip: frozenset[str] = frozenset()) -> SyncStats:
    """Make ``dst`` (which exists) hold ``src``'s tree: send what differs in size or mtime
    (``skip``: paths never sent, and protected from ``delete``, :meth:`SyncPlan.skip_set`)."""
    stats = SyncStats("sftp")
    local = local_tree(src, excludes, skip)
    remote = remote_tree(sftp, dst, excludes)

    def rpath(rel: str) -> str:
        return f"{dst.rstrip('/')}/{rel}"

    def remove(rel: str) -> None:
        entry = remote.get(rel)
        if entry is None:
            return
        if entry.kind == "dir":
            for child in sorted((r for r in remote if r.startswith(rel + "/")), reverse=True):
                if remote[child].kind == "dir":
                    sftp.rmdir(rpath(child))
                else:
                    sftp.remove(rpath(child))
            sftp.rmdir(rpath(rel))
        else:
            sftp.remove(rpath(rel))

    for rel in sorted(local):  # parents sort before their children
        want, have = local[rel], remote.get(rel)
        path = rpath(rel)
        if have is not None and have.kind != want.kind:
            remove(rel)
            have = None
        if want.kind == "dir":
            if have is None:
                sftp.mkdir(path, want.mode or 0o755)
            if have is None or have.mode != want.mode:
                sftp.chmod(path, want.mode)
        elif want.kind == "link":
            if have is None or have.link != want.link:
                if have is not None:
                    sftp.remove(path)
                sftp.symlink(want.link, path)
                stats.files += 1
        else:
            if have is None or have.size != want.size or have.mtime != want.mtime:
                sftp.put(os.path.join(src, rel), path, confirm=True)
                sftp.utime(path, (want.mtime, want.mtime))
                stats.files += 1
                stats.bytes += want.size
            if have is None or have.mode != want.mode:
                sftp.chmod(path, want.mode)
    if delete:
        gone: list[str] = []
        for rel in sorted(remote):  # a directory sorts before its contents
            if rel in local or any(rel.startswith(g + "/") for g in gone):
                continue
            if rel in skip or any(rel.startswith(k + "/") for k in skip) or \
                    is_excluded(rel, remote[rel].kind == "dir", excludes):
                continue  # excluded and skipped files are protected, as with rsync
            gone.append(rel)
        for rel in gone:
            stats.deleted += 1 + sum(1 for r in remote if r.startswith(rel + "/") and remote[r].kind != "dir")
            remove(rel)
    return stats


# --- one sync per host, as a job runs it -------------------------------------------------------------


def remote_path(path: str) -> str:
    """``path`` for a remote shell: quoted, but a leading ``~``/``~/`` is the remote ``$HOME``."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        rest = path[2:].lstrip("/")
        return '"$HOME"/' + shlex.quote(rest) if rest else '"$HOME"'
    return shlex.quote(path)


def prepare_dir_command(path: str) -> str:
    """Create the sync target; print its absolute path and rsync's path (empty without rsync).

    The lines are marked: a login shell's rc files may print to stdout too.
    A leading ``~`` or ``~/`` (a YAML value, a quoted option) means the remote
    home, as it does in dmlc's ``rsync ... host:DIR``; anything else is quoted.
    """
    q = remote_path(path)
    return (f"mkdir -p -- {q} && cd -- {q} && echo \"pslaunch-dir=$(pwd)\" && "
            "echo \"pslaunch-rsync=$(command -v rsync)\"")


def parse_prepare_dir(output: str) -> tuple[Optional[str], bool]:
    """(the absolute directory, whether rsync exists) from :func:`prepare_dir_command`'s output."""
    found = dict(line.partition("=")[::2] for line in output.splitlines() if line.startswith("pslaunch-"))
    return found.get("pslaunch-dir") or None, bool(found.get("pslaunch-rsync", "").strip())


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class Syncer:
    """``--sync-dst-dir`` for one job: syncs a host over its session; stops every rsync on demand.

    Each rsync runs in a process group of its own, registered with the launcher's watchdog
    (``watchdog``: anything with ``watch``/``forget``), so a killed launcher takes it along.
    """

    def __init__(self, src: str, dst: str, opts: SSHOptions, watchdog: Any = None,
                 plan: Optional[SyncPlan] = None) -> None:
        self.src = src
        self.dst = dst
        self.opts = opts
        self.watchdog = watchdog
        self.plan = plan or SyncPlan(src=src, excludes=tuple(opts.sync_exclude))
        self._lock = threading.Lock()
        self._rsyncs: set[subprocess.Popen] = set()
        self._stopped = False

    def sync(self, session: HostSession) -> tuple[str, SyncStats]:
        """Sync into ``session``'s host; ``(the absolute remote directory, stats)``."""
        label, t0 = session.label, time.monotonic()
        r = session.exec(prepare_dir_command(self.dst))
        if r.code != 0:
            raise LaunchError(f"sync to {label}:{self.dst} failed: cannot create the directory: {r.err_line}")
        found, remote_rsync = parse_prepare_dir(r.stdout.decode(errors="replace"))
        abs_dst = found or self.dst
        local_tools = shutil.which("rsync") is not None and shutil.which("ssh") is not None
        if local_tools and remote_rsync:
            stats = self._rsync(session, abs_dst)
        else:
            log.debug("%s: syncing over SFTP (%s)", label, "no rsync here" if not local_tools else "no rsync on the host")
            try:
                sftp = session.sftp()
                try:
                    stats = sftp_sync(sftp, self.src, abs_dst, excludes=self.opts.sync_exclude,
                                      delete=self.opts.sync_delete, skip=self.plan.skip_set())
                finally:
                    sftp.close()
            except OSError as e:
                raise LaunchError(f"sync to {label}:{abs_dst} failed (SFTP): {e}") from None
        stats.seconds = time.monotonic() - t0
        log.info("synced %s to %s:%s with %s: %d file%s, %s sent%s in %.1fs", self.src, label, abs_dst,
                 stats.method, stats.files, "" if stats.files == 1 else "s", size_text(stats.bytes),
                 f", {stats.deleted} deleted" if stats.deleted else "", stats.seconds)
        return abs_dst, stats

    def argv(self, target: Target, dst: str) -> list[str]:
        """The rsync command for one host (the dry run shows this very list)."""
        return rsync_argv(self.src, dst, target, excludes=self.opts.sync_exclude, delete=self.opts.sync_delete,
                          connect_timeout=self.opts.connect_timeout, config_file=target.config_file,
                          exclude_from_stdin=bool(self.plan.skipped))

    def _rsync(self, session: HostSession, dst: str) -> SyncStats:
        argv = self.argv(session.target, dst)
        log.debug("%s: %s", session.label, shlex.join(argv))
        with self._lock:
            if self._stopped:
                raise LaunchError(f"sync to {session.label}: the launcher is stopping")
            # its own group, known to the watchdog: rsync and its ssh go too if the launcher is killed
            stdin = self.plan.exclude_from()
            p = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            self._rsyncs.add(p)
            if self.watchdog is not None:
                self.watchdog.watch(p.pid)
        try:
            out_b, err_b = p.communicate(stdin or None)
            out, err = out_b.decode(errors="replace"), err_b.decode(errors="replace")
        finally:
            with self._lock:
                self._rsyncs.discard(p)
            if self.watchdog is not None:
                self.watchdog.forget(p.pid)
        if p.returncode != 0:
            lines = [x for x in err.splitlines() if x.strip()]
            reason = lines[0] if lines else f"exit code {p.returncode}"
            raise LaunchError(f"sync to {session.label}:{dst} failed: rsync exited with code {p.returncode}: "
                              f"{reason}")
        files, sent = parse_rsync_stats(out)
        return SyncStats("rsync", files=files, bytes=sent)

    def stop(self) -> None:
        """Kill every rsync now (Ctrl-C during the sync), and refuse to start more."""
        from ..node.procgroup import signal_group

        with self._lock:
            self._stopped = True
            rsyncs = list(self._rsyncs)
        for p in rsyncs:
            if p.poll() is None:  # the leader still runs: the group is still ours
                signal_group(p.pid, signal.SIGKILL)
