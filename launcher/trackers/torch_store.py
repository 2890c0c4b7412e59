"""Hosts the rendezvous store of a ``--tracker torch`` job, in a process of its own.

Usage (with a Python that has torch; the launcher never imports it)::

    python torch_store.py --listen-fd FD --host ADDR --port PORT

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

It writes JSON lines on its stdout, one object each:

* ``{"event": "listening", "port": PORT, "torch": VERSION, "pid": PID, "seconds": S}`` once the
  store serves (``S``: from this program's start);
* ``{"event": "failed", "error": "..."}`` (exit code 2) when it cannot: no torch, a torch without
  ``master_listen_fd``.

Stdin is the launcher's leash: at end of file (the launcher closed it, or died) the program
exits at once, code 0. Nothing else goes to stdout (what torch writes there goes to stderr, for
the launcher to label ``[torch store]``). The store has no authentication, as torchrun's has none:
it listens only on the address the launcher chose.

Standard library and torch only; nothing from the launcher is imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _emit(stream, **obj) -> None:
    try:
        stream.write(json.dumps(obj) + "\n")
        stream.flush()
    except (OSError, ValueError):
        pass


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:500]


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listen-fd", type=int, required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    a = ap.parse_args(argv)

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    try:
        import torch
        from torch.distributed import TCPStore
    except ImportError as e:
        _emit(out, event="failed", error=f"cannot import torch.distributed with {sys.executable}: {e}; install "
                                         "torch there or choose another --tracker-python")
        return 2
    try:
        # (held in a variable: the store serves as long as the object lives)
        store = TCPStore(a.host, a.port, is_master=True, wait_for_workers=False,  # noqa: F841
                         master_listen_fd=a.listen_fd)
    except TypeError as e:  # a torch too old for master_listen_fd
        _emit(out, event="failed", error=f"torch {torch.__version__} at {sys.executable} cannot host the store "
                                         f"({_first_line(e)}): use torch 2.0 or later")
        return 2
    except Exception as e:  # noqa: BLE001 - torch's own error types vary by version
        _emit(out, event="failed", error=f"cannot start the store on {a.host}:{a.port}: {_first_line(e)}")
        return 2
    _emit(out, event="listening", port=a.port, torch=torch.__version__, pid=os.getpid(),
          seconds=round(time.monotonic() - t0, 3))
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    _emit(out, event="stopped")
    sys.stderr.flush()
    os._exit(0)  # (the store's threads must not delay the exit)


if __name__ == "__main__":
    sys.exit(main())
