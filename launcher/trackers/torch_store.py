"""Hosts the rendezvous store of a ``--tracker torch`` job, in a process of its own: one store per
attempt of the job, in the one process that lives as long as the job.

Usage (with a Python that has torch; the launcher never imports it)::

    python torch_store.py --listen-fd FD --host ADDR --port PORT [--attempt K]

The launcher binds and listens on ``ADDR:PORT`` itself (the first free port of ``--port-range``
on the address every node reaches) and hands the listening socket over as ``FD``; this program
wraps it in ``torch.distributed.TCPStore(is_master=True, master_listen_fd=FD)``, the store that
torchrun's agent hosts for its workers. So the port is taken before the workers start, with no
race between probing it and binding it, and the workers start at the same time as this program:
a worker that connects while torch is still being imported here waits in the socket's backlog,
it is not refused.

The workers get ``MASTER_ADDR=ADDR``, ``MASTER_PORT=PORT`` and
``TORCHELASTIC_USE_AGENT_STORE=True``: ``init_process_group("env://")`` then connects every rank,
rank 0 included, to this store as a client (``torch/distributed/rendezvous.py``,
``_create_c10d_store``), as torchrun's workers connect to their agent's. The store outlives
every rank (the launcher stops it after the last worker ended), so a rank that finishes first
never takes the store away from the others.

Stdin is the launcher's leash, one end of a Unix socket pair. At end of file (the launcher closed
it, or died) the program exits at once, code 0. Before each later attempt of the job
(``--max-restarts``) the launcher binds the attempt's port as for the first and sends the
listening socket over the leash (``SCM_RIGHTS``) with one JSON line,
``{"attempt": K, "host": ADDR, "port": PORT}``: the store of the attempt before is closed first
(its port, its connections and its keys go with it), and a new, empty store serves on the new
socket. So a restart costs no second ``import torch`` (about 1.8 s of CPU, beside the ranks'
own imports), and nothing of attempt K reaches attempt K+1's store. With a stdin that is not a
socket (a pipe), the program serves its first store until end of file.

It writes JSON lines on its stdout, one object each:

* ``{"event": "listening", "port": PORT, "attempt": K, "torch": VERSION, "pid": PID, "seconds": S}``
  once each store serves (``S``: from this program's start, for the first; from the request,
  for a later one);
* ``{"event": "failed", "error": "...", "attempt": K}`` (exit code 2) when it cannot: no torch, a
  torch without ``master_listen_fd``, a request without a socket.

Nothing else goes to stdout (what torch writes there goes to stderr, for the launcher to label
``[torch store]``). The store has no authentication, as torchrun's has none: it listens only on
the address the launcher chose.

Standard library and torch only, Python 3.8 or later; nothing from the launcher is imported.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import socket
import sys
import time

FD_SIZE = array.array("i").itemsize
MAX_FDS = 4  # (room for more than the one socket each request brings: none is lost unclosed)


def _emit(stream, **obj) -> None:
    try:
        stream.write(json.dumps(obj) + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:500]


def _serve(host: str, port: int, fd: int):
    """A store on the listening socket ``fd`` (the store owns it from then on): ``(store, None)``,
    or ``(None, why)`` when it cannot."""
    import torch
    from torch.distributed import TCPStore

    try:
        return TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd), None
    except TypeError as e:  # a torch too old for master_listen_fd
        return None, (f"torch {torch.__version__} at {sys.executable} cannot host the store ({_first_line(e)}): "
                      "use torch 2.0 or later")
    except Exception as e:  # noqa: BLE001 - torch's own error types vary by version
        return None, f"cannot start the store on {host}:{port}: {_first_line(e)}"


def _leash():
    """Stdin as a socket, or None when it is not one (then only its end of file counts)."""
    try:
        sock = socket.socket(fileno=os.dup(0))
    except OSError:
        return None
    if sock.family != socket.AF_UNIX:
        sock.close()
        return None
    return sock


def _requests(leash):
    """Each request the launcher sends on ``leash``: ``(the JSON object, the socket that came with
    it or None)``, in order; the generator ends at end of file."""
    buf = b""
    fds: list = []
    flags = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    while True:
        try:
            data, ancillary, _, _ = leash.recvmsg(4096, socket.CMSG_SPACE(MAX_FDS * FD_SIZE), flags)
        except OSError:
            data, ancillary = b"", []
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[:len(payload) - len(payload) % FD_SIZE])
                fds.extend(got)
        if not data:
            for fd in fds:
                os.close(fd)
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                request = json.loads(line)
            except ValueError:
                request = None
            yield (request if isinstance(request, dict) else {}), (fds.pop(0) if fds else None)


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen-fd", type=int, required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--attempt", type=int, default=0)
    a = ap.parse_args(argv)

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    try:
        import torch
        from torch.distributed import TCPStore  # noqa: F401 - (what the store needs: said now, once)
    except ImportError as e:
        _emit(out, event="failed", attempt=a.attempt,
              error=f"cannot import torch.distributed with {sys.executable}: {e}; install torch there or "
                    "choose another --tracker-python")
        return 2
    # (held in a variable: the store serves as long as the object lives)
    store, why = _serve(a.host, a.port, a.listen_fd)
    if store is None:
        _emit(out, event="failed", error=why, attempt=a.attempt)
        return 2
    _emit(out, event="listening", port=a.port, attempt=a.attempt, torch=torch.__version__, pid=os.getpid(),
          seconds=round(time.monotonic() - t0, 3))
    leash = _leash()
    if leash is None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
    else:
        for request, fd in _requests(leash):
            t1 = time.monotonic()
            attempt, host, port = request.get("attempt"), request.get("host"), request.get("port")
            store = None  # the last attempt's store ends first: its port, its connections, its keys
            if fd is None or not isinstance(host, str) or not isinstance(port, int):
                if fd is not None:
                    os.close(fd)
                _emit(out, event="failed", attempt=attempt, error=f"a request for a store without a socket, host "
                                                                  f"or port: {str(request)[:200]}")
                sys.stderr.flush()
                os._exit(2)
            store, why = _serve(host, port, fd)
            if store is None:
                _emit(out, event="failed", error=why, attempt=attempt)
                sys.stderr.flush()
                os._exit(2)
            _emit(out, event="listening", port=port, attempt=attempt, torch=torch.__version__, pid=os.getpid(),
                  seconds=round(time.monotonic() - t1, 3))
    _emit(out, event="stopped")
    sys.stderr.flush()
    os._exit(0)  # (the store's threads must not delay the exit)


if __name__ == "__main__":
    sys.exit(main())
