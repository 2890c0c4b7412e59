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
               connect_timeout: float, config_file: Optional[str]) -> list[str]:
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


def local_tree(src: str, excludes: Sequence[str]) -> dict[str, Entry]:
    """Every path below ``src`` (relative, ``/``-separated) that is not excluded."""
    out: dict[str, Entry] = {}
    for root, dirs, files in os.walk(src):
        rel_root = os.path.relpath(root, src)
        rel_root = "" if rel_root == "." else rel_root.replace(os.sep, "/") + "/"
        keep = []
        for d in sorted(dirs):
            rel = rel_root + d
            path = os.path.join(root, d)
            if is_excluded(rel, True, excludes):
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
            if is_excluded(rel, False, excludes):
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
              delete: bool) -> SyncStats:
    """Make ``dst`` (which exists) hold ``src``'s tree: send what differs in size or mtime."""
    stats = SyncStats("sftp")
    local = local_tree(src, excludes)
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
            if is_excluded(rel, remote[rel].kind == "dir", excludes):
                continue  # excluded files are protected, as with rsync
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

    def __init__(self, src: str, dst: str, opts: SSHOptions, watchdog: Any = None) -> None:
        self.src = src
        self.dst = dst
        self.opts = opts
        self.watchdog = watchdog
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
                                      delete=self.opts.sync_delete)
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
        return rsync_argv(self.src, dst, target, excludes=self.opts.sync_exclude, delete=self.opts.sync_delete,
                          connect_timeout=self.opts.connect_timeout, config_file=target.config_file)

    def _rsync(self, session: HostSession, dst: str) -> SyncStats:
        argv = self.argv(session.target, dst)
        log.debug("%s: %s", session.label, shlex.join(argv))
        with self._lock:
            if self._stopped:
                raise LaunchError(f"sync to {session.label}: the launcher is stopping")
            # its own group, known to the watchdog: rsync and its ssh go too if the launcher is killed
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, errors="replace", start_new_session=True)
            self._rsyncs.add(p)
            if self.watchdog is not None:
                self.watchdog.watch(p.pid)
        try:
            out, err = p.communicate()
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
