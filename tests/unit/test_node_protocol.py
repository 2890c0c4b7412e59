"""The node protocol (``launcher.node.protocol``): golden frames of every kind, the in-band envelope,
and the decoder."""

from __future__ import annotations

import re

import pytest

from launcher.node import protocol
from launcher.node.protocol import NODE, Decoder, envelope, frame, unwrap


def test_the_vocabulary() -> None:
    """One letter per kind and direction: upper case to the node, lower case from it; each a
    constant, and each in the spec's tables."""
    assert len(set(protocol.TO_NODE)) == len(protocol.TO_NODE) == 8
    assert len(set(protocol.FROM_NODE)) == len(protocol.FROM_NODE) == 10
    assert all(len(k) == 1 and k.isupper() for k in protocol.TO_NODE)
    assert all(len(k) == 1 and k.islower() for k in protocol.FROM_NODE)
    doc = protocol.__doc__ or ""
    names = {v: n for n, v in vars(protocol).items() if isinstance(v, bytes) and n.isupper() and len(v) == 1
             and v.isalpha()}
    for kind in (*protocol.TO_NODE, *protocol.FROM_NODE):
        assert re.search(rf"^{kind.decode()}\s+:data:`{names[kind]}`", doc, re.M), (kind, names[kind])
    assert protocol.HEAD.size == 7 and protocol.NODE == 0xFFFF


# --- golden frames -----------------------------------------------------------------------------------------


def test_golden_frames() -> None:
    assert protocol.signal_frame(3, "TERM") == b"X\x00\x03\x00\x00\x00\x04TERM"
    assert protocol.signal_frame(NODE, "KILL") == b"X\xff\xff\x00\x00\x00\x04KILL"
    with pytest.raises(ValueError):
        protocol.signal_frame(0, "HUP")
    assert protocol.env_frame(4, {"RANK": "1"}) == b'E\x00\x04\x00\x00\x00\x0c{"RANK":"1"}'
    assert frame(protocol.PING, NODE) == b"K\xff\xff\x00\x00\x00\x00"
    assert frame(protocol.EXIT, 2, b"137") == b"x\x00\x02\x00\x00\x00\x03137"
    assert frame(protocol.STDOUT, 2, b"hi\n") == b"o\x00\x02\x00\x00\x00\x03hi\n"
    assert protocol.blob(b"abc") == b"0000000003abc"


# --- the in-band envelope -----------------------------------------------------------------------------------


def test_golden_envelopes() -> None:
    assert envelope(protocol.EXIT, 2, b"3") == b"\x1eeAACAAAAATM=\n"
    assert envelope(protocol.STDOUT, 0, b"hi\n") == b"\x1ebwAAAAAAA2hpCg==\n"
    assert unwrap(b"\x1eeAACAAAAATM=") == (protocol.EXIT, 2, b"3")
    longest = envelope(protocol.STDOUT, 1, b"y" * protocol.LINE_PAYLOAD)
    assert len(longest) == 4094 and unwrap(longest[:-1]) == (protocol.STDOUT, 1, b"y" * protocol.LINE_PAYLOAD)
    with pytest.raises(ValueError):
        envelope(protocol.STDOUT, 1, b"y" * (protocol.LINE_PAYLOAD + 1))  # one write would not be atomic


@pytest.mark.parametrize("line", [
    b"", b"hello", b"\x1e", b"\x1eAAAA", b"[mpirun] \x1eeAACAAAAATM=",  # text, too short, text in front
    b"\x1eeAACAAAAATM= trailing", b"\x1eeAACAAAAATM=\r", b"\x1e!AACAAAAATM=",  # not exactly an envelope
    b"\x1eeAACAAAAAjM=",  # a length that does not match what follows
    b"\x1e" + __import__("base64").b64encode(frame(protocol.EXIT, 1, b"0") + b"more"),
])
def test_what_is_not_an_envelope_is_text(line: bytes) -> None:
    assert unwrap(line) is None


# --- the decoder ---------------------------------------------------------------------------------------------


FRAMES = [(protocol.STARTED, 0, b'{"pid": 5}'), (protocol.STDOUT, 3, b"hello\n"), (protocol.ALIVE, NODE, b""),
          (protocol.EXIT, 0, b"0")]
STREAM = b"".join(frame(*f) for f in FRAMES)


def test_split_and_joined_reads() -> None:
    for step in (1, 2, 3, 7, 1000):
        dec = Decoder()
        got = []
        for i in range(0, len(STREAM), step):
            got += dec.feed(STREAM[i:i + step])
        assert got == FRAMES and dec.pending == 0, step


def test_the_marker_and_what_came_before_it() -> None:
    stream = b"Welcome to node1\n" + protocol.MAGIC + STREAM  # a chatty .bashrc first
    dec = Decoder(marker=protocol.MAGIC)
    got = []
    for i in range(0, len(stream), 3):  # (the marker split across reads)
        got += dec.feed(stream[i:i + 3])
    assert got == FRAMES and bytes(dec.preamble) == b"Welcome to node1\n"


def test_an_oversized_frame_is_dropped_without_keeping_it_and_the_rest_goes_on() -> None:
    dec = Decoder(limit=100)
    big = frame(protocol.STDOUT, 1, b"z" * 10_000)
    got = dec.feed(big[:5000])
    assert got == [] and dec.pending < 100  # its bytes are not kept
    got = dec.feed(big[5000:] + STREAM)
    assert got == FRAMES and dec.dropped == 1
