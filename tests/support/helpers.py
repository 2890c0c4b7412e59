"""Helpers every test module may use: waiting, live processes, probes, running pslaunch.

One copy of each: test modules import them from here (``from support.helpers import ...``),
never from ``conftest`` or from another test module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterable, Optional

from launcher.node import procgroup
from launcher.spec.job import JobSpec

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "tests" / "bin"
PROBE = BIN / "probe.py"


def wait_for(cond: Callable[[], object], timeout: float, interval: float = 0.05, what: str = "condition") -> object:
    """Poll ``cond`` until it returns something true (returned), or fail after ``timeout`` seconds."""
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
    st = procgroup.stat(pid)
    return st is not None and st.alive


def assert_no_orphans(pids: Iterable[int], timeout: float = 10.0) -> None:
    """Every pid in ``pids`` is gone (or a zombie) within ``timeout`` seconds.

    Check before anything reaps them: a reaped pid is gone whether or not the
    code under test stopped it.
    """
    pids = list(pids)
    assert pids, "no pids recorded"
    try:
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout, what="every process to be gone")
    except AssertionError:
        alive = [p for p in pids if pid_alive(p)]
        raise AssertionError(f"{len(alive)} orphan(s) still running after {timeout}s: {describe_pids(alive)}") from None


def describe_pids(pids: Iterable[int]) -> str:
    """``"4711 python probe.py ...; ..."`` for messages."""
    parts = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            cmd = "?"
        parts.append(f"{pid} {cmd[:160].strip()}")
    return "; ".join(parts) or "none"


def pids_with_env(name: str, value: str) -> list[int]:
    """Live processes whose initial environment has ``name=value`` (from ``/proc/PID/environ``).

    Every process a job starts, and whatever those start in turn (a grandchild that
    called ``setsid()`` included), inherits the job's variables: a unique value
    finds them all, on this machine and in its network namespaces (one pid namespace).
    """
    needle = f"{name}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0") and pid_alive(int(entry)):
            found.append(int(entry))
    return sorted(found)


def all_pids(probes: dict) -> list[int]:
    """The pids a set of probe records names: each process and its grandchild, if any."""
    pids = []
    for rec in probes.values():
        pids.append(rec["pid"])
        if rec.get("child"):
            pids.append(rec["child"])
    return pids


def read_probes(directory: Path) -> dict[str, dict]:
    """``{"worker-0": {...}, "scheduler": {...}}`` from probe.py's JSON files."""
    out = {}
    for f in sorted(Path(directory).glob("*.json")):
        out[f.stem] = json.loads(f.read_text())
    return out


def wait_probes(directory: Path, count: int, timeout: float = 30, alive: bool = False) -> dict[str, dict]:
    """Wait until ``count`` probes have written their records; return them.

    With ``alive``, only records of live processes count: a job that lost its port race is
    started again (launcher/run/supervisor.py), and the stopped attempt's processes may have
    written records that the new attempt's have not yet replaced. (Only where the probes run
    in this machine's PID namespace.)
    """
    def ready() -> Optional[dict[str, dict]]:
        probes = read_probes(directory)
        if alive:
            probes = {k: v for k, v in probes.items() if pid_alive(v["pid"])}
        return probes if len(probes) == count else None

    return wait_for(ready, timeout, what=f"{count} processes to start")  # type: ignore[return-value]


def load_script(name: str) -> ModuleType:
    """``scripts/NAME.py`` imported as the module ``NAME`` (registered in ``sys.modules``:
    dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def probe_argv(out: Path, *args: str, python: str = sys.executable) -> list[str]:
    """The argv of ``tests/bin/probe.py`` writing its record into ``out``."""
    return [python, str(PROBE), "--out", str(out), *args]


def pslaunch_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launcher", *args]


def spec_of(args: list[str]) -> JobSpec:
    """Parse ``args`` as pslaunch does and return the JobSpec it would run (nothing is run)."""
    import pytest

    from launcher import cli
    from launcher.cli import job

    captured: dict[str, JobSpec] = {}

    def fake_execute(spec: JobSpec) -> int:
        captured["spec"] = spec
        return 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(job, "execute", fake_execute)
        code = cli.main(args)
    assert code == 0, code
    return captured["spec"]


def run_pslaunch(*args: str, timeout: float = 60, env: Optional[dict] = None, cwd: str | Path | None = None,
                 input: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run pslaunch to the end (text output captured)."""
    return subprocess.run(pslaunch_argv(*args), capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd or REPO, input=input)


def start_pslaunch(*args: str, env: Optional[dict] = None, cwd: str | Path | None = None) -> subprocess.Popen:
    """Start pslaunch in the background (text pipes), for signal tests."""
    return subprocess.Popen(pslaunch_argv(*args), cwd=cwd or REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def one_line_error(stderr: str) -> str:
    """The single ``pslaunch: error:`` line that ``stderr`` must consist of."""
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert lines[0].startswith("pslaunch: error: "), lines[0]
    return lines[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago."""
    s = socket.socket()
    s.bind((host, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def ancestors(pid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of ``pid``'s parents, nearest first."""
    out = []
    while pid > 1:
        st = procgroup.stat(pid)
        if st is None:
            break
        ppid = st.ppid
        try:
            with open(f"/proc/{ppid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            break
        out.append((ppid, cmd))
        pid = ppid
    return out


def mxnet_python() -> Optional[str]:
    """The Python of a venv with MXNet 1.9.1 (scripts/deps/20-mxnet.sh makes .venv-mxnet)."""
    cand = os.environ.get("PSLAUNCH_MXNET_PYTHON") or str(REPO / ".venv-mxnet" / "bin" / "python")
    return cand if os.path.exists(cand) else None


XGBOOST_VENVS = {"2.0": ("PSLAUNCH_XGB20_PYTHON", ".venv-xgb20"), "3.0": ("PSLAUNCH_XGB30_PYTHON", ".venv-xgb30")}


def xgboost_python(version: str) -> Optional[str]:
    """The Python of the XGBoost ``version`` venv (``2.0``: 2.0.3, ``3.0``: 3.0.x), made by
    scripts/deps/70-xgboost.sh (``$PSLAUNCH_XGB20_PYTHON``/``$PSLAUNCH_XGB30_PYTHON``), or None."""
    var, venv = XGBOOST_VENVS[version]
    cand = os.environ.get(var) or str(REPO / venv / "bin" / "python")
    return cand if os.path.exists(cand) else None


MPIRUNS = {"openmpi": ("PSLAUNCH_MPIRUN_OPENMPI", "/usr/bin/mpirun.openmpi"),
           "mpich": ("PSLAUNCH_MPIRUN_MPICH", "/usr/bin/mpirun.mpich")}


def mpirun_path(impl: str) -> Optional[str]:
    """The mpirun of ``impl`` (``openmpi``/``mpich``): ``$PSLAUNCH_MPIRUN_*`` or Debian's path."""
    var, default = MPIRUNS[impl]
    path = os.environ.get(var) or default
    return path if os.access(path, os.X_OK) else None


class PipeChannel:
    """What RemoteHost uses of a paramiko channel, carried by a local ``sh -c COMMAND`` (no sshd)."""

    def __init__(self) -> None:
        self.p: subprocess.Popen | None = None
        self.timeout = 0.5

    def settimeout(self, timeout: float) -> None:
        self.timeout = timeout

    def exec_command(self, command: str) -> None:
        self.p = subprocess.Popen(["sh", "-c", command], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True)

    def sendall(self, data: bytes) -> None:
        assert self.p is not None and self.p.stdin is not None
        self.p.stdin.write(data)
        self.p.stdin.flush()

    def send(self, data: bytes) -> int:
        self.sendall(data)
        return len(data)

    def send_ready(self) -> bool:
        """True when a write would not block (the pipe has room), as paramiko's."""
        assert self.p is not None and self.p.stdin is not None
        return bool(select.select([], [self.p.stdin], [], 0)[1])

    def recv(self, n: int) -> bytes:
        assert self.p is not None and self.p.stdout is not None
        if not select.select([self.p.stdout], [], [], self.timeout)[0]:
            raise socket.timeout
        return os.read(self.p.stdout.fileno(), n)

    def recv_stderr_ready(self) -> bool:
        return False

    def exit_status_ready(self) -> bool:
        return self.p is not None and self.p.poll() is not None

    def recv_exit_status(self) -> int:
        assert self.p is not None
        return self.p.wait()

    def close(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.kill()
            self.p.wait()
