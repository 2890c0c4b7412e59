"""Rules of the test suite that conftest.py applies (kept importable for their own tests)."""

from __future__ import annotations

import pytest

#: markers of tests that need a backend or a real client; CI must not skip them
STRICT_MARKERS = ("mxnet", "xgboost", "torchlibs", "ssh", "mpi", "sge", "slurm", "yarn", "ray", "k8s", "browser")


def fail_skips_under_ci(item: pytest.Item, report: pytest.TestReport, environ: dict) -> None:
    """Turn the skip of a backend or real-client test into a failure when CI=true.

    An expected failure (``xfail``, reported as skipped with ``wasxfail``) ran: it is no skip.
    """
    if report.skipped and not hasattr(report, "wasxfail") and environ.get("CI", "").lower() == "true":
        strict = [m for m in STRICT_MARKERS if item.get_closest_marker(m)]
        if strict:
            reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true (marker {', '.join(strict)}): {reason}"


#: markers of tests that share one service of this machine (a cluster that a test may stop a node of,
#: a queue whose jobs another test counts): under pytest-xdist each service's tests run in one worker,
#: one after the other (``--dist loadgroup``); tests of different services, and all others, run side by side
SERVICE_GROUPS = ("slurm", "sge", "yarn", "ray", "k8s")


def group_by_service(items: list[pytest.Item]) -> None:
    """Mark each test that uses a shared service (``SERVICE_GROUPS``) with its xdist group."""
    for item in items:
        group = next((m for m in SERVICE_GROUPS if item.get_closest_marker(m)), None)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
