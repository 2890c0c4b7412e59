"""Lightning's DDP on the CPU, as a torchrun user writes it, for tests/integration/test_torch_libraries.py.

``Trainer(accelerator="cpu", devices=LOCAL_WORLD_SIZE, num_nodes=GROUP_WORLD_SIZE, strategy="ddp")``
(``devices`` is per node, as under ``torchrun --nproc-per-node``: Lightning checks that devices x
nodes is ``WORLD_SIZE``) fits a linear model on a fixed regression set. Started by a launcher that
speaks torchrun's contract, Lightning must pick ``TorchElasticEnvironment`` and start no process of
its own; each rank writes ``<out>/rank-<global rank>.json``: its pid, the cluster environment
Lightning chose, how many processes its strategy's launcher started (Lightning's own process
starter, which starts the other ranks unless they come from outside), the processes under it
while it trains, the mean loss of every epoch, and the final parameters (DDP keeps them equal on
every rank).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch


class Regression(L.LightningModule):
    """y = X w + b on a fixed set: its loss falls epoch by epoch when the gradients are right."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.epoch_losses: list[float] = []
        self._sum = 0.0
        self._count = 0
        self.children_while_training: list[str] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self._sum += float(loss.detach())
        self._count += 1
        return loss

    def on_train_start(self) -> None:
        # Lightning's own launcher (a torchrun user's mistake it guards against) would have started
        # copies of this script by now: what runs under this process?
        self.children_while_training = _children(os.getpid())

    def on_train_epoch_end(self) -> None:
        self.epoch_losses.append(self._sum / max(self._count, 1))
        self._sum, self._count = 0.0, 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _children(pid: int) -> list[str]:
    """Command lines of the processes under ``pid`` (from /proc: no library needed)."""
    out: list[str] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
        for k in kids:
            try:
                out.append(Path(f"/proc/{k}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
            except OSError:
                continue
            todo.append(k)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=4)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    L.seed_everything(0, verbose=False)
    model = Regression()
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")), max_epochs=a.epochs,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=a.out)
    trainer.fit(model, data)
    strategy = trainer.strategy
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "world_size": trainer.world_size,
        "node_rank": trainer.node_rank,
        "cluster_environment": type(strategy.cluster_environment).__name__,
        "creates_processes_externally": strategy.cluster_environment.creates_processes_externally,
        # DDP always has a launcher (_SubprocessScriptLauncher); it starts the other ranks itself
        # (its procs) unless the cluster environment says they come from outside
        "launcher_procs": len(getattr(strategy.launcher, "procs", [])),
        "strategy": type(strategy).__name__,
        "children_while_training": model.children_while_training,
        "epoch_losses": model.epoch_losses,
        "params": [float(v) for v in torch.cat([p.detach().flatten() for p in model.parameters()])],
        "lightning": L.__version__,
        "state": trainer.state.status.value,
    }
    Path(a.out, f"rank-{trainer.global_rank}.json").write_text(json.dumps(record))
    print(f"lightning rank {trainer.global_rank} pid {os.getpid()}: {record['cluster_environment']}, "
          f"losses {[f'{v:.4f}' for v in model.epoch_losses]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
