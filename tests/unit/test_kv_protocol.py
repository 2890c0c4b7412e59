"""Wire protocol: round trips, handshake, MACs, replays, and fuzzing (no sockets)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.kv import protocol as P

SECRET = P.secret_key("ab" * 32)
OTHER = P.secret_key("cd" * 32)


def pair(mac_payload: bool = False, secret: bytes = SECRET) -> tuple[P.Session, P.Session, P.Acceptor]:
    """A client session and the matching server session, through the real handshake."""
    acceptor = P.Acceptor(secret, mac_payload)
    hs = P.ClientHandshake(secret, mac_payload)
    rid = b"\x00rid1"
    assert acceptor.receive(rid, hs.hello()) is None
    (_, challenge), = acceptor.outbox
    acceptor.outbox.clear()
    client = hs.answer(challenge)
    assert acceptor.receive(rid, hs.auth_frames) is None
    (_, ok), = acceptor.outbox
    acceptor.outbox.clear()
    assert client.open(ok).cmd == P.AUTH_OK
    return client, acceptor.peers[rid].session, acceptor  # type: ignore[return-value]


K1, K2 = bytes(range(32)), bytes(range(32, 64))


def sessions(mac_payload: bool = False) -> tuple[P.Session, P.Session]:
    """A fresh client/server session pair with fixed keys (cheap; for the fuzzers)."""
    return P.Session(K1, K2, mac_payload), P.Session(K2, K1, mac_payload)


def frames_of(session: P.Session, cmd: int, payload: list, **kw) -> list:
    return [session.seal(cmd, payload=payload, **kw), *payload]


# --- round trips ------------------------------------------------------------------------------

TENSOR = np.arange(12, dtype=np.float32)
INDEX = P.pack_index([(3, 1, 12, 1)])  # key 3, part 1, 12 elements of float32
INDEX2 = P.pack_index([(3, 1, 12, 1), (4, 0, 2, 2)])
PAIR = np.arange(2, dtype=np.float64)
MESSAGES = [
    (P.REGISTER, dict(), [P.dumps({"role": "worker", "task_id": 0})]),
    (P.READY, dict(), [P.dumps({"rank": 0, "servers": [["127.0.0.1", 1]]})]),
    (P.HEARTBEAT, dict(), []),
    (P.BARRIER, dict(key=P.GROUP_WORKERS), []),
    (P.RELEASE, dict(key=P.GROUP_ALL), []),
    (P.FAIL, dict(), [P.dumps({"reason": "boom"})]),
    (P.ABORT, dict(), [P.dumps({"reason": "worker 1 died"})]),
    (P.FINALIZE, dict(), []),
    (P.DONE, dict(), []),
    (P.INIT, dict(key=3, part=1, req=7, count=1), [INDEX, TENSOR]),
    (P.PUSH, dict(key=3, req=8, count=1, flags=P.F_PULL), [INDEX, TENSOR]),
    (P.PUSH, dict(key=3, req=9, count=2, flags=P.F_ASYNC), [INDEX2, TENSOR, PAIR]),
    (P.PULL, dict(key=3, req=10, count=2), [INDEX2]),
    (P.VALUES, dict(key=3, req=10, count=1), [INDEX, TENSOR]),
    (P.REPLY, dict(req=11), []),
    (P.REPLY, dict(req=12, status=P.ST_ERROR), [b"key 3 was never initialised"]),
    (P.REPLY, dict(req=13), [P.dumps({"slots": []}), TENSOR]),
    (P.SET_OPTIMIZER, dict(req=14), [P.dumps({"name": "sgd"})]),
    (P.GET_STATES, dict(req=15), []),
    (P.SET_STATES, dict(req=16), [P.dumps({"slots": []}), TENSOR]),
    (P.STOP, dict(req=17), []),
    (P.PUSH, dict(key=3, req=18, count=1, flags=P.F_STEP, status=41), [INDEX, TENSOR]),
    (P.STEPS, dict(req=19), []),
]


@pytest.mark.parametrize("mac_payload", [False, True])
def test_round_trip_of_every_message_type(mac_payload: bool) -> None:
    client, server, _ = pair(mac_payload)
    for cmd, kw, payload in MESSAGES:
        for sender, receiver in ((client, server), (server, client)):
            msg = receiver.open(frames_of(sender, cmd, payload, **kw))
            assert msg.cmd == cmd
            for name, value in kw.items():
                got = getattr(msg, name)
                assert (got & value if name == "flags" else got) == value
            assert [bytes(memoryview(f)) for f in msg.frames] == [bytes(memoryview(p)) for p in payload]
            if cmd in (P.REGISTER, P.READY, P.FAIL, P.ABORT, P.SET_OPTIMIZER):
                assert msg.json() == P.load_json(payload[0])
            if cmd in P.BATCH_COMMANDS:
                assert msg.items == list(P.ITEM.iter_unpack(payload[0]))
    covered = {cmd for cmd, _, _ in MESSAGES} | {P.AUTH_OK}
    assert covered == P.SEALED_COMMANDS


def test_payload_mac_flag_follows_the_sender() -> None:
    client, server, _ = pair(mac_payload=False)
    msg = server.open(frames_of(client, P.PUSH, [INDEX, TENSOR], count=1))
    assert not msg.flags & P.F_MAC
    # Control messages and replies always carry a payload MAC.
    assert server.open(frames_of(client, P.REGISTER, [b"{}"])).flags & P.F_MAC
    assert client.open(frames_of(server, P.REPLY, [b"oops"], status=P.ST_ERROR)).flags & P.F_MAC
    macced, server2, _ = pair(mac_payload=True)
    assert server2.open(frames_of(macced, P.PUSH, [INDEX, TENSOR], count=1)).flags & P.F_MAC


def test_tensor_data_tampering_is_caught_only_with_a_payload_mac() -> None:
    for mac_payload in (False, True):
        client, server, _ = pair(mac_payload)
        head = client.seal(P.PUSH, count=1, payload=[INDEX, TENSOR])
        evil = TENSOR.copy()
        evil[0] = 99
        if mac_payload:
            with pytest.raises(P.ProtocolError, match="bad-mac"):
                server.open([head, INDEX, evil])
        else:
            assert server.open([head, INDEX, evil]).frames[1] is evil  # data unMAC'd: by design


def test_the_index_of_a_batch_is_always_authenticated() -> None:
    client, server, _ = pair(mac_payload=False)
    head = client.seal(P.PUSH, count=1, payload=[INDEX, TENSOR])
    other = P.pack_index([(4, 1, 12, 1)])  # the same sizes, another key
    with pytest.raises(P.ProtocolError, match="bad-mac"):
        server.open([head, other, TENSOR])
    assert server.open([head, INDEX, TENSOR]).items == [(3, 1, 12, 1)]


def test_the_mac_reads_a_frame_as_it_is_now() -> None:
    # A server sends the values it holds, updated in place between two answers (and
    # pyzmq's Frame.bytes would give the first copy it made).
    import zmq

    client, server, _ = pair(mac_payload=True)
    value = zmq.Frame(np.zeros(6, np.float32).tobytes())
    index = P.pack_index([(0, 0, 6, 1)])
    for step in range(3):
        assert value.bytes is not None
        np.frombuffer(value.buffer, np.float32)[:] = step  # the optimizer's in-place update
        head = server.seal(P.VALUES, count=1, payload=[index, value])
        got = client.open([head, index, value.buffer.tobytes()])
        assert np.frombuffer(got.frames[1], np.float32).tolist() == [step] * 6


def test_short_covered_frames_enter_the_mac_as_they_are_long_ones_hashed() -> None:
    assert P.mac_input([INDEX]) == struct.pack("<Q", 16) + INDEX
    assert P.mac_input([]) == b""
    big = np.zeros(1024, np.float32)
    assert P.mac_input([INDEX, big]) == P.payload_digest([INDEX, big])  # 4 KB: hashed
    assert len(P.mac_input([INDEX, big])) == 32
    client, server, _ = pair(mac_payload=True)
    head = client.seal(P.PUSH, count=1, payload=[P.pack_index([(0, 0, 1024, 1)]), big])
    evil = big.copy()
    evil[-1] = 1
    with pytest.raises(P.ProtocolError, match="bad-mac"):
        server.open([head, P.pack_index([(0, 0, 1024, 1)]), evil])
    assert server.open([head, P.pack_index([(0, 0, 1024, 1)]), big]).items == [(0, 0, 1024, 1)]


# --- the handshake ------------------------------------------------------------------------------


def test_wrong_secret_is_rejected_by_the_server() -> None:
    acceptor = P.Acceptor(SECRET)
    hs = P.ClientHandshake(OTHER)
    acceptor.receive(b"r", hs.hello())
    (_, challenge), = acceptor.outbox
    acceptor.outbox.clear()
    with pytest.raises(P.AuthError, match="does not know"):
        hs.answer(challenge)  # the client notices first: the server's proof is wrong
    # A client that sends a proof anyway gets AUTH_FAIL and is never served.
    acceptor.receive(b"r", P.plain(P.AUTH, [bytes(32)]))
    (_, fail), = acceptor.outbox
    assert P.plain_command(fail) == P.AUTH_FAIL
    assert not acceptor.peers
    assert acceptor.drops.counts == {"auth-failed": 1}
    with pytest.raises(P.AuthError, match="rejected"):
        P.ClientHandshake(SECRET).answer(fail)


def test_secret_never_crosses_the_wire() -> None:
    secret_text = "0123456789abcdef" * 4
    key = P.secret_key(secret_text)
    acceptor = P.Acceptor(key)
    hs = P.ClientHandshake(key)
    wire = []
    wire += hs.hello()
    acceptor.receive(b"r", hs.hello())
    for _, frames in acceptor.outbox:
        wire += frames
        hs.answer(frames)
        break
    wire += hs.auth_frames
    blob = b"".join(bytes(f) for f in wire)
    assert key not in blob and secret_text.encode() not in blob


def test_sessions_are_per_connection_and_per_direction() -> None:
    client1, server1, _ = pair()
    client2, server2, _ = pair()
    frames = frames_of(client1, P.HEARTBEAT, [])
    with pytest.raises(P.ProtocolError, match="bad-mac"):
        server2.open(frames)  # another connection's key
    with pytest.raises(P.ProtocolError, match="bad-mac"):
        client1.open(frames)  # reflected back to its sender
    assert server1.open(frames).cmd == P.HEARTBEAT


def test_replay_is_rejected() -> None:
    client, server, _ = pair()
    first = frames_of(client, P.HEARTBEAT, [])
    second = frames_of(client, P.BARRIER, [], key=P.GROUP_WORKERS)
    server.open(first)
    server.open(second)
    for old in (first, second):
        with pytest.raises(P.ProtocolError, match="replay"):
            server.open(old)
    assert server.open(frames_of(client, P.HEARTBEAT, [])).cmd == P.HEARTBEAT


def test_version_and_structure_checks() -> None:
    client, server, _ = pair()
    head = bytearray(client.seal(P.HEARTBEAT))
    head[0] = 1
    with pytest.raises(P.ProtocolError, match="version"):
        server.open([bytes(head)])
    bad = [
        (P.PUSH, [P.pack_index([(3, 1, 13, 1)]), TENSOR], 1),  # 13 elements said, 12 sent
        (P.PUSH, [P.pack_index([(3, 1, 12, 99)]), TENSOR], 1),  # unknown dtype
        (P.PUSH, [INDEX, TENSOR], 2),  # the count says 2 items
        (P.PUSH, [INDEX2, TENSOR], 2),  # one data frame missing
        (P.PULL, [INDEX, TENSOR], 1),  # a pull carries no data
        (P.VALUES, [], 0),  # no index
        (P.REGISTER, [], 0),
    ]
    for cmd, payload, count in bad:
        with pytest.raises(P.ProtocolError, match="malformed"):
            server.open(frames_of(client, cmd, payload, count=count))
    # A failed message does not advance the sequence: the next good one passes.
    assert server.open(frames_of(client, P.HEARTBEAT, [])).cmd == P.HEARTBEAT


def test_json_payloads_must_be_objects() -> None:
    for bad in (b"[1]", b"\xff", b"{", b"1"):
        with pytest.raises(P.ProtocolError):
            P.load_json(bad)


def test_pending_handshakes_are_bounded() -> None:
    acceptor = P.Acceptor(SECRET, max_pending=4)
    for i in range(50):
        acceptor.receive(struct.pack("<I", i), P.ClientHandshake(SECRET).hello())
    assert acceptor.pending == 4
    assert acceptor.drops.counts == {"handshake-evicted": 46}


def complete(acceptor: P.Acceptor, hs: P.ClientHandshake, rid: bytes, challenge: list) -> bool:
    """Answer a challenge; True when the acceptor then authenticates the peer."""
    hs.answer(challenge)
    acceptor.receive(rid, hs.auth_frames, "10.0.0.1")
    return rid in acceptor.peers


def test_a_flood_from_one_address_evicts_its_own_handshakes_first() -> None:
    acceptor = P.Acceptor(SECRET, max_pending=64, max_per_address=16)
    real = P.ClientHandshake(SECRET)
    acceptor.receive(b"real", real.hello(), "10.0.0.1")
    (_, challenge), = acceptor.outbox
    for i in range(1000):  # an attacker's HELLOs from another host
        acceptor.receive(struct.pack("<I", i), P.ClientHandshake(OTHER).hello(), "10.6.6.6")
    assert acceptor.pending == 17
    assert complete(acceptor, real, b"real", challenge)


def test_a_flood_from_the_same_address_is_survived_by_repeating_the_hello() -> None:
    acceptor = P.Acceptor(SECRET, max_pending=64, max_per_address=16)
    real = P.ClientHandshake(SECRET)
    acceptor.receive(b"real", real.hello(), "10.0.0.1")
    for i in range(100):
        acceptor.receive(struct.pack("<I", i), P.ClientHandshake(OTHER).hello(), "10.0.0.1")
    acceptor.outbox.clear()
    # evicted: its AUTH is not answered ...
    stale = P.ClientHandshake(SECRET)
    acceptor.receive(b"real", stale.hello(), "10.0.0.1")  # (stands for the evicted one)
    for i in range(100, 200):
        acceptor.receive(struct.pack("<I", i), P.ClientHandshake(OTHER).hello(), "10.0.0.1")
    (_, old), *_ = acceptor.outbox
    acceptor.outbox.clear()
    assert not complete(acceptor, stale, b"real", old)
    assert acceptor.outbox == []  # nothing to say: the handshake is unknown
    # ... so the real peer repeats its HELLO (a new nonce) and completes at once
    again = P.ClientHandshake(SECRET)
    acceptor.receive(b"real", again.hello(), "10.0.0.1")
    (_, challenge), = acceptor.outbox
    assert complete(acceptor, again, b"real", challenge)


def test_a_repeated_hello_replaces_the_handshake_and_stale_challenges_are_recognised() -> None:
    acceptor = P.Acceptor(SECRET)
    first, second = P.ClientHandshake(SECRET), P.ClientHandshake(SECRET)
    acceptor.receive(b"r", first.hello())
    acceptor.receive(b"r", second.hello())
    assert acceptor.pending == 1
    (_, c1), (_, c2) = acceptor.outbox
    assert not second.matches(c1, [first])  # the answer to our earlier HELLO: ignore it
    assert second.matches(c2, [first])
    with pytest.raises(P.AuthError, match="bad-proof"):
        second.answer(c1)
    second.answer(c2)
    acceptor.receive(b"r", second.auth_frames)
    assert b"r" in acceptor.peers


def test_handshakes_expire() -> None:
    now = [100.0]
    acceptor = P.Acceptor(SECRET, clock=lambda: now[0])
    acceptor.receive(b"old", P.ClientHandshake(SECRET).hello(), "a")
    now[0] += P.HANDSHAKE_SECONDS + 1
    acceptor.receive(b"new", P.ClientHandshake(SECRET).hello(), "b")
    assert acceptor.pending == 1 and acceptor.drops.counts == {"handshake-expired": 1}


def test_gate_token_is_derived_from_the_secret() -> None:
    token = P.gate_token(SECRET)
    assert token == P.gate_token(SECRET) != P.gate_token(OTHER)
    assert len(token) == 64 and SECRET.hex().encode() not in token


# --- fuzzing: 10,000+ cases, nothing accepted, nothing raised but ProtocolError ---------------

EXAMPLES = 2500  # per fuzzer; four fuzzers
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
counts = {"random": 0, "mutated": 0, "replayed": 0, "unauthenticated": 0}


def run_fuzzer(fuzzer, name: str) -> None:
    """Run a Hypothesis fuzzer and check how many cases really ran."""
    before = counts[name]
    fuzzer()
    assert counts[name] - before >= EXAMPLES, f"only {counts[name] - before} cases ran"

frame_st = st.one_of(
    st.binary(max_size=80),
    st.binary(min_size=P.HEADER_SIZE, max_size=P.HEADER_SIZE),
    st.builds(lambda v, c, rest: bytes([v, c]) + rest, st.sampled_from([0, 1, 2, 255]),
              st.sampled_from(sorted(P.COMMAND_NAMES) + [0, 99, 255]),
              st.binary(min_size=P.HEADER_SIZE - 2, max_size=P.HEADER_SIZE - 2)),
)
frames_st = st.lists(frame_st, min_size=0, max_size=4)
AUTHED = pair()


@FUZZ
@given(frames=frames_st)
def fuzz_random_frames(frames: list[bytes]) -> None:
    _, server, acceptor = AUTHED
    with pytest.raises(P.ProtocolError):
        server.open(frames)
    # ... and neither by the acceptor, from an authenticated or an unknown peer
    before = acceptor.drops.total
    rid = next(iter(acceptor.peers))
    assert acceptor.receive(rid, frames) is None
    assert acceptor.receive(b"\x00stranger", frames) is None
    assert acceptor.drops.total >= before + 1
    assert list(acceptor.peers) == [rid]
    counts["random"] += 1


@FUZZ
@given(data=st.data())
def fuzz_mutated_messages(data: st.DataObject) -> None:
    client, server = sessions(mac_payload=data.draw(st.booleans()))
    cmd, kw, payload = data.draw(st.sampled_from(MESSAGES))
    frames = [bytes(memoryview(f)) for f in frames_of(client, cmd, payload, **kw)]
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop", "add", "swap"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(frames) - 1))
        # a flipped data byte of a batch is only caught when all its payload is MAC'd
        if i > 1 and not (P.HEADER.unpack_from(frames[0])[2] & P.F_MAC):
            i = 0
        if not frames[i]:
            frames[i] = b"\x00"
        else:
            j = data.draw(st.integers(0, len(frames[i]) - 1))
            bit = 1 << data.draw(st.integers(0, 7))
            b = bytearray(frames[i])
            b[j] ^= bit
            frames[i] = bytes(b)
    elif how == "truncate":
        cut = data.draw(st.integers(0, len(frames[0]) - 1))
        frames[0] = frames[0][:cut]
    elif how == "extend":
        frames[0] = frames[0] + data.draw(st.binary(min_size=1, max_size=8))
    elif how == "drop":
        if len(frames) == 1:
            frames = []
        else:
            del frames[data.draw(st.integers(1, len(frames) - 1))]
    elif how == "add":
        frames.append(data.draw(st.binary(max_size=16)))
    else:
        other_cmd, other_kw, other_payload = data.draw(st.sampled_from(MESSAGES))
        other = frames_of(client, other_cmd, other_payload, **other_kw)
        frames[0] = bytes(other[0])  # another (unsent) message's header on this payload
        other_payload = [bytes(memoryview(f)) for f in other[1:]]
        covered = len(other_payload) if P.HEADER.unpack_from(frames[0])[2] & P.F_MAC else 1
        if other_payload[:covered] == frames[1:][:covered]:
            # that header is valid for this payload (the same covered frames: the same
            # message, or a batch with the same index whose data is not MAC'd, by
            # design): break it instead
            frames[0] = frames[0][:-1] + bytes([frames[0][-1] ^ 1])
    with pytest.raises(P.ProtocolError):
        server.open(frames)
    counts["mutated"] += 1


@FUZZ
@given(data=st.data())
def fuzz_replays(data: st.DataObject) -> None:
    client, server = sessions()
    sent = [frames_of(client, c, p, **k) for c, k, p in data.draw(
        st.lists(st.sampled_from(MESSAGES), min_size=1, max_size=6))]
    for frames in sent:
        server.open(frames)
    for frames in data.draw(st.lists(st.sampled_from(sent), min_size=1, max_size=6)):
        with pytest.raises(P.ProtocolError, match="replay"):
            server.open(frames)
    counts["replayed"] += 1


@FUZZ
@given(steps=st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c"]), st.one_of(
    frames_st,
    st.builds(lambda n: P.ClientHandshake(OTHER).hello() if n else [], st.booleans()),
    st.builds(lambda proof: P.plain(P.AUTH, [proof]), st.binary(min_size=32, max_size=32)),
    st.builds(lambda: P.plain(P.HELLO, [bytes(32)])),
)), max_size=12))
def fuzz_unauthenticated(steps: list) -> None:
    acceptor = P.Acceptor(SECRET)
    for rid, frames in steps:
        assert acceptor.receive(rid, frames) is None
    assert not acceptor.peers
    assert not acceptor.new_peers
    counts["unauthenticated"] += 1


# 4 x 2,500 = 10,000 cases, each counted as it runs.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fuzz_random_frames_are_never_accepted() -> None:
    run_fuzzer(fuzz_random_frames, "random")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fuzz_mutated_valid_messages_are_rejected() -> None:
    run_fuzzer(fuzz_mutated_messages, "mutated")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fuzz_replays_are_rejected() -> None:
    run_fuzzer(fuzz_replays, "replayed")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fuzz_unauthenticated_peers_are_never_served() -> None:
    run_fuzzer(fuzz_unauthenticated, "unauthenticated")


def test_nonces_differ() -> None:
    seen = {bytes(P.ClientHandshake(SECRET).hello()[1]) for _ in range(100)}
    assert len(seen) == 100
