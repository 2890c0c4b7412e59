"""The supervisor against a fake backend and a scripted clock: fail-fast order, staged shutdown,
the second signal, --timeout, and the summary, with every moment chosen by the test.

The fake processes are scripts over virtual time: each knows when it exits and with which code,
whether it ignores SIGTERM, and what it does when killed. Virtual time advances only when the
supervisor sleeps, so the order of events is exact, never a race with the machine's clock.
"""

from __future__ import annotations

import io
import json
import logging
import signal
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import pytest

from launcher.backends.base import Backend
from launcher.run.supervisor import Supervisor
from launcher.runtime.handle import ProcessHandle, ProcGroup
from launcher.runtime.output import Console
from launcher.spec.job import Host, JobSpec
from launcher.spec.plan import ProcSpec


@pytest.fixture(autouse=True)
def _no_tracker(monkeypatch: pytest.MonkeyPatch) -> None:
    """These jobs of workers only (-s 0) have no tracker: their fake processes never talk to one,
    and the rabit tracker is XGBoost's own, run with a Python that has it."""
    from launcher import trackers

    monkeypatch.setattr(trackers, "create", lambda *args: None)


class Clock:
    """Virtual time: ``sleep`` moves it forward; nothing else does."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.on_sleep: list = []

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        for hook in list(self.on_sleep):
            hook(self.now)


@dataclass
class Script:
    """What one fake process does: exit with ``code`` at time ``exit_at`` (None: never by itself)."""

    exit_at: Optional[float] = None
    code: int = 0
    ignores_term: bool = False
    events: list[tuple[float, str]] = field(default_factory=list)
    #: why it could not start at all (then it "exits" with ``code`` at once)
    failure: Optional[str] = None
    #: when the launcher learns of its exit (None: at once), as a slow host's exit frame arrives late
    seen_at: Optional[float] = None
    #: the environment it was started with (filled in by the fake backend)
    env: dict[str, str] = field(default_factory=dict)
    #: once it has ended: why the launcher lost its host (as the ssh backend's keep-alives say)
    lost: Optional[str] = None
    #: the lines it writes to stderr as it ends
    says: list[str] = field(default_factory=list)


class FakeHandle(ProcessHandle):
    def __init__(self, proc: ProcSpec, output: Any, clock: Clock, script: Script, t0: float) -> None:
        super().__init__(proc, output, "fakehost", clock=clock)
        self.script, self.clock_, self.t0 = script, clock, t0
        self.pid = 100 + proc.task_id if proc.task_id is not None else 99
        self._code: Optional[int] = None
        if script.failure is not None:
            self.failure = script.failure
            self._end(script.code, t0)

    def _poll(self) -> Optional[int]:
        s = self.script
        if self._code is None and s.exit_at is not None and self.clock_.now - self.t0 >= (s.seen_at or s.exit_at):
            self._end(s.code, self.t0 + s.exit_at)
        return self._code

    def _exited(self) -> bool:
        """It has ended, whether or not the launcher knows yet (a signal then changes nothing)."""
        return self.script.exit_at is not None and self.clock_.now - self.t0 >= self.script.exit_at

    def _end(self, code: int, at: float) -> None:
        self._code, self.ended_at = code, at
        for line in self.script.says:
            self.output.stderr.feed(line.encode() + b"\n")
        self.output.close()

    def terminate(self) -> None:
        self.script.events.append((self.clock_.now - self.t0, "TERM"))
        if not self.script.ignores_term and self._poll() is None and not self._exited():
            self._end(143, self.clock_.now)

    def kill(self) -> None:
        self.script.events.append((self.clock_.now - self.t0, "KILL"))
        if self._poll() is None and not self._exited():
            self._end(137, self.clock_.now)

    def dump_stacks(self) -> None:
        self.script.events.append((self.clock_.now - self.t0, "ABRT"))

    def host_lost(self) -> Optional[str]:
        return self.script.lost if self._code is not None else None


def fake_backend(scripts: dict[str, Script], clock: Clock, groups: list) -> type[Backend]:
    class FakeBackend(Backend):
        name = "fake"
        remote = True

        def start(self, procs: Sequence[ProcSpec]) -> ProcGroup:
            t0 = clock.now
            group = ProcGroup(FakeHandle(p, self.console.proc(p.name, p.label, str(p.role)), clock,
                                         _script(scripts[p.name], p), t0) for p in procs)
            groups.append(group)
            return group

    return FakeBackend


def _script(script: Any, p: ProcSpec) -> Script:
    """A process's script: one for every attempt, or a list of one per attempt (the last repeats)."""
    if isinstance(script, list):
        attempt = int(p.env["PSLAUNCH_ATTEMPT"])
        script[min(attempt, len(script) - 1)].env = dict(p.env)
        return script[min(attempt, len(script) - 1)]
    return script


def run(scripts: dict[str, Any], tmp_path, workers: int, clock: Optional[Clock] = None, **kw: Any):
    clock = clock or Clock()
    spec = JobSpec(command=("prog",), num_workers=workers, num_servers=0, launcher="fake", kill_grace=10.0,
                   summary_json=str(tmp_path / "summary.json"), **kw)
    err = io.BytesIO()
    groups: list = []
    sup = Supervisor(spec, Console(stdout=io.BytesIO(), stderr=err, color=False),
                     backend=fake_backend(scripts, clock, groups), clock=clock, watchdog=False)
    result = sup.run()
    return result, sup, clock, json.loads((tmp_path / "summary.json").read_text())


def test_the_first_failure_by_time_is_reported_not_the_first_seen(tmp_path) -> None:
    # worker-2 fails at 5.0 s, worker-0 at 5.01 s; worker-0 is polled first: the report names worker-2
    scripts = {"worker-0": Script(exit_at=5.01, code=4), "worker-1": Script(), "worker-2": Script(exit_at=5.0, code=3)}
    result, sup, clock, doc = run(scripts, tmp_path, 3)
    assert result.exit_code == 3 and result.reason == "failure"
    assert result.first_failure is not None and result.first_failure.name == "worker-2"
    assert doc["first_failure"] == "worker-2" and doc["exit_code"] == 3


def test_the_root_cause_is_the_first_failure_even_when_its_news_comes_later(tmp_path) -> None:
    # worker-0 fails at 5.0 s on a slow host, whose frame arrives at 5.5 s; worker-1 fails at 5.2 s and is
    # seen at once: the launcher acts on worker-1, and then learns that worker-0 failed first
    scripts = {"worker-0": Script(exit_at=5.0, seen_at=5.5, code=3), "worker-1": Script(exit_at=5.2, code=4),
               "worker-2": Script()}
    result, sup, clock, doc = run(scripts, tmp_path, 3)
    assert result.exit_code == 3 and doc["first_failure"] == "worker-0"
    procs = {p["name"]: p for p in doc["processes"]}
    assert not procs["worker-0"]["stopped_by_launcher"] and not procs["worker-1"]["stopped_by_launcher"]
    assert procs["worker-2"]["stopped_by_launcher"]


def test_a_process_another_blames_in_the_same_look_is_the_first_failure(tmp_path) -> None:
    # worker-1 is killed and worker-0 (as a ps-lite scheduler would) says so and exits 1; one look sees
    # both ended, worker-0 first (a local process's end is when it is seen): worker-1 is the first failure
    blame = "pslaunch-cause: worker 1: worker 1 disconnected before the end of the job"
    scripts = {"worker-0": Script(exit_at=5.0, code=1, says=[blame]), "worker-1": Script(exit_at=5.0, code=137),
               "worker-2": Script()}
    result, sup, clock, doc = run(scripts, tmp_path, 3)
    assert result.exit_code == 137 and doc["first_failure"] == "worker-1"
    # the same without the line: the order seen stands (the test can fail)
    scripts["worker-0"] = Script(exit_at=5.0, code=1)
    scripts["worker-1"] = Script(exit_at=5.0, code=137)
    result, sup, clock, doc = run(scripts, tmp_path, 3)
    assert result.exit_code == 1 and doc["first_failure"] == "worker-0"


def test_staged_shutdown_term_then_kill_after_the_grace(tmp_path) -> None:
    scripts = {"worker-0": Script(exit_at=1.0, code=7), "worker-1": Script(), "worker-2": Script(ignores_term=True)}
    result, sup, clock, doc = run(scripts, tmp_path, 3)
    assert result.exit_code == 7
    w1, w2 = scripts["worker-1"].events, scripts["worker-2"].events
    assert [e for _, e in w1] == ["TERM"]                     # it stopped on SIGTERM
    assert [e for _, e in w2] == ["TERM", "KILL"]             # it ignored it: SIGKILL after the grace
    (t_term, _), (t_kill, _) = w2
    assert t_term == pytest.approx(1.0, abs=0.05) and t_kill - t_term == pytest.approx(10.0, abs=0.05)
    procs = {p["name"]: p for p in doc["processes"]}
    assert not procs["worker-0"]["stopped_by_launcher"] and procs["worker-0"]["exit_code"] == 7
    assert procs["worker-1"]["stopped_by_launcher"] and procs["worker-1"]["signal"] == "SIGTERM"
    assert procs["worker-2"]["stopped_by_launcher"] and procs["worker-2"]["signal"] == "SIGKILL"


def test_a_second_signal_kills_at_once(tmp_path) -> None:
    scripts = {"worker-0": Script(ignores_term=True), "worker-1": Script(ignores_term=True)}
    clock = Clock()
    sent = []

    def signals(now: float) -> None:  # Ctrl-C at 2 s, again at 4 s (during the 10 s grace)
        sup_ = holder[0]
        for at in (2.0, 4.0):
            if now - 1000.0 >= at and at not in sent:
                sent.append(at)
                sup_.signals.handle(signal.SIGINT)

    holder: list = []
    spec = JobSpec(command=("prog",), num_workers=2, num_servers=0, launcher="fake", kill_grace=10.0)
    groups: list = []
    sup = Supervisor(spec, Console(stdout=io.BytesIO(), stderr=io.BytesIO(), color=False),
                     backend=fake_backend(scripts, clock, groups), clock=clock, watchdog=False)
    holder.append(sup)
    clock.on_sleep.append(signals)
    result = sup.run()
    assert result.exit_code == 130 and result.reason == "signal"
    for s in scripts.values():
        assert [e for _, e in s.events] == ["TERM", "KILL"]
        (t_term, _), (t_kill, _) = s.events
        assert t_term == pytest.approx(2.0, abs=0.05)   # the first Ctrl-C: SIGTERM
        assert t_kill == pytest.approx(4.0, abs=0.05)   # the second: SIGKILL then, not after the grace


def test_timeout_dumps_stacks_then_stops_and_exits_124(tmp_path) -> None:
    scripts = {"worker-0": Script(), "worker-1": Script(exit_at=3.0, code=0)}
    result, sup, clock, doc = run(scripts, tmp_path, 2, timeout=20.0)
    assert result.exit_code == 124 and result.reason == "timeout"
    events = scripts["worker-0"].events
    assert [e for _, e in events] == ["ABRT", "TERM"]
    assert events[0][0] == pytest.approx(20.0, abs=0.05)           # at the timeout
    assert events[1][0] - events[0][0] == pytest.approx(3.0, abs=0.05)  # after the dumps had time to print
    assert scripts["worker-1"].events == []                       # it had already ended: left alone
    assert doc["reason"] == "timeout" and doc["exit_code"] == 124


def test_success_summary_records_every_process(tmp_path) -> None:
    scripts = {"worker-0": Script(exit_at=1.0), "worker-1": Script(exit_at=2.5)}
    result, sup, clock, doc = run(scripts, tmp_path, 2)
    assert result.exit_code == 0 and result.reason == "success" and result.first_failure is None
    procs = {p["name"]: p for p in doc["processes"]}
    assert procs["worker-1"]["end_time"] - procs["worker-1"]["start_time"] == pytest.approx(2.5, abs=0.05)
    assert all(not p["stopped_by_launcher"] and p["exit_code"] == 0 and p["host"] == "fakehost"
               for p in procs.values())
    assert all(s.events == [] for s in scripts.values())  # nothing was signalled


def test_a_ctrl_c_while_the_backend_waits_for_its_tasks_stops_what_it_started(tmp_path) -> None:
    # a batch backend's start() waits until every task runs; a Ctrl-C there raises out of it.
    # What it had started is stopped like the rest (SIGTERM, then SIGKILL on the second Ctrl-C),
    # not left to the batch system's removal at close (which some systems do with SIGTERM only).
    scripts = {"worker-0": Script(ignores_term=True), "worker-1": Script(ignores_term=True)}
    clock = Clock()
    started: list = []

    class WaitingBackend(Backend):
        name = "fake"
        remote = True

        def start(self, procs: Sequence[ProcSpec]) -> ProcGroup:
            started.extend(FakeHandle(p, self.console.proc(p.name, p.label, str(p.role)), clock, scripts[p.name],
                                      clock.now) for p in procs)
            sup.signals.handle(signal.SIGINT)  # while the tasks are "queued": raises Interrupted
            raise AssertionError("the signal did not interrupt start()")

        def started(self) -> ProcGroup:
            return ProcGroup(started)

    def second_ctrl_c(now: float) -> None:
        if now - 1000.0 >= 2.0 and sup.signals.count == 1:
            sup.signals.handle(signal.SIGINT)

    spec = JobSpec(command=("prog",), num_workers=2, num_servers=0, launcher="fake", kill_grace=10.0)
    sup = Supervisor(spec, Console(stdout=io.BytesIO(), stderr=io.BytesIO(), color=False), backend=WaitingBackend,
                     clock=clock, watchdog=False)
    clock.on_sleep.append(second_ctrl_c)
    result = sup.run()
    assert result.exit_code == 130 and result.reason == "signal"
    for s in scripts.values():
        assert [e for _, e in s.events] == ["TERM", "KILL"]
        assert s.events[1][0] == pytest.approx(2.0, abs=0.05)  # at the second Ctrl-C, not after the grace


# --- the real clock: how often the supervisor looks --------------------------------------------


def test_wakeup_is_one_bit_that_wait_clears() -> None:
    from launcher.run.supervisor import Wakeup

    w = Wakeup()
    assert w.wait(0.01) is False
    w.set()
    w.set()  # twice is once
    assert w.wait(5) is True
    assert w.wait(0.01) is False


def test_a_handled_signal_wakes_the_supervisor() -> None:
    from launcher.run.signals import Signals

    s, calls = Signals(), []
    s.raise_now = False  # the job runs: the handler only counts
    s.on_signal = lambda: calls.append(1)
    s.handle(signal.SIGTERM)
    assert s.count == 1 and calls == [1]


LOOK_COUNTER = """
import sys
from launcher.runtime.local import LocalProcess
looks = [0]
real_poll = LocalProcess.poll
def poll(self):
    looks[0] += 1
    return real_poll(self)
LocalProcess.poll = poll
import atexit
atexit.register(lambda: sys.stderr.write(f"LOOKS {looks[0]}\\n"))
from launcher.cli import main
main(prog_name="pslaunch")
"""


@pytest.mark.timeout(60)
def test_a_calm_local_job_is_looked_at_ever_less_often_and_its_end_is_seen_at_once(tmp_path) -> None:
    # every 20 ms, a 2 s job was about 100 looks (each ~150 us of the CPU its processes need);
    # a local child's end wakes the supervisor (pidfd), so backing off costs no fail-fast
    import subprocess
    import sys
    import time

    from support.helpers import REPO

    job = tmp_path / "job.py"
    job.write_text("import os, socket, time\n"
                   "role = os.environ['DMLC_ROLE']\n"
                   "if role == 'scheduler':\n"
                   "    s = socket.socket()\n"
                   "    s.bind((os.environ['DMLC_PS_ROOT_URI'], int(os.environ['DMLC_PS_ROOT_PORT'])))\n"
                   "    s.listen()\n"
                   "time.sleep(2 if role == 'worker' else 30)\n"
                   "raise SystemExit(3 if role == 'worker' else 0)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", LOOK_COUNTER, "-n", "1", "-s", "1", "--summary-json",
                        str(tmp_path / "s.json"), sys.executable, str(job)],
                       capture_output=True, text=True, timeout=50, cwd=REPO)
    wall = time.monotonic() - t0
    assert r.returncode == 3, r.stderr
    looks = int(r.stderr.rsplit("LOOKS ", 1)[1].split()[0])
    assert 3 * 5 <= looks <= 3 * 40, r.stderr  # (3 processes: one poll each per look)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["reason"] == "failure" and doc["exit_code"] == 3
    assert wall < 10, wall  # (liveness only)


def test_signal_names_in_messages() -> None:
    from launcher.run.signals import Interrupted
    from launcher.runtime.handle import describe_exit, signal_name

    assert (signal_name(137), signal_name(143), signal_name(1), signal_name(128 + 65), signal_name(None)) == (
        "SIGKILL", "SIGTERM", None, None, None)
    assert describe_exit(137) == "was killed by SIGKILL (exit code 137)" and describe_exit(3) == "exited with code 3"
    assert str(Interrupted(signal.SIGINT)) == "SIGINT" and str(Interrupted(15)) == "SIGTERM"


# --- restarts (--max-restarts) ----------------------------------------------------------------------


def ok() -> Script:
    return Script(exit_at=2.0)


def test_a_failure_restarts_every_process_with_the_attempt_in_their_environment(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    scripts = {"worker-0": [Script(), Script(), ok()],
               "worker-1": [Script(exit_at=1.0, code=3), Script(exit_at=1.0, code=137), ok()]}
    result, sup, clock, doc = run(scripts, tmp_path, 2, max_restarts=2, restart_delay=1.0)
    assert result.exit_code == 0 and result.reason == "success"
    attempts = doc["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1, 2]
    assert [a["reason"] for a in attempts] == ["failure", "failure", "success"]
    assert [a["cause"]["process"] for a in attempts[:2]] == ["worker-1", "worker-1"]
    assert attempts[1]["cause"]["signal"] == "SIGKILL" and attempts[0]["cause"]["exit_code"] == 3
    # the delays double from --restart-delay, with +-10% jitter, and are waited for
    assert 0.9 <= attempts[0]["delay"] <= 1.1 and 1.8 <= attempts[1]["delay"] <= 2.2
    for a, b in zip(attempts, attempts[1:]):
        assert b["start_time"] - a["end_time"] == pytest.approx(a["delay"], abs=0.05)
    # every process of attempt k was stopped before attempt k+1 started
    assert [e for _, e in scripts["worker-0"][0].events] == ["TERM"]
    assert doc["restarts"] == {"max": 2, "done": 2, "first_delay": 1.0, "window": None, "scope": "job"}
    assert doc["replacements"] == []
    # each attempt's processes learn it; the run id stays, the secret is new
    envs = [scripts["worker-0"][k].env for k in range(3)]
    assert [e["PSLAUNCH_ATTEMPT"] for e in envs] == ["0", "1", "2"]
    assert {e["PSLAUNCH_MAX_RESTARTS"] for e in envs} == {"2"}
    assert len({e["PSLAUNCH_RUN_ID"] for e in envs}) == 1 and envs[0]["PSLAUNCH_RUN_ID"] == envs[0]["PSLAUNCH_JOB_ID"]
    assert len({e["PSLAUNCH_SECRET"] for e in envs}) == 3
    assert "after 2 restarts" in caplog.text


def test_the_budget_is_the_jobs_not_each_processs(tmp_path, caplog) -> None:
    # a different process fails in each attempt: torchrun's per-node counts would allow this; ours do not
    fail = Script(exit_at=1.0, code=5)
    scripts = {"worker-0": [fail, Script(), Script(), ok()],
               "worker-1": [Script(), Script(exit_at=1.0, code=6), Script(), ok()],
               "worker-2": [Script(), Script(), Script(exit_at=1.0, code=7), ok()]}
    result, sup, clock, doc = run(scripts, tmp_path, 3, max_restarts=2, restart_delay=0.5)
    assert result.exit_code == 7 and result.reason == "failure"
    assert len(doc["attempts"]) == 3 and doc["attempts"][-1]["delay"] is None
    said = [m for m in caplog.messages if m.startswith("attempt ")]
    assert said[-1] == "attempt 3/3 failed: worker 2 on fakehost (pid 102) exited with code 7; 2/2 restarts used"
    assert said[0].startswith("attempt 1/3 failed: worker 0 on fakehost (pid 100) exited with code 5; restarting "
                              "every process in ")
    assert said[0].endswith("s (restart 1/2)") and result.message == said[-1]


def test_the_window_gives_the_budget_back(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    long_fail, quick_fail = Script(exit_at=20.0, code=3), Script(exit_at=1.0, code=4)
    scripts = {"worker-0": [long_fail, Script(exit_at=20.0, code=3), Script(exit_at=20.0, code=3), quick_fail]}
    result, sup, clock, doc = run(scripts, tmp_path, 1, max_restarts=1, restart_delay=1.0, restart_window=10.0)
    # each of the first three ran 20 s >= the window: the budget (1) came back each time
    assert [a["reason"] for a in doc["attempts"]] == ["failure"] * 4 and result.exit_code == 4
    assert all(0.9 <= a["delay"] <= 1.1 for a in doc["attempts"][:3])  # the delays start again too
    assert "the restart budget is back" in caplog.text


@pytest.mark.parametrize("case", ["timeout", "could-not-start"])
def test_what_never_restarts(tmp_path, case: str) -> None:
    if case == "timeout":
        scripts = {"worker-0": [Script(), ok()]}
        result, sup, clock, doc = run(scripts, tmp_path, 1, max_restarts=3, timeout=5.0)
        assert result.exit_code == 124
    else:
        scripts = {"worker-0": [Script(code=127, failure="cannot run 'prog': no such program"), ok()]}
        result, sup, clock, doc = run(scripts, tmp_path, 1, max_restarts=3)
        assert result.exit_code == 127
    assert len(doc["attempts"]) == 1 and doc["attempts"][0]["delay"] is None


def test_a_signal_while_waiting_to_restart_ends_the_job(tmp_path) -> None:
    clock = Clock()
    holder: list = []

    def ctrl_c(now: float) -> None:  # during the 30 s wait before attempt 1
        if now - 1000.0 >= 10.0 and not holder[0].signals.count:
            holder[0].signals.handle(signal.SIGINT)

    scripts = {"worker-0": [Script(exit_at=1.0, code=3), ok()]}
    spec = JobSpec(command=("prog",), num_workers=1, num_servers=0, launcher="fake", max_restarts=2,
                   restart_delay=30.0, summary_json=str(tmp_path / "s.json"))
    sup = Supervisor(spec, Console(stdout=io.BytesIO(), stderr=io.BytesIO(), color=False),
                     backend=fake_backend(scripts, clock, []), clock=clock, watchdog=False)
    holder.append(sup)
    clock.on_sleep.append(ctrl_c)
    result = sup.run()
    assert result.exit_code == 130 and result.reason == "signal"
    assert scripts["worker-0"][1].env == {}  # attempt 1 never started
    assert clock.now - 1000.0 < 15.0


def test_a_ranks_clean_exit_stops_nobody_and_the_store_outlives_the_last_rank(tmp_path, monkeypatch) -> None:
    # issue 32: rank 1 leaves at 1 s while rank 0 still writes its snapshot until 30 s: rank 0 is never
    # signalled, and the torch store (a process of its own, as torchrun's lives in its agent) is closed
    # once, only after rank 0 has ended
    from launcher import trackers
    from launcher.trackers.interface import Tracker

    clock = Clock()
    closed: list[float] = []

    class Store(Tracker):
        kind, label = "torch", "torch store"

        def start(self, address: str) -> int:
            self.address, self.port = address, 9091
            return self.port

        def close(self) -> None:
            closed.append(clock.now)

    monkeypatch.setattr(trackers, "create", lambda spec, console, watchdog: Store(spec, console, watchdog))
    scripts = {"worker-0": Script(exit_at=30.0), "worker-1": Script(exit_at=1.0)}
    t0 = clock.now
    result, sup, clock, doc = run(scripts, tmp_path, 2, clock=clock, tracker="torch")
    assert result.exit_code == 0 and result.reason == "success", result
    assert all(s.events == [] for s in scripts.values())  # nothing was signalled
    assert len(closed) == 1 and closed[0] - t0 >= 30.0, closed


# --- hosts that fail (launcher/run/hosthealth.py) --------------------------------------------------


def lost_at(t: float) -> Script:
    return Script(exit_at=t, code=255, lost="no reply to keep-alives for 4s")


def test_a_lost_host_is_left_out_and_a_spare_takes_its_place(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    h1, h2, h3, spare = Host("127.0.0.1"), Host("127.0.0.2"), Host("127.0.0.3"), Host("127.0.0.4", spare=True)
    scripts = {"worker-0": [Script(), ok()], "worker-1": [lost_at(1.0), ok()], "worker-2": [Script(), ok()]}
    result, sup, clock, doc = run(scripts, tmp_path, 3, max_restarts=2, restart_delay=1.0, hosts=(h1, h2, h3),
                                  spares=(spare,))
    assert result.exit_code == 0, caplog.text
    first, second = doc["attempts"]
    assert first["hosts"] is None and first["cause"]["process"] == "worker-1"
    assert second["hosts"]["used"] == ["127.0.0.1", "127.0.0.4", "127.0.0.3"] and second["hosts"]["spares"] == [
        {"spare": "127.0.0.4", "replaces": "127.0.0.2"}]
    (out,) = second["hosts"]["excluded"]
    assert out["host"] == "127.0.0.2" and out["reason"] == "lost in attempt 0: no reply to keep-alives for 4s"
    assert 60.0 <= out["cooldown"] < 120.0
    # worker 1 of the second attempt ran on the spare, with the same rank
    assert [p["host"] for p in doc["processes"]] == ["fakehost"] * 3
    assert sup.spec.hosts == (h1, spare, h3) and sup.job_spec.hosts == (h1, h2, h3)
    said = caplog.messages
    left = next(m for m in said if m.startswith("leaving out host 127.0.0.2 for "))
    assert left.endswith("s more: lost in attempt 0: no reply to keep-alives for 4s")
    assert "spare 127.0.0.4 takes the place of 127.0.0.2" in said
    assert said.index(left) > next(i for i, m in enumerate(said) if m.startswith("attempt 1/3 failed"))


def test_min_max_goes_on_with_fewer_workers_and_their_count(tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO)
    hosts = tuple(Host(f"127.0.0.{i}") for i in range(1, 5))
    scripts = {"worker-0": [Script(), ok()], "worker-1": [Script(), ok()], "worker-2": [lost_at(1.0), ok()],
               "worker-3": [Script()]}
    result, sup, clock, doc = run(scripts, tmp_path, 4, max_restarts=1, hosts=hosts, min_workers=2,
                                  tracker="rabit")
    assert result.exit_code == 0, caplog.text
    assert doc["attempts"][1]["hosts"]["workers"] == 3 and doc["attempts"][1]["hosts"]["dropped"] == ["127.0.0.3"]
    assert [p["name"] for p in doc["processes"]] == ["worker-0", "worker-1", "worker-2"]
    env = scripts["worker-2"][1].env
    assert env["DMLC_NUM_WORKER"] == "3" and env["PSLAUNCH_ATTEMPT"] == "1"
    assert "the next attempt runs 3 of 4 workers (-n 2:4): 127.0.0.3 is out and no spare is left" in caplog.messages


def test_too_few_hosts_left_ends_the_job_with_one_line(tmp_path, caplog) -> None:
    hosts = tuple(Host(f"127.0.0.{i}") for i in range(1, 5))
    scripts = {"worker-0": Script(), "worker-1": lost_at(1.0), "worker-2": lost_at(1.0), "worker-3": lost_at(1.0)}
    result, sup, clock, doc = run(scripts, tmp_path, 4, max_restarts=3, hosts=hosts, min_workers=2,
                                  tracker="rabit")
    assert result.exit_code == 255 and len(doc["attempts"]) == 1 and doc["attempts"][0]["delay"] is None
    assert result.message.startswith("attempt 1 failed and the job cannot go on: the hosts left hold 1 worker, fewer "
                                     "than -n 2:4's minimum, and the hostfile has no spare; left out: 127.0.0.2 (lost")
    assert caplog.messages[-1] == result.message and "restarts used" not in caplog.text


def test_a_smaller_job_that_its_options_do_not_allow_ends_with_one_line(tmp_path, caplog) -> None:
    from launcher.spec.only import parse_only

    hosts = tuple(Host(f"127.0.0.{i}") for i in range(1, 4))
    scripts = {"worker-0": Script(), "worker-1": Script(), "worker-2": lost_at(1.0)}
    result, sup, clock, doc = run(scripts, tmp_path, 3, max_restarts=1, hosts=hosts, min_workers=1,
                                  tracker="rabit", only=parse_only(["worker:2"]))
    assert result.exit_code == 255 and len(doc["attempts"]) == 1
    assert result.message.startswith("attempt 1 failed and the job cannot go on with 2 workers: --only worker:2")


def test_a_host_that_does_not_answer_when_the_job_starts_again_is_left_out(tmp_path, caplog) -> None:
    from launcher.errors import LaunchError

    caplog.set_level(logging.INFO)
    clock = Clock()
    h1, h2, h3, spare = Host("127.0.0.1"), Host("127.0.0.2"), Host("127.0.0.3"), Host("127.0.0.4", spare=True)
    scripts = {"worker-0": [Script(), ok()], "worker-1": [Script(exit_at=1.0, code=3), ok()],
               "worker-2": [Script(), ok()]}
    tried: list = []

    class Flaky(fake_backend(scripts, clock, [])):  # type: ignore[misc]
        def prepare(self):
            tried.append(self.spec.hosts)
            if len(tried) == 2:  # attempt 1: h3 does not answer
                e = LaunchError("127.0.0.3: cannot reach 127.0.0.3:22: no answer within 10s (--ssh-connect-timeout)")
                e.unreachable = (h3,)
                raise e
            return {}

    spec = JobSpec(command=("prog",), num_workers=3, num_servers=0, launcher="fake", kill_grace=10.0,
                   summary_json=str(tmp_path / "summary.json"), max_restarts=3, hosts=(h1, h2, h3), spares=(spare,))
    sup = Supervisor(spec, Console(stdout=io.BytesIO(), stderr=io.BytesIO(), color=False), backend=Flaky,
                     clock=clock, watchdog=False)
    result = sup.run()
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert result.exit_code == 0, caplog.text
    assert tried == [(h1, h2, h3), (h1, h2, h3), (h1, h2, spare)]
    second = doc["attempts"][1]
    assert second["cause"]["role"] == "host" and second["cause"]["unreachable"] == ["127.0.0.3"]
    assert doc["attempts"][2]["hosts"]["excluded"][0]["reason"] == ("lost in attempt 1: it did not answer when the "
                                                                     "attempt started")
    assert any(m.startswith("attempt 2/4 failed: its start failed: 127.0.0.3: cannot reach 127.0.0.3:22") and
               m.endswith("(restart 2/3)") for m in caplog.messages), caplog.text
    assert "spare 127.0.0.4 takes the place of 127.0.0.3" in caplog.messages
