# ruff: noqa: F811 - the testbed fixture is imported, and test arguments share its name
"""Keep-alives on the namespace testbed: one thread pings every host (issue 36).

The launcher used to hold a keep-alive thread per host; :data:`launcher.backends.ssh.KEEPALIVES`
now ticks every host from one thread. A host it failed to ping would be declared lost by the
launcher (no reply for 4 intervals) and its wrapper would stop its processes (no input for 4
intervals): a silent job on every host, running for several times that, shows both sides kept
alive. Liveness only: the deadlines are generous.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from support.helpers import run_pslaunch
from support.testbed import Testbed

pytestmark = [pytest.mark.integration, pytest.mark.ssh]


@pytest.mark.timeout(120)
def test_a_silent_job_on_every_host_outlives_many_keepalive_intervals(testbed: Testbed, tmp_path: Path) -> None:
    keepalive = 1.0  # lost after 4 silent intervals (shorter ones flake on a loaded 2-core machine)
    hosts = testbed.write_hostfile(tmp_path / "hosts", testbed.hosts)
    n = 2 * len(testbed.hosts)
    t0 = time.monotonic()
    r = run_pslaunch("--launcher", "ssh", "-H", str(hosts), "-n", str(n), "-s", "0", "--tracker", "torch",
                     "--ssh-keepalive", str(keepalive), "--kill-grace", "1",
                     sys.executable, "-S", "-c", "import time; time.sleep(10)",
                     env=testbed.env(), timeout=100)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert "is lost" not in r.stderr, r.stderr
    assert took >= 10, took  # (the processes ran their 10 s: 10 keep-alive intervals, 2.5 times the limit)
    print(f"{n} silent processes on {len(testbed.hosts)} hosts, keep-alive {keepalive:g}s: ended 0 after {took:.1f}s")
