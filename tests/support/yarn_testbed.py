"""The YARN testbed from the tests' side (scripts/setup-yarn.sh builds and starts it; CI does so).

Its containers are local process groups, each with YARN's ``CONTAINER_ID`` in its environment
(inherited by every process it starts): :func:`container_pids` finds whatever is left of an
application by that; :func:`app_status` asks the testbed's ResourceManager how it ended.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from support.helpers import pid_alive, wait_for


@functools.cache
def yarn_problem() -> str | None:
    """Why no YARN job can run here (one line), or None. Asked once per session: it starts a JVM."""
    for name in ("JAVA_HOME", "HADOOP_HOME", "HADOOP_CONF_DIR"):
        if not os.environ.get(name):
            return f"{name} is not set (eval \"$(scripts/setup-yarn.sh)\")"
    if importlib.util.find_spec("skein") is None:
        return "skein is not installed (scripts/setup-yarn.sh installs it into .venv)"
    if not yarn_program().exists():
        return f"{yarn_program()} is missing (scripts/setup-yarn.sh builds it)"
    r = subprocess.run([str(yarn_program()), "application", "-list"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        return f"'yarn application -list' fails (start the testbed: scripts/setup-yarn.sh): {r.stderr[-300:]}"
    return None


def yarn_program() -> Path:
    return Path(os.environ["HADOOP_HOME"]) / "bin" / "yarn"


def yarn(*args: str) -> str:
    r = subprocess.run([str(yarn_program()), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"yarn {' '.join(args)}: {r.stdout}{r.stderr}"
    return r.stdout


def app_status(app_id: str) -> tuple[str, str]:
    """``(state, final status)`` as the ResourceManager reports them."""
    out = yarn("application", "-status", app_id)
    fields = dict(re.findall(r"^\t([\w-]+(?: [\w-]+)*) : (.*)$", out, re.M))
    return fields["State"], fields["Final-State"]


def container_pids(app_id: str) -> list[int]:
    """Live processes of the application's containers (their environment names the container)."""
    marker = b"CONTAINER_ID=container_" + app_id.removeprefix("application_").encode() + b"_"
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if any(v.startswith(marker) for v in environ) and pid_alive(int(entry)):
            pids.append(int(entry))
    return pids


def assert_nothing_left(app_id: str, timeout: float = 20.0) -> float:
    """Waits until no process of the application runs; returns how long that took."""
    t0 = time.monotonic()
    try:
        wait_for(lambda: not container_pids(app_id), timeout, interval=0.1, what=f"{app_id}'s containers to end")
    except AssertionError:
        raise AssertionError(f"processes of {app_id} still running after {timeout}s: "
                             f"{container_pids(app_id)}") from None
    return time.monotonic() - t0


def apps_named(name: str, driver_env: dict[str, str] | None = None) -> list[str]:
    """Applications the ResourceManager lists (submitted, accepted, running) under ``name``: through
    the session's skein driver (``driver_env``, from :func:`skein_driver`: milliseconds), else
    ``yarn application -list`` (a JVM)."""
    if driver_env:
        client = _driver_client(driver_env["SKEIN_CONFIG"])
        return sorted(r.id for r in client.get_applications(states=["SUBMITTED", "ACCEPTED", "RUNNING"])
                      if r.name == name)
    return [line.split("\t")[0] for line in yarn("application", "-list").splitlines() if f"\t{name}\t" in line]


@functools.cache
def _driver_client(config: str) -> object:
    import skein

    address = json.loads((Path(config) / "driver").read_text())["address"]
    return skein.Client(address=address, security=skein.Security.from_directory(config))


@pytest.fixture(scope="session")
def skein_driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A global skein driver for the session (``skein driver start``, as YARN users run one), in a
    ``SKEIN_CONFIG`` of its own: the variables that make pslaunch use it.

    pslaunch uses a running global driver instead of starting one of its own, a JVM (3-5 s on 2
    cores): the contract suite's YARN jobs use this one. ``tests/integration/test_yarn_testbed.py``
    keeps the launcher starting and stopping its own driver.
    """
    problem = yarn_problem()
    if problem:
        pytest.skip(f"no YARN testbed: {problem}")
    env = {**os.environ, "SKEIN_CONFIG": str(tmp_path_factory.mktemp("skein"))}
    skein = [sys.executable, "-c", "import sys; from skein.cli import main; sys.exit(main())", "driver"]
    r = subprocess.run([*skein, "start"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"skein driver start: {r.stdout}{r.stderr}"
    try:
        yield {"SKEIN_CONFIG": env["SKEIN_CONFIG"]}
    finally:
        subprocess.run([*skein, "stop"], env=env, capture_output=True, text=True, timeout=60)
