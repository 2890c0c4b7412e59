"""Suite-wide rules and fixtures.

* Every test has a timeout (pytest-timeout; default in pyproject).
* Under ``CI=true`` a *skipped* test that carries a backend or real-client
  marker (see ``suite_rules.STRICT_MARKERS``) fails instead: a missing install
  must not pass quietly.
* A network guard (``tests/netguard``) refuses Python sockets to anything but
  loopback and the test namespaces, in this process and in every Python child;
  any attempt fails the session.

Helpers live in ``tests/support`` (importable as ``support``); this file only
registers fixtures.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, Iterable

import pytest
from support.browser import Browser, artifacts_dir
from support.browser import missing as browser_missing
from support.helpers import MPIRUNS, REPO, mpirun_path, mxnet_python, probe_argv
from support.helpers import free_port as _free_port
from support.k8s_testbed import k8s_cluster  # noqa: F401 - the running Kubernetes test cluster (a fixture)
from support.ray_testbed import ray_cluster  # noqa: F401 - the session's Ray test cluster (a fixture)
from support.testbed import shared_out, testbed  # noqa: F401 - the session's namespace hosts, a folder all share (fixtures)
from support.yarn_testbed import skein_driver  # noqa: F401 - the session's global skein driver (a fixture)

GUARD_DIR = REPO / "tests" / "netguard"

sys.path.insert(0, str(GUARD_DIR))
import _pslaunch_netguard  # noqa: E402
from suite_rules import fail_skips_under_ci, group_by_service  # noqa: E402


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


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group_by_service(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterable[None]:
    outcome = yield
    fail_skips_under_ci(item, outcome.get_result(), dict(os.environ))


@pytest.fixture(autouse=True)
def _launcher_messages_through_logging() -> Iterable[None]:
    """A test that ran ``pslaunch`` in-process (``cli.main``) gave the launcher's logger its own
    handlers (``launcher.logs.configure``); the next test gets its messages through ``logging``
    again, as any program that never configured them (``caplog`` sees them)."""
    import logging

    logger = logging.getLogger("launcher")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:], logger.propagate, logger.level = saved


@pytest.fixture
def probe(tmp_path: Path) -> Callable[..., list[str]]:
    """``probe("--sleep", "5")`` -> the argv of tests/bin/probe.py writing into a fresh dir (``probe.dir``)."""
    out = tmp_path / "probes"
    out.mkdir()

    def make(*args: str) -> list[str]:
        return probe_argv(out, *args)

    make.dir = out  # type: ignore[attr-defined]
    return make


@pytest.fixture
def free_port() -> int:
    return _free_port()


@pytest.fixture
def mxnet() -> str:
    """The Python of a venv with MXNet 1.9.1 (scripts/install-test-deps.sh makes .venv-mxnet)."""
    py = mxnet_python()
    if py is None:
        pytest.skip("MXNet 1.9.1 venv not found (run scripts/install-test-deps.sh or set PSLAUNCH_MXNET_PYTHON)")
    return py


@pytest.fixture(params=sorted(MPIRUNS))
def mpirun(request: pytest.FixtureRequest) -> str:
    """The path of a real mpirun, once per family (Open MPI, MPICH)."""
    path = mpirun_path(request.param)
    if path is None:
        pytest.skip(f"{request.param}: mpirun not found "
                    f"(run scripts/deps/40-mpi.sh or set {MPIRUNS[request.param][0]})")
    return path


@pytest.fixture
def browser(request: pytest.FixtureRequest) -> Iterable[Browser]:
    """A headless Chromium (tests/support/browser.py) whose screenshots, console and requests stay
    under ``$PSLAUNCH_TEST_ARTIFACTS/<test>`` (default test-artifacts/); a last screenshot at the end."""
    why = browser_missing()
    if why:
        pytest.skip(why)
    b = Browser(artifacts_dir(request.node.nodeid))
    yield b
    b.close()
