"""Addresses, ports and the secret check of the KV transport (loopback only)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import zmq
from support.helpers import REPO

from pscontract import ClusterEnv
from trainer.kv import protocol as P
from trainer.kv.errors import KVConfigError
from trainer.kv.transport import bind, check_dist_env, node_address

ENV = ClusterEnv(role="server", root_uri="127.0.0.1", root_port=9, num_workers=1, num_servers=1)


def test_node_address_follows_ps_lites_order() -> None:
    # DMLC_NODE_HOST first, even when DMLC_INTERFACE names nothing here
    assert node_address(replace(ENV, node_host="127.0.0.2", interface="nosuchif9")) \
        == "127.0.0.2"
    assert node_address(replace(ENV, interface="lo")) == "127.0.0.1"
    assert node_address(replace(ENV, interface="127.0.0.0/8")) == "127.0.0.1"
    assert node_address(ENV) == "127.0.0.1"  # the address that routes to the scheduler
    with pytest.raises(KVConfigError, match="cannot work out this node's address") as e:
        node_address(replace(ENV, interface="nosuchif9"))
    assert "\n" not in str(e.value)


def test_port_range_is_used_and_a_full_range_is_a_one_line_error() -> None:
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.ROUTER) for _ in range(3)]
    try:
        first = bind(socks[0], "127.0.0.1")  # ephemeral
        assert first > 0
        lo = first  # taken: the range must skip it
        try:
            got = bind(socks[1], "127.0.0.1", port_range=(lo, lo + 1))
        except KVConfigError:
            pytest.skip(f"port {lo + 1} is busy on this host")
        assert got == lo + 1
        with pytest.raises(KVConfigError, match=rf"no free port in PS_PORT_RANGE={lo}-{lo + 1} "
                                                r"on 127\.0\.0\.1 for this node; widen the range"):
            bind(socks[2], "127.0.0.1", port_range=(lo, lo + 1))
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


def test_the_secret_is_required_unless_waived() -> None:
    assert check_dist_env(replace(ENV, secret="ab" * 32)) == bytes([0xAB] * 32)
    assert check_dist_env(replace(ENV, insecure=True)) == P.secret_key(None) == b""
    with pytest.raises(KVConfigError, match="PSLAUNCH_SECRET is not set") as e:
        check_dist_env(ENV)
    assert "\n" not in str(e.value)


_FAULTS = """
import ctypes, resource, sys
if sys.argv[1] == "bulk":
    from trainer.kv.transport import bulk_context
    bulk_context().term()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def parts():  # what a 16 MB array's parts cost: 16 messages of 1 MB, written, then freed
    blocks = [libc.malloc(1 << 20) for _ in range(16)]
    for b in blocks:
        ctypes.memset(b, 1, 1 << 20)
    for b in blocks:
        libc.free(b)
parts()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    parts()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.parametrize("mode, environ, many", [
    ("plain", {}, True),
    ("bulk", {}, False),
    ("bulk", {"MALLOC_TRIM_THRESHOLD_": "131072"}, True),   # the user's setting wins
])
def test_a_bulk_context_keeps_freed_message_memory(mode, environ, many) -> None:
    # glibc returns freed 1 MB messages to the kernel and faults them in again, page by page;
    # the KV server's and client's context keeps them (16 MB push+pull a third faster)
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], env={**env, **environ}, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    faults = int(out.stdout.strip() or -1)
    assert (faults > 20 * 4096 // 2) if many else (0 <= faults < 4096), (faults, out.stderr)


def test_a_hub_told_a_message_waits_never_blocks_when_none_does() -> None:
    # the server reads its first message after a poll without asking ZeroMQ first; a poll that
    # woke for nothing (or a message another read took) must not hang the server
    import threading

    from trainer.kv.transport import Hub, Verbose

    ctx = zmq.Context()
    hub = Hub(ctx, b"k" * 32, False, Verbose(0, "S[0]"))
    try:
        hub.bind("127.0.0.1", 0)
        got: list = []
        t = threading.Thread(target=lambda: got.append(hub.receive(ready=True)), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive() and got == [[]]
    finally:
        hub.close()
        ctx.term()
