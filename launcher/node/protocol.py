# ruff: noqa: UP004, UP031 - Python 3.5 syntax: the ssh backend runs this with a host's own python3
"""The node protocol: how the launcher and a node agent talk, whatever carries them. This is the spec.

Both halves import this module: the launcher (``launcher.runtime.remote``, ``.hub``, the backends)
and every node program (:mod:`.agent`, which reaches ssh hosts inside the node bundle). Standard
library only, Python 3.5 syntax.

Frames
======

Every message, in both directions and on every transport, is one *frame*::

    kind (1 byte) | process id (2 bytes, big endian) | length (4 bytes, big endian) | payload

The kind is an ASCII letter: upper case for what the launcher sends to a node, lower case for what
a node sends to the launcher. The process id is the process's number in the job (its index in the
job's process list for ssh, the MPI rank, a batch task's task id; a job has at most 20,000
processes); :data:`NODE` (0xFFFF) stands for the node itself. JSON payloads are UTF-8 objects.
Exit codes are always the shell's: the code, or 128+N for a process killed by signal N. A receiver
ignores a frame of a kind it does not know, of a process it does not run, or longer than it
accepts (its bytes are read and dropped: :class:`Decoder`), and never ends anything for it. A
launcher accepts :data:`MAX_FROM_NODE` bytes in a frame, :data:`MAX_ANSWER` in an answer (``i``,
``s``, ``d``: a request waiting for an answer that was dropped fails at once); a node accepts
:data:`MAX_TO_NODE`.

Launcher -> node:

====  ==============  ==========  ==================================================================
kind  constant        process id  payload
====  ==============  ==========  ==================================================================
H     :data:`HEADER`  NODE        JSON ``{"procs": [{"id", "argv", "env", "cwd"}, ...], "keepalive",
                                  "lost_after", "grace"}``: start these processes (ssh; sent once,
                                  so the environment never appears on a command line)
X     :data:`SIGNAL`  a process,  ASCII ``TERM`` or ``INT`` (stop the process's group: the signal,
                      or NODE     then ``CONT``; ``KILL`` after the job's grace), ``KILL``, ``ABRT``
                      for all     (faulthandler: dump the Python stacks), ``USR1`` or ``USR2`` (pass
                                  a batch system's notice on to the group; the process goes on)
E     :data:`PLACE`   a process   JSON ``{name: value}``, ASCII, at most :data:`ENV_MAX` bytes: the
                                  variables that depend on which processes share a host (answers
                                  ``h``, see *Placement*)
K     :data:`PING`    NODE        empty: a keep-alive, answered with ``k``
I     :data:`IFACE`   NODE        JSON ``{"iface"}``: this host's address on ``DMLC_INTERFACE``
                                  (ssh, before ``H``; answered with ``i``)
S     :data:`SYNC`    NODE        JSON ``{"dst", "rows", "excludes", "skip", "delete"}``: sync a
                                  directory tree (:mod:`.treesync`; ssh, before ``H``; answered
                                  with ``s``)
F     :data:`FILE`    NODE        the data of one file ``s`` asked for: :data:`SYNC_HEAD` (the
                                  path's length), the path (UTF-8), one byte (:data:`SYNC_LAST`:
                                  the file's last piece, else :data:`SYNC_MORE`), then at most
                                  :data:`SYNC_CHUNK` bytes; files in ``s``'s order
D     :data:`DONE`    NODE        empty: the sync's data is complete, apply it (answered with ``d``)
====  ==============  ==========  ==================================================================

Node -> launcher:

====  =====================  ==========  =========================================================
kind  constant               process id  payload
====  =====================  ==========  =========================================================
p     :data:`STARTED`        a process   JSON ``{"pid", "agent", "host", "boot", "pidns", ...}``:
                                         it runs, as the leader of its own process group (pgid =
                                         pid); before any of its output. ``boot`` and ``pidns``
                                         tell whether the pid is one of the launcher's machine;
                                         a backend may add fields (``addr``, ``step``)
f     :data:`FAILED`         a process   JSON ``{"error", "code", "host"}``: it could not start;
                                         ``error`` is one line, ``code`` the shell's (127: no such
                                         program, 126: not executable, 1: anything else)
o     :data:`STDOUT`         a process   bytes of its stdout, as they came
e     :data:`STDERR`         a process   bytes of its stderr
x     :data:`EXIT`           a process   ASCII decimal exit code (N, or 128+N for signal N), then
                                         a space and the node's clock when the agent saw the exit
                                         (seconds since the epoch, decimal; optional); after the
                                         process's output, once its pipes ended (or 0.5 s after it
                                         exited, when what it started holds them open)
r     :data:`RECORD`         a process   JSON ``{"message", "traceback", "time"}``: what the
                                         process wrote to its error file (:mod:`.errorfile`:
                                         ``PSLAUNCH_ERROR_FILE``, torch's ``@record``), bounded;
                                         ``time`` is the node's clock; just before its ``x``, and
                                         only when it wrote one
h     :data:`HERE`           a process   JSON ``{"host", ...}`` (as ``p``): it awaits its ``E``
k     :data:`ALIVE`          NODE        empty: the answer to ``K``
i     :data:`IFACE_ANSWER`   NODE        JSON ``{"address", "interface"}`` or ``{"error"}``
s     :data:`SYNC_ANSWER`    NODE        JSON ``{"dir", "need": [path, ...]}`` (the absolute target
                                         and the files to send, in order) or ``{"error"}``
d     :data:`DONE_ANSWER`    NODE        JSON ``{"dir", "files", "bytes", "deleted"}`` or
                                         ``{"error"}``: once per sync, after ``D`` or at the first
                                         error while writing
u     :data:`USAGE`          a process   ASCII ``CPU RSS``: the percent of one core its process
                                         tree used since the last ``u`` (decimal, one place) and
                                         its resident bytes (:class:`.procgroup.UsageMeter`); about
                                         once per :data:`USAGE_INTERVAL` while it runs, only when
                                         the launcher asked (``"usage"`` in the header, the task
                                         file or the rank table), never after its ``x``
====  =====================  ==========  =========================================================

Transports
==========

(a) **An ssh channel** (the ssh backend: one per host, whatever its number of processes). The
channel's command is :data:`BOOTSTRAP` (nothing job-specific, nothing secret). On its stdin the
launcher writes :func:`blob` (the loader, :mod:`.ssh_loader`), which the bootstrap runs; then
:func:`blob` (the node bundle, ``launcher.node.bundle``), which the loader imports from memory
(nothing is written to the host's disk) and whose ``__main__`` it runs; then frames. On its stdout
the node writes :data:`MAGIC` (whatever a login shell's rc files printed before it is not the
node's), then frames. Its stderr is the node program's own (a traceback, a shell's ``python3: not
found``). No handshake: the connection is authenticated already. The node answers each ``K``;
when nothing came for ``lost_after`` seconds, or its stdin reaches its end (the launcher is done,
gone, or unreachable), it stops every process.

(b) **TCP to the launcher's hub** (``launcher.runtime.hub``: the mpi rank wrappers and the batch
task wrappers). One connection per process. Both sides prove that they hold the job's secret; the
secret itself never crosses the wire. One line each way, then frames both ways::

    launcher: pslaunch-node 2 <server nonce, hex>
    agent:    <process id> <client nonce, hex> <channel_mac("client")>
    launcher: ok <channel_mac("server")>

:func:`channel_mac` binds both nonces and the process id, so no proof can be replayed or used
for another process; a connection is served only after its proof, only for a process of this
job, and only once per process. When the connection ends while the process runs, the launcher is
gone: the agent stops it.

(c) **In-band**, when an agent cannot connect: node -> launcher only, on mpirun's or srun's
output, which carries every rank's or task's output and the launcher's tools' own text. Each frame
is one line, the byte ``\\x1e`` (the record separator), the frame in base64, a newline, written
with one ``write`` below ``PIPE_BUF`` so that no other writer's bytes can land inside it::

    \\x1eeAACAAAAATM=\\n        (x, process 2, exit code 3)

An in-band frame carries at most :data:`LINE_PAYLOAD` bytes (a process's output is cut into such
pieces, ``r`` is shortened to fit), so its line stays under 4096 bytes. ``p``, ``o``, ``u`` and ``x`` go
to the agent's stdout, ``e`` and ``f`` to its stderr, and ``r`` and ``x`` to both (the launcher keeps
the first that arrives). A line that is not exactly one envelope (:func:`unwrap`) is the tools' own
text.

Time
====

The launcher takes the job's first failure by time across all hosts: a node's ``x`` says when the
process ended by the node's clock, not when the launcher heard of it. This assumes that the hosts'
clocks agree (NTP); a node's time later than the launcher's arrival of the frame is not used.

Placement
=========

Some variables depend on which processes share a host (torch's ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, and ``RANK`` numbered host by host), which nobody knows
before a batch system has placed the tasks. A task told to await its placement sends ``h`` before
it starts its command and waits for its ``E``; the launcher answers every such task once the last
of them has said where it runs.
"""

import binascii
import json
import os
import struct

HEAD = struct.Struct(">cHI")  # kind, process id, payload length
#: The process id of frames about the node itself, not one of its processes.
NODE = 0xFFFF

# launcher -> node
HEADER = b"H"
SIGNAL = b"X"
PLACE = b"E"
PING = b"K"
IFACE = b"I"
SYNC = b"S"
FILE = b"F"
DONE = b"D"
# node -> launcher
STARTED = b"p"
FAILED = b"f"
STDOUT = b"o"
STDERR = b"e"
EXIT = b"x"
RECORD = b"r"
HERE = b"h"
ALIVE = b"k"
IFACE_ANSWER = b"i"
SYNC_ANSWER = b"s"
DONE_ANSWER = b"d"
USAGE = b"u"

TO_NODE = (HEADER, SIGNAL, PLACE, PING, IFACE, SYNC, FILE, DONE)
FROM_NODE = (STARTED, FAILED, STDOUT, STDERR, EXIT, RECORD, HERE, ALIVE, IFACE_ANSWER, SYNC_ANSWER, DONE_ANSWER,
             USAGE)
#: The payloads of :data:`SIGNAL`.
SIGNALS = ("TERM", "INT", "KILL", "ABRT", "USR1", "USR2")

#: The longest frame a launcher accepts from a node (output comes in pieces of 64 KiB).
MAX_FROM_NODE = 1 << 20
#: The longest frame a node accepts from the launcher (a header carries every process's environment).
MAX_TO_NODE = 1 << 30
#: The longest answer (``i``, ``s``, ``d``) a launcher accepts from a node: as long as a request
#: may be (``s`` lists every file a host lacks, which for a large tree is more than
#: :data:`MAX_FROM_NODE`).
MAX_ANSWER = MAX_TO_NODE
#: Seconds between a node's usage reports (``u``), when the launcher asks for them: what it sends
#: as ``"usage"`` (an agent takes any positive number it is given).
USAGE_INTERVAL = 1.0
#: The longest placement payload.
ENV_MAX = 64 * 1024
#: The longest payload of an in-band frame: its line, ``\\x1e``, base64 and newline, is then at most
#: 4094 bytes, under PIPE_BUF (4096).
LINE_PAYLOAD = 3062
RECORD_MARK = b"\x1e"
_BASE64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="

SYNC_HEAD = struct.Struct(">H")  # an F frame: the length of the path that follows
SYNC_CHUNK = 1 << 20  # the most file data in one F frame
SYNC_MORE, SYNC_LAST = b"\x00", b"\x01"  # an F frame's byte after the path: the file's last piece?

#: What a node writes to an ssh channel's stdout before its first frame.
MAGIC = b"\0pslaunch-frames\0"
#: The start of the hub's greeting (transport b).
HELLO = b"pslaunch-node 2 "
#: The longest handshake line either side accepts.
LINE_MAX = 512

# Reads one blob (10 ASCII digits giving its length, then the bytes) from stdin and runs it as
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


def frame(kind, ident, payload=b""):
    """One frame (see the module docstring)."""
    return HEAD.pack(kind, ident, len(payload)) + payload


def signal_frame(ident, signame):
    """``X``: ``signame`` (one of :data:`SIGNALS`) to process ``ident`` (:data:`NODE`: to all)."""
    if signame not in SIGNALS:
        raise ValueError("unknown signal %r" % signame)
    return frame(SIGNAL, ident, signame.encode("ascii"))


def env_frame(ident, env):
    """``E``: process ``ident``'s placement variables; ValueError when they do not fit."""
    payload = json.dumps(dict(env), separators=(",", ":"), ensure_ascii=True, sort_keys=True).encode("ascii")
    if len(payload) > ENV_MAX:
        raise ValueError("the placement variables take %d bytes; at most %d fit in one frame" % (len(payload), ENV_MAX))
    return frame(PLACE, ident, payload)


def parse_env(payload):
    """The variables of an ``E`` payload, or None when it is malformed."""
    try:
        env = json.loads(payload.decode("ascii"))
    except ValueError:  # (UnicodeDecodeError is one)
        return None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None
    return env


def parse_json(payload):
    """A JSON object payload, or ``{}`` when it is not one (input never ends anything)."""
    try:
        doc = json.loads(payload.decode("utf-8"))
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def exit_payload(code, when=None):
    """An ``x`` payload: the exit code and, if known, the node's clock when the process ended."""
    return b"%d" % code if when is None else b"%d %.6f" % (code, when)


def parse_exit(payload):
    """``(exit code, the node's time of the exit or None)`` of an ``x`` payload (code 1 when it is
    malformed; no time when the time is)."""
    parts = payload.split()
    try:
        code = int(parts[0].decode("ascii"))
    except (ValueError, IndexError):
        return 1, None
    when = None
    if len(parts) == 2:
        try:
            when = float(parts[1].decode("ascii"))
        except ValueError:
            pass
        if when is not None and not 0 < when < 1e11:  # (NaN, infinity, nonsense)
            when = None
    return code, when


def parse_code(payload):
    """The exit code of an ``x`` payload (1 when it is malformed)."""
    return parse_exit(payload)[0]


def usage_payload(cpu, rss):
    """A ``u`` payload: CPU percent of one core (one decimal place) and resident bytes."""
    return b"%.1f %d" % (cpu, rss)


def parse_usage(payload):
    """``(CPU percent, RSS bytes)`` of a ``u`` payload, or None when it is malformed."""
    parts = payload.split()
    if len(parts) != 2:
        return None
    try:
        cpu, rss = float(parts[0].decode("ascii")), int(parts[1].decode("ascii"))
    except ValueError:  # (UnicodeDecodeError is one)
        return None
    if not 0.0 <= cpu < 1e7 or not 0 <= rss < 1 << 62:  # (NaN, infinity, nonsense)
        return None
    return cpu, rss


def blob(data):
    """``data`` with its length in front (10 ASCII digits), as :data:`BOOTSTRAP` and the loader read it."""
    return b"%010d" % len(data) + data


def read_blob(fd=0):
    """Read one :func:`blob` from ``fd``; EOFError when the stream ends first."""
    def read(n):
        data = b""
        while len(data) < n:
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return data

    return read(int(read(10)))


class Decoder(object):
    """Splits a byte stream into frames: :meth:`feed` returns ``[(kind, process id, payload)]``.

    Args:
        limit: a frame whose payload is longer is dropped (its bytes are read and discarded, never
            kept) and counted in :attr:`dropped`; the frames after it are decoded as usual.
        marker: bytes before the first ``marker`` are not frames; they are kept in :attr:`preamble`
            (transport a: what a login shell printed).
        limits: ``{kind: limit}`` for the kinds that may be longer (or must be shorter) than ``limit``.
        on_drop: called as ``on_drop(kind, process id, length)`` for each frame dropped.
    """

    def __init__(self, limit=MAX_FROM_NODE, marker=None, limits=None, on_drop=None):
        self.limit = limit
        self.limits = dict(limits or {})
        self.on_drop = on_drop
        self.dropped = 0
        self.preamble = bytearray()
        self._marker = marker
        self._buf = bytearray()
        self._skip = 0

    def feed(self, data):
        buf = self._buf
        buf += data
        if self._marker is not None:
            at = buf.find(self._marker)
            if at < 0:
                keep = max(0, len(buf) - len(self._marker) + 1)  # (the marker may be split across reads)
                self.preamble += buf[:keep]
                del buf[:keep]
                return []
            self.preamble += buf[:at]
            del buf[:at + len(self._marker)]
            self._marker = None
        frames = []
        pos, size, end = 0, HEAD.size, len(buf)
        while True:
            if self._skip:
                n = min(self._skip, end - pos)
                self._skip -= n
                pos += n
                if self._skip:
                    break
            if end - pos < size:
                break
            kind, ident, length = HEAD.unpack_from(buf, pos)
            if length > self.limits.get(kind, self.limit):
                self.dropped += 1
                self._skip = length
                pos += size
                if self.on_drop is not None:
                    self.on_drop(kind, ident, length)
                continue
            if end - pos < size + length:
                break
            frames.append((kind, ident, bytes(buf[pos + size:pos + size + length])))
            pos += size + length
        del buf[:pos]
        return frames

    @property
    def framing(self):
        """Whether the frames have begun (the ``marker`` arrived, or there is none)."""
        return self._marker is None

    @property
    def pending(self):
        """Bytes received that are not a whole frame yet."""
        return len(self._buf)


def envelope(kind, ident, payload=b""):
    """One frame as an in-band line (transport c): ``\\x1e``, its base64, ``\\n``; under PIPE_BUF."""
    if len(payload) > LINE_PAYLOAD:
        raise ValueError("an in-band frame carries at most %d bytes" % LINE_PAYLOAD)
    return RECORD_MARK + binascii.b2a_base64(frame(kind, ident, payload), newline=True)


def unwrap(line):
    """``(kind, process id, payload)`` of an in-band line (without its newline), or None when the
    line is not exactly one envelope (it is someone else's text)."""
    if not line.startswith(RECORD_MARK) or len(line) < 13 or line.translate(None, _BASE64) != RECORD_MARK:
        return None
    try:
        raw = binascii.a2b_base64(line[1:])
    except (binascii.Error, ValueError):
        return None
    if len(raw) < HEAD.size:
        return None
    kind, ident, length = HEAD.unpack_from(raw)
    if len(raw) != HEAD.size + length:
        return None
    return kind, ident, raw[HEAD.size:]


def channel_mac(secret, side, server_nonce, client_nonce, ident):
    """The proof that ``side`` (``client``: the agent, ``server``: the launcher) holds the job
    secret, bound to both nonces and the process id (transport b)."""
    import hashlib  # (here: an ssh host's node never needs them, and they cost its start milliseconds)
    import hmac

    msg = b"\0".join((b"pslaunch-node", side.encode(), server_nonce, client_nonce, str(ident).encode()))
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()
