"""The builtin ps-lite scheduler's pure parts: protobuf of ps-lite's meta.proto, ZMTP 3.0 frames,
and ps-lite's numbering of nodes (the real MXNet runs are in tests/integration/test_mxnet.py)."""

from __future__ import annotations

import pytest

from launcher.node import pslite
from launcher.node.pslite import (
    ADD_NODE,
    BARRIER,
    EMPTY,
    GREETING,
    SCHEDULER,
    SERVER,
    WORKER,
    Meta,
    Node,
    Peer,
    WireError,
)


def test_an_add_node_reply_is_what_ps_lite_packs() -> None:
    # golden bytes: libprotobuf writes these fields in field-number order, as here
    meta = Meta(ADD_NODE, [Node(WORKER, 9, "10.0.0.2", 40001, customer_id=0),
                           Node(SCHEDULER, 1, "10.0.0.1", 9091)], timestamp=3)
    assert meta.encode().hex() == (
        "08ffffffff07"                     # head = kEmpty
        "1a31"                             # control, 49 bytes
        "0802"                             # cmd = ADD_NODE
        "1216" "0801" "1009" "1a0831302e302e302e32" "20c1b802" "2800" "5000"  # worker 9
        "1215" "0802" "1001" "1a0831302e302e302e31" "208347" "2800" "5000"    # scheduler 1
        "2000" "2800" "3000"               # request, push, simple_app = false
        "4003"                             # timestamp = 3
        "50ffffffff07"                     # customer_id = kEmpty
        "6000" "6800"                      # pull = false, priority = 0
    )


def test_meta_round_trip() -> None:
    nodes = [Node(SERVER, EMPTY, "h", 5, customer_id=2), Node(WORKER, 11, "ü-host", 65535, is_recovery=True)]
    back = Meta.decode(Meta(ADD_NODE, nodes, request=True, app_id=0, customer_id=7, timestamp=12).encode())
    assert (back.cmd, back.request, back.app_id, back.customer_id, back.timestamp) == (ADD_NODE, True, 0, 7, 12)
    assert [(n.role, n.id, n.hostname, n.port, n.is_recovery, n.customer_id) for n in back.nodes] == [
        (SERVER, EMPTY, "h", 5, False, 2), (WORKER, 11, "ü-host", 65535, True, 0)]
    barrier = Meta.decode(Meta(BARRIER, request=True, app_id=0, customer_id=3, barrier_group=4).encode())
    assert (barrier.cmd, barrier.barrier_group, barrier.customer_id) == (BARRIER, 4, 3)


def test_negative_int32_is_ten_bytes_and_reads_back() -> None:
    assert pslite._varint(-1) == b"\xff" * 9 + b"\x01"
    assert pslite._int32(pslite._read_varint(pslite._varint(-2), 0)[0]) == -2


def test_a_data_message_has_no_command() -> None:
    # a message that is not a control message (a push, say) has no field 3
    assert Meta.decode(pslite._int(1, 0) + pslite._int(5, 1) + pslite._int(7, 0)).cmd == pslite.CMD_EMPTY


@pytest.mark.parametrize("raw, why", [
    (b"\x08", "past the end"),
    (b"\x1a\x05\x08", "past the end"),
    (b"\x0b", "wire type 3"),
    (b"\x00\x01", "numbered 0"),
    (b"\x08" + b"\xff" * 11, "longer than ten bytes"),
    (b"\x1a\x02\x10\x01", "without its command"),
    (b"\x1a\x06\x08\x02\x12\x02\x10\x09", "without a valid role"),
    (b"\x1a\x08\x08\x02\x12\x04\x08\x01\x1a\x01", "past the end"),
    (b"\x1a\x09\x08\x02\x12\x05\x08\x01\x1a\x01\xff", "hostname is not UTF-8"),
])
def test_bad_protobuf_is_a_wire_error(raw: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        Meta.decode(raw)


def test_nodes_are_numbered_as_ps_lite_numbers_them() -> None:
    nodes = [Node(WORKER, hostname="10.0.0.2", port=7), Node(SERVER, hostname="10.0.0.3", port=9),
             Node(WORKER, hostname="10.0.0.2", port=3), Node(SERVER, hostname="10.0.0.10", port=1),
             Node(WORKER, hostname="10.0.0.3", port=1)]
    order = pslite.assign_ids(pslite.sort_nodes(nodes))
    # host names in descending order (as strings: "10.0.0.10" < "10.0.0.2"), ports ascending
    assert [(n.hostname, n.port, n.id) for n in order] == [
        ("10.0.0.3", 1, 9), ("10.0.0.3", 9, 8), ("10.0.0.2", 3, 11), ("10.0.0.2", 7, 13), ("10.0.0.10", 1, 10)]


def test_barrier_groups() -> None:
    assert pslite.group_ids(7, 2, 3) == [1, 8, 10, 9, 11, 13]
    assert pslite.group_ids(4, 2, 3) == [9, 11, 13]
    assert pslite.group_ids(2, 2, 3) == [8, 10]
    assert pslite.group_ids(5, 1, 1) == [1, 9]


def test_node_ids_from_zmq_identities() -> None:
    assert pslite.node_id(b"ps9") == 9 and pslite.node_id(b"ps123") == 123
    assert pslite.node_id(b"") == EMPTY and pslite.node_id(b"\x00\x80\x00\x41\xa7") == EMPTY
    assert pslite.node_id(b"ps") == EMPTY and pslite.node_id(b"ps9x") == EMPTY


def _message(frames: list[bytes]) -> bytes:
    """A message of ``frames`` as a ZMTP peer sends it (every frame but the last marked MORE)."""
    return b"".join(pslite.frame(f, pslite.MORE if i < len(frames) - 1 else 0) for i, f in enumerate(frames))


class _Sock:
    def __init__(self) -> None:
        self.sent = b""

    def sendall(self, data: bytes) -> None:
        self.sent += data


def _peer() -> Peer:
    return Peer(_Sock(), "peer", outgoing=False)  # type: ignore[arg-type]


def test_frames_arrive_in_any_pieces() -> None:
    big = bytes(range(256)) * 3
    stream = (GREETING + pslite.ready(b"DEALER", b"ps9") + _message([b"meta", big])
              + _message([b"second"]))
    for step in (1, 7, 64, len(stream)):
        peer, got = _peer(), []
        for i in range(0, len(stream), step):
            got += peer.feed(stream[i:i + step])
        assert got == [[b"meta", big], [b"second"]]
        assert peer.identity == b"ps9"


def test_a_peer_without_identity_is_nobody() -> None:
    peer = _peer()
    peer.feed(GREETING + pslite.ready(b"DEALER", b""))
    assert peer.ready and pslite.node_id(peer.identity) == EMPTY


def test_ping_is_answered_with_pong() -> None:
    peer = _peer()
    peer.feed(GREETING + pslite.ready(b"DEALER") + pslite.frame(b"\x04PING\x00\x0actx", pslite.COMMAND))
    assert peer.sock.sent == pslite.frame(b"\x04PONGctx", pslite.COMMAND)  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream, why", [
    (b"GET / HTTP/1.1\r\n", "not a ZeroMQ peer"),
    (b"\xff" + b"\0" * 8 + b"\x7f\x02" + b"\0" * 53, "older than ZMTP 3.0"),
    (GREETING[:12] + b"CURVE".ljust(20, b"\0") + GREETING[32:], "mechanism 'CURVE'"),
    (GREETING + _message([b"x"]), "before the ZMTP handshake"),
    (GREETING + pslite.ready(b"DEALER") + b"\x02" + (64 << 20).to_bytes(8, "big"), "a frame of 67108864 bytes"),
    (GREETING + pslite.frame(b"\x05ERROR\x04nope", pslite.COMMAND), "refused the connection: nope"),
    (GREETING + pslite.frame(b"\x05READY\x0bSocket-Type\x00\x00\x00\x09DEAL", pslite.COMMAND), "runs past"),
])
def test_bad_zmtp_is_a_wire_error(stream: bytes, why: str) -> None:
    with pytest.raises(WireError, match=why):
        _peer().feed(stream)


def test_main_refuses_what_it_cannot_serve(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    base = {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1",
            "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1"}
    for extra, why in (({"DMLC_PS_VAN_TYPE": "ibverbs"}, "DMLC_PS_VAN_TYPE=ibverbs: the builtin scheduler"),
                       ({"DMLC_LOCAL": "1"}, "DMLC_LOCAL=1 (ipc sockets)"),
                       ({"PS_RESEND": "1"}, "PS_RESEND=1: the builtin scheduler does not acknowledge"),
                       ({"DMLC_ROLE": "worker"}, "the scheduler only"),
                       ({"DMLC_NUM_SERVER": "x"}, "not a number")):
        for name in (*base, "DMLC_PS_VAN_TYPE", "DMLC_LOCAL", "PS_RESEND"):
            monkeypatch.delenv(name, raising=False)
        for name, value in {**base, **extra}.items():
            monkeypatch.setenv(name, value)
        assert pslite.main() == 1
        err = capsys.readouterr().err
        assert err.startswith("pslaunch scheduler: error: ") and why in err and err.count("\n") == 1
    monkeypatch.delenv("DMLC_PS_ROOT_URI")
    monkeypatch.setenv("DMLC_NUM_SERVER", "1")
    assert pslite.main() == 1
    assert "DMLC_PS_ROOT_URI is not set" in capsys.readouterr().err
