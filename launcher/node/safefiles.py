# ruff: noqa: UP004, UP031
"""Writing files where another user may have been first: ``/tmp`` and other shared directories.

Used by ``--sync-dst-dir`` (both halves: :mod:`.treesync`), ``--log-dir``
(``launcher.runtime.output``) and ``--summary-json`` (``launcher.run.report``). The rules:

* the directory the user named is opened once, without following a link at its last component,
  and must be the user's own (:func:`open_dir`); a link there, or a directory another user owns,
  is refused with one line that says so;
* everything below it is reached relative to that descriptor, one component at a time, never
  through a link (:func:`walk`, :func:`open_file`, :func:`remove`), so a component swapped for
  a link half-way cannot send a write, a mode change or a delete elsewhere;
* a new file gets an unpredictable temporary name, created with ``O_EXCL`` (:func:`temporary`),
  and is renamed into place (:func:`write_atomic`); an existing file is opened with
  ``O_NOFOLLOW`` and must be a regular file of the user's with no other hard link.

Root passes every permission check, so for root these checks are the only ones. Standard library
only, Python 3.5 syntax (the ssh wrapper imports it on a host).
"""

import errno
import os
import stat

#: a directory below an open one, never through a link
NOFOLLOW_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


class Refused(ValueError):
    """A path that is not safe to write (one line: what is wrong and what to do)."""


#: what to do about a directory that is refused
_OWN = "choose a directory of your own"


def open_dir(path, what, create=False):
    """A descriptor of the directory ``path``, which must not be a symbolic link and must be
    owned by this user; ``what`` names it in the error (``"--log-dir logs"``). With ``create``,
    a missing directory is made (with its parents, as ``os.makedirs`` would)."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    if not name:  # "/"
        parent, name = path, "."
    if create and not os.path.lexists(parent):
        os.makedirs(parent)
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if create:
            try:
                os.mkdir(name, dir_fd=pfd)
            except FileExistsError:
                pass
        try:
            fd = os.open(name, NOFOLLOW_DIR, dir_fd=pfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    raise Refused("%s is a symbolic link (links are not followed there: another user may have "
                                  "planted it); %s" % (what, _OWN)) from None
                raise Refused("%s is not a directory" % what) from None
            raise
    finally:
        os.close(pfd)
    try:
        owner = os.fstat(fd).st_uid
        if owner != os.geteuid():
            raise Refused("%s is owned by uid %d, not by you (uid %d); %s" % (what, owner, os.geteuid(), _OWN))
    except BaseException:
        os.close(fd)
        raise
    return fd


def walk(root_fd, parts, make=False):
    """A new descriptor of the directory ``root_fd/parts[0]/parts[1]/...``, each component
    opened without following a link. ``make``: a missing component is created (mode 0700), and
    one that is not a directory (a file, a link) is removed and created. Without it an
    OSError (``ELOOP``, ``ENOTDIR``, ``ENOENT``) says the path is not what it was."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            try:
                nxt = os.open(part, NOFOLLOW_DIR, dir_fd=fd)
            except OSError as e:
                if not make or e.errno not in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                    raise
                if e.errno != errno.ENOENT:
                    remove(fd, part)
                os.mkdir(part, 0o700, dir_fd=fd)
                nxt = os.open(part, NOFOLLOW_DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove(dir_fd, name):
    """Remove ``name`` in ``dir_fd`` and, for a directory, everything in it, never following a
    link (a link is removed, not what it points at). Missing: nothing happens."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, NOFOLLOW_DIR, dir_fd=dir_fd)
    try:
        for child in os.listdir(fd):
            remove(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


def open_file(dir_fd, name, flags, mode=0o666, what=None):
    """``os.open(name, flags | O_NOFOLLOW, dir_fd=dir_fd)`` for a regular file of this user's with
    no other hard link (an append to a log, a read of a file to send): a link, a device, a FIFO
    or another user's file is refused (:class:`Refused`, naming ``what`` or ``name``)."""
    what = what or name
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise Refused("%s is a symbolic link (not followed)" % what) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused("%s is not a regular file" % what)
        if flags & (os.O_WRONLY | os.O_RDWR) and (st.st_uid != os.geteuid() or st.st_nlink != 1):
            raise Refused("%s is another user's file or has another hard link (not written)" % what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def temporary(dir_fd, name, mode=0o600):
    """A new file beside ``name`` in ``dir_fd`` with an unpredictable name, created exclusively
    (nothing planted there can be followed or reused): ``(fd, its name)``."""
    for _ in range(100):
        tmp = ".%s.pslaunch-%s" % (name, os.urandom(8).hex())
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=dir_fd), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary name beside %s" % name)


def write_all(fd, data):
    """Write all of ``data`` (a short write is continued; an error raises)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_atomic(path, data, mode=0o666):
    """Replace the file ``path`` with ``data`` at once, through a temporary file created with
    ``O_EXCL`` under an unpredictable name in the same directory (``mode`` less the umask)."""
    parent, name = os.path.split(os.path.abspath(path))
    dfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd, tmp = temporary(dfd, name, mode)
        try:
            try:
                write_all(fd, data)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)
