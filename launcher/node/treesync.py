# ruff: noqa: UP004, UP031
"""``--sync-dst-dir`` without rsync or SFTP: a directory tree copied over the ssh wrapper's channel.

Both halves import this module: the launcher (``launcher.transport.sync``) lists what it sends
with :func:`scan` and :func:`manifest`; the ssh wrapper on the host (:mod:`.ssh_wrapper`) compares
with what is there (:class:`Receiver`), asks for what differs, and writes it. One round trip
when nothing changed. Standard library only, Python 3.5 syntax (it reaches hosts inside the node
bundle).

The rules are rsync's for what we use of it (``-a`` without owners, ``--delete`` optional):

* an entry is a directory, a regular file or a symbolic link, by its ``/``-separated path below
  the root; a file is sent when the host lacks it, or its size or modification time (whole
  seconds) differ; modes and modification times are kept, links are recreated as they are;
* excludes: a pattern without ``/`` matches a name at any depth, one with ``/`` matches the path
  from the root (a leading ``/`` anchors it), a trailing ``/`` matches directories only; an
  excluded path on the host is never touched, even with ``delete`` (rsync's protection);
* ``skip`` names further anchored paths that are neither sent nor touched (what ``.gitignore``
  ignores, virtual environments: decided by the launcher).

A path from the launcher that is absolute or has a ``..`` part is refused, and nothing is written
through a symbolic link on the host: the tree cannot reach outside the target directory. The
target must be the user's own directory, not a link (another user may have planted it in a
shared ``/tmp``); below it every file and directory is reached relative to an open directory,
one component at a time without following links, and new files get unpredictable temporary names
(:mod:`.safefiles`).
"""

import fnmatch
import os
import stat

from . import safefiles

DIR, FILE, LINK = "d", "f", "l"


def is_excluded(rel, is_dir, patterns):
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


def scan(root, excludes=(), skip=(), ids=None):
    """Every entry below ``root`` (a path, or an open directory's descriptor) that is neither
    excluded nor skipped: ``{rel: (kind, size, mtime, mode, link)}``. Nothing is followed through
    a link. ``ids``, a dict, gets each file's ``(st_dev, st_ino)`` (what the sender checks it
    still reads)."""
    skip = frozenset(p.rstrip("/") for p in skip)
    out = {}
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY) if isinstance(root, str) else os.dup(root)
    except OSError:
        return out
    stack = [("", top)]
    while stack:
        rel_dir, fd = stack.pop()
        try:
            names = sorted(os.listdir(fd))
        except OSError:
            names = []
        for name in names:
            rel = rel_dir + "/" + name if rel_dir else name
            if rel in skip:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if is_excluded(rel, True, excludes):
                    continue
                try:
                    sub = os.open(name, safefiles.NOFOLLOW_DIR, dir_fd=fd)
                except OSError:
                    continue
                out[rel] = (DIR, 0, 0, stat.S_IMODE(st.st_mode), "")
                stack.append((rel, sub))
            elif is_excluded(rel, False, excludes):
                continue
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = (LINK, 0, 0, 0, os.readlink(name, dir_fd=fd))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = (FILE, st.st_size, int(st.st_mtime), stat.S_IMODE(st.st_mode), "")
                if ids is not None:
                    ids[rel] = (st.st_dev, st.st_ino)
        os.close(fd)
    return out


def manifest(tree):
    """``tree`` (from :func:`scan`) as JSON-ready rows ``[rel, kind, size, mtime, mode, link]``."""
    return [[rel] + list(tree[rel]) for rel in sorted(tree)]


def differs(want, have):
    """True when the host's entry ``have`` (or None) must be replaced by ``want``'s content."""
    if have is None or have[0] != want[0]:
        return True
    if want[0] == FILE:
        return have[1] != want[1] or have[2] != want[2]
    return want[0] == LINK and have[4] != want[4]


def check_rel(rel):
    """``rel`` if it names a path inside the root; ValueError otherwise."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in rel:
        raise ValueError("refusing the path %r" % rel)
    return rel


class Receiver(object):
    """The host's half: ``Receiver(dst, rows, excludes, skip, delete)``, then :meth:`need`, the
    data of each needed file in order (:meth:`write`), then :meth:`finish` (or :meth:`close`).

    ``dst`` is created when missing; one that is a symbolic link, or another user's directory,
    is refused (:class:`.safefiles.Refused`, a ValueError)."""

    def __init__(self, dst, rows, excludes=(), skip=(), delete=False):
        self.dst = os.path.abspath(os.path.expanduser(dst))
        self.want = {}
        for row in rows:
            rel = check_rel(str(row[0]))
            self.want[rel] = (str(row[1]), int(row[2]), int(row[3]), int(row[4]), str(row[5]))
        self.excludes = list(excludes)
        self.skip = list(skip)
        self.delete = delete
        self.files = 0
        self.bytes = 0
        self.deleted = 0
        self._open = None  # (rel, file descriptor, its directory's descriptor, temporary name)
        self.fd = safefiles.open_dir(self.dst, "the destination", create=True)
        self.have = scan(self.fd, self.excludes, self.skip)

    def close(self):
        """Let go of the target (and of a file half written: its temporary file goes)."""
        if self._open is not None:
            _, fd, dfd, tmp = self._open
            self._open = None
            os.close(fd)
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            os.close(dfd)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def need(self):
        """The files whose content the host lacks, in order."""
        return [rel for rel in sorted(self.want)
                if self.want[rel][0] == FILE and differs(self.want[rel], self.have.get(rel))]

    def _parent(self, rel):
        """``(descriptor of rel's directory, rel's name)``: the directories on the way are made
        (one that is a file or a link is replaced by a directory), none is followed through a link."""
        parts = rel.split("/")
        return safefiles.walk(self.fd, parts[:-1], make=True), parts[-1]

    def write(self, rel, data, last):
        """Part of file ``rel``'s content; ``last``: it is complete."""
        if self._open is None or self._open[0] != rel:
            if self._open is not None:
                raise ValueError("the data of %r ended early" % self._open[0])
            if rel not in self.want or self.want[rel][0] != FILE:
                raise ValueError("unexpected data for %r" % rel)
            dfd, name = self._parent(check_rel(rel))
            try:
                fd, tmp = safefiles.temporary(dfd, name)
            except BaseException:
                os.close(dfd)
                raise
            self._open = (rel, fd, dfd, tmp)
        _, fd, dfd, tmp = self._open
        safefiles.write_all(fd, data)
        if last:
            self._open = None
            try:
                _, size, mtime, mode, _ = self.want[rel]
                os.fchmod(fd, mode)
                os.utime(fd, (mtime, mtime))
                os.close(fd)
                fd = None
                name = rel.rsplit("/", 1)[-1]
                st = _lstat(dfd, name)
                if st is not None and stat.S_ISDIR(st.st_mode):
                    safefiles.remove(dfd, name)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            finally:
                if fd is not None:
                    os.close(fd)
                os.close(dfd)
            self.files += 1
            self.bytes += size

    def finish(self):
        """Directories, links and modes as the launcher has them; with ``delete``, what it does not
        have goes (excluded and skipped paths stay). Returns the stats; the target is let go."""
        try:
            return self._finish()
        finally:
            self.close()

    def _finish(self):
        if self._open is not None:
            raise ValueError("the data of %r ended early" % self._open[0])
        for rel in sorted(self.want):  # parents sort before their children
            kind, _, _, mode, link = self.want[rel]
            have = self.have.get(rel)
            if kind == DIR:
                fd = safefiles.walk(self.fd, rel.split("/"), make=True)  # (a needed file may have made it already)
                try:
                    os.fchmod(fd, mode)
                finally:
                    os.close(fd)
            elif kind == LINK:
                if differs(self.want[rel], have):
                    dfd, name = self._parent(rel)
                    try:
                        safefiles.remove(dfd, name)
                        os.symlink(link, name, dir_fd=dfd)
                    finally:
                        os.close(dfd)
                    self.files += 1
            elif have is not None and have[0] == FILE and not differs(self.want[rel], have) and have[3] != mode:
                dfd, name = self._parent(rel)
                try:
                    _chmod_file(dfd, name, mode)
                finally:
                    os.close(dfd)
        if self.delete:
            gone = []
            for rel in sorted(self.have):  # a directory sorts before its contents
                if rel in self.want or any(rel.startswith(g + "/") for g in gone):
                    continue
                gone.append(rel)
            for rel in gone:
                self.deleted += 1 + sum(1 for r in self.have if r.startswith(rel + "/") and self.have[r][0] != DIR)
                try:
                    dfd = safefiles.walk(self.fd, rel.split("/")[:-1])
                except OSError:
                    continue  # (its directory went, or became something else: nothing of ours to delete)
                try:
                    safefiles.remove(dfd, rel.rsplit("/", 1)[-1])
                finally:
                    os.close(dfd)
        return {"dir": self.dst, "files": self.files, "bytes": self.bytes, "deleted": self.deleted}


def _lstat(dir_fd, name):
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _chmod_file(dir_fd, name, mode):
    """Set the mode of the regular file ``name`` in ``dir_fd``, not through a link."""
    try:
        fd = safefiles.open_file(dir_fd, name, os.O_RDONLY)
    except PermissionError:  # (not readable by us: a user's own file in our own directory, checked)
        st = _lstat(dir_fd, name)
        if st is None or not stat.S_ISREG(st.st_mode):
            raise
        os.chmod(name, mode, dir_fd=dir_fd)
        return
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
