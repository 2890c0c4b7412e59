# ruff: noqa: UP004, UP031
"""The ssh backend's wire format: how the launcher talks to a host's wrapper over one ssh channel.

Both halves import this module: the launcher (``launcher.backends.ssh``) and the wrapper
(:mod:`.ssh_wrapper`, which reaches the host inside the node bundle). Python 3.5 syntax.

The channel's command is :data:`BOOTSTRAP` (nothing job-specific, nothing secret). What the
launcher then writes to the channel's stdin, in order:

1. the loader (:mod:`.ssh_loader`): ten ASCII digits giving its length, then its source,
   which the bootstrap runs;
2. the node bundle (``launcher.node.bundle``), which the loader reads the same way and imports
   from memory: nothing is written to the host's disk;
3. frames of ``kind (1 byte) + length (4 bytes, big endian) + payload``:

   * before the header, while the launcher prepares (each answered by the wrapper, see below):

     - ``I``: JSON ``{"iface"}``: this host's address on ``DMLC_INTERFACE``;
     - ``S``: JSON ``{"dst", "rows", "excludes", "skip", "delete"}``: sync a directory tree
       (:mod:`.treesync`; ``rows`` lists what the launcher has), then ``F`` frames with the data
       of each file the wrapper asked for, in its order: :data:`SYNC_HEAD` (the path's length),
       the path (UTF-8), one byte (1: the file's last piece), the bytes (at most
       :data:`SYNC_CHUNK`); then ``D`` (empty): done, apply it.

   * ``H``: JSON ``{"procs": [{"id", "argv", "env", "cwd"}, ...], "keepalive", "lost_after",
     "grace"}``. The environment travels here, never on a command line. Sent once; the
     processes start.
   * ``k``: a keep-alive (empty).

Wrapper -> launcher (the channel's stdout): :data:`MAGIC` (what the login shell's rc files
printed before it is not the wrapper's), then frames of ``kind (1 byte) + process id
(2 bytes) + length (4 bytes) + payload``:

* ``p`` JSON ``{"pid", "pgid"}`` once a process runs; ``f`` JSON ``{"error", "code"}`` if it
  could not be started;
* ``o`` / ``e``: the process's stdout / stderr bytes;
* ``x`` JSON ``{"code"}`` when it exited (negative: killed by that signal);
* ``h`` (process id :data:`HOST_ID`): the answer to each keep-alive;
* with process id :data:`HOST_ID`, the answers before the header: ``i`` JSON ``{"address",
  "interface"}`` or ``{"error"}`` (for ``I``); ``s`` JSON ``{"dir", "need": [path, ...]}`` or
  ``{"error"}`` (for ``S``: the absolute target and the files to send); ``d`` JSON ``{"dir",
  "files", "bytes", "deleted"}`` or ``{"error"}`` (once per sync: after ``D``, or at the first
  error while writing).
"""

import struct

IN_HEAD = struct.Struct(">cI")  # launcher -> wrapper: kind, length
OUT_HEAD = struct.Struct(">cHI")  # wrapper -> launcher: kind, process id, length
HOST_ID = 0xFFFF
MAGIC = b"\0pslaunch-frames\0"
KEEPALIVE = IN_HEAD.pack(b"k", 0)
SYNC_HEAD = struct.Struct(">H")  # an F frame: the length of the path that follows
SYNC_CHUNK = 1 << 20  # the most file data in one F frame

# Reads one length-prefixed blob (10 ASCII digits, then the bytes) from stdin and runs it as
# Python source, leaving the rest of stdin to what it runs.
BOOTSTRAP = """import os
def r(n):
 b=b""
 while len(b)<n:
  c=os.read(0,n-len(b))
  if not c:os._exit(255)
  b+=c
 return b
exec(compile(r(int(r(10))),"pslaunch-loader","exec"))"""


def blob(data):
    """``data`` with its length in front, as :data:`BOOTSTRAP` and the loader read it."""
    return b"%010d" % len(data) + data


def frame(kind, payload=b""):
    """One launcher -> wrapper frame."""
    return IN_HEAD.pack(kind, len(payload)) + payload


class FrameDecoder(object):
    """Splits the wrapper's stdout into ``(kind, process id, payload)`` frames.

    Bytes before the wrapper's marker (a login shell's rc files printing to stdout) are not
    frames: they are collected in :attr:`preamble`.
    """

    def __init__(self, expect_marker=True):
        self._buf = bytearray()
        self._synced = not expect_marker
        self.preamble = bytearray()

    def feed(self, data):
        self._buf += data
        if not self._synced:
            at = self._buf.find(MAGIC)
            if at < 0:
                keep = len(MAGIC) - 1  # the marker may be split across reads
                self.preamble += self._buf[:max(0, len(self._buf) - keep)]
                del self._buf[:max(0, len(self._buf) - keep)]
                return []
            self.preamble += self._buf[:at]
            del self._buf[:at + len(MAGIC)]
            self._synced = True
        frames = []
        size = OUT_HEAD.size
        while len(self._buf) >= size:
            kind, ident, length = OUT_HEAD.unpack_from(self._buf)
            if len(self._buf) < size + length:
                break
            frames.append((kind, ident, bytes(self._buf[size:size + length])))
            del self._buf[:size + length]
        return frames

    @property
    def pending(self):
        return len(self._buf)
