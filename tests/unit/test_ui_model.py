"""The job page's model (launcher/ui/model.py): the snapshot's shape (the UI contract), the rows
from the handles, throughput from Speedometer lines, the event ids and their resume, and the bounds
on memory whatever the processes print."""

from __future__ import annotations

import json
import tracemalloc
from types import SimpleNamespace as NS
from typing import Any, Optional

import pytest

from launcher.ui import model
from launcher.ui.model import JobView


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


def procs(workers: int = 2, servers: int = 1, scheduler: bool = True) -> list[Any]:
    out = [NS(name="scheduler", role="scheduler", rank=0, label="scheduler", host=None)] if scheduler else []
    out += [NS(name=f"server-{r}", role="server", rank=r, label=f"server {r}", host=None) for r in range(servers)]
    # (workers out of order: the rows come sorted)
    out += [NS(name=f"worker-{r}", role="worker", rank=r, label=f"worker {r} @ h1", host=NS(name="h1"))
            for r in reversed(range(workers))]
    return out


def handle(name: str, pid: Optional[int] = 100, exit_code: Optional[int] = None, host: str = "h1",
           usage: Any = None) -> Any:
    h = NS(name=name, pid=pid, exit_code=exit_code, host=host)
    if usage is not None:
        h.usage = usage
    return h


def view(clock: Optional[Clock] = None, **kw: Any) -> JobView:
    v = JobView(["python", "train.py"], "ps", "local", clock=clock or Clock(), **kw)
    v.plan("pslaunch-abc", procs(), 0)
    v.viewer(+1)  # (someone watches: lines become events)
    return v


SPEED = "Epoch[1] Batch [100-200]\tSpeed: {:.2f} samples/sec\taccuracy=0.912"


def test_the_snapshot_has_the_contracts_shape_and_is_json() -> None:
    clock = Clock()
    v = view(clock, logs=True)
    clock.now += 2.5
    v.add_line("worker-1", "hello", err=True)
    v.add_line("worker-1", SPEED.format(1234.5), err=False)
    snap = json.loads(json.dumps(v.snapshot()))
    assert set(snap) == {"job", "processes", "throughput", "failure", "logs"}
    job = snap["job"]
    assert set(job) == {"id", "command", "tracker", "backend", "state", "attempt", "max_restarts", "start",
                        "elapsed", "end", "exit_code", "logs", "attempts"}
    assert (job["id"], job["command"], job["state"], job["elapsed"], job["logs"]) == (
        "pslaunch-abc", "python train.py", "starting", 2.5, True)
    assert [p["name"] for p in snap["processes"]] == ["scheduler", "server-0", "worker-0", "worker-1"]
    row = snap["processes"][3]
    assert set(row) == {"name", "role", "rank", "label", "host", "pid", "state", "exit_code", "signal", "cpu", "rss",
                        "last_line", "speed", "epoch", "batch", "lines", "log"}
    assert (row["label"], row["host"], row["lines"], row["speed"], row["epoch"], row["batch"], row["log"]) == (
        "worker 1", "h1", 2, 1234.5, 1, 200, "worker-1.log")
    assert snap["logs"]["worker-1"] == [[1, 2.5, "e", "hello"], [2, 2.5, "o", SPEED.format(1234.5)]]
    assert snap["throughput"] == {"worker-1": [[2.5, 1234.5]]}
    assert snap["failure"] is None


def test_rows_follow_the_handles_and_the_job_ends_with_each_state() -> None:
    v = view()
    v.sync([handle("worker-0"), handle("worker-1")], force=True)
    assert v.job["state"] == "running"
    v.sync([handle("worker-0", exit_code=0), handle("worker-1", exit_code=137)], force=True)
    rows = {r["name"]: r for r in v.snapshot()["processes"]}
    assert (rows["worker-0"]["state"], rows["worker-1"]["state"], rows["worker-1"]["exit_code"],
            rows["worker-1"]["signal"]) == ("succeeded", "failed", 137, "SIGKILL")
    v.sync([handle("server-0", exit_code=143)], stopped={"server-0"}, force=True)
    v.set_failure("worker-1", "worker 1 (on h1, pid 100) was killed by SIGKILL (exit code 137)", ["last words"])
    v.finish("failure", 137)
    snap = v.snapshot()
    states = {r["name"]: r["state"] for r in snap["processes"]}
    assert states == {"scheduler": "stopped", "server-0": "stopped", "worker-0": "succeeded", "worker-1": "failed"}
    assert (snap["job"]["state"], snap["job"]["exit_code"]) == ("failed", 137)
    assert snap["failure"]["name"] == "worker-1" and snap["failure"]["lines"] == ["last words"]
    assert [model.job_state(r) for r in ("success", "failure", "signal", "timeout")] == [
        "succeeded", "failed", "stopped", "failed"]


def test_cpu_and_rss_come_from_usage_at_most_once_a_second() -> None:
    clock = Clock()
    calls = []

    def usage() -> tuple[float, int]:
        calls.append(clock.now)
        return 97.25, 123456

    v = view(clock)
    h = handle("worker-0", usage=usage)
    for _ in range(30):  # (3 s of the supervisor's looks, every 0.1 s)
        v.sync([h, handle("worker-1")])
        clock.now += 0.1
    assert 3 <= len(calls) <= 4
    row = v.snapshot()["processes"][2]
    assert (row["cpu"], row["rss"]) == (97.2, 123456)

    def broken() -> tuple[float, int]:
        raise OSError("the node went away")

    clock.now += 2
    v.sync([handle("worker-0", usage=broken)])  # (a failed sample changes nothing, and raises nothing)
    assert v.snapshot()["processes"][2]["rss"] == 123456
    clock.now += 2
    v.sync([handle("worker-0", usage=lambda: (3.0, 0))])  # (a process leaving: its memory given back)
    assert (v.snapshot()["processes"][2]["cpu"], v.snapshot()["processes"][2]["rss"]) == (3.0, 123456)


def test_events_carry_one_global_id_and_resume_after_any_of_them() -> None:
    clock = Clock()
    v = view(clock)
    last, snap = v.snapshot_message()
    assert snap.startswith(f"id: {last}\nevent: snapshot\ndata: {{".encode())
    v.add_line("worker-0", "one", False)
    v.sync([handle("worker-0")], force=True)
    v.add_line("worker-0", "two", False)
    events = v.events_after(last)
    assert events is not None
    ids = [i for i, _ in events]
    assert ids == list(range(last + 1, last + 1 + len(ids)))
    kinds = [m.split(b"\n")[1] for _, m in events]
    # (the line first: what led to a change comes before it; then the job's state, the row, the next line)
    assert kinds == [b"event: lines", b"event: job", b"event: procs", b"event: lines"]
    data = [json.loads(m.split(b"\n")[2][len(b"data: "):]) for _, m in events]
    assert data[0]["lines"] == [["worker-0", 1, 0.0, "o", "one"]] and data[3]["lines"][0][4] == "two"
    assert data[1]["state"] == "running" and data[2]["procs"][0]["pid"] == 100
    assert v.events_after(ids[0]) == events[1:]  # (a viewer that saw the first gets the rest)
    assert v.events_after(ids[-1]) == []
    assert v.events_after(ids[-1] + 1000) is None  # (not an id of this job: a snapshot)


def test_a_viewer_behind_the_ring_gets_a_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model, "MAX_EVENTS", 10)
    v = view()
    first, _ = v.snapshot_message()
    for i in range(30):
        v.set_state(f"state-{i}")
    assert v.events_after(first) is None
    last, _ = v.snapshot_message()
    assert v.events_after(last) == []


def test_lines_printed_while_nobody_watches_are_not_encoded_and_force_a_snapshot() -> None:
    v = view()
    last, _ = v.snapshot_message()
    v.viewer(-1)
    v._watched_at = -1e9  # (the last viewer left long ago)
    v.add_line("worker-0", "unseen", False)
    v.add_line("worker-0", "unseen too", False)
    assert v._events[-1][0] <= last  # (no event holds them)
    assert v.events_after(last) is None  # (the viewer would miss them: a snapshot)
    last2, snap = v.snapshot_message()
    assert b"unseen too" in snap and v.events_after(last2) == []


def test_throughput_comes_from_the_progress_lines_parser_and_its_series_is_bounded() -> None:
    clock = Clock()
    v = view(clock)
    v.add_line("worker-0", "Epoch[0] Validation-accuracy=0.5", False)  # (no speed: no point)
    for i in range(5 * model.SERIES_POINTS):
        clock.now += 1.0
        v.add_line("worker-0", SPEED.format(100 + i % 7), False)
    v.add_line("worker-0", "not a speed line", False)
    series = v.snapshot()["throughput"]["worker-0"]
    assert model.SERIES_POINTS // 2 <= len(series) <= model.SERIES_POINTS
    assert series[0][0] == 1.0 and series[-1][0] > 4 * model.SERIES_POINTS  # (the whole run, thinned)
    assert all(b[0] > a[0] for a, b in zip(series, series[1:]))
    assert v.snapshot()["processes"][2]["speed"] == 100 + (5 * model.SERIES_POINTS - 1) % 7


def test_a_long_line_is_cut_and_each_process_keeps_its_last_lines() -> None:
    v = view()
    v.add_line("worker-0", "x" * 100_000, False)
    kept = v.snapshot()["logs"]["worker-0"][0][3]
    assert len(kept) < model.MAX_LINE + 40 and kept.endswith("(98,000 more characters)")
    for i in range(model.LOG_LINES + 500):
        v.add_line("worker-0", f"line {i}", False)
    logs = v.snapshot()["logs"]["worker-0"]
    assert len(logs) == model.LOG_LINES
    assert logs[-1][0] == model.LOG_LINES + 501 and logs[-1][3] == f"line {model.LOG_LINES + 499}"
    assert v.snapshot()["processes"][2]["lines"] == model.LOG_LINES + 501


def test_memory_stays_bounded_for_256_processes_printing_long_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    """256 processes printing 8 times what the bounds hold (the bounds made small, so that
    tracemalloc can watch in a few seconds; scripts/bench_ui.py measures the real ones at 256
    processes x 50,000 lines): what Python allocated stays within the bounds the docstring states."""
    monkeypatch.setattr(model, "LOG_BUDGET", 512 * 1024)
    monkeypatch.setattr(model, "LOG_MIN_BYTES", 1024)
    monkeypatch.setattr(model, "EVENT_BYTES", 512 * 1024)
    monkeypatch.setattr(model, "BATCH_CHARS", 32 * 1024)
    v = JobView(["python", "t.py"], "ps", "local", clock=Clock())
    v.plan("pslaunch-big", [NS(name=f"worker-{r}", role="worker", rank=r, label=f"worker {r}", host=None)
                            for r in range(256)], 0)
    v.viewer(+1)
    text = "y" * 290
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(40):
            for r in range(256):
                v.add_line(f"worker-{r}", f"{i:06d} {text}", False)
            if i % 4 == 0:
                v.events_after(0)  # (a viewer takes events now and then)
        held, peak = (m - base for m in tracemalloc.get_traced_memory())
    finally:
        tracemalloc.stop()
    bound = model.LOG_BUDGET + model.EVENT_BYTES  # (no series here)
    assert v.memory() <= bound
    assert held < bound * 1.25, f"{held / 2**20:.2f} MiB held for a bound of {bound / 2**20:.2f} MiB"
    # (and while a batch of lines is encoded, a few copies of it)
    assert peak < bound * 1.25 + 8 * model.BATCH_CHARS, f"{peak / 2**20:.2f} MiB at the peak"
    assert all(len(r.ring) < 40 for r in v.rows.values())  # (the budget, not the line count, held them)


def test_an_attempts_hosts_in_one_line() -> None:
    from launcher.ui.model import hosts_note

    assert hosts_note(None) == "" and hosts_note({"used": ["h1"], "workers": 2}) == ""
    hosts = {"used": ["h1", "h4"], "workers": 3, "back": ["h5"], "dropped": ["h3"],
             "excluded": [{"host": "h2", "reason": "its processes failed first in 2 attempts in a row",
                           "cooldown": 61.7}],
             "spares": [{"spare": "h4", "replaces": "h2"}]}
    assert hosts_note(hosts) == ("h2 left out (its processes failed first in 2 attempts in a row; 62s); spare h4 for "
                                 "h2; h5 back; 3 workers (h3 out, no spare)")
