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


def _conftest() -> str:
    from conftest import REPO
    return f'''
import sys
sys.path.insert(0, {str(REPO / "tests")!r})
from suite_rules import fail_skips_under_ci
import os, pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    fail_skips_under_ci(item, outcome.get_result(), dict(os.environ))

def pytest_configure(config):
    for m in ("ssh", "mxnet", "mpi", "sge"):
        config.addinivalue_line("markers", m)
'''


@pytest.mark.parametrize("ci, failed, skipped", [("true", 2, 1), ("", 0, 3)])
def test_skips_of_backend_tests_fail_under_ci(pytester, monkeypatch, ci, failed, skipped) -> None:
    """A skipped backend test fails under CI=true; an expected failure (xfail) of one stays one."""
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest(_conftest())
    pytester.makepyfile(INNER)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=failed, skipped=skipped, xfailed=1)
