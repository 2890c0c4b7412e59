"""The node protocol (``launcher.node.protocol``): golden frames of every kind, both ways, built by
the code that sends them; the in-band envelope; the decoders; and that no other module spells a
frame kind itself."""

from __future__ import annotations

import ast
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.helpers import wait_for

from launcher.backends.ssh import header_frame, wrapper_header
from launcher.node import protocol
from launcher.node.agent import Agent, Channel, connect, machine
from launcher.node.protocol import NODE, Decoder, envelope, frame, unwrap
from launcher.runtime.hub import Hub
from launcher.runtime.output import Console, PipePump
from launcher.runtime.remote import RemoteProcess
from launcher.spec.job import Role
from launcher.spec.plan import ProcSpec
from launcher.transport.wiresync import TreeSync

ROOT = Path(__file__).resolve().parents[2]
HOST = machine()["host"]


def test_the_vocabulary() -> None:
    """One letter per kind and direction: upper case to the node, lower case from it; each a
    constant, and each in the spec's tables."""
    assert len(set(protocol.TO_NODE)) == len(protocol.TO_NODE) == 8
    assert len(set(protocol.FROM_NODE)) == len(protocol.FROM_NODE) == 12
    assert all(len(k) == 1 and k.isupper() for k in protocol.TO_NODE)
    assert all(len(k) == 1 and k.islower() for k in protocol.FROM_NODE)
    doc = protocol.__doc__ or ""
    names = {v: n for n, v in vars(protocol).items() if isinstance(v, bytes) and n.isupper() and len(v) == 1
             and v.isalpha()}
    for kind in (*protocol.TO_NODE, *protocol.FROM_NODE):
        assert re.search(rf"^{kind.decode()}\s+:data:`{names[kind]}`", doc, re.M), (kind, names[kind])
    assert protocol.HEAD.size == 7 and protocol.NODE == 0xFFFF


# --- golden frames, launcher -> node --------------------------------------------------------------------


def test_golden_frames_to_the_node(tmp_path) -> None:
    proc = ProcSpec(Role.WORKER, 0, 0, None, ("python", "t.py"), {"A": "1"})
    header = header_frame(wrapper_header([(0, proc)], "/w", keepalive=2.0, grace=3.0))
    body = b'{"procs":[{"id":0,"argv":["python","t.py"],"env":{"A":"1"},"cwd":"/w"}],"keepalive":2.0,' \
           b'"lost_after":8.0,"grace":3.0}'
    assert header == b"H\xff\xff" + len(body).to_bytes(4, "big") + body
    assert protocol.signal_frame(3, "TERM") == b"X\x00\x03\x00\x00\x00\x04TERM"
    assert protocol.signal_frame(NODE, "KILL") == b"X\xff\xff\x00\x00\x00\x04KILL"
    with pytest.raises(ValueError):
        protocol.signal_frame(0, "HUP")
    assert protocol.env_frame(4, {"RANK": "1"}) == b'E\x00\x04\x00\x00\x00\x0c{"RANK":"1"}'
    from launcher.backends import ssh

    assert ssh._PING == b"K\xff\xff\x00\x00\x00\x00"
    assert frame(protocol.IFACE, NODE, json.dumps({"iface": "eth0"}).encode()) == \
        b'I\xff\xff\x00\x00\x00\x11{"iface": "eth0"}'  # (as the backend builds it)
    # the sync: S with the listing, F with each file's data, D
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"hi")
    tree = TreeSync(str(src), "/dst", [".git"], delete=True)
    body = tree.request_body
    sent: list[bytes] = []

    def request(kind: bytes, payload: bytes, reply: bytes) -> dict:
        sent.append(frame(kind, NODE, payload))
        return {"dir": "/dst", "need": ["a.txt"]} if kind == protocol.SYNC else {"dir": "/dst", "files": 1}

    tree.sync("h", request, lambda kind, payload: sent.append(frame(kind, NODE, payload)))
    mtime = int(os.stat(src / "a.txt").st_mtime)
    mode = os.stat(src / "a.txt").st_mode & 0o7777
    assert body == b'{"dst":"/dst","rows":[["a.txt","f",2,%d,%d,""]],"excludes":[".git"],"skip":[],"delete":true}' \
        % (mtime, mode)
    assert sent == [b"S\xff\xff" + len(body).to_bytes(4, "big") + body,
                    b"F\xff\xff\x00\x00\x00\x0a\x00\x05a.txt\x01hi",
                    b"D\xff\xff\x00\x00\x00\x00"]


# --- golden frames, node -> launcher: what a real agent writes --------------------------------------------


class Wire:
    """A real agent on a channel made of two pipes: what it writes, read back frame by frame."""

    def __init__(self) -> None:
        self.to_agent_r, self.to_agent_w = os.pipe()
        self.from_agent_r, self.from_agent_w = os.pipe()
        self.channel = Channel(self.to_agent_r, self.from_agent_w)

    def written(self) -> bytes:
        self.channel.flush(time.monotonic() + 5)
        os.set_blocking(self.from_agent_r, False)
        try:
            return os.read(self.from_agent_r, 1 << 20)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        for fd in (self.to_agent_r, self.to_agent_w, self.from_agent_r, self.from_agent_w):
            os.close(fd)


@pytest.fixture
def wire():
    w = Wire()
    yield w
    w.close()


def test_golden_frames_from_the_agent(wire: Wire) -> None:
    agent = Agent(1.0, wire.channel)
    agent.error(3, "cannot run 'x': no such program", 127)
    error = f'{{"error": "cannot run \'x\': no such program", "code": 127, "host": "{HOST}"}}'.encode()
    assert wire.written() == b"f\x00\x03" + len(error).to_bytes(4, "big") + error
    agent.send(protocol.STDOUT, 3, b"out\n")
    agent.send(protocol.STDERR, 3, b"err")
    assert wire.written() == b"o\x00\x03\x00\x00\x00\x04out\ne\x00\x03\x00\x00\x00\x03err"
    agent._commands([(protocol.PING, NODE, b"")])  # a keep-alive is answered
    assert wire.written() == b"k\xff\xff\x00\x00\x00\x00"
    here = json.dumps(machine(), separators=(",", ":")).encode()
    agent.send_json(protocol.HERE, 3, machine())
    assert wire.written() == b"h\x00\x03" + len(here).to_bytes(4, "big") + here


def test_golden_frames_of_a_process_the_agent_runs() -> None:
    """A real agent (in its own process: it becomes a subreaper) on a pipe channel runs a process
    that prints and is killed by SIGKILL."""
    code = ("import sys; from launcher.node.agent import Agent, Channel; "
            "sys.exit(Agent(1.0, Channel(0, 1)).run([{'id': 2, 'argv': ['sh', '-c', 'echo hi; kill -9 $$'], "
            "'env': {'PATH': '/usr/bin:/bin'}, 'start': {'addr': '10.0.0.1'}}])[0])")
    p = subprocess.Popen([sys.executable, "-S", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
    try:
        out = p.stdout.read()  # type: ignore[union-attr]  # (its stdin stays open: the launcher is there)
        assert p.wait(timeout=30) == 137  # killed by SIGKILL: 128 + 9, always
    finally:
        p.kill()
        p.wait()
    frames = Decoder().feed(out)
    assert [(k, i) for k, i, _ in frames] == [(protocol.STARTED, 2), (protocol.STDOUT, 2), (protocol.EXIT, 2)]
    start = json.loads(frames[0][2])
    assert start == {**machine(), "pid": start["pid"], "agent": start["agent"], "addr": "10.0.0.1"}
    assert frames[0][2] == json.dumps(start, separators=(",", ":")).encode()
    assert frame(*frames[1][:2], frames[1][2]) == b"o\x00\x02\x00\x00\x00\x03hi\n"
    code, when = frames[2][2].split(b" ")  # the code, then the node's clock at the exit
    assert code == b"137" and abs(float(when) - time.time()) < 30 and re.fullmatch(rb"\d+\.\d{6}", when)
    assert frame(*frames[2][:2], frames[2][2]) == b"x\x00\x02" + len(frames[2][2]).to_bytes(4, "big") + frames[2][2]


def test_golden_answers_before_the_header(wire: Wire, tmp_path) -> None:
    """The ssh wrapper's answers to I, S/F/D, and the header that ends its requests."""
    from launcher.node import ssh_wrapper

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(b"hi")
    dst = tmp_path / "dst"
    tree = TreeSync(str(tmp_path / "src"), str(dst), [])
    requests = [frame(protocol.IFACE, NODE, b'{"iface": "lo"}'), frame(protocol.SYNC, NODE, tree.request_body),
                frame(protocol.FILE, NODE, protocol.SYNC_HEAD.pack(5) + b"a.txt\x01hi"),
                frame(protocol.DONE, NODE), frame(protocol.HEADER, NODE, b'{"procs": []}'),
                frame(protocol.PING, NODE)]
    os.write(wire.to_agent_w, b"".join(requests))
    header, rest = ssh_wrapper.prepare(wire.channel)
    assert header == {"procs": []} and rest == [(protocol.PING, NODE, b"")]  # (for the agent)
    answers = [b'{"address": "127.0.0.1", "interface": "lo"}',
               f'{{"dir": "{dst}", "need": ["a.txt"]}}'.encode(),
               f'{{"dir": "{dst}", "files": 1, "bytes": 2, "deleted": 0}}'.encode()]
    assert wire.written() == b"".join(frame(k, NODE, a) for k, a in zip(
        (protocol.IFACE_ANSWER, protocol.SYNC_ANSWER, protocol.DONE_ANSWER), answers))
    assert (dst / "a.txt").read_bytes() == b"hi"


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


def test_a_kind_may_have_its_own_limit_and_a_dropped_frame_is_reported() -> None:
    drops = []
    dec = Decoder(limit=100, limits={protocol.SYNC_ANSWER: 1000}, on_drop=lambda *a: drops.append(a))
    answer = frame(protocol.SYNC_ANSWER, protocol.NODE, b"a" * 500)
    got = dec.feed(answer + frame(protocol.STDOUT, 1, b"z" * 500) + frame(protocol.DONE_ANSWER, 7, b"d" * 101))
    assert got == [(protocol.SYNC_ANSWER, protocol.NODE, b"a" * 500)]
    assert drops == [(protocol.STDOUT, 1, 500), (protocol.DONE_ANSWER, 7, 101)] and dec.dropped == 2
    assert protocol.MAX_ANSWER >= protocol.MAX_TO_NODE


def test_frames_that_say_nonsense_end_nothing() -> None:
    """Malformed payloads, unknown kinds and processes: no exception, the process keeps its state."""
    console = Console(stdout=open(os.devnull, "wb"), stderr=open(os.devnull, "wb"), color=False)
    proc = ProcSpec(Role.WORKER, 0, 0, None, ("x",), {})
    p = RemoteProcess(proc, console.proc("w", "worker 0", "worker"), "h", 0)
    for kind, payload in ((protocol.STARTED, b"not json"), (protocol.STARTED, b"[1]"), (b"?", b"x"),
                          (protocol.HERE, b"\xff"), (protocol.FAILED, b'{"code": "x"}')):
        p.frame(kind, payload)
    assert p.pid is None and p.reported == 1 and p.failure == "could not start"
    q = RemoteProcess(proc, console.proc("w", "worker 0", "worker"), "h", 0)
    q.frame(protocol.EXIT, b"abc")
    assert q.reported == 1
    q.frame(protocol.EXIT, b"0")  # the first report counts
    assert q.poll() == 1


def test_the_hub_drops_an_oversized_frame_and_serves_the_connection_on(monkeypatch) -> None:
    class Heard:
        def __init__(self) -> None:
            self.frames: list = []
            self.channel = "none"

        def frame(self, kind: bytes, payload: bytes) -> None:
            self.frames.append((kind, payload))

        def channel_opened(self) -> None:
            self.channel = "open"

        def channel_closed(self) -> None:
            self.channel = "closed"

    secret = "ab" * 32
    pump = PipePump()
    heard = Heard()
    hub = Hub(pump, secret, socket.create_server(("127.0.0.1", 0)), [0], {0: heard})  # type: ignore[dict-item]
    try:
        ch = connect(hub.address, 0, secret)
        assert ch.sock is not None
        ch.sock.sendall(frame(protocol.STDOUT, 0, b"z" * (protocol.MAX_FROM_NODE + 1)))
        ch.send(protocol.STDOUT, 0, b"after\n")
        ch.send(protocol.EXIT, 0, b"0")
        wait_for(lambda: len(heard.frames) == 2, 10, what="the frames after the oversized one")
        assert heard.frames == [(protocol.STDOUT, b"after\n"), (protocol.EXIT, b"0")] and heard.channel == "open"
        ch.close()
        wait_for(lambda: heard.channel == "closed", 10, what="the connection to end")
    finally:
        hub.stop()
        pump.stop()


def test_the_hub_admits_a_process_started_later_under_an_id_of_its_own() -> None:
    secret = "ab" * 32
    pump = PipePump()
    hub = Hub(pump, secret, socket.create_server(("127.0.0.1", 0)), [0, 1, 2], {})
    try:
        with pytest.raises(ConnectionError):  # (not admitted yet: refused after the handshake)
            connect(hub.address, 3, secret).sock.recv(1)  # type: ignore[union-attr]
        ident = hub.admit_new()
        assert ident == 3 and hub.admit_new() == 4  # never an id that a process of the job had
        ch = connect(hub.address, ident, secret)
        wait_for(lambda: hub.connected(ident), 10, what="the admitted process's connection")
        ch.close()
    finally:
        hub.stop()
        pump.stop()


# --- no frame kind is spelled outside the protocol module -------------------------------------------------

#: One-letter bytes literals in launcher/ that are not frame kinds, and why (a new one must say why here).
NOT_KINDS = {
    ("launcher/runtime/output.py", b"x"): "the byte that wakes the pump's select",
}


def test_every_frame_kind_in_the_launcher_is_a_constant_of_the_protocol_module() -> None:
    found = []
    for path in sorted((ROOT / "launcher").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "launcher/node/protocol.py":
            continue
        for n in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Constant) and isinstance(n.value, bytes) and len(n.value) == 1 \
                    and n.value.isalpha() and (rel, n.value) not in NOT_KINDS:
                found.append(f"{rel}:{n.lineno}: {n.value!r}")
            if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "Struct":
                found += [f"{rel}:{n.lineno}: a frame header" for a in n.args
                          if isinstance(a, ast.Constant) and str(a.value).startswith(">c")]
    assert found == [], "use the kinds of launcher.node.protocol (or say in NOT_KINDS why it is no kind)"
