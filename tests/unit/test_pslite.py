"""The builtin ps-lite scheduler's pure parts: protobuf of ps-lite's meta.proto and ps-lite's
numbering of nodes (its sockets against real libzmq are in tests/integration/test_pslite_scheduler.py,
the real MXNet runs in tests/integration/test_mxnet.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.helpers import one_line_error

from launcher.errors import BackendUnavailableError
from launcher.trackers import pslite
from launcher.trackers.pslite import (
    ADD_NODE,
    BARRIER,
    EMPTY,
    SCHEDULER,
    SERVER,
    WORKER,
    Meta,
    Node,
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


def test_a_heartbeat_timeout_that_is_no_number_is_one_line(capsys: pytest.CaptureFixture) -> None:
    # (ps-lite's atoi would make it 0, heartbeats off: no worker could ever be replaced)
    env = {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1",
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1", "PS_HEARTBEAT_TIMEOUT": "2s"}
    assert pslite.main(env) == 1
    err = capsys.readouterr().err
    assert err == "pslaunch scheduler: error: PS_HEARTBEAT_TIMEOUT='2s' is not a number of seconds\n"


@pytest.mark.parametrize("hostname, port, why", [
    ("", 1, "its host name '' is no host name or address"),
    ("\u00fc-host", 1, "its host name '\u00fc-host' is no host name or address"),  # (libzmq would not resolve it)
    ("a b", 1, "its host name 'a b' is no host name or address"),
    ("a\0b", 1, "its host name 'a\\x00b' is no host name or address"),
    ("10.0.0.2", 0, "its port 0 is not from 1 to 65535"),
    ("10.0.0.2", 65536, "its port 65536 is not from 1 to 65535"),
    ("10.0.0.2", EMPTY, f"its port {EMPTY} is not from 1 to 65535"),
])
def test_a_registered_address_no_connection_can_be_made_to(hostname: str, port: int, why: str) -> None:
    assert pslite.host_problem(Node(WORKER, hostname=hostname, port=port)) == why


def test_a_registered_address_a_connection_can_be_made_to() -> None:
    for hostname in ("10.0.0.2", "node-3.cluster.example", "fe80::1"):
        assert pslite.host_problem(Node(SERVER, hostname=hostname, port=65535)) is None
    # the resolver's own check (a connection to them raised UnicodeError, and the job hung)
    for hostname in ("a..b", "a" * 64 + ".test"):
        assert pslite.host_problem(Node(SERVER, hostname=hostname, port=65535)) == (
            f"its host name {hostname[:60]!r} is no host name or address")


_ENV = {"DMLC_ROLE": "scheduler", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "1",
        "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1"}


def test_without_pyzmq_the_scheduler_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # (Python's own way to make an import fail)
    assert pslite.main(_ENV) == 1
    assert capsys.readouterr().err == ("pslaunch scheduler: error: the builtin scheduler needs pyzmq (import of zmq "
                                       "halted; None in sys.modules): pip install '.[pslite]' in your clone of "
                                       "pslaunch (or pip install pyzmq)\n")
    with pytest.raises(BackendUnavailableError, match=r"^--scheduler builtin needs pyzmq: pip install "
                                                      r"'\.\[pslite\]' in your clone of pslaunch "
                                                      r"\(or pip install pyzmq\)$"):
        pslite.require_pyzmq()


def test_without_pyzmq_a_builtin_job_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    """As a missing paramiko for --launcher ssh: a backend-unavailable error, exit 2."""
    mark = tmp_path / "started"
    argv = ["-n", "1", "-s", "1", "--scheduler", "builtin", "--", sys.executable, "-c", f"open({str(mark)!r}, 'w')"]
    code = f"import sys; sys.modules['zmq'] = None; from launcher.cli import main; sys.exit(main({argv!r}))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert one_line_error(r.stderr) == ("pslaunch: error: --scheduler builtin needs pyzmq: pip install "
                                        "'.[pslite]' in your clone of pslaunch (or pip install pyzmq)")
    assert not mark.exists()


def test_the_peers_are_the_addresses_of_the_jobs_hosts() -> None:
    peers, unknown = pslite.resolve_peers(["10.0.0.5", "::ffff:10.0.0.6", "a" * 64 + ".test"], "10.0.0.1")
    assert peers == {"10.0.0.5", "10.0.0.6"} and unknown == ["a" * 64 + ".test"]
    # a host of the job that is this machine: its processes come from the scheduler's address
    peers, _ = pslite.resolve_peers(["127.0.0.1"], "10.0.0.1")
    assert peers == {"127.0.0.1", "10.0.0.1"}


def test_an_identity_of_more_digits_than_a_node_id_has_is_a_wire_error() -> None:
    assert pslite.node_id(b"ps9") == 9 and pslite.node_id(b"\0abc") == EMPTY
    with pytest.raises(WireError, match=r"ps<5000 digits> is no ps-lite node's"):
        pslite.node_id(b"ps" + b"1" * 5000)
