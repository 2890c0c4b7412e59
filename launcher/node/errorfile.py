# ruff: noqa: UP004, UP031 - Python 3.5 syntax: the ssh backend runs it with a host's own python3
"""A process's error file: where a program says why it failed, and how whoever started it reads it back.

Whoever starts a process of the job (the launcher for a local process, the node agent on a node)
gives it a :class:`Slot`: a new private directory (``tempfile.mkdtemp``: an unpredictable name,
mode 0700, created exclusively, so nothing another user planted can be there) and, in it, the
path of a file that does not exist yet. Both ``PSLAUNCH_ERROR_FILE`` and torch's
``TORCHELASTIC_ERROR_FILE`` name that path, so a program decorated with torch's
``torch.distributed.elastic.multiprocessing.errors.record`` writes its exception there: torch
opens the path with ``open(path, "w")`` and writes
``{"message": {"message": "ValueError: ...", "extraInfo": {"py_callstack": "Traceback ...",
"timestamp": "<whole seconds>"}}}``; any other program may write plain text.

Once the process ended, :meth:`Slot.collect` reads the file and removes the directory. The file is
the program's, so nothing in it is trusted:

* it is opened without following a link and read only if it is a regular file (a link the program
  planted, a FIFO or a directory there is no error file), and at most :data:`LIMIT` bytes of it;
* it is parsed as JSON (never unpickled nor evaluated) or else taken as text, decoded as UTF-8
  with replacement characters; the message and the traceback are cut to :data:`MESSAGE_MAX` and
  :data:`TRACE_MAX` characters (the traceback keeps its end: the innermost frames and the
  exception). Control characters stay: the launcher shows them as ``printable`` makes them;
* the directory is removed with everything in it, never following a link.

The error's ``time`` is the file's modification time (torch's own ``timestamp`` counts whole
seconds only; it is used when the file's time cannot be read). Standard library only, Python 3.5
syntax.
"""

import errno
import json
import os
import stat
import tempfile

from . import safefiles

#: the variables that name the file (``pscontract.ERROR_FILE`` and ``TORCH_ERROR_FILE``: spelled
#: here too, as this module must run with Python 3.5, which cannot import pscontract)
NAMES = ("PSLAUNCH_ERROR_FILE", "TORCHELASTIC_ERROR_FILE")
#: the file's name in its directory
FILE_NAME = "error.json"
#: the most bytes of an error file that are read
LIMIT = 64 * 1024
#: the longest message and traceback kept (characters)
MESSAGE_MAX = 2000
TRACE_MAX = 16000
_CUT = "[...]"
_PYTHON_TRACEBACK = "Traceback (most recent call last):"


class Base(object):
    """One private directory (0700, an unpredictable name) for the error files of every process
    that one program starts (a node agent, the launcher). Given that program's watchdog, what a
    ``kill -9`` of the program leaves behind here is removed with the processes."""

    def __init__(self, watchdog=None):
        self.dir = tempfile.mkdtemp(prefix="pslaunch-errors-")
        if watchdog is not None:
            watchdog.remove_after_kill(os.path.join(self.dir, "pslaunch-error-*"))
            watchdog.remove_dir_after_kill(self.dir)

    def slot(self):
        """A new process's :class:`Slot`, in this directory."""
        return Slot(self.dir)

    def close(self):
        """The end: the directory goes (its slots were collected or discarded)."""
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


class Slot(object):
    """One process's error file: made before the process starts, collected once it ended."""

    def __init__(self, base=None):
        self.dir = tempfile.mkdtemp(prefix="pslaunch-error-", dir=base)
        self.path = os.path.join(self.dir, FILE_NAME)
        self.done = False

    def env(self):
        """The variables to add to the process's environment."""
        return dict((name, self.path) for name in NAMES)

    def collect(self):
        """What the process wrote (:func:`parse`), or None; the directory is gone afterwards. Once only."""
        if self.done:
            return None
        self.done = True
        data = mtime = None
        try:
            fd = os.open(self.dir, safefiles.NOFOLLOW_DIR)
        except OSError:
            fd = None  # (the program removed it, or put a link there: nothing to read)
        if fd is not None:
            try:
                data, mtime = read(fd, FILE_NAME)
            finally:
                os.close(fd)
        self.discard()
        return None if data is None else parse(data, mtime)

    def discard(self):
        """Remove the directory and whatever is in it, never following a link."""
        self.done = True
        parent, name = os.path.split(self.dir)
        try:
            pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            safefiles.remove(pfd, name)
        except OSError:
            pass  # (what could not be removed stays: it is in the spawner's own 0700 directory)
        finally:
            os.close(pfd)


def read(dir_fd, name, limit=LIMIT):
    """``(at most limit + 1 bytes of the regular file name, its modification time)``, or
    ``(None, None)`` when it is missing, a link, or anything but a regular file."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None, None  # (ENOENT: it wrote nothing; ELOOP: a link; ENXIO: a socket ...)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, None
        chunks, size = [], 0
        while size <= limit:
            try:
                chunk = os.read(fd, limit + 1 - size)
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks), st.st_mtime
    finally:
        os.close(fd)


def parse(data, mtime=None, limit=LIMIT):
    """``{"message", "traceback", "time"}`` of an error file's bytes (``limit`` + 1 of them mean
    that it was longer), or None when it says nothing. Torch's JSON, or text: the message is its
    first line that is not blank (a Python traceback's last one), the traceback the whole text
    when it has more than one line."""
    longer = len(data) > limit
    text = data[:limit].decode("utf-8", "replace")
    message, trace, stamp = _torch(text) if not longer else (None, None, None)
    if message is None:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        if not lines:
            return None
        message = lines[-1] if lines[0].strip() == _PYTHON_TRACEBACK and not longer else lines[0]
        trace = text.strip() if len(lines) > 1 else ""
        if longer:
            trace += "\n%s (the error file is longer than %d KiB; the rest is not read)" % (_CUT, limit // 1024)
    when = mtime if mtime is not None else stamp
    return {"message": cut(message.strip(), MESSAGE_MAX), "traceback": cut_start((trace or "").rstrip(), TRACE_MAX),
            "time": when}


def _torch(text):
    """``(message, traceback, timestamp)`` of torch's JSON, or ``(None, None, None)``."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        return None, None, None
    inner = doc.get("message") if isinstance(doc, dict) else None
    if isinstance(inner, str) and inner.strip():  # (the flat form: {"message": "...", "errorCode": N})
        return inner, "", None
    if not isinstance(inner, dict) or not isinstance(inner.get("message"), str):
        return None, None, None
    extra = inner.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    trace = extra.get("py_callstack")
    try:
        stamp = float(extra.get("timestamp"))
    except (TypeError, ValueError, OverflowError):
        stamp = None
    if stamp is not None and not 0 < stamp < 1e11:  # (NaN, infinity, nonsense)
        stamp = None
    return inner["message"] or "(no message)", trace if isinstance(trace, str) else "", stamp


def cut(text, most):
    """``text``, or its first ``most`` characters and a mark."""
    return text if len(text) <= most else text[:most - len(_CUT)] + _CUT


def cut_start(text, most):
    """``text``, or a mark and its last ``most`` characters (a traceback's end says the most)."""
    return text if len(text) <= most else _CUT + text[len(text) - most + len(_CUT):]


def fit(doc, most):
    """``doc`` (:func:`parse`'s) as UTF-8 JSON of at most ``most`` bytes: its traceback, then its
    message, shortened until it fits (an in-band frame is short)."""
    doc = dict(doc)
    while True:
        payload = json.dumps(doc, separators=(",", ":")).encode("utf-8")
        if len(payload) <= most:
            return payload
        if doc.get("traceback"):
            trace = doc["traceback"]
            doc["traceback"] = cut_start(trace, len(trace) * 3 // 4) if len(trace) > 64 else ""
        elif doc.get("message"):
            doc["message"] = cut(doc["message"], len(doc["message"]) * 3 // 4) if len(doc["message"]) > 64 else ""
        else:
            return b"{}"
