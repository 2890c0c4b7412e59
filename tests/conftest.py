"""Shared fixtures and the suite-wide rules.

* Every test has a timeout (pytest-timeout; default in pyproject).
* Under ``CI=true`` a *skipped* test that carries a backend or real-client
  marker (mxnet, ssh, mpi, sge) fails instead: a missing install must not pass
  quietly.
* A network guard (``tests/netguard``) refuses Python sockets to anything but
  loopback and the test namespaces, in this process and in every Python child;
  any attempt fails the session.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import pytest

REPO = Path(__file__).resolve().parent.parent
GUARD_DIR = REPO / "tests" / "netguard"
BIN = REPO / "tests" / "bin"

sys.path.insert(0, str(GUARD_DIR))
import _pslaunch_netguard  # noqa: E402
from suite_rules import fail_skips_under_ci  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    log = Path(os.environ.get("PSLAUNCH_NETGUARD_LOG") or (REPO / ".pytest_cache" / f"netguard-{os.getpid()}.log"))
    log.parent.mkdir(parents=True, exist_ok=True)
    if log.exists() and "PYTEST_XDIST_WORKER" not in os.environ:
        log.unlink()
    os.environ["PSLAUNCH_NETGUARD_LOG"] = str(log)
    parts = [str(GUARD_DIR), str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    _pslaunch_netguard.install()
    config._netguard_log = log  # type: ignore[attr-defined]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    log: Path = session.config._netguard_log  # type: ignore[attr-defined]
    if log.exists() and log.read_text().strip():
        text = log.read_text()
        print(f"\nNETWORK GUARD: sockets outside loopback and the test namespaces:\n{text}", file=sys.stderr)
        session.exitstatus = 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterable[None]:
    outcome = yield
    fail_skips_under_ci(item, outcome.get_result(), dict(os.environ))


# --- helpers -------------------------------------------------------------------


def wait_for(cond: Callable[[], object], timeout: float, interval: float = 0.05, what: str = "condition") -> object:
    end = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """True for a live, non-zombie process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:].split()[0] not in (b"Z", b"X")


def assert_no_orphans(pids: Iterable[int], timeout: float = 10.0) -> None:
    pids = list(pids)
    assert pids, "no pids recorded"
    try:
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout, what="every process to be gone")
    except AssertionError:
        alive = [p for p in pids if pid_alive(p)]
        raise AssertionError(f"{len(alive)} orphan(s) still running after {timeout}s: {alive}") from None


def read_probes(directory: Path) -> dict[str, dict]:
    """``{"worker-0": {...}, "scheduler": {...}}`` from probe.py's JSON files."""
    out = {}
    for f in sorted(directory.glob("*.json")):
        out[f.stem] = json.loads(f.read_text())
    return out


def pslaunch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *args]


def run_pslaunch(*args: str, timeout: float = 60, env: dict | None = None, cwd: str | Path | None = None,
                 input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(pslaunch_argv(*args), capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd or REPO, input=input)


@pytest.fixture
def probe(tmp_path: Path) -> Callable[..., list[str]]:
    """``probe("--sleep", "5")`` -> the argv of tests/bin/probe.py writing into a fresh dir."""
    out = tmp_path / "probes"
    out.mkdir()

    def make(*args: str) -> list[str]:
        return [sys.executable, str(BIN / "probe.py"), "--out", str(out), *args]

    make.dir = out  # type: ignore[attr-defined]
    return make


@pytest.fixture
def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def mxnet_python() -> str | None:
    cand = os.environ.get("PSLAUNCH_MXNET_PYTHON") or str(REPO / ".venv-mxnet" / "bin" / "python")
    return cand if os.path.exists(cand) else None


@pytest.fixture
def mxnet() -> str:
    """The Python of a venv with MXNet 1.9.1 (scripts/install-test-deps.sh makes .venv-mxnet)."""
    py = mxnet_python()
    if py is None:
        pytest.skip("MXNet 1.9.1 venv not found (run scripts/install-test-deps.sh or set PSLAUNCH_MXNET_PYTHON)")
    return py
