"""A DDP program that ends as the usual tutorial script ends (gloo on the CPU, no GPU needed).

It joins with ``init_process_group("gloo")`` (``env://``: torchrun's or ``pslaunch --tracker
torch``'s variables), trains a small linear model with DistributedDataParallel for ``--epochs``
epochs over a synthetic data set split by a DistributedSampler, and rank 0 saves a snapshot
(``torch.save``) after each epoch while the others go on. After the last epoch every rank calls
``destroy_process_group()`` and exits 0: rank 0 is still writing its last snapshot when the others
leave, the order in which a job's clean end happens in practice.

``--exit-at-once``: after all that, each rank leaves with ``os._exit(0)`` (its output flushed),
without the interpreter's finalization, where torch's gloo backend has a race of its own that
aborts a rank now and then (tests/bin/gloo_exit_race.py; docs/collective.md, "A rank aborts at
exit").

``--snapshot PATH`` is where rank 0 writes (a temporary directory's file by default);
``--rows`` and ``--snapshot-mb`` size the data set and the snapshot (a larger one is written
longer after the others left).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--snapshot", default=None)
    ap.add_argument("--snapshot-mb", type=float, default=4.0, help="size of the extra tensor in each snapshot")
    ap.add_argument("--exit-at-once", action="store_true", help="os._exit(0) after destroy_process_group()")
    a = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.rand(a.rows, 20, generator=g), torch.rand(a.rows, 1, generator=g))
    loader = DataLoader(data, batch_size=a.batch, sampler=DistributedSampler(data))
    model = DistributedDataParallel(torch.nn.Linear(20, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    snapshot = a.snapshot or os.path.join(tempfile.gettempdir(), f"ddp_epochs-{os.getpid()}.pt")
    ballast = torch.zeros(int(a.snapshot_mb * 2**20 / 4))
    for epoch in range(a.epochs):
        loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for x, y in loader:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        print(f"rank {rank}: epoch {epoch} done", flush=True)
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "ballast": ballast}, snapshot)
            print(f"rank 0: epoch {epoch} snapshot saved at {snapshot}", flush=True)
    dist.destroy_process_group()
    if rank == 0 and not a.snapshot:
        os.unlink(snapshot)
    if a.exit_at_once:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
