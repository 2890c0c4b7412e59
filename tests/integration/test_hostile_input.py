"""Hostile or mistaken input to the CLI: one line, a non-zero code, no traceback, bounded time and memory.

Every case runs the real ``pslaunch`` in a child process, with its address space capped (so a
regression cannot take this machine down with it) and its peak memory read from the kernel
(``wait4``'s ``ru_maxrss``, taken by a small program in between: see ``_MEASURE``). A case passes
when pslaunch:

* exits with the expected non-zero code (2 for a usage error) within :data:`DEADLINE` seconds;
* writes exactly one line to stderr, ``pslaunch: error: ...``, with no traceback, and nothing
  to stdout;
* never grows beyond :data:`MAX_RSS_MB`;
* starts nothing: the command of every case that is not a dry run would leave a file behind.

The inputs are those of issue 12 (hostfiles that never end, YAML bombs, huge numbers, paths
that cannot be written, ...) and more of the same kinds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import pytest

pytestmark = pytest.mark.integration

DEADLINE = 30.0         # seconds: a liveness bound (pslaunch answers these in well under one)
MAX_RSS_MB = 400        # peak resident memory of the pslaunch process
ADDRESS_SPACE = 3 << 30  # the child's RLIMIT_AS: a runaway reads into a MemoryError, not the OOM killer


@dataclass
class Case:
    """``args`` may contain ``{tmp}``; ``files(tmp)`` creates what the case needs first."""

    args: list[str]
    message: str                 # a piece of the one error line
    code: int = 2
    files: Optional[Callable[[Path], None]] = None
    stdin: Optional[str] = None  # a path to open as stdin ("/dev/zero")
    env: dict = field(default_factory=dict)
    info: bool = False           # the launcher's own info lines may come first (it started to run)


def write(name: str, content: str | bytes) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        data = content.encode() if isinstance(content, str) else content
        (tmp / name).write_bytes(data)
    return make


def many(*makers: Callable[[Path], None]) -> Callable[[Path], None]:
    def make(tmp: Path) -> None:
        for m in makers:
            m(tmp)
    return make


def fifo(name: str) -> Callable[[Path], None]:
    return lambda tmp: os.mkfifo(tmp / name)


def directory(name: str) -> Callable[[Path], None]:
    return lambda tmp: (tmp / name).mkdir()


def sparse(name: str, size: int) -> Callable[[Path], None]:
    """A file of ``size`` bytes that takes no disk (a hole: reads as zero bytes)."""
    def make(tmp: Path) -> None:
        with open(tmp / name, "wb") as f:
            f.truncate(size)
    return make


def alias_bomb(levels: int = 30, width: int = 10) -> str:
    """The "billion laughs" under a known key: ``width ** levels`` strings once expanded
    (anchors nest in a list under ``env-worker``; each level repeats the one before ``width`` times)."""
    text = "num-workers: 1\ncommand: [echo]\nenv-worker:\n"
    text += "  - &a0 [" + ",".join(["A=1"] * width) + "]\n"
    for i in range(1, levels):
        text += f"  - &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]\n"
    return text


STARTED = "{tmp}/started"  # the command of every non-dry-run case: `touch` leaves this behind
TOUCH = ["touch", STARTED]

CASES: dict[str, Case] = {
    # -- -H: files that never end, are huge, or are not files ---------------------------------------
    "hostfile-dev-zero": Case(["-n", "1", "-H", "/dev/zero", *TOUCH], "not a regular file"),
    "hostfile-dev-urandom": Case(["-n", "1", "-H", "/dev/urandom", *TOUCH], "not a regular file"),
    "hostfile-fifo": Case(["-n", "1", "-H", "{tmp}/fifo", *TOUCH], "not a regular file", files=fifo("fifo")),
    "hostfile-directory": Case(["-n", "1", "-H", "{tmp}/d", *TOUCH], "is a directory", files=directory("d")),
    "hostfile-dev-stdin-pipe": Case(["-n", "1", "-H", "/dev/stdin", *TOUCH], "not a regular file",
                                    stdin="/dev/zero"),
    "hostfile-stdin-endless": Case(["-n", "1", "-H", "-", *TOUCH], "larger than 1024 KiB", stdin="/dev/zero"),
    "hostfile-2gb-sparse": Case(["-n", "1", "-H", "{tmp}/big", *TOUCH], "larger than 1024 KiB",
                                files=sparse("big", 2 << 30)),
    "hostfile-2mb-of-hosts": Case(["-n", "1", "-H", "{tmp}/h", *TOUCH], "larger than 1024 KiB",
                                  files=write("h", "host\n" * 400_000)),
    "hostfile-10mb-host-name": Case(["-n", "1", "-H", "{tmp}/h", *TOUCH], "larger than 1024 KiB",
                                    files=write("h", "a" * 10_000_000 + "\n")),
    "hostfile-long-host-name": Case(["-n", "1", "-H", "{tmp}/h", *TOUCH], "too long",
                                    files=write("h", "a" * 300_000 + "\n")),
    "hostfile-300-char-name": Case(["-n", "1", "-H", "{tmp}/h", *TOUCH], "host name of 300 characters is too long",
                                   files=write("h", "a" * 300 + "\n")),
    "hostfile-23-digit-slots": Case(["-n", "1", "-H", "{tmp}/h", *TOUCH], "slots=",
                                    files=write("h", "a slots=12345678901234567890123\n")),
    "hostfile-zero-slots": Case(["-n", "1", "-H", "{tmp}/h", *TOUCH], "slots='0'", files=write("h", "a slots=0\n")),
    "hostfile-too-few-slots": Case(["-n", "3", "-H", "{tmp}/h", *TOUCH], "do not fit",
                                   files=write("h", "a slots=1\n")),
    "hostfile-huge-port": Case(["-n", "1", "-H", "{tmp}/h", *TOUCH], "port",
                               files=write("h", "a:" + "9" * 40 + "\n")),
    "hostfile-binary": Case(["-n", "1", "-H", "{tmp}/h", *TOUCH], "not UTF-8",
                            files=write("h", bytes(range(128, 256)))),
    "hostfile-nul-bytes": Case(["-n", "1", "-H", "{tmp}/h", *TOUCH], "bad host name", files=write("h", "a\0b\n")),
    "hostfile-only-comments": Case(["-n", "1", "-H", "{tmp}/h", *TOUCH], "no hosts found",
                                   files=write("h", "# nothing\n\n")),
    "hostfile-missing-path": Case(["-n", "1", "-H", "{tmp}/nope/hosts", *TOUCH], "cannot read hostfile"),
    "host-list-empty-item": Case(["-n", "1", "-H", "h1,,h2", *TOUCH], "empty host"),
    "host-list-trailing-comma": Case(["-n", "1", "-H", "h1,", *TOUCH], "empty host"),
    "host-list-bad-ipv6": Case(["-n", "1", "-H", "[::1,h2", *TOUCH], "missing ']'"),
    "host-list-huge": Case(["-n", "1", "-H", ",".join(["h"] * 60_000), *TOUCH], "too long"),
    "host-list-comment": Case(["-n", "1", "-H", "h1#x", *TOUCH], "'#' is not allowed"),
    # -- YAML -----------------------------------------------------------------------------------------
    "yaml-alias-bomb-under-env": Case(["--config", "{tmp}/c.yaml"], "aliases", files=write("c.yaml", alias_bomb())),
    "yaml-52mb": Case(["--config", "{tmp}/c.yaml"], "larger than 1024 KiB",
                      files=write("c.yaml", "num-workers: 1\ncommand: [echo]\n" + "# padding\n" * 5_200_000)),
    "yaml-million-item-command": Case(["--config", "{tmp}/c.yaml"], "larger than 1024 KiB",
                                      files=write("c.yaml", "num-workers: 1\ncommand: [" + "a," * 1_000_000 + "a]\n")),
    "yaml-300k-item-command": Case(["--config", "{tmp}/c.yaml"], "more than 10,000 YAML values",
                                   files=write("c.yaml", "num-workers: 1\ncommand: [" + "a," * 300_000 + "a]\n")),
    "yaml-10000-nested-brackets": Case(["--config", "{tmp}/c.yaml"], "nested more than 50 levels",
                                       files=write("c.yaml", "[" * 10_000 + "]" * 10_000 + "\n")),
    "yaml-10000-nested-under-env": Case(["--config", "{tmp}/c.yaml"], "nested more than 50 levels",
                                        files=write("c.yaml", "num-workers: 1\nenv: " + "[" * 10_000 + "]" * 10_000)),
    "yaml-10000-nested-mappings": Case(["--config", "{tmp}/c.yaml"], "nested more than 50 levels",
                                       files=write("c.yaml", "{a: " * 10_000 + "1" + "}" * 10_000 + "\n")),
    "yaml-command-5": Case(["--config", "{tmp}/c.yaml"], "command is a number",
                           files=write("c.yaml", "num-workers: 1\ncommand: 5\n")),
    "yaml-command-mapping": Case(["--config", "{tmp}/c.yaml"], "command is a mapping",
                                 files=write("c.yaml", "num-workers: 1\ncommand: {a: 1}\n")),
    "yaml-command-nested-list": Case(["--config", "{tmp}/c.yaml"], "command item 2 is a list",
                                     files=write("c.yaml", "num-workers: 1\ncommand: [a, [b]]\n")),
    "yaml-command-bool-item": Case(["--config", "{tmp}/c.yaml"], "quote it",
                                   files=write("c.yaml", "num-workers: 1\ncommand: [a, yes]\n")),
    "yaml-command-bad-quotes": Case(["--config", "{tmp}/c.yaml"], "in the command string",
                                    files=write("c.yaml", "num-workers: 1\ncommand: \"python 'x\"\n")),
    "yaml-num-workers-1.5": Case(["--config", "{tmp}/c.yaml"], "num-workers is '1.5'; expected a whole number",
                                 files=write("c.yaml", "num-workers: 1.5\ncommand: [echo]\n")),
    "yaml-num-workers-null": Case(["--config", "{tmp}/c.yaml"], "num-workers has no value (null)",
                                  files=write("c.yaml", "num-workers: null\ncommand: [echo]\n")),
    "yaml-num-workers-string": Case(["--config", "{tmp}/c.yaml"], "expected a whole number",
                                    files=write("c.yaml", "num-workers: two\ncommand: [echo]\n")),
    "yaml-num-workers-bool": Case(["--config", "{tmp}/c.yaml"], "takes a value, not true/false",
                                  files=write("c.yaml", "num-workers: true\ncommand: [echo]\n")),
    "yaml-num-workers-30-digits": Case(["--config", "{tmp}/c.yaml", "--dry-run"], "far too large",
                                       files=write("c.yaml", "num-workers: " + "9" * 30 + "\ncommand: [echo]\n")),
    "yaml-num-workers-5000-digits": Case(["--config", "{tmp}/c.yaml", "--dry-run"], "cannot be read",
                                         files=write("c.yaml", "num-workers: " + "9" * 5000 + "\ncommand: [echo]\n")),
    "yaml-timeout-nan": Case(["--config", "{tmp}/c.yaml"], "timeout is nan; expected a finite number",
                             files=write("c.yaml", "num-workers: 1\ntimeout: .nan\ncommand: [echo]\n")),
    "yaml-kill-grace-inf": Case(["--config", "{tmp}/c.yaml"], "kill-grace is inf; expected a finite number",
                                files=write("c.yaml", "num-workers: 1\nkill-grace: .inf\ncommand: [echo]\n")),
    "yaml-env-nested": Case(["--config", "{tmp}/c.yaml"], "env: A is a mapping",
                            files=write("c.yaml", "num-workers: 1\nenv: {A: {B: 1}}\ncommand: [echo]\n")),
    "yaml-env-list-value": Case(["--config", "{tmp}/c.yaml"], "env: A is a list",
                                files=write("c.yaml", "num-workers: 1\nenv: {A: [1, 2]}\ncommand: [echo]\n")),
    "yaml-env-bad-name": Case(["--config", "{tmp}/c.yaml"], "expected NAME",
                              files=write("c.yaml", "num-workers: 1\nenv: {'1A': x}\ncommand: [echo]\n")),
    "yaml-duplicate-key": Case(["--config", "{tmp}/c.yaml"], "key 'num-workers' is given twice",
                               files=write("c.yaml", "num-workers: 1\nnum-workers: 2\ncommand: [echo]\n")),
    "yaml-duplicate-env-key": Case(["--config", "{tmp}/c.yaml"], "key 'A' is given twice",
                                   files=write("c.yaml", "num-workers: 1\nenv: {A: 1, A: 2}\ncommand: [echo]\n")),
    "yaml-two-spellings": Case(["--config", "{tmp}/c.yaml"], "another spelling",
                               files=write("c.yaml", "num-workers: 1\nnum_workers: 2\ncommand: [echo]\n")),
    "yaml-flag-not-bool": Case(["--config", "{tmp}/c.yaml"], "expected true or false",
                               files=write("c.yaml", "num-workers: 1\ndry-run: 'no'\ncommand: [echo]\n")),
    "yaml-binary": Case(["--config", "{tmp}/c.yaml"], "binary file", files=write("c.yaml", bytes(range(256)) * 10)),
    "yaml-latin1": Case(["--config", "{tmp}/c.yaml"], "not UTF-8",
                        files=write("c.yaml", "num-workers: 1 # \xe9\n".encode("latin-1"))),
    "yaml-control-characters": Case(["--config", "{tmp}/c.yaml"], "c.yaml",
                                    files=write("c.yaml", "num-workers: 1\ncommand: [\x07]\n")),
    "yaml-python-tag": Case(["--config", "{tmp}/c.yaml"], "c.yaml",
                            files=write("c.yaml", "num-workers: !!python/object/apply:os.system ['touch x']\n")),
    "yaml-top-level-list": Case(["--config", "{tmp}/c.yaml"], "expected a mapping",
                                files=write("c.yaml", "- a\n- b\n")),
    "yaml-top-level-scalar": Case(["--config", "{tmp}/c.yaml"], "expected a mapping", files=write("c.yaml", "42\n")),
    "yaml-non-string-key": Case(["--config", "{tmp}/c.yaml"], "is a number",
                                files=write("c.yaml", "1: 2\n")),
    "yaml-huge-unknown-key": Case(["--config", "{tmp}/c.yaml"], "c.yaml:1",
                                  files=write("c.yaml", "k" * 500_000 + ": 1\n")),
    "yaml-bad-indentation": Case(["--config", "{tmp}/c.yaml"], "c.yaml:2",
                                 files=write("c.yaml", "num-workers: 2\n  bad: indent\n")),
    "yaml-two-documents": Case(["--config", "{tmp}/c.yaml"], "c.yaml",
                               files=write("c.yaml", "num-workers: 1\n---\nnum-workers: 2\n")),
    "yaml-dev-zero": Case(["--config", "/dev/zero"], "not a regular file"),
    "yaml-fifo": Case(["--config", "{tmp}/f"], "not a regular file", files=fifo("f")),
    "yaml-directory": Case(["--config", "{tmp}"], "is a directory"),
    "yaml-missing": Case(["--config", "{tmp}/none.yaml"], "cannot read --config"),
    # -- numbers ----------------------------------------------------------------------------------------
    "n-30-digits-dry-run": Case(["-n", "1" * 30, "--dry-run", "true"], "far too large"),
    "n-5000-digits": Case(["-n", "9" * 5000, "--dry-run", "true"], "far too large"),
    "n-100000": Case(["-n", "100000", *TOUCH], "at most 20,000"),
    "n-100000-dry-run": Case(["-n", "100000", "--dry-run", "true"], "at most 20,000"),
    "n-over-machine-limits": Case(["-n", "9000", "-s", "9000", *TOUCH], "do not fit this machine"),
    "s-30-digits": Case(["-n", "1", "-s", "9" * 30, "--dry-run", "true"], "far too large"),
    "n-negative": Case(["-n", "-5", "true"], "at least 1"),
    "n-zero": Case(["-n", "0", "true"], "at least 1"),
    "n-float": Case(["-n", "1.5", "true"], "not a valid integer"),
    "timeout-nan": Case(["-n", "1", "--timeout", "nan", *TOUCH], "not a finite number"),
    "timeout-inf": Case(["-n", "1", "--timeout", "inf", *TOUCH], "not a finite number"),
    "timeout-negative": Case(["-n", "1", "--timeout", "-1", *TOUCH], "must be positive"),
    "kill-grace-nan": Case(["-n", "1", "--kill-grace", "nan", *TOUCH], "not a finite number"),
    "start-timeout-inf": Case(["-n", "1", "--start-timeout", "inf", *TOUCH], "not a finite number"),
    "start-timeout-huge-text": Case(["-n", "1", "--start-timeout", "1" * 100_000, *TOUCH], "not a finite number"),
    "port-range-empty": Case(["-n", "1", "--port-range", "", *TOUCH], "--port-range is empty"),
    "port-range-one-number": Case(["-n", "1", "--port-range", "9000", *TOUCH], "--port-range"),
    "port-range-reversed": Case(["-n", "1", "--port-range", "9-1", *TOUCH], "--port-range"),
    "port-range-too-high": Case(["-n", "1", "--port-range", "70000-80000", *TOUCH], "--port-range"),
    "port-range-100-digits": Case(["-n", "1", "--port-range", "1-" + "9" * 100, *TOUCH], "--port-range"),
    "worker-cores-30-digits": Case(["-n", "1", "--worker-cores", "9" * 30, *TOUCH], "far too large"),
    "worker-cores-too-many": Case(["-n", "1", "--worker-cores", "100000", *TOUCH], "from 1 to 4096"),
    "worker-memory-huge": Case(["-n", "1", "--worker-memory", "9" * 40 + "g", *TOUCH], "--worker-memory"),
    "worker-memory-petabytes": Case(["-n", "1", "--worker-memory", "99999999g", *TOUCH], "1 PiB"),
    "ssh-port-huge": Case(["-n", "1", "-H", "h", "--ssh-port", "9" * 30, *TOUCH], "far too large"),
    "ssh-timeout-nan": Case(["-n", "1", "-H", "h", "--ssh-connect-timeout", "nan", *TOUCH], "not a finite number"),
    # -- outputs that cannot be written: refused before anything starts --------------------------------
    "log-dir-unwritable": Case(["-n", "1", "-s", "0", "--log-dir", "/proc/pslaunch-logs", *TOUCH], "--log-dir"),
    "log-dir-on-a-file": Case(["-n", "1", "-s", "0", "--log-dir", "{tmp}/f", *TOUCH], "is a file",
                              files=write("f", "x")),
    "log-dir-below-a-file": Case(["-n", "1", "-s", "0", "--log-dir", "{tmp}/f/logs", *TOUCH], "--log-dir",
                                 files=write("f", "x")),
    "summary-unwritable": Case(["-n", "1", "-s", "0", "--summary-json", "/proc/s.json", *TOUCH],
                               "--summary-json /proc/s.json: cannot write there"),
    "summary-no-directory": Case(["-n", "1", "-s", "0", "--summary-json", "{tmp}/no/s.json", *TOUCH],
                                 "does not exist"),
    "summary-is-a-directory": Case(["-n", "1", "-s", "0", "--summary-json", "{tmp}", *TOUCH], "is a directory"),
    "log-file-unwritable": Case(["-n", "1", "-s", "0", "--log-file", "/proc/x.log", *TOUCH], "--log-file"),
    # -- the rest ----------------------------------------------------------------------------------------
    "env-bad-name": Case(["-n", "1", "--env", "1BAD=x", *TOUCH], "expected NAME"),
    "env-unset-name": Case(["-n", "1", "--env", "PSLAUNCH_TEST_UNSET_VAR", *TOUCH], "is not set"),
    "env-worker-no-value": Case(["-n", "1", "--env-worker", "A", *TOUCH], "expected NAME=VALUE"),
    "unknown-launcher": Case(["-n", "1", "--launcher", "x" * 100_000, *TOUCH], "Invalid value for '--launcher'"),
    "unknown-option": Case(["-n", "1", "--bogus", *TOUCH], "No such option"),
    "no-command": Case(["-n", "1"], "no command given"),
    "sync-on-local": Case(["-n", "1", "--sync-dst-dir", "/tmp/x", *TOUCH], "--sync-dst-dir"),
    "heartbeat-timeout-below-interval": Case(["-n", "1", "--env", "PS_HEARTBEAT_TIMEOUT=1", *TOUCH],
                                             "PS_HEARTBEAT_TIMEOUT"),
    "program-not-found": Case(["-n", "1", "-s", "0", "{tmp}/no-such-program"], "no such program", code=127, info=True),
    "program-not-executable": Case(["-n", "1", "-s", "0", "{tmp}/prog"], "permission denied", code=126, info=True,
                                   files=write("prog", "#!/bin/sh\ntouch started\n")),
}


# A small Python between the test and pslaunch, for honest numbers: a child forked from the test
# process starts with the test's resident memory (torch, if other tests loaded it) and the kernel
# keeps that high-water mark across exec. Forked from this small program instead, pslaunch's peak
# is its own. It caps pslaunch's address space, waits for it and writes its status and peak.
_MEASURE = r"""
import json, os, resource, sys
limit, result, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.execv(argv[0], argv)
_, status, usage = os.wait4(pid, 0)
with open(result, "w") as f:
    json.dump({"code": os.waitstatus_to_exitcode(status), "maxrss_kb": usage.ru_maxrss}, f)
"""


def run_case(case: Case, tmp: Path) -> tuple[int, str, str, float, float]:
    """(exit code, stdout, stderr, seconds, peak RSS in MB) of pslaunch on ``case``."""
    import json
    import signal

    if case.files:
        case.files(tmp)
    args = [a.replace("{tmp}", str(tmp)) for a in case.args]
    env = {**os.environ, **case.env}
    result = tmp / ".measure.json"
    stdin = open(case.stdin, "rb") if case.stdin else subprocess.DEVNULL
    t0 = time.monotonic()
    try:
        p = subprocess.Popen([sys.executable, "-S", "-c", _MEASURE, str(ADDRESS_SPACE), str(result),
                              sys.executable, "-m", "launcher", *args], stdin=stdin, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=tmp, env=env, start_new_session=True)
    finally:
        if case.stdin:
            stdin.close()
    out: list[bytes] = []
    err: list[bytes] = []
    readers = [threading.Thread(target=lambda s=s, b=b: b.append(s.read()), daemon=True)
               for s, b in ((p.stdout, out), (p.stderr, err))]
    for r in readers:
        r.start()
    timer = threading.Timer(DEADLINE, lambda: os.killpg(p.pid, signal.SIGKILL))  # pslaunch and all
    timer.start()
    try:
        p.wait()
    finally:
        timer.cancel()
    seconds = time.monotonic() - t0
    for r in readers:
        r.join(5)
    measured = json.loads(result.read_text()) if result.exists() else {"code": p.returncode, "maxrss_kb": 0}
    result.unlink(missing_ok=True)
    return (measured["code"], b"".join(out).decode(errors="replace"), b"".join(err).decode(errors="replace"),
            seconds, measured["maxrss_kb"] / 1024)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_is_one_line_and_bounded(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    code, out, err, seconds, rss_mb = run_case(case, tmp_path)
    assert seconds < DEADLINE, f"{name}: still running after {DEADLINE}s (killed)"
    assert code == case.code, f"{name}: exit code {code}, expected {case.code}; stderr: {err[:2000]}"
    assert "Traceback" not in err, err[:5000]
    lines = [x for x in err.splitlines() if x.strip()]
    if case.info:
        assert all(x.startswith("pslaunch: ") for x in lines), err[:3000]
        lines = [x for x in lines if x.startswith("pslaunch: error: ")]
    assert len(lines) == 1, f"{name}: {len(lines)} lines on stderr: {err[:3000]}"
    assert lines[0].startswith("pslaunch: error: "), lines[0][:500]
    assert case.message in lines[0], f"{name}: {lines[0][:500]}"
    assert len(lines[0]) <= 2100, f"{name}: a {len(lines[0]):,}-character line"
    assert out == "", out[:1000]
    assert rss_mb < MAX_RSS_MB, f"{name}: pslaunch grew to {rss_mb:.0f} MB"
    assert not (tmp_path / "started").exists(), f"{name}: the job's command ran"


def test_the_issue_inputs_are_all_here() -> None:
    """Issue 12's list, each by its case name: a guard against a case quietly dropped."""
    issue = ["hostfile-dev-zero", "yaml-alias-bomb-under-env", "yaml-52mb", "yaml-million-item-command",
             "yaml-duplicate-key", "yaml-command-5", "yaml-num-workers-1.5", "yaml-num-workers-null",
             "yaml-env-nested", "n-30-digits-dry-run", "n-100000", "yaml-binary", "yaml-10000-nested-brackets",
             "log-dir-unwritable", "log-dir-on-a-file", "summary-unwritable", "timeout-nan", "port-range-empty",
             "hostfile-10mb-host-name", "hostfile-23-digit-slots", "program-not-found", "program-not-executable"]
    assert not [n for n in issue if n not in CASES]
    assert len(CASES) >= 100


@pytest.mark.timeout(120)
def test_large_valid_inputs_stay_bounded(tmp_path: Path) -> None:
    """The largest inputs the limits allow still work, in bounded time and memory: a hostfile just
    under the size limit, and a dry run of the most processes a job may have."""
    hosts = tmp_path / "hosts"
    line = "h-0123456789.example.org\n"
    hosts.write_text(line * ((1 << 20) // len(line)))
    for args in (["-n", "1", "-H", str(hosts), "--dry-run", "true"],
                 ["-n", "10000", "-s", "10000", "-H", "a,b,c", "--dry-run", "true"]):
        case = Case(args, "")
        code, out, err, seconds, rss_mb = run_case(case, tmp_path)
        assert code == 0, err[:2000]
        assert seconds < DEADLINE and rss_mb < 2 * MAX_RSS_MB, (args[:4], seconds, rss_mb)
