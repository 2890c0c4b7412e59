# ruff: noqa: UP004, UP031 - Python 3.5 syntax: a host's own python3 runs it
"""pslaunch's remote wrapper: the node agent of one ssh host, and what the ssh backend asks of it first.

The ssh backend never installs anything on a host. Per host it runs ``exec python3 -S -c
BOOTSTRAP`` on its connection; the bootstrap and :mod:`.ssh_loader` read the node bundle from the
channel's stdin and run this module from memory (:mod:`.protocol`, transport a). One wrapper per
host, not per process: a login shell and a Python start once per host, however many processes it
runs.

Before the processes, it answers the launcher's requests: ``I`` (the host's address on
``DMLC_INTERFACE``) and ``S``/``F``/``D`` (``--sync-dst-dir``: a directory tree, :mod:`.treesync`).
Then the header ``H`` gives every process's argv, environment (added to the wrapper's own) and
directory, and the node agent (:class:`.agent.Agent`, ``hold``) runs them: until the launcher
closes the channel, the channel dies, no keep-alive came for ``lost_after`` seconds, or a
SIGHUP/SIGTERM/SIGINT arrives. Nothing depends on the wrapper staying alive: killed (``kill -9``,
the OOM killer), its processes get their parent-death signal and its watchdog, a fork of it,
stops their groups (:mod:`.agent`). Standard library only, Python 3.5 syntax.
"""

import json
import os
import time

from . import protocol, treesync
from .agent import Agent, Channel, catch_signals


def _error_text(e):
    text = " ".join(str(e).split())
    return "%s: %s" % (type(e).__name__, text) if not isinstance(e, (OSError, ValueError)) else text


def resolve(doc):
    """``DMLC_INTERFACE`` on this host: ``{"address", "interface"}`` or ``{"error"}``."""
    try:
        from pscontract import netif  # (Python 3.7 or later)

        iface = netif.match(str(doc["iface"]), netif.interfaces())
        return {"address": iface.address, "interface": iface.name}
    except SyntaxError:
        return {"error": "resolving DMLC_INTERFACE needs python3 >= 3.7 on the host"}
    except Exception as e:  # noqa: BLE001 - netif.NetifError (its text says it all) or anything else
        text = " ".join(str(e).split())
        return {"error": text if type(e).__name__ == "NetifError" else _error_text(e)}


def _drop(receiver):
    """Let go of a sync's target (None: none); returns None."""
    if receiver is not None:
        receiver.close()
    return None


def prepare(channel):
    """Answer the launcher's requests until the header arrives: ``(header, the frames after it)``."""
    receiver = None
    answer = lambda kind, doc: channel.send(kind, protocol.NODE, json.dumps(doc).encode("utf-8"))  # noqa: E731
    while True:
        frames = channel.wait()
        for at, (kind, _, payload) in enumerate(frames):
            if kind == protocol.HEADER:
                return json.loads(payload.decode("utf-8")), frames[at + 1:]
            if kind == protocol.PING:
                channel.send(protocol.ALIVE, protocol.NODE)
            elif kind == protocol.IFACE:
                answer(protocol.IFACE_ANSWER, resolve(json.loads(payload.decode("utf-8"))))
            elif kind == protocol.SYNC:
                receiver = _drop(receiver)
                try:
                    doc = json.loads(payload.decode("utf-8"))
                    receiver = treesync.Receiver(doc["dst"], doc["rows"], doc.get("excludes") or (),
                                                 doc.get("skip") or (), bool(doc.get("delete")))
                    answer(protocol.SYNC_ANSWER, {"dir": receiver.dst, "need": receiver.need()})
                except (OSError, ValueError, KeyError) as e:
                    receiver = _drop(receiver)
                    answer(protocol.SYNC_ANSWER, {"error": _error_text(e)})
            elif kind == protocol.FILE and receiver is not None:  # (else the error went with its S)
                n = protocol.SYNC_HEAD.unpack(payload[:protocol.SYNC_HEAD.size])[0]
                rest = payload[protocol.SYNC_HEAD.size:]
                try:
                    receiver.write(rest[:n].decode("utf-8", "surrogateescape"), rest[n + 1:],
                                   rest[n:n + 1] == protocol.SYNC_LAST)
                except (OSError, ValueError) as e:
                    answer(protocol.DONE_ANSWER, {"error": _error_text(e)})
                    receiver = _drop(receiver)
            elif kind == protocol.DONE and receiver is not None:
                try:
                    answer(protocol.DONE_ANSWER, receiver.finish())
                except (OSError, ValueError) as e:
                    answer(protocol.DONE_ANSWER, {"error": _error_text(e)})
                receiver = _drop(receiver)
        channel.flush(time.monotonic() + 30.0)


def main():
    channel = Channel(0, 1)
    channel.out += protocol.MAGIC  # whatever a login shell printed before this is not ours
    try:
        channel.flush(time.monotonic() + 30.0)
        header, frames = prepare(channel)
    except (EOFError, ValueError, OSError):
        return 2
    catch_signals()
    keepalive = float(header.get("keepalive") or 5.0)
    agent = Agent(float(header.get("grace") or 0.0), channel, hold=True,
                  lost_after=float(header.get("lost_after") or 4 * keepalive), watchdog="fork",
                  usage=float(header.get("usage") or 0.0))
    specs = []
    for proc in header["procs"]:
        env = dict(os.environ)
        env.update(proc.get("env") or {})
        specs.append(dict(proc, env=env))
    agent.run(specs, frames)
    return 0
