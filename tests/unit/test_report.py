"""The failure report's pure parts: which process is blamed, the job-type hint, the tail; and what
the console says once where many processes say the same (issue 32, items 1 and 4)."""

from __future__ import annotations

import io
import logging
from typing import Optional

import pytest

import pscontract
from launcher.run import report
from launcher.runtime.handle import ProcessHandle
from launcher.runtime.output import Console
from launcher.spec.env import Redactor
from launcher.spec.job import JobSpec, Role
from launcher.spec.plan import ProcSpec

TORCH_TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/tmp/ddp.py", line 5, in main',
    '    dist.init_process_group("gloo")',
    '  File "/venv/torch/distributed/rendezvous.py", line 254, in _get_env_or_raise',
    "    raise _env_error(env_var)",
    "ValueError: Error initializing torch.distributed using env:// rendezvous: environment variable RANK "
    "expected, but not set",
]
XGB_TAIL = [
    "xgboost.core.XGBoostError: [05:39:06] /workspace/src/collective/result.cc:78: ",
    "- [socket.h:79|05:39:06]: recv Connection reset by peer",
    "Stack trace:",
    "  [bt] (0) /venv/xgboost/lib/libxgboost.so(+0x1086be) [0x7fc4ce5086be]",
    "  [bt] (1) /venv/xgboost/lib/libxgboost.so(XGCommunicatorInit+0x4b) [0x7fc4ce55494b]",
    "",
    "",
]
#: a rank of torch's gloo exit race (tests/bin/gloo_exit_race.py): faulthandler's dump after libstdc++'s line
EXIT_ABORT_TAIL = [
    "rank 1: leaving",
    "terminate called without an active exception",
    "Fatal Python error: Aborted",
    "",
    "Thread 0x00007f5c9b487b80 (most recent call first):",
    "  <no Python frame>",
    "",
    "Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)",
]
HEARTBEAT = "worker 1 (task 1, pid 3772 on 127.0.0.1) sent no heartbeat for 10 s (PS_HEARTBEAT_TIMEOUT): it hangs"


class Sink(io.BytesIO):
    def fileno(self) -> int:  # not a tty, not a file
        raise OSError


class Ended(ProcessHandle):
    """A process that has ended with ``code`` at ``end``, after printing ``lines`` on stderr."""

    def __init__(self, console: Console, role: Role, rank: int, code: int, end: float, lines: list[str]) -> None:
        proc = ProcSpec(role, rank, rank, None, ("prog",))
        super().__init__(proc, console.proc(proc.name, proc.label, str(role)), "localhost")
        self.pid, self.exit_code, self.end_time = 100 + rank, code, end
        self.output.stderr.feed("".join(line + "\n" for line in lines).encode())


def spec(**kw) -> JobSpec:
    return JobSpec(**{"command": ("python", "ddp.py"), "num_workers": 2, "num_servers": 2, "launcher": "local", **kw})


def console(tmp_path=None) -> tuple[Console, Sink]:
    err = Sink()
    return Console(stdout=err, stderr=err, color=False, log_dir=str(tmp_path) if tmp_path else None), err


def reported(caplog, h: ProcessHandle, cause: Optional[report.Cause] = None, hint: Optional[str] = None) -> list[str]:
    """The report's lines, as logged."""
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="launcher"):
        report.failure_report(h, 4, Redactor(()), cause, hint)
    return [r.getMessage() for r in caplog.records]


# --- the hint: the job type, named at once --------------------------------------------------------

def test_a_torch_program_without_its_variables_is_told_to_use_the_torch_tracker() -> None:
    assert report.job_type_hint(spec(), TORCH_TRACEBACK) == (
        "torch.distributed found no RANK: this is a collective job; run it with --tracker torch "
        "(pslaunch -n 2 --tracker torch python ddp.py)")
    assert report.job_type_hint(spec(tracker="torch", num_servers=0), TORCH_TRACEBACK) is None
    assert report.job_type_hint(spec(), ["ValueError: boom"]) is None


def test_a_tracker_that_names_the_right_tracker_is_the_hint() -> None:
    said = ("the worker at 127.0.0.1 speaks XGBoost 2.1+'s tracker protocol, which this rabit tracker does not: "
            "run the job with --tracker xgboost")
    rabit = JobSpec(command=("python", "xgb.py"), num_workers=2, num_servers=0, launcher="local", tracker="rabit")
    assert report.job_type_hint(rabit, XGB_TAIL, said) == f"{said} (pslaunch -n 2 --tracker xgboost python xgb.py)"
    assert report.job_type_hint(rabit, XGB_TAIL, "a worker closed its connection") is None


def test_the_hint_is_the_reports_first_line(caplog) -> None:
    c, _ = console()
    h = Ended(c, Role.WORKER, 1, 1, 10.0, TORCH_TRACEBACK)
    hint = report.job_type_hint(spec(), h.output.lines())
    lines = reported(caplog, h, hint=hint)
    assert lines[0].startswith("worker 1 (on localhost, pid 101) exited with code 1 first: torch.distributed found "
                               "no RANK: this is a collective job; run it with --tracker torch")


# --- who is blamed: the first to fail, in its own words -------------------------------------------

def test_the_first_to_fail_in_its_own_words_is_blamed_not_whom_a_later_process_named(caplog) -> None:
    c, _ = console()
    gpu = "train_mnist: error: --gpus 0: CUDA is not available to this torch (2.13.0+cpu); use --cpus N"
    worker = Ended(c, Role.WORKER, 0, 2, 10.0, [gpu])
    server = Ended(c, Role.SERVER, 0, 1, 10.5, ["pslaunch-cause: scheduler: lost the connection to the scheduler",
                                                "server: error: lost the connection to the scheduler"])
    scheduler = Ended(c, Role.SCHEDULER, 0, 1, 10.4, [])
    handles = [scheduler, server, worker]
    assert report.find_cause(worker, handles) is None
    lines = reported(caplog, worker, report.find_cause(worker, handles))
    assert lines == [f"worker 0 (on localhost, pid 100) exited with code 2 first: {gpu}; stopped the other processes"]


def test_a_cause_the_first_to_fail_gave_names_the_culprit(caplog) -> None:
    c, _ = console()
    hung = Ended(c, Role.WORKER, 1, 137, 20.0, ["epoch 0 batch 5"])
    scheduler = Ended(c, Role.SCHEDULER, 0, 1, 10.0, [f"pslaunch-cause: worker 1: {HEARTBEAT}",
                                                      f"scheduler: error: {HEARTBEAT}"])
    cause = report.find_cause(scheduler, [scheduler, hung])
    assert cause is not None and cause.culprit is hung and cause.reporter is scheduler
    lines = reported(caplog, scheduler, cause)
    assert lines[0].startswith(f"worker 1 (on localhost, pid 101): {HEARTBEAT} (reported by the scheduler")
    assert not any("pslaunch-cause" in line for line in lines), lines
    assert sum(HEARTBEAT in line for line in lines) == 1, lines


def test_a_first_failure_that_tells_the_cause_a_later_one_gave_names_its_culprit(caplog) -> None:
    c, _ = console()
    hung = Ended(c, Role.WORKER, 1, 137, 20.0, ["epoch 0 batch 5"])
    told = Ended(c, Role.WORKER, 0, 1, 10.0, [f"train_mnist: error: the scheduler aborted the job: {HEARTBEAT}"])
    scheduler = Ended(c, Role.SCHEDULER, 0, 1, 10.2, [f"pslaunch-cause: worker 1: {HEARTBEAT}"])
    cause = report.find_cause(told, [scheduler, told, hung])
    assert cause is not None and cause.culprit is hung and cause.reporter is scheduler
    assert reported(caplog, told, cause)[0].startswith(f"worker 1 (on localhost, pid 101): {HEARTBEAT} (reported by")


def test_a_first_failure_without_words_of_its_own_takes_the_cause_a_later_one_gave() -> None:
    c, _ = console()
    first = Ended(c, Role.WORKER, 0, 137, 10.0, ["epoch 0 batch 5"])
    scheduler = Ended(c, Role.SCHEDULER, 0, 1, 11.0, ["pslaunch-cause: worker 0: lost the connection to worker 0"])
    cause = report.find_cause(first, [scheduler, first])
    assert cause is not None and cause.culprit is first and cause.reason == "lost the connection to worker 0"


# --- the tail -------------------------------------------------------------------------------------

def test_the_tail_has_no_marker_lines_no_cpp_frames_and_no_blank_end() -> None:
    assert report.tail_lines(["pslaunch-cause: worker 1: x", *XGB_TAIL]) == XGB_TAIL[:2]


def test_a_tail_the_console_showed_just_above_is_not_shown_again(caplog) -> None:
    c, _ = console()
    h = Ended(c, Role.WORKER, 1, 1, 10.0, TORCH_TRACEBACK)
    assert reported(caplog, h)[1:] == ["(the last lines of worker 1 are just above)"]
    for i in range(report.ABOVE):  # another process's lines push it up, out of sight
        c.proc("worker-0", "worker 0", "worker").stdout.feed(f"line {i}\n".encode())
    lines = reported(caplog, h)
    assert lines[1] == f"last {len(TORCH_TRACEBACK)} lines of worker 1:" and len(lines) == 2 + len(TORCH_TRACEBACK)


def test_a_tail_on_another_stream_than_the_report_is_shown(caplog) -> None:
    out, err = Sink(), Sink()
    c = Console(stdout=out, stderr=err, color=False)  # (stdout to a file, say: not above the report)
    h = Ended(c, Role.WORKER, 1, 1, 10.0, [])
    h.output.stdout.feed(b"the last words\n")
    assert reported(caplog, h)[1:] == ["last 1 line of worker 1:", "  | the last words"]


# --- the console: said once -----------------------------------------------------------------------

def test_a_traceback_many_processes_print_is_shown_once_and_logged_by_each(tmp_path) -> None:
    c, err = console(tmp_path)
    text = "".join(line + "\n" for line in TORCH_TRACEBACK).encode()
    names = [("worker-1", "worker 1"), ("scheduler", "scheduler"), ("worker-0", "worker 0"), ("server-0", "server 0")]
    for name, label in names:
        c.proc(name, label, name.split("-")[0]).stderr.feed(text)
    shown = err.getvalue().decode().splitlines()
    assert shown == [f"[worker 1] {line}" for line in TORCH_TRACEBACK] + [
        f"[{label}] (the same traceback as worker 1: {len(TORCH_TRACEBACK)} lines)" for _, label in names[1:]]
    for name, _ in names:
        assert (tmp_path / f"{name}.log").read_text().splitlines() == TORCH_TRACEBACK


def test_a_different_traceback_is_shown_whole_and_one_cut_short_is_shown_at_its_end() -> None:
    c, err = console()
    a = c.proc("worker-0", "worker 0", "worker")
    a.stderr.feed("".join(line + "\n" for line in TORCH_TRACEBACK).encode())
    b = c.proc("worker-1", "worker 1", "worker")
    b.stderr.feed(b"Traceback (most recent call last):\n  File \"x.py\", line 1\n")
    b.stdout.feed(b"other stream\n")  # (passes: only the traceback's stream waits)
    assert err.getvalue().decode().splitlines()[-1] == "[worker 1] other stream"
    b.stderr.close()
    assert err.getvalue().decode().splitlines()[-2:] == ["[worker 1] Traceback (most recent call last):",
                                                        '[worker 1]   File "x.py", line 1']


def test_marker_lines_are_logged_not_shown_and_a_cause_is_shown_once(tmp_path) -> None:
    c, err = console(tmp_path)
    c.proc("scheduler", "scheduler", "scheduler").stderr.feed(
        f"pslaunch-cause: worker 1: {HEARTBEAT}\nscheduler: error: {HEARTBEAT}\n".encode())
    for rank in (0, 1):
        c.proc(f"server-{rank}", f"server {rank}", "server").stderr.feed(
            f"server: error: the scheduler aborted the job: {HEARTBEAT}\n".encode())
    shown = err.getvalue().decode()
    assert "pslaunch-cause" not in shown and shown.count(HEARTBEAT) == 1, shown
    assert shown.splitlines()[1:] == ["[server 0] server: error: the scheduler aborted the job: (the cause above)",
                                      "[server 1] server: error: the scheduler aborted the job: (the cause above)"]
    assert (tmp_path / "scheduler.log").read_text().startswith(f"pslaunch-cause: worker 1: {HEARTBEAT}\n")
    assert HEARTBEAT in (tmp_path / "server-1.log").read_text()


def test_a_cause_is_shown_once_when_a_told_process_is_read_before_the_scheduler(tmp_path) -> None:
    """The pipes are read in no set order: a server's relayed cause line (written before its own
    words) lets the console know the reason before the scheduler's cause line comes."""
    c, err = console(tmp_path)
    server = c.proc("server-0", "server 0", "server")
    server.stderr.feed(f"{pscontract.relayed_cause_line(HEARTBEAT)}\n"
                       f"server: error: the scheduler aborted the job: {HEARTBEAT}\n".encode())
    c.proc("scheduler", "scheduler", "scheduler").stderr.feed(
        f"{pscontract.cause_line(HEARTBEAT, 'worker', 1)}\nscheduler: error: {HEARTBEAT}\n".encode())
    shown = err.getvalue().decode()
    assert "pslaunch-cause" not in shown and shown.count(HEARTBEAT) == 1, shown
    assert shown.splitlines() == [f"[server 0] server: error: the scheduler aborted the job: {HEARTBEAT}",
                                  "[scheduler] scheduler: error: (the cause above)"]
    assert server.cause is None  # (a relayed line blames nobody: the scheduler's names the culprit)
    assert pscontract.cause_reason(pscontract.relayed_cause_line(HEARTBEAT)) == HEARTBEAT
    assert pscontract.parse_cause(pscontract.relayed_cause_line(HEARTBEAT)) is None


def test_cpp_stack_frames_are_logged_not_shown(tmp_path) -> None:
    c, err = console(tmp_path)
    c.proc("worker-0", "worker 0", "worker").stderr.feed("".join(line + "\n" for line in XGB_TAIL).encode())
    shown = err.getvalue().decode()
    assert "[bt]" not in shown and "[worker 0] Stack trace: (its frames are left out here" in shown
    assert (tmp_path / "worker-0.log").read_text().count("[bt]") == 2


@pytest.mark.parametrize("line", ["ValueError: boom", "train_mnist: error: --gpus 0: no CUDA",
                                  "KeyboardInterrupt"])
def test_own_error_takes_a_last_line_that_names_an_error(line: str) -> None:
    c, _ = console()
    h = Ended(c, Role.WORKER, 0, 1, 1.0, ["working", line])
    assert report.own_error(h) == (None if line == "KeyboardInterrupt" else line)


# --- an abort at the interpreter's exit: torch's gloo race, said so --------------------------------

def test_an_abort_after_the_program_returned_is_told_for_what_it_is(caplog) -> None:
    c, _ = console()
    h = Ended(c, Role.WORKER, 1, 134, 10.0, EXIT_ABORT_TAIL)
    assert report.exit_abort(h.output.lines())
    lines = reported(caplog, h)
    assert lines[0] == f"worker 1 (on localhost, pid 101) was killed by SIGABRT (exit code 134) first: " \
                       f"{report.EXIT_ABORT}; stopped the other processes"


@pytest.mark.parametrize("tail", [
    # a Python frame left: the program was still running (a joinable thread destroyed, say)
    EXIT_ABORT_TAIL[:5] + ['  File "/tmp/ddp.py", line 9 in main'] + EXIT_ABORT_TAIL[6:],
    # the main thread without Python, another one in it
    EXIT_ABORT_TAIL[:7] + ["Current thread 0x00007f5c9b400000 (most recent call first):",
                           '  File "/tmp/ddp.py", line 3 in hook'],
    # no faulthandler: where it aborted is not known
    EXIT_ABORT_TAIL[:2],
    # another C++ error
    ["terminate called after throwing an instance of 'gloo::EnforceNotMet'", "Fatal Python error: Aborted", "",
     "Thread 0x00007f5c9b487b80 (most recent call first):", "  <no Python frame>"],
])
def test_other_aborts_are_not_taken_for_the_exit_race(tail: list[str]) -> None:
    assert not report.exit_abort(tail)
