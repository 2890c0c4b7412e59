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
