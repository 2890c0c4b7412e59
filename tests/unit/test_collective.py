"""trainer/collective.py without a job: the GPU share of a worker, and the store's one-line error
outside a torch.distributed job."""

from __future__ import annotations

import pytest

from trainer import kvstore
from trainer.collective import worker_gpus


@pytest.mark.parametrize("gpus, env, expected", [
    ([0, 1], {}, [0, 1]),                                                  # alone: all of them
    ([0, 1, 2, 3], {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, [2, 3]),  # cuda:LOCAL_RANK blocks
    ([4, 5], {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, [5]),
    ([0], {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}, [0]),
])
def test_worker_gpus(gpus, env, expected) -> None:
    assert worker_gpus(gpus, env) == expected


@pytest.mark.parametrize("gpus", [[0], [0, 1, 2]])
def test_worker_gpus_refuses_an_uneven_share(gpus) -> None:
    with pytest.raises(ValueError, match="2 workers share this host"):
        worker_gpus(gpus, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"})


def test_allreduce_outside_a_torch_job_is_one_line(monkeypatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(kvstore.KVConfigError, match=r"dist_allreduce needs torch.distributed's variables \(RANK, "
                       r"WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set\): "
                       r"start the workers with pslaunch --tracker torch"):
        kvstore.create("dist_allreduce")
