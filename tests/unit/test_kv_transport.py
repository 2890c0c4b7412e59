"""Addresses, ports and the secret check of the KV transport (loopback only)."""

from __future__ import annotations

import dataclasses

import pytest
import zmq

from pscontract import ClusterEnv
from trainer.kv import protocol as P
from trainer.kv.errors import KVConfigError
from trainer.kv.transport import bind, check_dist_env, node_address

ENV = ClusterEnv(role="server", root_uri="127.0.0.1", root_port=9, num_workers=1, num_servers=1)


def test_node_address_follows_ps_lites_order() -> None:
    # DMLC_NODE_HOST first, even when DMLC_INTERFACE names nothing here
    assert node_address(dataclasses.replace(ENV, node_host="127.0.0.2", interface="nosuchif9")) \
        == "127.0.0.2"
    assert node_address(dataclasses.replace(ENV, interface="lo")) == "127.0.0.1"
    assert node_address(dataclasses.replace(ENV, interface="127.0.0.0/8")) == "127.0.0.1"
    assert node_address(ENV) == "127.0.0.1"  # the address that routes to the scheduler
    with pytest.raises(KVConfigError, match="cannot work out this node's address") as e:
        node_address(dataclasses.replace(ENV, interface="nosuchif9"))
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
    assert check_dist_env(dataclasses.replace(ENV, secret="ab" * 32)) == bytes([0xAB] * 32)
    assert check_dist_env(dataclasses.replace(ENV, insecure=True)) == P.secret_key(None) == b""
    with pytest.raises(KVConfigError, match="PSLAUNCH_SECRET is not set") as e:
        check_dist_env(ENV)
    assert "\n" not in str(e.value)
