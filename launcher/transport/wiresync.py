"""``--sync-dst-dir`` over the ssh wrapper's channel: the launcher's half.

The working directory is listed once per job (:class:`TreeSync`); per host, the listing goes to
the host's wrapper, which compares it with what the target holds and asks for the files that
differ (size or modification time), which follow in pieces on the same channel; then the wrapper
sets directories, links and modes and, with ``--sync-delete``, removes what is gone here. The
rules and the host's half are in :mod:`launcher.node.treesync`; the frames (``S``, ``F``, ``D``
and their answers) in :mod:`launcher.node.protocol`.

No second connection, no rsync or SFTP on either end, no shell command: the connection the job
already has, and the wrapper that starts the processes next. An unchanged tree costs one round
trip.
"""

from __future__ import annotations

import errno
import json
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import LaunchError
from ..node import protocol, safefiles, treesync
from ..node.protocol import SYNC_CHUNK, SYNC_HEAD


@dataclass
class SyncStats:
    """What one host's sync did."""

    method: str = "wrapper"
    files: int = 0  # regular files (and links) written there
    bytes: int = 0  # file bytes sent
    deleted: int = 0
    seconds: float = 0.0


class TreeSync:
    """One job's copy of ``src`` to ``dst`` on every host.

    ``excludes`` are patterns, ``skip`` anchored paths (``.gitignore``'s, virtual environments),
    both neither sent nor touched on the host.
    """

    def __init__(self, src: str, dst: str, excludes: Sequence[str], skip: Sequence[str] = (),
                 delete: bool = False) -> None:
        self.src = os.path.abspath(src)
        self.dst = dst
        self.excludes = list(excludes)
        self.skip = list(skip)
        self.delete = delete
        self.ids: dict[str, tuple[int, int]] = {}  # each file's (device, inode) when listed
        self.tree = treesync.scan(self.src, self.excludes, self.skip, self.ids)
        self.request_body = json.dumps({"dst": dst, "rows": treesync.manifest(self.tree), "excludes": self.excludes,
                                        "skip": self.skip, "delete": delete}, separators=(",", ":")).encode()

    @property
    def files(self) -> int:
        return sum(1 for e in self.tree.values() if e[0] == treesync.FILE)

    def sync(self, label: str, request: Callable[[bytes, bytes, bytes], dict],
             send: Callable[[bytes, bytes], None]) -> tuple[str, SyncStats]:
        """Sync one host: ``request(kind, payload, reply_kind)`` sends a frame and returns the
        wrapper's JSON answer, ``send(kind, payload)`` sends one. Returns the absolute target
        directory there and the stats."""
        t0 = time.monotonic()
        reply = request(protocol.SYNC, self.request_body, protocol.SYNC_ANSWER)
        if "error" in reply:
            raise LaunchError(f"sync to {label}:{self.dst} failed: {reply['error']}")
        for rel in reply.get("need") or ():
            entry = self.tree.get(rel)
            if entry is None or entry[0] != treesync.FILE:
                raise LaunchError(f"sync to {label}:{self.dst} failed: the host asked for {rel!r}")
            self._send_file(label, rel, send)
        done = request(protocol.DONE, b"", protocol.DONE_ANSWER)
        if "error" in done:
            raise LaunchError(f"sync to {label}:{reply.get('dir') or self.dst} failed: {done['error']}")
        stats = SyncStats(files=int(done.get("files", 0)), bytes=int(done.get("bytes", 0)),
                          deleted=int(done.get("deleted", 0)), seconds=time.monotonic() - t0)
        return str(done.get("dir") or reply.get("dir") or self.dst), stats

    def _send_file(self, label: str, rel: str, send: Callable[[bytes, bytes], None]) -> None:
        """Send ``rel``'s content: the very file listed, reached without following a link (one put
        there since, on the file or on a directory of its path, fails the sync: its target's
        content is never sent)."""
        name = rel.encode("utf-8", "surrogateescape")
        head = SYNC_HEAD.pack(len(name)) + name
        path = os.path.join(self.src, rel)
        try:
            fd = self._open_listed(rel)
        except OSError as e:
            raise LaunchError(f"sync to {label}: cannot read {path}: {e.strerror or e}") from None
        except (ValueError, LookupError) as e:
            raise LaunchError(f"sync to {label}: {path} changed while it was sent: {e}; run the job again") from None
        try:
            with open(fd, "rb") as f:
                piece = f.read(SYNC_CHUNK)
                while True:
                    after = f.read(SYNC_CHUNK)
                    send(protocol.FILE, head + (protocol.SYNC_MORE if after else protocol.SYNC_LAST) + piece)
                    if not after:
                        return
                    piece = after
        except OSError as e:
            raise LaunchError(f"sync to {label}: cannot read {path}: {e.strerror or e}") from None

    def _open_listed(self, rel: str) -> int:
        """A descriptor of the file listed as ``rel``: ValueError when a link or another file is there now."""
        *dirs, name = rel.split("/")
        top = os.open(self.src, os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                parent = safefiles.walk(top, dirs)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise ValueError("a directory on its path is a symbolic link now (not followed)") from None
                raise
        finally:
            os.close(top)
        try:
            fd = safefiles.open_file(parent, name, os.O_RDONLY, what="it")
        finally:
            os.close(parent)
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.ids[rel]:
            os.close(fd)
            raise ValueError("it was replaced by another file")
        os.set_blocking(fd, True)
        return fd
