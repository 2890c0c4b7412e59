"""The suite's own rules must bite: a skipped backend test fails under CI=true."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

INNER = '''
import pytest

@pytest.mark.ssh
def test_needs_testbed():
    pytest.skip("no testbed")

@pytest.mark.mxnet
def test_needs_mxnet():
    pytest.skip("no mxnet")

def test_plain_skip():
    pytest.skip("fine to skip")

@pytest.mark.sge
@pytest.mark.xfail(strict=True, reason="a known bug: it ran, and failed as expected")
def test_known_bug():
    assert False
'''


def _conftest(hooks: str, markers: tuple[str, ...]) -> str:
    """An inner session's conftest: ``tests/`` importable (suite_rules), ``markers`` registered,
    then ``hooks``."""
    from conftest import REPO
    return f'''
import os, sys
import pytest
sys.path.insert(0, {str(REPO / "tests")!r})

def pytest_configure(config):
    for m in {markers!r}:
        config.addinivalue_line("markers", m)
''' + hooks


SKIP_RULE = '''
from suite_rules import fail_skips_under_ci

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    fail_skips_under_ci(item, outcome.get_result(), dict(os.environ))
'''


@pytest.mark.parametrize("ci, failed, skipped", [("true", 2, 1), ("", 0, 3)])
def test_skips_of_backend_tests_fail_under_ci(pytester, monkeypatch, ci, failed, skipped) -> None:
    """A skipped backend test fails under CI=true; an expected failure (xfail) of one stays one."""
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest(_conftest(SKIP_RULE, ("ssh", "mxnet", "mpi", "sge")))
    pytester.makepyfile(INNER)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=failed, skipped=skipped, xfailed=1)


GROUPS_RULE = '''
from suite_rules import group_by_service

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    group_by_service(items)
'''

GROUPED = '''
import os, pytest

def record(name):
    with open(os.path.join(os.environ["RECORD_DIR"], name), "w") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "none"))

@pytest.mark.parametrize("i", range(6))
@pytest.mark.slurm
def test_slurm(i):
    record(f"slurm-{i}")

@pytest.mark.parametrize("i", range(6))
@pytest.mark.yarn
def test_yarn(i):
    record(f"yarn-{i}")

@pytest.mark.parametrize("i", range(12))
def test_plain(i):
    record(f"plain-{i}")
'''


def test_tests_of_one_shared_service_run_in_one_xdist_worker(pytester, tmp_path, monkeypatch) -> None:
    """scripts/test.sh runs the suite in pytest-xdist workers (``--dist loadgroup``): every test of
    one shared service (a Slurm test may stop a node another Slurm test runs on) runs in one worker."""
    monkeypatch.setenv("RECORD_DIR", str(tmp_path))
    pytester.makeconftest(_conftest(GROUPS_RULE, ("slurm", "yarn")))
    pytester.makepyfile(GROUPED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup")
    result.assert_outcomes(passed=24)
    ran = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert len(ran) == 24
    for group in ("slurm", "yarn"):
        workers = {w for name, w in ran.items() if name.startswith(group)}
        assert len(workers) == 1 and workers <= {"gw0", "gw1"}, ran
    assert {w for name, w in ran.items() if name.startswith("plain")} == {"gw0", "gw1"}, ran  # side by side


def test_no_two_test_modules_share_a_name() -> None:
    """pytest imports test modules by their base name (no packages here): two ``test_x.py`` in
    different folders make the second one an import error, in a run that collects both (CI)."""
    from collections import Counter
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    names = Counter(p.name for p in tests.rglob("test_*.py") if "pytest-of" not in str(p))
    assert [n for n, c in names.items() if c > 1] == []
