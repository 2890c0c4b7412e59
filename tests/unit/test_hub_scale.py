"""The hub when every agent of a large job connects at the same moment (docs/scale.md)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

from support.helpers import REPO

from launcher.node import protocol
from launcher.runtime import hub as hub_module
from launcher.runtime.hub import Hub
from launcher.runtime.output import PipePump

SECRET = "5e" * 32


def test_a_job_larger_than_the_pending_limit_connecting_at_once_loses_no_agent() -> None:
    """400 agents, each from its own host's address, are all greeted before any of them answers
    (the launcher's pump is busy: 1,000 batch tasks started at once). A hub that held a fixed
    256 unauthenticated connections evicted the first 144 of the job's own agents, which then ran
    without a connection to the launcher; it holds the whole job, and every agent gets in."""
    n = hub_module.PENDING_MAX + 144
    pump = PipePump()
    hub = Hub(pump, SECRET, socket.create_server(("127.0.0.1", 0)), range(n), {})
    socks: list[socket.socket] = []
    try:
        hellos = []
        for ident in range(n):
            s = socket.create_connection(hub.address, timeout=30,
                                         source_address=(f"127.3.{ident // 250}.{1 + ident % 250}", 0))
            socks.append(s)
            hellos.append(s.recv(4096))
        assert all(h.startswith(protocol.HELLO) for h in hellos)
        answers = []
        for ident, (s, hello) in enumerate(zip(socks, hellos)):
            server_nonce = bytes.fromhex(hello[len(protocol.HELLO):].strip().decode())
            client_nonce = os.urandom(16)
            mac = protocol.channel_mac(SECRET, "client", server_nonce, client_nonce, ident)
            s.sendall(f"{ident} {client_nonce.hex()} {mac}\n".encode())
        for s in socks:
            answers.append(s.recv(4096))
        refused = [i for i, a in enumerate(answers) if not a.startswith(b"ok ")]
        assert refused == []
        assert len(hub.conns) == n
    finally:
        for s in socks:
            s.close()
        hub.stop()
        pump.stop()


def test_the_hub_raises_the_open_file_limit_for_its_connections() -> None:
    """Each agent's connection holds two descriptors in the launcher and a log file a third: a hub
    for 1,000 tasks under the soft limit most logins get (1,024) ran out at about 500 of them."""
    code = textwrap.dedent("""
        import resource, socket
        from launcher.runtime.hub import Hub
        from launcher.runtime.output import PipePump
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
        pump = PipePump()
        hub = Hub(pump, "5e" * 32, socket.create_server(("127.0.0.1", 0)), range(1000), {})
        print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)
        hub.stop(); pump.stop()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=REPO).stdout.split()
    soft, hard = int(out[0]), int(out[1])
    assert soft >= min(hard, 3000)
