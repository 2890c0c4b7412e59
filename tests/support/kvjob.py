"""A tiny job runner for the KVStore integration tests: the launcher's contract,
without the launcher's fail-fast, so a test can watch every process react on
its own (kill one, see the others exit by themselves).

Example:
    job = KVJob(tmp_path, workers=2, servers=1, command=[sys.executable, "kv_worker.py", "sync"])
    job.start()
    codes = job.wait(timeout=60)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import pscontract as pc
from support.helpers import BIN, REPO, free_port

SECRET = "5e" * 32


class KVJob:
    """Start a scheduler, servers and workers with the dmlc contract on loopback.

    Args:
        tmp: directory for the per-process logs.
        workers: N.
        servers: S.
        command: argv every role runs (or see ``role_command``).
        env: extra variables for every process.
        role_env: extra variables per process name (``scheduler``, ``server-0``, ``worker-1``).
        role_command: argv per role name (``scheduler``, ``server``, ``worker``).
        skip: process names not to start (to simulate a missing node).
        start_timeout: ``PS_START_TIMEOUT``.
    """

    def __init__(self, tmp: Path, *, workers: int = 2, servers: int = 1,
                 command: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 role_env: Mapping[str, Mapping[str, str]] | None = None,
                 role_command: Mapping[str, Sequence[str]] | None = None,
                 skip: Sequence[str] = (), start_timeout: float = 30, secret: str = SECRET) -> None:
        self.tmp = Path(tmp)
        self.workers, self.servers = workers, servers
        self.command = list(command)
        self.env = dict(env or {})
        self.role_env = {k: dict(v) for k, v in (role_env or {}).items()}
        self.role_command = {k: list(v) for k, v in (role_command or {}).items()}
        self.skip = set(skip)
        self.port = free_port()
        self.start_timeout = start_timeout
        self.secret = secret
        self.procs: dict[str, subprocess.Popen] = {}
        self.exit_times: dict[str, float] = {}

    def names(self) -> list[str]:
        return (["scheduler"] + [f"server-{i}" for i in range(self.servers)]
                + [f"worker-{i}" for i in range(self.workers)])

    def _env(self, name: str) -> dict[str, str]:
        role = name.split("-")[0]
        task = None
        if role == "worker":
            task = int(name.split("-")[1])
        elif role == "server":
            task = self.workers + int(name.split("-")[1])
        env = dict(os.environ)
        env[pc.PYTHONPATH] = os.pathsep.join(
            p for p in (str(REPO), os.environ.get(pc.PYTHONPATH)) if p)
        env[pc.PYTHONUNBUFFERED] = "1"
        env.update(pc.contract(
            role, root_uri="127.0.0.1", root_port=self.port, num_workers=self.workers,
            num_servers=self.servers, secret=self.secret, start_timeout=self.start_timeout,
            job_id="kvtest", task_id=task, cluster="local" if task is not None else None,
            node_host="127.0.0.1" if task is not None else None))
        env.update(self.env)
        env.update(self.role_env.get(name, {}))
        return env

    def start(self) -> KVJob:
        for name in self.names():
            if name in self.skip:
                continue
            role = name.split("-")[0]
            argv = self.role_command.get(role, self.command)
            log = open(self.tmp / f"{name}.log", "wb")
            self.procs[name] = subprocess.Popen(argv, env=self._env(name), stdout=log,
                                                stderr=subprocess.STDOUT, cwd=self.tmp,
                                                start_new_session=True)
            log.close()
        return self

    def poll(self) -> None:
        for name, p in self.procs.items():
            if name not in self.exit_times and p.poll() is not None:
                self.exit_times[name] = time.monotonic()

    def wait(self, timeout: float, names: Sequence[str] | None = None) -> dict[str, int | None]:
        """Wait for ``names`` (default: all) to exit; return every exit code (None: running)."""
        wanted = list(names) if names is not None else list(self.procs)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.poll()
            if all(n in self.exit_times for n in wanted):
                break
            time.sleep(0.05)
        self.poll()
        return {n: p.returncode for n, p in self.procs.items()}

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- {n}\n{self.output(n)}" for n in self.procs)

    def signal(self, name: str, sig: int) -> float:
        self.procs[name].send_signal(sig)
        return time.monotonic()

    def cleanup(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)


def worker_command(*args: str) -> list[str]:
    return [sys.executable, str(BIN / "kv_worker.py"), *args]
