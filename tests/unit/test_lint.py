"""The lint that scripts/test.sh runs before the tests, so that pytest alone catches it too:
``ruff check .`` and ``mypy`` (launcher/ and pscontract/), both configured in pyproject.toml."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from support.helpers import REPO


def _run(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed here (the test extra): rerun scripts/setup.sh")
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_ruff_finds_nothing() -> None:
    r = _run("ruff", "check", ".", timeout=60)
    assert r.returncode == 0, f"ruff check . failed:\n{r.stdout}{r.stderr}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mypy_finds_nothing() -> None:
    r = _run("mypy", timeout=280)  # (about 35 s without its cache in .mypy_cache)
    assert r.returncode == 0, f"mypy failed:\n{r.stdout}{r.stderr}"
