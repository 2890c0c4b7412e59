"""The launcher against 200 simulated hosts (``scripts/sim_scale.py``, docs/scale.md).

The launcher's own supervisor, batch backend, hub, pump and console run a job of 200 node agents
that connect at once over loopback (each from its own address) and speak the node protocol. The
test checks what must hold at any size, never how fast: every agent got in, every line of every
host reached the console once, whole and under its own label, the one failure ended the job with
its exit code, and the stop reached every other agent, which acknowledged it. The deadlines are
for liveness only (the simulation itself takes a few seconds).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.helpers import REPO

pytestmark = pytest.mark.integration

HOSTS, LINES = 200, 5


def simulate(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "sim_scale.py"), "--hosts", str(HOSTS), "--lines",
                        str(LINES), "--helpers", "2", "--check-lines", "--kill-grace", "20", "--start-timeout", "120",
                        "--json", str(out), *extra], capture_output=True, text=True, timeout=400)
    assert out.exists(), r.stderr[-3000:]
    return r.returncode, json.loads(out.read_text())


@pytest.mark.timeout(420)
def test_two_hundred_hosts_fan_out_merge_and_stop(tmp_path) -> None:
    code, doc = simulate(tmp_path)
    assert doc["launch_error"] is None
    assert doc["agent_errors"] == [] and doc["agents_reported"] == HOSTS  # every agent got in
    assert doc["lines_merged"] == HOSTS * LINES + 1  # (and the failing host's last line)
    assert doc["labels"] == {"hosts_with_every_line_once": HOSTS, "mislabelled": 0, "mislabelled_lines": []}
    assert doc["exit_code"] == 1 and doc["first_failure"] == f"worker-{HOSTS // 2}"
    assert doc["agents_not_told"] == [] and doc["agents_not_told_count"] == 0
    assert doc["agents_not_acked_count"] == 0  # every other agent answered the stop with its exit
    assert code == 0


@pytest.mark.timeout(420)
@pytest.mark.parametrize("broken", ["mislabel", "deaf"])
def test_the_simulation_sees_a_broken_agent(tmp_path, broken: str) -> None:
    """The checks above can fail: a line that names another host than its label, or agents that
    ignore the stop, make the simulation fail (exit 1) and say which."""
    code, doc = simulate(tmp_path, "--broken", broken, "--kill-grace", "3")
    assert code == 1
    if broken == "mislabel":
        assert doc["labels"]["mislabelled"] == 1
        assert doc["labels"]["mislabelled_lines"] == ["[worker 3] host 4 line 0 " + "." * 36]
    else:
        assert doc["agents_not_acked_count"] == len([i for i in range(HOSTS) if i % 7 == 0 and i != HOSTS // 2])
