"""The mpi backend's rank wrapper: mpirun starts one of these per server and worker.

``mpirun ... python /path/to/launcher/mpirank.py -- COMMAND...`` runs this
file as every MPI rank. It

1. reads its MPI rank from ``OMPI_COMM_WORLD_RANK``, ``PMIX_RANK`` or
   ``PMI_RANK``; if none is set (or ``PSLAUNCH_MPI_RANK_SOURCE=mpi4py``) it
   asks mpi4py, and then calls ``MPI_Finalize`` itself before it exits, as
   Open MPI counts a rank that initialised MPI and did not finalise as failed;
2. looks its rank up in the table the launcher's plan produced
   (``PSLAUNCH_MPI_TABLE``) to learn its role, rank and task id, and builds
   the user command's environment: what mpirun gave this rank, plus the
   role's and the rank's own variables, plus ``DMLC_NODE_HOST`` worked out
   here on the node (the address on ``DMLC_INTERFACE``, else the address
   this node uses to reach the scheduler);
3. runs the command as a child in its own session and process group (stdin
   from ``/dev/null``), with a dead-man switch (:mod:`launcher.watchdog`) that
   kills that group if this wrapper is killed with SIGKILL;
4. relays the child's output as *records*, so the launcher can tell every
   line's rank; reports the child's pid at the start and its exit code at
   the end; exits with the child's code (128+N for signal N).

Where the records go: over this rank's own TCP connection to the launcher
(the table's ``output`` address), authenticated both ways with the job
secret (see :func:`channel_mac`; the secret never crosses the wire). mpirun
relays output in chunks of its own size, and Open MPI's chunks from different
ranks interleave in the middle of lines, so records sent through mpirun cannot
always be told apart. Only if that connection cannot be made (or breaks) do
the records go through mpirun's output instead, one ``write`` each, with a
warning.

Signals: SIGTERM, SIGINT and SIGHUP (and the death of the parent, mpirun's
daemon) are passed to the child's group, which gets SIGKILL after the job's
``--kill-grace``; SIGUSR1 (which both Open MPI and MPICH forward to every
rank) makes the child's group dump its Python stacks (SIGABRT).

Record format, one line on the connection (or the wrapper's stdout for stdout
records, stderr for stderr records)::

    \\x1e<mpi rank><kind> <payload>\\n

with kind ``o``/``e`` a whole stdout/stderr line, ``O``/``E`` the first part
of a long line (no newline yet), ``s`` the start (JSON: pid, host, node
address), ``x`` the exit code (written to both streams). Lines from mpirun
itself carry no mark.

Standard library only, importable as ``launcher.mpirank`` and runnable as a
script on a node where only Python is installed (its siblings ``envvars.py``,
``netif.py`` and ``watchdog.py`` must sit beside it, as MPI programs must be
at the same path on every node).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import time
import zlib
from typing import Any, Mapping, Optional, Sequence

try:
    from . import envvars, netif
except ImportError:  # run as a script by mpirun: the siblings are on sys.path[0]
    import envvars  # type: ignore[no-redef]
    import netif  # type: ignore[no-redef]

TABLE_VERSION = 1
RECORD_MARK = b"\x1e"
# A record must reach mpirun in one piece: keep it under PIPE_BUF (4096).
MAX_PAYLOAD = 3072
STDOUT_LINE, STDOUT_PART, STDERR_LINE, STDERR_PART, START, EXIT = "o", "O", "e", "E", "s", "x"
RECORD_RE = re.compile(rb"\x1e(\d+)([oOeEsx]) ?(.*)", re.DOTALL)
# The connection to the launcher: its greeting, and how long connecting and sending may take.
CHANNEL_HELLO = b"pslaunch-mpi-output 1 "
CHANNEL_CONNECT_TIMEOUT = 10.0
CHANNEL_SEND_TIMEOUT = 60.0
CHANNEL_LINE_MAX = 512
# After the child exits, how long its leftover grandchildren may keep its pipes open.
DRAIN_SECONDS = 0.5
_PR_SET_PDEATHSIG = 1


class WrapperError(Exception):
    """A problem the wrapper reports as one line, with the exit code to use."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# --- the rank table (built by launcher.backends.mpi, read here) --------------------


def encode_table(table: Mapping[str, Any]) -> str:
    """The table as one environment value: compressed JSON, base64 (no secrets on argv)."""
    raw = json.dumps(table, separators=(",", ":"), sort_keys=True).encode()
    return f"z{TABLE_VERSION}:" + base64.b64encode(zlib.compress(raw, 9)).decode("ascii")


def decode_table(text: str) -> dict[str, Any]:
    """Inverse of :func:`encode_table`; raises :class:`WrapperError` on a bad value."""
    prefix = f"z{TABLE_VERSION}:"
    if not text or not text.startswith(prefix):
        raise WrapperError(f"{envvars.MPI_TABLE} is missing or from another pslaunch version; "
                           "start this wrapper through pslaunch --launcher mpi")
    try:
        table = json.loads(zlib.decompress(base64.b64decode(text[len(prefix):])))
    except (ValueError, zlib.error) as e:
        raise WrapperError(f"{envvars.MPI_TABLE} is corrupt: {e}") from None
    if not isinstance(table, dict) or not isinstance(table.get("ranks"), list):
        raise WrapperError(f"{envvars.MPI_TABLE} is corrupt: no rank list")
    return table


def rank_from_environ(environ: Mapping[str, str]) -> Optional[int]:
    """The MPI rank that mpirun put in the environment, or None."""
    for name in envvars.MPI_RANK_VARS:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def size_from_environ(environ: Mapping[str, str]) -> Optional[int]:
    for name in envvars.MPI_SIZE_VARS:
        value = environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def rank_entry(table: Mapping[str, Any], rank: int, size: Optional[int]) -> tuple[str, int, dict[str, str]]:
    """``(role, rank within the role, environment)`` for MPI rank ``rank``."""
    ranks = table["ranks"]
    if size is not None and size != len(ranks):
        raise WrapperError(f"mpirun started {size} ranks but the job has {len(ranks)} servers and workers; "
                           "do not add -n/-np to --mpirun-args")
    if not 0 <= rank < len(ranks):
        raise WrapperError(f"MPI rank {rank} is not in the job's table of {len(ranks)} ranks")
    role, role_rank, own = ranks[rank]
    env = dict(table.get("pinned", {}))
    env.update(table.get("roles", {}).get(role, {}))
    env.update(own)
    return role, int(role_rank), env


def child_environ(environ: Mapping[str, str], job_env: Mapping[str, str]) -> dict[str, str]:
    """The command's environment: this rank's (from mpirun) under the job's, minus the table."""
    env = {k: v for k, v in environ.items() if k not in (envvars.MPI_TABLE, envvars.MPI_RANK_SOURCE)}
    env.update(job_env)
    return env


def node_address(env: Mapping[str, str]) -> str:
    """``DMLC_NODE_HOST`` for this node, worked out here.

    The launcher's value if it gave one (everything on one machine); else this
    node's IPv4 address on ``DMLC_INTERFACE`` (name, ps-lite name prefix or
    CIDR); else the address this node uses to reach the scheduler.
    """
    given = env.get(envvars.NODE_HOST, "").strip()
    if given:
        return given
    if not env.get(envvars.INTERFACE, "").strip() and not env.get(envvars.ROOT_URI, "").strip():
        raise WrapperError(f"{envvars.ROOT_URI} is not set; cannot tell this node's address")
    try:
        return netif.node_address(env.get(envvars.INTERFACE), env.get(envvars.ROOT_URI))
    except netif.NetifError as e:
        raise WrapperError(f"on {socket.gethostname()}: {e}") from None


def record(rank: int, kind: str, payload: bytes = b"") -> bytes:
    return RECORD_MARK + f"{rank}{kind} ".encode() + payload + b"\n"


def parse_record(line: bytes) -> Optional[tuple[int, str, bytes]]:
    """``(rank, kind, payload)`` for a record line (without its newline), else None."""
    m = RECORD_RE.fullmatch(line)
    if not m:
        return None
    return int(m.group(1)), m.group(2).decode(), m.group(3)


# --- the connection to the launcher ------------------------------------------------------


def channel_mac(secret: str, side: str, server_nonce: bytes, client_nonce: bytes, rank: int) -> str:
    """The proof that ``side`` (``client``: the wrapper, ``server``: the launcher) holds the job
    secret, bound to both nonces and the rank, so no proof can be replayed or reused."""
    msg = b"\0".join((b"pslaunch-mpi-output", side.encode(), server_nonce, client_nonce, str(rank).encode()))
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def _read_line(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(CHANNEL_LINE_MAX)
        if not chunk:
            raise ConnectionError("the launcher closed the connection")
        data += chunk
        if len(data) > CHANNEL_LINE_MAX:
            raise ConnectionError("the launcher's greeting is too long")
    return data[:-1]


class Channel:
    """This rank's authenticated connection to the launcher, which carries its records.

    Handshake (one line each way, then records)::

        launcher: pslaunch-mpi-output 1 <server nonce, hex>
        wrapper:  <MPI rank> <client nonce, hex> <channel_mac(client)>
        launcher: ok <channel_mac(server)>
    """

    def __init__(self, address: Sequence[Any], rank: int, secret: str) -> None:
        host, port = str(address[0]), int(address[1])
        sock = socket.create_connection((host, port), timeout=CHANNEL_CONNECT_TIMEOUT)
        try:
            hello = _read_line(sock)
            if not hello.startswith(CHANNEL_HELLO):
                raise ConnectionError(f"{host}:{port} is not a pslaunch launcher")
            server_nonce = bytes.fromhex(hello[len(CHANNEL_HELLO):].decode("ascii"))
            client_nonce = os.urandom(16)
            mac = channel_mac(secret, "client", server_nonce, client_nonce, rank)
            sock.sendall(f"{rank} {client_nonce.hex()} {mac}\n".encode())
            answer = _read_line(sock).decode("ascii", "replace")
            expected = "ok " + channel_mac(secret, "server", server_nonce, client_nonce, rank)
            if not hmac.compare_digest(answer, expected):
                raise ConnectionError(f"{host}:{port} did not prove it holds the job's secret")
        except (OSError, ValueError):
            sock.close()
            raise
        sock.settimeout(CHANNEL_SEND_TIMEOUT)
        self.sock = sock

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)  # the launcher reads everything, then EOF
        except OSError:
            pass
        self.sock.close()


_CHANNEL: Optional[Channel] = None


def _open_channel(rank: int, table: Mapping[str, Any], env: Mapping[str, str]) -> None:
    """Connect to the launcher if the table says where; on failure, warn and use mpirun's output."""
    global _CHANNEL
    address = table.get("output")
    secret = env.get(envvars.SECRET, "")
    if not address:
        return
    try:
        if not secret:
            raise ValueError(f"{envvars.SECRET} is not set")
        _CHANNEL = Channel(address, rank, secret)
    except (OSError, ValueError) as e:
        _emit(rank, STDERR_LINE, (
            f"pslaunch rank wrapper: warning: cannot send this rank's output to the launcher at "
            f"{address[0]}:{address[1]} from {socket.gethostname()} ({e}); it goes through mpirun's output "
            "instead, where long lines of different ranks may mix").encode("utf-8", "replace")[:MAX_PAYLOAD])


def _close_channel() -> None:
    global _CHANNEL
    if _CHANNEL is not None:
        _CHANNEL.close()
        _CHANNEL = None


def _send(fd: int, data: bytes) -> bool:
    """One record to the launcher: on the connection, else on ``fd`` (mpirun's output).
    True if it went on the connection."""
    global _CHANNEL
    if _CHANNEL is not None:
        try:
            _CHANNEL.send(data)
            return True
        except OSError:
            _close_channel()  # the launcher is gone or stuck: mpirun's output is all that is left
    try:
        os.write(fd, data)
    except OSError:
        pass  # mpirun's side is gone; keep going so the child is still stopped
    return False


# --- running the command -------------------------------------------------------------


class _Relay:
    """Cuts one child stream into line records, each written with a single ``write``."""

    def __init__(self, rank: int, fd: int, line_kind: str, part_kind: str) -> None:
        self.rank = rank
        self.fd = fd
        self.line_kind = line_kind
        self.part_kind = part_kind
        self.partial = b""

    def feed(self, data: bytes) -> None:
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        for line in lines:
            self._line(line)
        while len(self.partial) > MAX_PAYLOAD:
            self._write(record(self.rank, self.part_kind, self.partial[:MAX_PAYLOAD]))
            self.partial = self.partial[MAX_PAYLOAD:]

    def _line(self, line: bytes) -> None:
        while len(line) > MAX_PAYLOAD:
            self._write(record(self.rank, self.part_kind, line[:MAX_PAYLOAD]))
            line = line[MAX_PAYLOAD:]
        self._write(record(self.rank, self.line_kind, line))

    def close(self) -> None:
        if self.partial:
            self._line(self.partial)
            self.partial = b""

    def _write(self, data: bytes) -> None:
        _send(self.fd, data)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _set_parent_death_signal(sig: int) -> None:
    """Linux: get ``sig`` when the parent (mpirun's daemon) dies."""
    try:
        import ctypes
        import ctypes.util
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _machine() -> dict[str, Any]:
    """What tells the launcher whether a pid here is a pid on its own machine."""
    info: dict[str, Any] = {"host": socket.gethostname()}
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            info["boot"] = f.read().strip()
        info["pidns"] = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pass
    return info


def _resolve_program(argv0: str, env: Mapping[str, str]) -> str:
    """dmlc's rule, as the local backend: a bare name found only in the cwd runs as ``./name``."""
    if "/" in argv0 or shutil.which(argv0, path=env.get("PATH", os.defpath)):
        return argv0
    if os.path.isfile(argv0) and os.access(argv0, os.X_OK):
        return "./" + argv0
    return argv0


class _Watchdog:
    """The node's dead-man switch (watchdog.py beside this file), if it can start."""

    def __init__(self, grace: float) -> None:
        self.proc: Optional[subprocess.Popen] = None
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "watchdog.py")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-S", "-u", script], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        except OSError:
            return
        self.send(f"grace {max(1.0, grace)}")

    def send(self, line: str) -> None:
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self.proc is None:
            return
        self.send("done")
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


class _Runner:
    """Runs the command for one rank and relays its output until it is gone."""

    def __init__(self, rank: int, grace: float, source: str = "env") -> None:
        self.rank = rank
        self.grace = grace
        self.source = source
        self.child: Optional[subprocess.Popen] = None
        self.pending = _PENDING_SIGNALS
        self.kill_at: Optional[float] = None

    def _handle_signals(self) -> None:
        while self.pending:
            signum = self.pending.pop(0)
            if self.child is None:
                continue
            if signum == signal.SIGUSR1:
                _killpg(self.child.pid, signal.SIGABRT)  # faulthandler: dump the Python stacks
            elif signum == signal.SIGUSR2:
                _killpg(self.child.pid, signal.SIGUSR2)
            else:
                _killpg(self.child.pid, signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
                if self.kill_at is None:
                    self.kill_at = time.monotonic() + self.grace

    def run(self, argv: Sequence[str], env: Mapping[str, str], watchdog: _Watchdog) -> int:
        """Start the command, announce it, relay its output; its exit code (128+N for signal N)."""
        argv = [_resolve_program(argv[0], env), *argv[1:]]
        where = socket.gethostname()
        stop = [s for s in self.pending if s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)]
        if stop:
            raise WrapperError("stopped before the command started", 128 + stop[0])
        try:
            self.child = subprocess.Popen(argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True, close_fds=True)
        except FileNotFoundError:
            raise WrapperError(f"cannot run {argv[0]!r} on {where}: no such program or directory "
                               "(is it on PATH there? give a path such as ./prog)", 127) from None
        except PermissionError:
            raise WrapperError(f"cannot run {argv[0]!r} on {where}: permission denied (is it executable?)",
                               126) from None
        except OSError as e:
            raise WrapperError(f"cannot run {argv[0]!r} on {where}: {e.strerror or e}") from None
        child = self.child
        watchdog.send(f"pgid {child.pid}")
        # The start record goes out before any output line of the command.
        start = {"pid": child.pid, "addr": env.get(envvars.NODE_HOST), "wrapper": os.getpid(),
                 "source": self.source, **_machine()}
        _emit(self.rank, START, json.dumps(start, separators=(",", ":")).encode())
        assert child.stdout is not None and child.stderr is not None
        relays = {child.stdout.fileno(): _Relay(self.rank, 1, STDOUT_LINE, STDOUT_PART),
                  child.stderr.fileno(): _Relay(self.rank, 2, STDERR_LINE, STDERR_PART)}
        return self._pump(child, relays)

    def _pump(self, child: subprocess.Popen, relays: dict[int, _Relay]) -> int:
        sel = selectors.DefaultSelector()
        for fd in relays:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        exited_at: Optional[float] = None
        swept = False
        while sel.get_map() or child.poll() is None:
            # (an empty selector still sleeps for the timeout: the command closed its
            # stdout and stderr but runs on, and signals must still be passed on)
            for key, _ in sel.select(timeout=0.05):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    relays[key.fd].feed(chunk)
                else:
                    sel.unregister(key.fd)
            self._handle_signals()
            now = time.monotonic()
            if self.kill_at is not None and now >= self.kill_at:
                _killpg(child.pid, signal.SIGKILL)
                self.kill_at = None
            if exited_at is None and child.poll() is not None:
                exited_at = now
            if exited_at is not None and sel.get_map() and now - exited_at > DRAIN_SECONDS:
                if not swept:  # grandchildren still hold the pipes: they go with the job
                    _killpg(child.pid, signal.SIGKILL)
                    swept = True
                elif now - exited_at > 2 * DRAIN_SECONDS + 1.0:
                    break  # something outside the group holds them; stop reading
        sel.close()
        for relay in relays.values():
            relay.close()
        code = child.wait()
        _killpg(child.pid, signal.SIGKILL)  # leftovers of a finished command go with it
        return 128 - code if code < 0 else code


_PENDING_SIGNALS: list[int] = []
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _on_signal(signum: int, frame: object) -> None:
    _PENDING_SIGNALS.append(signum)  # acted on by the relay loop, once the command runs


def _emit_error(rank: Optional[int], message: str) -> None:
    text = f"pslaunch rank wrapper: error: {message}".encode("utf-8", "replace")
    if rank is not None:
        _send(2, record(rank, STDERR_LINE, text[:MAX_PAYLOAD]))
        return
    try:
        os.write(2, text + b"\n")
    except OSError:
        pass


def _emit_exit(rank: int, code: int) -> None:
    """The exit record: on the connection, after the last output record; without one, on
    stdout and on stderr, and the launcher keeps the first that arrives (one copy reaching it
    is enough; a lost exit record would make it guess)."""
    data = record(rank, EXIT, str(code).encode())
    if not _send(1, data):
        _send(2, data)


def _emit(rank: int, kind: str, payload: bytes) -> None:
    _send(1 if kind in (STDOUT_LINE, STDOUT_PART, START, EXIT) else 2, record(rank, kind, payload))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: ``mpirank.py [--] COMMAND...``; returns the command's exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    parent = os.getppid()
    for sig in _FORWARDED:
        signal.signal(sig, _on_signal)
    _set_parent_death_signal(signal.SIGTERM)
    environ = dict(os.environ)
    rank: Optional[int] = None
    mpi = None
    runner: Optional[_Runner] = None
    watchdog: Optional[_Watchdog] = None
    try:
        if not args:
            raise WrapperError("no command given")
        if os.getppid() != parent:
            raise WrapperError("mpirun's daemon died before the rank started", 143)
        rank = None if environ.get(envvars.MPI_RANK_SOURCE) == "mpi4py" else rank_from_environ(environ)
        size = size_from_environ(environ)
        if rank is None:
            try:
                from mpi4py import MPI  # initialises MPI: finalised below
            except ImportError:
                raise WrapperError(f"no MPI rank in the environment ({', '.join(envvars.MPI_RANK_VARS)}) "
                                   "and mpi4py is not installed (pip install mpi4py)") from None
            except Exception as e:  # noqa: BLE001 - mpi4py raises RuntimeError and others
                raise WrapperError(f"mpi4py could not initialise MPI: {str(e).splitlines()[0] if str(e) else e!r}",
                                   ) from None
            mpi = MPI
            rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        table = decode_table(environ.get(envvars.MPI_TABLE, ""))
        _, _, job_env = rank_entry(table, rank, size)
        env = child_environ(environ, job_env)
        env[envvars.NODE_HOST] = node_address(env)
        _open_channel(rank, table, env)
        runner = _Runner(rank, float(table.get("grace", 10.0)), "mpi4py" if mpi is not None else "env")
        watchdog = _Watchdog(runner.grace)
        code = runner.run(args, env, watchdog)
        _emit_exit(rank, code)  # as soon as it is known: the rest is housekeeping
    except WrapperError as e:
        _emit_error(rank, str(e))
        code = e.code
        if rank is not None:
            _emit_exit(rank, code)
    except BaseException:
        # anything else: the command's group goes too (the watchdog is told "done" below)
        if runner is not None and runner.child is not None:
            _killpg(runner.child.pid, signal.SIGKILL)
        raise
    finally:
        if watchdog is not None:
            watchdog.close()
        _close_channel()
    if mpi is not None:
        try:
            mpi.Finalize()
        except Exception:  # noqa: BLE001 - the exit code matters more than a finalize problem
            pass
    return code


if __name__ == "__main__":
    sys.exit(main())
