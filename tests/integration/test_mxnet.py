"""Real MXNet 1.9.1 (C++ ps-lite) under the launcher: it must behave as under launch.py."""

from __future__ import annotations

import pytest
from support.helpers import BIN, run_pslaunch

pytestmark = [pytest.mark.integration, pytest.mark.mxnet]


@pytest.mark.timeout(120)
def test_mxnet_ps_lite_dist_sync_local(mxnet: str) -> None:
    r = run_pslaunch("-n", "2", "-s", "1", "--kill-grace", "1", "--timeout", "100",
                     mxnet, str(BIN / "mxnet_dist_sync.py"), timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [x for x in r.stdout.splitlines() if "pulled" in x]
    assert len(lines) == 2, r.stdout
    for line in lines:
        assert line.startswith("[worker ") and "expected 3.0" in line
    assert "all 4 processes exited 0" in r.stderr


@pytest.mark.timeout(120)
def test_mxnet_ps_verbose_reaches_every_node(mxnet: str) -> None:
    r = run_pslaunch("-n", "2", "-s", "1", "--kill-grace", "1", "--env", "PS_VERBOSE=1", "--timeout", "100",
                     mxnet, str(BIN / "mxnet_dist_sync.py"), timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    text = r.stdout + r.stderr
    for label in ("scheduler", "server 0", "worker 0", "worker 1"):
        assert any(line.startswith(f"[{label}]") and "van.cc" in line for line in text.splitlines()), label
    assert "the scheduler is connected to 2 workers and 1 servers" in text


@pytest.mark.timeout(120)
def test_mxnet_server_crash_fails_fast(mxnet: str) -> None:
    # dist_async without an optimizer makes MXNet's server abort ("Updater needs to be set
    # for async mode"); under launch.py the job hangs, here it ends with the server named.
    r = run_pslaunch("-n", "2", "-s", "1", "--kill-grace", "1", "--timeout", "100", "--env", "KV_TYPE=dist_async",
                     mxnet, str(BIN / "mxnet_dist_sync.py"), timeout=110)
    assert r.returncode == 134, r.stderr  # SIGABRT
    assert "server 0 (on localhost, pid" in r.stderr and "was killed by SIGABRT" in r.stderr
    assert "Updater needs to be set for async mode" in r.stderr
