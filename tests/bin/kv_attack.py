"""Attacks on a KV process's port, for the tests: what a peer without the job's secret can try.

``kv_attack.py MODE --port P [--host 127.0.0.1] [--seconds S] [--count N] [--token HEX]``
prints one JSON line with what it did (connections, bytes sent, answers seen). Every mode
is bounded in connections, bytes and time. Modes:

    hello-flood  N DEALER sockets send our HELLO again and again for S seconds (the issue's
                 "300 for 5 s"); with ``--token`` they pass ZeroMQ's gate (a peer that read
                 the token off the wire), without it they knock at the gate.
    hello-burst  N DEALER sockets, each sends one HELLO and stays (the issue's "500 in a loop").
    big-frame    raw ZMTP: announce a 4 GiB frame and stream up to 256 MB of it. Without
                 ``--token`` as the PLAIN HELLO command (before the gate), with it as a message
                 after a complete PLAIN handshake (past the gate).
    null-stream  raw ZMTP with the NULL mechanism: an endless multipart message of 1 MB frames
                 (what libzmq would buffer whole without the gate), up to 256 MB.
    null-frame   raw ZMTP with the NULL mechanism (no gate at all): a 4 GiB frame, up to 256 MB.
    slow-frames  N connections each announce a HELLO command just under the frame limit,
                 send all but the last KB and hold it, for S seconds (memory per connection).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import zmq  # noqa: E402

from trainer.kv import protocol as P  # noqa: E402

MB = 1 << 20
STREAM_LIMIT = 256 * MB


def greeting(mechanism: bytes) -> bytes:
    """ZMTP 3.0's 64-byte greeting of a client."""
    return b"\xff" + bytes(8) + b"\x7f\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" + bytes(31)


def command(name: bytes, body: bytes) -> bytes:
    data = bytes([len(name)]) + name + body
    if len(data) < 256:
        return bytes([0x04, len(data)]) + data
    return bytes([0x06]) + struct.pack(">Q", len(data)) + data


def prop(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed by the peer")
        buf += chunk
    return buf


def read_command(sock: socket.socket) -> bytes:
    flags = read_exact(sock, 1)[0]
    size = read_exact(sock, 8 if flags & 0x02 else 1)
    n = struct.unpack(">Q", size)[0] if flags & 0x02 else size[0]
    return read_exact(sock, n)


def raw_connect(host: str, port: int, mechanism: bytes) -> socket.socket:
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(greeting(mechanism))
    read_exact(s, 64)
    return s


def plain_session(host: str, port: int, token: bytes) -> socket.socket:
    """A raw socket past ZeroMQ's PLAIN handshake, as a DEALER."""
    s = raw_connect(host, port, b"PLAIN")
    s.sendall(command(b"HELLO", bytes([8]) + b"pslaunch" + bytes([len(token)]) + token))
    if not read_command(s).startswith(b"\x07WELCOME"):
        raise ConnectionError("no WELCOME")
    s.sendall(command(b"INITIATE", prop(b"Socket-Type", b"DEALER")))
    if not read_command(s).startswith(b"\x05READY"):
        raise ConnectionError("no READY")
    return s


def stream(s: socket.socket, limit: int, deadline: float) -> int:
    """Send zeros until ``limit`` bytes, the deadline, or the peer closes; bytes sent."""
    block = bytes(MB)
    sent = 0
    try:
        while sent < limit and time.monotonic() < deadline:
            sent += s.send(block)
    except OSError:
        pass
    return sent


def big_frame(args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + args.seconds
    if args.token:
        s = plain_session(args.host, args.port, args.token.encode())
        s.sendall(bytes([0x02]) + struct.pack(">Q", 4 << 30))  # a 4 GiB message frame
    else:
        s = raw_connect(args.host, args.port, b"PLAIN")
        s.sendall(bytes([0x06]) + struct.pack(">Q", 4 << 30) + b"\x05HELLO")
    sent = stream(s, STREAM_LIMIT, deadline)
    s.close()
    return {"connections": 1, "bytes": sent}


def null_frame(args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + args.seconds
    sent = 0
    try:
        s = raw_connect(args.host, args.port, b"NULL")
        s.sendall(command(b"READY", prop(b"Socket-Type", b"DEALER")))
        s.sendall(bytes([0x02]) + struct.pack(">Q", 4 << 30))
        sent = stream(s, STREAM_LIMIT, deadline)
        s.close()
    except OSError:
        pass
    return {"connections": 1, "bytes": sent}


def null_stream(args: argparse.Namespace) -> dict:
    deadline = time.monotonic() + args.seconds
    sent = 0
    try:
        s = raw_connect(args.host, args.port, b"NULL")
        s.sendall(command(b"READY", prop(b"Socket-Type", b"DEALER")))
        frame = bytes([0x03]) + struct.pack(">Q", MB) + bytes(MB)  # MORE | LONG
        while sent < STREAM_LIMIT and time.monotonic() < deadline:
            s.sendall(frame)
            sent += len(frame)
        s.close()
    except OSError:
        pass
    return {"connections": 1, "bytes": sent}


def slow_frames(args: argparse.Namespace) -> dict:
    size = P.MAX_FRAME - 4096
    socks, sent, refused = [], 0, 0
    deadline = time.monotonic() + args.seconds
    for _ in range(args.count):
        if time.monotonic() >= deadline:
            break
        try:
            s = raw_connect(args.host, args.port, b"PLAIN")
            s.sendall(bytes([0x06]) + struct.pack(">Q", size) + b"\x05HELLO")
            s.sendall(bytes(size - 1024 - 6))
            sent += size - 1024
            socks.append(s)
        except OSError:
            refused += 1
    while time.monotonic() < deadline:
        time.sleep(0.05)
    alive = 0
    for s in socks:
        try:
            s.setblocking(False)
            alive += 0 if s.recv(1) == b"" else 1
        except BlockingIOError:
            alive += 1  # nothing to read: still open
        except OSError:
            pass
        s.close()
    return {"connections": len(socks), "refused": refused, "bytes": sent, "still_open": alive}


def dealers(args: argparse.Namespace, ctx: zmq.Context) -> list[zmq.Socket]:
    out = []
    for _ in range(args.count):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.SNDHWM, 1000)
        if args.token:
            d.setsockopt(zmq.PLAIN_USERNAME, b"pslaunch")
            d.setsockopt(zmq.PLAIN_PASSWORD, args.token.encode())
        d.connect(f"tcp://{args.host}:{args.port}")
        out.append(d)
    return out


def hello_flood(args: argparse.Namespace, once: bool) -> dict:
    ctx = zmq.Context()
    socks = dealers(args, ctx)
    # our HELLO, in the wire version asked for (an older KVStore's, to measure it)
    hello = [P.HEADER.pack(args.wire_version, P.HELLO, 0, 0, 0, 0, 0, 0, 0, 0) + bytes(P.MAC_SIZE),
             bytes(P.NONCE_SIZE)]
    sent = answers = 0
    deadline = time.monotonic() + args.seconds
    while True:
        for d in socks:
            try:
                d.send_multipart(hello, zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
            while d.poll(0):
                d.recv_multipart()
                answers += 1
        if once or time.monotonic() >= deadline:
            break
    if once:
        while time.monotonic() < deadline:
            for d in socks:
                while d.poll(0):
                    d.recv_multipart()
                    answers += 1
            time.sleep(0.05)
    # The sockets are not closed: main() ends the process as a crashed peer ends, and the kernel
    # closes the connections. libzmq 4.3.5 can abort when the application closes a socket while
    # the peer drops its connection in the middle of a message (errno_assert in
    # session_base_t::clean_pipes: "Resource temporarily unavailable (src/session_base.cpp:233)",
    # zeromq/libzmq#3442): the scheduler drops flooding connections, and a fresh CI run lost the
    # token holders' flood to that abort once, after the job had ended right.
    return {"connections": len(socks), "hellos": sent, "answers": answers}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["hello-flood", "hello-burst", "big-frame", "null-stream",
                                     "null-frame", "slow-frames"])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--token", default=None, help="ZeroMQ's PLAIN password (the gate's token)")
    ap.add_argument("--wire-version", type=int, default=P.VERSION,
                    help="the protocol version of the HELLOs (default: this checkout's)")
    args = ap.parse_args()
    started = time.monotonic()
    if args.mode == "hello-flood":
        out = hello_flood(args, once=False)
    elif args.mode == "hello-burst":
        out = hello_flood(args, once=True)
    elif args.mode == "big-frame":
        out = big_frame(args)
    elif args.mode == "null-stream":
        out = null_stream(args)
    elif args.mode == "null-frame":
        out = null_frame(args)
    else:
        out = slow_frames(args)
    out.update(mode=args.mode, seconds=round(time.monotonic() - started, 2))
    print(json.dumps(out), flush=True)
    os._exit(0)  # no libzmq teardown (hello_flood says why)


if __name__ == "__main__":
    main()
