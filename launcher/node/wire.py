"""The node channel: how a node agent reports to the launcher, and how the launcher controls it.

Each node agent (an MPI rank's wrapper, a batch task's wrapper) opens one TCP connection to
the launcher's hub (``launcher.runtime.hub``) before it starts its command. Both sides prove
that they hold the job's secret; the secret itself never crosses the wire. Handshake, one
line each way, then records and commands::

    launcher: pslaunch-node 1 <server nonce, hex>
    agent:    <ident> <client nonce, hex> <channel_mac(client)>
    launcher: ok <channel_mac(server)>

``ident`` is the process's number in the job (the MPI rank; a batch task's place in the
job's process list). The MACs bind both nonces and the ident, so no proof can be replayed
or used for another process.

Agent -> launcher: *records*, one line each::

    \\x1e<ident><kind> <payload>\\n

with kind ``o``/``e`` a whole stdout/stderr line, ``O``/``E`` the first part of a longer one
(no newline yet), ``s`` the start (JSON: pid, host, node address, ...), ``f`` the command
could not start (JSON: error, code), ``x`` the exit code (128+N for signal N), ``h`` "here I
am" (JSON: ``host``, the machine's name, and what else :func:`launcher.node.agent.machine`
tells) from an agent that awaits its placement. The mpi backend also accepts records in-band,
on mpirun's output, from an agent that cannot connect.

Launcher -> agent: *commands*, one word per line: ``TERM``, ``INT`` (stop the command's
group gracefully, ``KILL`` after the grace period), ``KILL``, ``ABRT`` (dump Python stacks);
and one *placement* line, ``ENV <JSON object of name: value>`` (ASCII, at most
:data:`ENV_MAX` bytes). When the connection ends while the command runs, the launcher is gone:
the agent stops it.

Placement. Some variables depend on which processes share a host (torch's ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, and ``RANK`` numbered host by host), which nobody knows
before a batch system has placed the tasks. An agent told to await its placement (a batch
task whose task file says so) sends ``h`` before it starts its command, then waits for the
``ENV`` line, adds those variables to the command's environment and starts it. The launcher
answers every agent once every such process has said where it runs::

    agent 0:  \x1e0h {"host": "n1", ...}          agent 1:  \x1e1h {"host": "n2", ...}
    launcher: ENV {"RANK": "0", "LOCAL_RANK": "0", ...}   (to each, its own, after the last h)

Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import socket
from typing import Mapping, Optional, Sequence

RECORD_MARK = b"\x1e"
# A record must reach a pipe (mpirun's output) in one write: keep it under PIPE_BUF (4096).
MAX_PAYLOAD = 3072
STDOUT_LINE, STDOUT_PART, STDERR_LINE, STDERR_PART, START, FAILED, EXIT = "o", "O", "e", "E", "s", "f", "x"
HERE = "h"
RECORD_RE = re.compile(rb"\x1e(\d+)([oOeEsfxh]) ?(.*)", re.DOTALL)
COMMANDS = ("TERM", "INT", "KILL", "ABRT")
ENV = "ENV"
#: The longest placement line the agent accepts.
ENV_MAX = 64 * 1024

HELLO = b"pslaunch-node 1 "
CONNECT_TIMEOUT = 10.0
SEND_TIMEOUT = 60.0
LINE_MAX = 512


def record(ident: int, kind: str, payload: bytes = b"") -> bytes:
    return RECORD_MARK + f"{ident}{kind} ".encode() + payload + b"\n"


def env_line(env: Mapping[str, str]) -> bytes:
    """The placement command that carries ``env`` (see the module docstring)."""
    line = (ENV + " " + json.dumps(dict(env), separators=(",", ":"), ensure_ascii=True, sort_keys=True)).encode()
    if len(line) >= ENV_MAX:
        raise ValueError(f"the placement variables take {len(line)} bytes; at most {ENV_MAX} fit in one line")
    return line + b"\n"


def parse_env_line(line: str) -> Optional[dict[str, str]]:
    """The variables of an ``ENV`` line, or None when it is not one (or malformed)."""
    word, _, rest = line.partition(" ")
    if word != ENV:
        return None
    try:
        env = json.loads(rest)
    except ValueError:
        return None
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None
    return env


def parse_record(line: bytes) -> Optional[tuple[int, str, bytes]]:
    """``(ident, kind, payload)`` for a record line (without its newline), else None."""
    m = RECORD_RE.fullmatch(line)
    if not m:
        return None
    return int(m.group(1)), m.group(2).decode(), m.group(3)


def channel_mac(secret: str, side: str, server_nonce: bytes, client_nonce: bytes, ident: int) -> str:
    """The proof that ``side`` (``client``: the agent, ``server``: the launcher) holds the job
    secret, bound to both nonces and the ident."""
    msg = b"\0".join((b"pslaunch-node", side.encode(), server_nonce, client_nonce, str(ident).encode()))
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(LINE_MAX)
        if not chunk:
            raise ConnectionError("the launcher closed the connection")
        data += chunk
        if len(data) > LINE_MAX:
            raise ConnectionError("the launcher's greeting is too long")
    return data[:-1]


class Channel:
    """The agent's side of the connection (see the module docstring)."""

    def __init__(self, address: Sequence[object], ident: int, secret: str) -> None:
        host, port = str(address[0]), int(address[1])  # type: ignore[call-overload]
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
        try:
            hello = _read_line(sock)
            if not hello.startswith(HELLO):
                raise ConnectionError(f"{host}:{port} is not a pslaunch launcher")
            server_nonce = bytes.fromhex(hello[len(HELLO):].decode("ascii"))
            client_nonce = os.urandom(16)
            mac = channel_mac(secret, "client", server_nonce, client_nonce, ident)
            sock.sendall(f"{ident} {client_nonce.hex()} {mac}\n".encode())
            answer = _read_line(sock).decode("ascii", "replace")
            expected = "ok " + channel_mac(secret, "server", server_nonce, client_nonce, ident)
            if not hmac.compare_digest(answer, expected):
                raise ConnectionError(f"{host}:{port} did not prove it holds the job's secret")
        except (OSError, ValueError):
            sock.close()
            raise
        sock.settimeout(SEND_TIMEOUT)
        self.sock = sock
        self._inbox = b""
        #: the placement variables, once the launcher has sent them (see the module docstring)
        self.env: Optional[dict[str, str]] = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def commands(self) -> list[str]:
        """The commands that arrived (call when :meth:`fileno` is readable). A placement line is
        kept in :attr:`env` instead.

        Raises:
            EOFError: the launcher closed the connection (or it broke).
        """
        try:
            self.sock.setblocking(False)
            try:
                data = self.sock.recv(ENV_MAX)
            finally:
                self.sock.settimeout(SEND_TIMEOUT)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            raise EOFError
        self._inbox += data
        *lines, self._inbox = self._inbox.split(b"\n")
        if len(self._inbox) > ENV_MAX:
            self._inbox = b""
        words = []
        for line in lines:
            text = line.decode("ascii", "replace").strip()
            if text in COMMANDS:
                words.append(text)
            elif self.env is None:
                self.env = parse_env_line(text)
        return words

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)  # the launcher reads everything, then EOF
        except OSError:
            pass
        self.sock.close()
