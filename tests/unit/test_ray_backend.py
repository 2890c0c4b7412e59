"""The ray backend's pure parts (launcher/backends/ray.py): the bundles, the address, the options and
the one line for a placement Ray cannot make. The backend itself runs on the Ray test cluster
(tests/integration/contract, tests/integration/test_ray.py)."""

from __future__ import annotations

import pytest
from support.helpers import spec_of

from launcher.backends import ray as rb
from launcher.errors import ConfigError
from launcher.spec.plan import build_plan


def _plan(args: list[str]):
    spec = spec_of(args)
    return spec, build_plan(spec, root_uri="10.0.0.1", root_port=9091, secret="s" * 64, job_id="j",
                            inherit_environ=False)


def test_one_bundle_per_process_with_its_roles_cores_and_a_workers_gpus() -> None:
    spec, plan = _plan(["--launcher", "ray", "--host-ip", "10.0.0.1", "-n", "2", "-s", "1", "--worker-cores", "2",
                        "--ray-gpus", "1", "true"])
    by_role = sorted((str(p.role), tuple(sorted(b.items()))) for p, b in zip(plan.procs, rb.bundles(spec, plan.procs)))
    assert by_role == [("server", (("CPU", 1.0),)), ("worker", (("CPU", 2.0), ("GPU", 1.0))),
                       ("worker", (("CPU", 2.0), ("GPU", 1.0)))]


def test_the_address_is_the_option_then_ray_address_then_auto() -> None:
    assert rb.cluster_address(rb.RayOptions(address="10.0.0.1:6379"), {"RAY_ADDRESS": "x:1"}) == "10.0.0.1:6379"
    assert rb.cluster_address(rb.RayOptions(), {"RAY_ADDRESS": "x:1"}) == "x:1"
    assert rb.cluster_address(rb.RayOptions(), {}) == "auto"


@pytest.mark.parametrize("kwargs, message", [
    ({"gpus": -1}, "--ray-gpus must be a whole number from 0 to 1024"),
    ({"address": " "}, "--ray-address needs an address"),
])
def test_bad_options_are_one_line(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        rb.RayOptions(**kwargs)


def test_an_unplaceable_group_names_what_is_missing() -> None:
    line = rb.describe_unplaced([{"CPU": 2.0}] * 4, "PACK", [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 1.0}], 30)
    assert line == ("Ray could not place the job within --start-timeout 30s: it needs 4 bundles of {CPU: 2}; "
                    "the cluster has 3 nodes with 2, 2, 1 CPUs free (5 in all)")
    spread = rb.describe_unplaced([{"CPU": 1.0}] * 4, "STRICT_SPREAD", [{"CPU": 2.0}] * 3, 5)
    assert "4 bundles of {CPU: 1}, each on its own node (--ray-spread)" in spread
    assert "3 nodes with 2 CPUs free each (6 in all)" in spread
    mixed = rb.describe_unplaced([{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}], "PACK", [{"CPU": 4.0}], 5)
    assert "1 bundle of {CPU: 1} + 1 bundle of {CPU: 1, GPU: 1}" in mixed and "0 GPUs free each" in mixed


def test_the_dry_run_shows_the_group_and_never_the_secret() -> None:
    spec, plan = _plan(["--launcher", "ray", "--host-ip", "10.0.0.1", "--ray-spread", "-n", "2", "-s", "1", "true"])
    text = "\n".join(rb.RayBackend.dry_run(spec, plan))
    assert "one placement group of 3 bundles ({CPU: 1}), STRICT_SPREAD" in text
    assert "s" * 64 not in text and "PSLAUNCH_TASK" in text


def test_without_ray_the_backend_is_one_line(monkeypatch) -> None:
    import importlib.util

    from launcher.errors import BackendUnavailableError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(BackendUnavailableError, match=r"pip install '\.\[ray\]' in your clone"):
        rb.load_ray()


def test_ray_client_addresses_are_refused_in_one_line_that_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"^--ray-address ray://head:10001: Ray Client \(ray://\) is not supported; "
                                          r"run pslaunch on a node of the cluster"):
        rb.RayOptions(address="ray://head:10001")
    helps = {o.flags[0]: o.help for o in rb.RayBackend.options}
    assert "must run on a node of the cluster" in helps["--ray-address"] and "ray://" in helps["--ray-address"]


def test_an_address_is_owned_only_where_a_socket_binds_to_it() -> None:
    assert rb.owns_address("127.0.0.1")
    assert not rb.owns_address("10.202.250.99")  # (in the test nets the network guard allows; nobody has it)


class _Nodes:
    """Ray's ``nodes()`` as a dead actor's node answers it: still alive in the GCS's view."""

    def __init__(self, alive: bool) -> None:
        self.alive = alive

    def nodes(self) -> list[dict]:
        return [{"NodeID": "n1", "Alive": self.alive}]


def test_a_node_is_lost_when_ray_marks_it_dead_or_its_raylet_takes_no_connection() -> None:
    import socket

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert not rb.node_lost(_Nodes(True), "n1", "127.0.0.1", port)
        assert rb.node_lost(_Nodes(False), "n1", "127.0.0.1", port)
    assert rb.node_lost(_Nodes(True), "n1", "127.0.0.1", port)  # (closed now)
    assert not rb.node_lost(_Nodes(True), "n1", "127.0.0.1", 0)  # no raylet known: not said lost


def test_the_wrapper_outlives_the_pool_thread_that_started_it() -> None:
    """PR_SET_PDEATHSIG fires when the forking *thread* ends: the actor forks from a thread of its own."""
    import os
    import threading
    import time

    actor = rb.actor_class()()
    got: dict = {}
    caller = threading.Thread(target=lambda: got.update(child=actor.spawn(["sleep", "30"], dict(os.environ), "/")))
    caller.start()
    caller.join()
    child = got["child"]
    try:
        time.sleep(1.0)
        assert child.poll() is None, f"the wrapper ended with its caller's thread: {child.returncode}"
    finally:
        child.kill()
        child.wait()


def test_the_wrapper_gets_sigterm_when_the_actor_process_dies(tmp_path) -> None:
    import os
    import subprocess
    import sys

    from support.helpers import REPO, wait_for

    code = ("import os, sys; from launcher.backends import ray as rb\n"
            "c = rb.actor_class()().spawn(['sleep', '30'], dict(os.environ), '/')\n"
            "print(c.pid, flush=True); os._exit(0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    pid = int(r.stdout.split()[0])

    def gone() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[1].startswith("Z")
        except OSError:
            return True
    try:
        wait_for(gone, 10, interval=0.1, what="the wrapper to end with the actor")
    finally:
        if not gone():
            os.kill(pid, 9)


def test_an_error_ray_publishes_is_one_warning_line(caplog) -> None:
    import logging

    with caplog.at_level(logging.DEBUG, logger="launcher.backends.ray"):
        rb._ray_said({"lines": ["Raylet is terminated. Termination is unexpected.\n    [log line 1]\n    [log line 2]"],
                      "pid": "raylet"})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["Ray says: Raylet is terminated. Termination is unexpected."]
    assert "[log line 2]" in caplog.text
