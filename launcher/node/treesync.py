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
through a symbolic link on the host: the tree cannot reach outside the target directory.
"""

import fnmatch
import os
import stat

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


def scan(root, excludes=(), skip=()):
    """Every entry below ``root`` that is neither excluded nor skipped: ``{rel: (kind, size,
    mtime, mode, link)}`` (directories are not followed through links)."""
    skip = frozenset(p.rstrip("/") for p in skip)
    out = {}
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        try:
            names = sorted(os.listdir(os.path.join(root, rel_dir) if rel_dir else root))
        except OSError:
            continue
        for name in names:
            rel = rel_dir + "/" + name if rel_dir else name
            if rel in skip:
                continue
            path = os.path.join(root, rel)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if is_excluded(rel, True, excludes):
                    continue
                out[rel] = (DIR, 0, 0, stat.S_IMODE(st.st_mode), "")
                stack.append(rel)
            elif is_excluded(rel, False, excludes):
                continue
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = (LINK, 0, 0, 0, os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = (FILE, st.st_size, int(st.st_mtime), stat.S_IMODE(st.st_mode), "")
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
    data of each needed file in order (:meth:`write`), then :meth:`finish`."""

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
        self._open = None  # (rel, file, temporary path)
        if not os.path.isdir(self.dst):
            os.makedirs(self.dst)
        self.have = scan(self.dst, self.excludes, self.skip)

    def need(self):
        """The files whose content the host lacks, in order."""
        return [rel for rel in sorted(self.want)
                if self.want[rel][0] == FILE and differs(self.want[rel], self.have.get(rel))]

    def _path(self, rel):
        """The host path of ``rel``, after checking that no directory on the way is a link."""
        parent = os.path.dirname(rel)
        if parent:
            self._make_dirs(parent)
        return os.path.join(self.dst, rel)

    def _make_dirs(self, rel_dir):
        path = self.dst
        for part in rel_dir.split("/"):
            path = os.path.join(path, part)
            try:
                st = os.lstat(path)
            except OSError:
                os.mkdir(path, 0o700)
                continue
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                self._remove(path)
                os.mkdir(path, 0o700)

    @staticmethod
    def _remove(path):
        try:
            st = os.lstat(path)
        except OSError:
            return
        if stat.S_ISDIR(st.st_mode):
            for name in os.listdir(path):
                Receiver._remove(os.path.join(path, name))
            os.rmdir(path)
        else:
            os.unlink(path)

    def write(self, rel, data, last):
        """Part of file ``rel``'s content; ``last``: it is complete."""
        if self._open is None or self._open[0] != rel:
            if self._open is not None:
                raise ValueError("the data of %r ended early" % self._open[0])
            if rel not in self.want or self.want[rel][0] != FILE:
                raise ValueError("unexpected data for %r" % rel)
            path = self._path(check_rel(rel))
            tmp = os.path.join(os.path.dirname(path), ".%s.pslaunch-%d" % (os.path.basename(path), os.getpid()))
            self._open = (rel, open(tmp, "wb"), tmp)
        f = self._open[1]
        f.write(data)
        if last:
            tmp = self._open[2]
            f.close()
            self._open = None
            _, size, mtime, mode, _ = self.want[rel]
            os.chmod(tmp, mode)
            os.utime(tmp, (mtime, mtime))
            path = os.path.join(self.dst, rel)
            if os.path.isdir(path) and not os.path.islink(path):
                self._remove(path)
            os.replace(tmp, path)
            self.files += 1
            self.bytes += size

    def finish(self):
        """Directories, links and modes as the launcher has them; with ``delete``, what it does not
        have goes (excluded and skipped paths stay). Returns the stats."""
        if self._open is not None:
            raise ValueError("the data of %r ended early" % self._open[0])
        for rel in sorted(self.want):  # parents sort before their children
            kind, _, _, mode, link = self.want[rel]
            have = self.have.get(rel)
            path = os.path.join(self.dst, rel)
            if kind == DIR:
                self._make_dirs(rel)  # (as it is now: a needed file may have created it already)
                os.chmod(path, mode)
            elif kind == LINK:
                if differs(self.want[rel], have):
                    self._path(rel)
                    self._remove(path)
                    os.symlink(link, path)
                    self.files += 1
            elif have is not None and have[0] == FILE and not differs(self.want[rel], have) and have[3] != mode:
                os.chmod(path, mode)
        if self.delete:
            gone = []
            for rel in sorted(self.have):  # a directory sorts before its contents
                if rel in self.want or any(rel.startswith(g + "/") for g in gone):
                    continue
                gone.append(rel)
            for rel in gone:
                self.deleted += 1 + sum(1 for r in self.have if r.startswith(rel + "/") and self.have[r][0] != DIR)
                self._remove(os.path.join(self.dst, rel))
        return {"dir": self.dst, "files": self.files, "bytes": self.bytes, "deleted": self.deleted}
