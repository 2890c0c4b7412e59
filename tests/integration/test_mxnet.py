"""Real MXNet 1.9.1 (C++ ps-lite) under the launcher: it must behave as under launch.py."""

from __future__ import annotations

import pytest
from support.helpers import BIN, run_pslaunch

pytestmark = [pytest.mark.integration, pytest.mark.mxnet]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheduler", ["command", "builtin"])
def test_mxnet_ps_lite_dist_sync_local(mxnet: str, scheduler: str) -> None:
    r = run_pslaunch("-n", "2", "-s", "1", "--kill-grace", "1", "--timeout", "100", "--scheduler", scheduler,
                     mxnet, str(BIN / "mxnet_dist_sync.py"), timeout=110)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [x for x in r.stdout.splitlines() if "pulled" in x]
    assert len(lines) == 2, r.stdout
    for line in lines:
        assert line.startswith("[worker ") and "expected 3.0" in line
    assert "all 4 processes exited 0" in r.stderr
    assert "Traceback" not in r.stdout + r.stderr


@pytest.mark.timeout(150)
def test_mxnet_under_the_builtin_scheduler_with_several_servers(mxnet: str) -> None:
    # 3 workers, 2 servers: both servers register and serve, worker barriers (kv._barrier) of 3,
    # the start and finalize barriers of 6; ranks 0-2 each exactly once, as ps-lite numbers them
    r = run_pslaunch("-n", "3", "-s", "2", "--kill-grace", "1", "--timeout", "130", "--scheduler", "builtin",
                     "--env", "PS_VERBOSE=1", mxnet, str(BIN / "mxnet_dist_sync.py"), timeout=140)
    assert r.returncode == 0, r.stdout + r.stderr
    pulled = [x for x in r.stdout.splitlines() if "pulled" in x]
    assert sorted(x.split("] ", 1)[1].split(":")[0] for x in pulled) == ["rank 0 of 3", "rank 1 of 3", "rank 2 of 3"]
    assert all("expected 6.0" in x for x in pulled), pulled
    text = r.stdout + r.stderr
    assigned = sorted(int(x.split("assign rank=")[1].split()[0]) for x in text.splitlines() if "assign rank=" in x)
    assert assigned == [8, 9, 10, 11, 13], text  # servers 8 + 2r, workers 9 + 2r
    assert "[scheduler]" in text and "the scheduler is connected to 3 workers and 2 servers" in text
    for label in ("server 0", "server 1", "worker 0", "worker 1", "worker 2"):
        assert any(x.startswith(f"[{label}]") and "is connected to others" in x for x in text.splitlines()), label
    assert "all 6 processes exited 0" in r.stderr


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
@pytest.mark.parametrize("scheduler", ["command", "builtin"])
def test_mxnet_server_crash_fails_fast(mxnet: str, scheduler: str) -> None:
    # dist_async without an optimizer makes MXNet's server abort ("Updater needs to be set
    # for async mode"); under launch.py the job hangs, here it ends with the server named.
    r = run_pslaunch("-n", "2", "-s", "1", "--kill-grace", "1", "--timeout", "100", "--env", "KV_TYPE=dist_async",
                     "--scheduler", scheduler, mxnet, str(BIN / "mxnet_dist_sync.py"), timeout=110)
    assert r.returncode == 134, r.stderr  # SIGABRT
    assert "server 0 (on localhost, pid" in r.stderr and "was killed by SIGABRT" in r.stderr
    assert "Updater needs to be set for async mode" in r.stderr
