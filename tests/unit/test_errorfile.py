"""Error files (``launcher.node.errorfile``): parsing torch's JSON and any text, the bounds, the
private directory, hostile files; and the launcher's side (``ProgramError``, the ``r`` and ``x``
frames of ``RemoteProcess``, the node's time as the end time)."""

from __future__ import annotations

import json
import os
import stat
import time
import traceback
from pathlib import Path

import pytest

import pscontract
from launcher.node import errorfile, protocol
from launcher.node.errorfile import LIMIT, Slot, fit, parse
from launcher.runtime.handle import ProgramError
from launcher.runtime.output import Console
from launcher.runtime.remote import RemoteProcess
from launcher.spec.job import Role
from launcher.spec.plan import ProcSpec


def torch_json(message: str, trace: str, stamp: str = "1700000000") -> bytes:
    """What torch's ErrorHandler.record_exception writes (torch 2.x)."""
    return json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": trace,
                                                                     "timestamp": stamp}}}).encode()


def test_the_names_are_the_contracts() -> None:
    assert errorfile.NAMES == (pscontract.ERROR_FILE, pscontract.TORCH_ERROR_FILE)
    assert set(errorfile.NAMES) <= pscontract.CONTRACT


def test_torch_json_from_torchs_own_error_handler(tmp_path: Path, monkeypatch) -> None:
    """The real ErrorHandler of the installed torch writes the file; parse reads it back."""
    handler = pytest.importorskip("torch.distributed.elastic.multiprocessing.errors.error_handler")
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        raise ValueError("boom")
    except ValueError as e:
        handler.ErrorHandler().record_exception(e)
    doc = parse(path.read_bytes(), 1700000001.5)
    assert doc is not None and doc["message"] == "ValueError: boom"
    assert doc["traceback"].startswith("Traceback (most recent call last):")
    assert 'raise ValueError("boom")' in doc["traceback"] and doc["traceback"].endswith("ValueError: boom")
    assert doc["time"] == 1700000001.5  # the file's time (torch's counts whole seconds)
    assert parse(path.read_bytes())["time"] == pytest.approx(time.time(), abs=5)  # without it: torch's


def test_other_json_forms_and_plain_text() -> None:
    assert parse(b'{"message": "flat form", "errorCode": 3}') == {"message": "flat form", "traceback": "",
                                                                   "time": None}
    assert parse(torch_json("", "tb"))["message"] == "(no message)"
    # JSON of another shape is text: the first line
    assert parse(b'{"error": "x"}')["message"] == '{"error": "x"}'
    assert parse(b"[1, 2]")["message"] == "[1, 2]"
    assert parse(b"CUDA out of memory on device 3\n") == {"message": "CUDA out of memory on device 3",
                                                         "traceback": "", "time": None}
    text = "\n\nfirst line\nsecond line\n"
    assert parse(text.encode(), 5.0) == {"message": "first line", "traceback": "first line\nsecond line",
                                         "time": 5.0}
    tb = "".join(traceback.format_exception(KeyError, KeyError("k"), None))
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n" + tb
    assert parse(tb.encode())["message"] == "KeyError: 'k'"  # a Python traceback: its last line
    for nothing in (b"", b"   \n\t\n", b"\n"):
        assert parse(nothing) is None


def test_hostile_contents_are_bounded_and_never_evaluated() -> None:
    # longer than the limit: read as text, cut, said so
    huge = b"A" * (LIMIT + 1)
    doc = parse(huge)
    assert len(doc["message"]) <= errorfile.MESSAGE_MAX and doc["message"].endswith("[...]")
    big = torch_json("E" * 100_000, "T\n" * 100_000)  # longer than LIMIT: not parsed as JSON
    assert len(big) > LIMIT and len(parse(big)["message"]) <= errorfile.MESSAGE_MAX
    fits = torch_json("E" * 10_000, "line\n" * 9_000 + "last")
    assert len(fits) <= LIMIT
    doc = parse(fits)
    assert len(doc["message"]) == errorfile.MESSAGE_MAX and len(doc["traceback"]) == errorfile.TRACE_MAX
    assert doc["traceback"].startswith("[...]") and doc["traceback"].endswith("line\nlast")  # its end kept
    # binary, invalid UTF-8, control characters: decoded with replacement, kept for printable()
    doc = parse(b"\xff\xfe\x00\x1b[2J\x07bad\nmore")
    assert doc["message"] == "\ufffd\ufffd\x00\x1b[2J\x07bad"
    # a recursion bomb, a pickle, nonsense timestamps
    assert parse(b"[" * 50_000)["message"].startswith("[[[")
    assert parse(b"\x80\x04\x95cos\nsystem\n")["message"].startswith("\ufffd")
    for stamp in ("nan", "inf", "-5", "1e300", "x", ""):
        assert parse(torch_json("m", "t", stamp))["time"] is None


def test_fit_shortens_the_traceback_then_the_message() -> None:
    doc = {"message": "M" * 2000, "traceback": "line\n" * 3000, "time": 1.5}
    assert json.loads(fit(doc, 1 << 20)) == doc
    small = json.loads(fit(doc, protocol.LINE_PAYLOAD))
    assert len(json.dumps(small, separators=(",", ":"))) <= protocol.LINE_PAYLOAD
    assert small["message"] == doc["message"] and small["time"] == 1.5  # only the traceback went
    assert len(fit(doc, 500)) <= 500 and json.loads(fit(doc, 500))["message"].startswith("M")
    wide = {"message": "\u2603" * 2000, "traceback": "", "time": None}  # (6 bytes each in JSON)
    assert len(fit(wide, protocol.LINE_PAYLOAD)) <= protocol.LINE_PAYLOAD


def test_a_slot_is_private_new_and_removed(tmp_path: Path) -> None:
    slot = Slot(str(tmp_path))
    st = os.lstat(slot.dir)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert not os.path.lexists(slot.path) and os.path.dirname(slot.path) == slot.dir
    assert slot.env() == {"PSLAUNCH_ERROR_FILE": slot.path, "TORCHELASTIC_ERROR_FILE": slot.path}
    other = Slot(str(tmp_path))
    assert other.dir != slot.dir  # (mkdtemp: an unpredictable name, made exclusively)
    other.discard()
    Path(slot.path).write_bytes(torch_json("ValueError: x", "tb"))
    doc = slot.collect()
    assert doc is not None and doc["message"] == "ValueError: x"
    assert doc["time"] == pytest.approx(time.time(), abs=5)
    assert list(tmp_path.iterdir()) == [] and slot.collect() is None  # removed; once only
    empty = Slot(str(tmp_path))
    assert empty.collect() is None and list(tmp_path.iterdir()) == []  # it wrote nothing: no error


def test_a_planted_link_is_neither_read_nor_followed_when_removing(tmp_path: Path) -> None:
    base, elsewhere = tmp_path / "base", tmp_path / "elsewhere"
    base.mkdir()
    elsewhere.mkdir()
    target = elsewhere / "secret.txt"
    target.write_text("not the error\n")
    # the file is a link: not read, the link removed, its target intact
    slot = Slot(str(base))
    os.symlink(target, slot.path)
    assert slot.collect() is None and target.read_text() == "not the error\n" and list(base.iterdir()) == []
    # the directory was swapped for a link to a directory holding an error.json: neither read nor emptied
    (elsewhere / errorfile.FILE_NAME).write_bytes(torch_json("planted", "tb"))
    slot = Slot(str(base))
    os.rmdir(slot.dir)
    os.symlink(elsewhere, slot.dir)
    assert slot.collect() is None and list(base.iterdir()) == []
    assert sorted(p.name for p in elsewhere.iterdir()) == [errorfile.FILE_NAME, "secret.txt"]
    # a directory, a FIFO (no blocking read) in its place
    slot = Slot(str(base))
    os.mkdir(slot.path)
    (Path(slot.path) / "inner").write_text("x")
    os.symlink(target, Path(slot.path) / "link")
    assert slot.collect() is None and list(base.iterdir()) == [] and target.exists()
    slot = Slot(str(base))
    os.mkfifo(slot.path)
    t0 = time.monotonic()
    assert slot.collect() is None and time.monotonic() - t0 < 2 and list(base.iterdir()) == []


def test_a_huge_file_is_read_only_to_the_limit(tmp_path: Path) -> None:
    slot = Slot(str(tmp_path))
    with open(slot.path, "wb") as f:
        f.truncate(1 << 30)  # a sparse GiB of NUL bytes
    t0 = time.monotonic()
    doc = slot.collect()
    assert time.monotonic() - t0 < 2 and list(tmp_path.iterdir()) == []
    assert doc is not None and len(doc["message"]) <= errorfile.MESSAGE_MAX and "longer than 64 KiB" in doc["traceback"]


# --- the launcher's side -------------------------------------------------------------------------------


def test_program_error_trusts_nothing_and_is_printable() -> None:
    assert ProgramError.from_doc(None) is None and ProgramError.from_doc([]) is None
    assert ProgramError.from_doc({"message": 3}) is None and ProgramError.from_doc({"message": "  "}) is None
    e = ProgramError.from_doc({"message": "bad\x1b[2J\nline", "traceback": "a\x07\nb\x1b]0;title\x07", "time": "x"})
    assert e == ProgramError(message="bad^[[2J^Jline", traceback="a^G\nb^[]0;title^G", time=None)
    for when in (True, float("nan"), -1, 1e300, "5"):
        assert ProgramError.from_doc({"message": "m", "time": when}).time is None  # type: ignore[union-attr]
    long = ProgramError.from_doc({"message": "m" * 10**6, "traceback": "t\n" * 10**6, "time": 1700000000})
    assert long is not None and len(long.message) <= errorfile.MESSAGE_MAX
    assert len(long.traceback) <= errorfile.TRACE_MAX and long.time == 1700000000.0
    e = ProgramError("ValueError: x", "\n".join(f"l{i}" for i in range(30)), 1.0)
    assert e.lines(5) == ["ValueError: x", "[... 25 earlier lines]", "l25", "l26", "l27", "l28", "l29"]
    assert ProgramError("m", "", None).lines() == ["m"]
    assert ProgramError("m", "one\x85two", None).lines() == ["m", "one\x85two"]  # (one line: not splitlines)


def _remote() -> RemoteProcess:
    console = Console(stdout=open(os.devnull, "wb"), stderr=open(os.devnull, "wb"), color=False)
    proc = ProcSpec(Role.WORKER, 1, 1, None, ("x",), {})
    return RemoteProcess(proc, console.proc("worker-1", "worker 1", "worker"), "h", 1)


def test_a_remote_process_carries_the_record_and_ends_at_the_nodes_time() -> None:
    p = _remote()
    doc = {"message": "ValueError: boom", "traceback": "Traceback ...\nValueError: boom", "time": 1700000000.25}
    p.frame(protocol.RECORD, fit(doc, protocol.MAX_FROM_NODE))
    p.frame(protocol.RECORD, b'{"message": "the second is ignored"}')  # (in-band, it comes twice)
    node_time = time.time() - 3.0  # it ended 3 s before the launcher heard of it
    p.frame(protocol.EXIT, protocol.exit_payload(1, node_time))
    assert p.poll() == 1 and p.end_time == pytest.approx(node_time, abs=1e-5)
    assert p.error == ProgramError("ValueError: boom", "Traceback ...\nValueError: boom", 1700000000.25)
    assert p.describe_error() == ["ValueError: boom", "Traceback ...", "ValueError: boom"]
    rec = p.record()
    assert rec.error == {"message": "ValueError: boom", "traceback": "Traceback ...\nValueError: boom",
                         "time": 1700000000.25} and rec.to_dict()["error"] == rec.error
    # whoever heard of its end first, the first failure by time is the one that ended first
    late = _remote()
    late.frame(protocol.EXIT, b"1")  # (no node time: when the launcher heard of it)
    assert late.poll() == 1 and min((late, p), key=lambda h: h.end_time or 0.0) is p


def test_a_nodes_time_later_than_the_launchers_and_nonsense_are_not_used() -> None:
    p = _remote()
    p.frame(protocol.EXIT, protocol.exit_payload(2, time.time() + 3600))  # a clock an hour ahead
    assert p.poll() == 2 and p.end_time is not None and p.end_time <= time.time()
    for payload in (b"2 nan", b"2 inf", b"2 -1", b"2 x", b"2 1 2"):
        q = _remote()
        q.frame(protocol.EXIT, payload)
        assert q.poll() == 2 and q.node_ended_at is None and q.error is None and q.describe_error() == []
    assert protocol.parse_exit(b"3") == (3, None) and protocol.parse_exit(b"") == (1, None)
    assert protocol.parse_exit(protocol.exit_payload(137, 1700000000.5)) == (137, 1700000000.5)


# --- the node agent: r before x, on a channel and in-band -------------------------------------------------

WRITER = ("import os, sys; p = os.environ['TORCHELASTIC_ERROR_FILE']; "
          "assert p == os.environ['PSLAUNCH_ERROR_FILE'] and not os.path.lexists(p); "
          "open(p, 'w').write(sys.argv[1] * int(sys.argv[2])); sys.exit(3)")


def _agent(tmp_path: Path, args: str, channel: bool) -> tuple[bytes, bytes]:
    """A real agent (its own process: it becomes a subreaper) runs WRITER; its stdout and stderr."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    make = "Channel(0, 1)" if channel else "None, fallback='in-band'"
    code = ("import sys; from launcher.node.agent import Agent, Channel; "
            f"sys.exit(Agent(1.0, {make}).run([{{'id': 2, 'argv': [sys.executable, '-c', {WRITER!r}, {args}], "
            "'env': {'PATH': '/usr/bin:/bin'}}])[0])")
    p = subprocess.Popen([sys.executable, "-S", "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=root, env={**os.environ, "TMPDIR": str(tmp_path)})
    try:  # (its stdin stays open: the launcher is there)
        out, err = p.stdout.read(), p.stderr.read()  # type: ignore[union-attr]
        assert p.wait(timeout=60) == 3, err
    finally:
        p.kill()
        p.wait()
    assert list(tmp_path.iterdir()) == []  # the agent removed the error file's directory
    return out, err


def test_the_agent_sends_the_record_before_the_exit(tmp_path: Path) -> None:
    out, _ = _agent(tmp_path, "'Traceback (most recent call last):\\nValueError: x\\n', 2", channel=True)
    frames = protocol.Decoder().feed(out)
    assert [k for k, i, _ in frames] == [protocol.STARTED, protocol.RECORD, protocol.EXIT]
    doc = json.loads(frames[1][2])
    assert doc["message"] == "ValueError: x" and doc["traceback"].count("ValueError: x") == 2
    code, when = protocol.parse_exit(frames[2][2])
    assert code == 3 and when is not None and doc["time"] <= when <= time.time()


def test_in_band_the_record_is_cut_to_one_line_on_both_streams(tmp_path: Path) -> None:
    out, err = _agent(tmp_path, "'x' * 60 + '\\n', 1000", channel=False)
    records = []
    for stream in (out, err):
        for line in stream.split(b"\n"):
            found = protocol.unwrap(line)
            if found and found[0] == protocol.RECORD:
                records.append(found[2])
    assert len(records) == 2 and records[0] == records[1] and len(records[0]) <= protocol.LINE_PAYLOAD
    doc = json.loads(records[0])
    assert doc["message"] == "x" * 60 and doc["traceback"].startswith("[...]")


def test_a_program_that_writes_nothing_sends_no_record(tmp_path: Path) -> None:
    out, _ = _agent(tmp_path, "'', 0", channel=True)  # (an empty file: says nothing)
    assert [k for k, i, _ in protocol.Decoder().feed(out)] == [protocol.STARTED, protocol.EXIT]


def test_the_bounds_hold_once_control_characters_are_made_visible() -> None:
    e = ProgramError.from_doc({"message": "\x01" * 5000, "traceback": "\x02" * 50_000})
    assert e is not None and len(e.message) <= errorfile.MESSAGE_MAX and len(e.traceback) <= errorfile.TRACE_MAX
    assert e.message.startswith("^A^A") and e.traceback.endswith("^B^B")
