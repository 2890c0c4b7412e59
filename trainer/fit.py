"""Data-parallel training through a kvstore: devices, work-load split, metrics, checkpoints.

One training step on a worker:

1. the worker's batch (its slice of the global batch, :func:`trainer.data.epoch_batches`)
   is split across its devices in proportion to the work-load list
   (:func:`split_batch`, MXNet's ``_split_input_slice``);
2. each device runs forward and backward on its slice; the loss is the *sum*
   of the per-sample cross-entropies, as MXNet's ``SoftmaxOutput`` gradient is;
3. ``kv.pushpull`` sums the devices' gradients (and, for ``dist_*``, the
   workers'), the optimizer runs where the kvstore keeps the weights (on the
   servers for ``dist_*``, MXNet's update-on-kvstore), and the new weights are
   copied back into every device's replica. With parameter servers and one CPU
   device, the big layers' gradients leave during backward (:class:`Overlap`)
   and only the pull waits after it.

The optimizer's ``rescale_grad`` (:func:`rescale_grad`) turns the summed
gradient into a step: ``1/b`` for ``local`` and ``device``, ``1/(N*b)`` for
``dist_sync``/``dist_device_sync`` with N workers and batch b (one machine with
batch N*b), and ``1/(N*N*b)`` for ``dist_async``, where MXNet's ``1/b``
diverges (see :func:`rescale_grad` for why).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainer.data import MNIST, atomic_write, batches_per_epoch, epoch_batches
from trainer.data import split_batch as data_split_batch
from trainer.kv.recovery import resume_position
from trainer.metrics import MetricsFile
from trainer.models import create_model, num_parameters

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "pslaunch-train-mnist/1"
VALIDATION_BATCH = 1000
#: The stores whose pushes return before the servers answer: there :class:`Overlap` lets a
#: gradient travel while backward computes the next one.
OVERLAPPED = ("dist_sync", "dist_device_sync", "dist_async")


class FitError(RuntimeError):
    """A user-facing training error (bad checkpoint, bad split); the message is one line."""


@dataclass
class TrainConfig:
    """What to train and how; the defaults are those of MXNet's train_mnist.py."""

    network: str = "mlp"
    batch_size: int = 64
    num_epochs: int = 20
    lr: float = 0.05
    lr_factor: float = 0.1
    lr_step_epochs: tuple[int, ...] = (10,)
    optimizer: str = "sgd"
    mom: float = 0.9
    wd: float = 0.0001
    disp_batches: int = 100
    model_prefix: str | None = None
    save_period: int = 1
    load_epoch: int | None = None
    #: start from the newest complete checkpoint of model_prefix, or from scratch when there is none
    resume: bool = False
    #: also checkpoint every this many batches of an epoch (and at every epoch's end); 0: off
    checkpoint_every_batches: int = 0
    #: the launcher's attempt number (PSLAUNCH_ATTEMPT), for the log only
    attempt: int | None = None
    num_examples: int = 60000
    seed: int = 0
    devices: tuple[str, ...] = ("cpu",)
    work_load: tuple[float, ...] | None = None
    #: LeNet in channels-last layout; None: on CPU devices only.
    channels_last: bool | None = None
    progress: bool = False


# --- pieces ----------------------------------------------------------------------


def split_batch(batch_size: int, work_load: Sequence[float]) -> list[slice]:
    """:func:`trainer.data.split_batch`, raising :class:`FitError`."""
    try:
        return data_split_batch(batch_size, work_load)
    except ValueError as e:
        raise FitError(str(e)) from None


def _fmt_list(values: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in values)


def rescale_grad(kv_type: str, batch_size: int, num_workers: int) -> float:
    """The factor that turns the summed gradient the optimizer receives into a step.

    * ``local``, ``device``: ``1/b`` (the devices' slices sum to b).
    * ``dist_sync``, ``dist_device_sync``: ``1/(N*b)``. The servers sum the N
      workers' gradients and update once, so the run is one machine with batch N*b.
    * ``dist_async``: ``1/(N*N*b)``, where MXNet uses ``1/b``. The servers apply
      each push on its own, against one momentum buffer, to weights that the
      other workers moved since this worker pulled them. With ``1/b``, N workers
      take N full steps per round and it diverges at lr 0.05 and momentum 0.9
      (MXNet, and ours with that scaling, end at 10% accuracy). With ``1/(N*b)``
      a round moves the weights as far as one ``dist_sync`` step, but the
      staleness acts as extra momentum and LeNet's 2-worker runs ended anywhere
      from 0.973 to 0.984 after 2 epochs. Dividing by N once more damps that:
      0.983 to 0.987 in our runs, at least as good as ``dist_sync``. For N = 1 all
      three rules give ``1/b``.
    """
    if kv_type == "dist_async":
        return 1.0 / (batch_size * num_workers * num_workers)
    if kv_type.startswith("dist"):
        return 1.0 / (batch_size * num_workers)
    return 1.0 / batch_size


def lr_steps(step_epochs: Sequence[int], epoch_size: int, updates_per_batch: int) -> list[int]:
    """Scheduler steps in optimizer updates (MXNet: ``epoch_size * epoch``).

    The kvstore restores the update counts with the optimizer state, so the
    steps are absolute: a resumed run keeps the schedule of an uninterrupted one.
    ``updates_per_batch`` is N for ``dist_async``, whose servers count every
    worker's push, so the rate still drops at the epochs asked for.
    """
    return sorted({s * epoch_size * updates_per_batch for s in step_epochs if s > 0})


def wd_mult(names: Sequence[str]) -> dict[str, float]:
    """Per-key weight-decay factors, MXNet's rule: only weights (and batch-norm
    gammas) decay; biases and other parameters get 0. Keys are list positions."""
    return {str(i): 0.0 for i, name in enumerate(names)
            if not name.endswith(("weight", "gamma"))}


def optimizer_spec(cfg: TrainConfig, kv_type: str, num_workers: int, epoch_size: int,
                   names: Sequence[str] = ()) -> dict[str, Any]:
    """The JSON optimizer spec for ``kv.set_optimizer``; ``names`` are the
    parameter names in key order (for ``wd_mult``)."""
    spec: dict[str, Any] = {
        "name": cfg.optimizer,
        "learning_rate": cfg.lr,
        "wd": cfg.wd,
        "wd_mult": wd_mult(list(names)),
        "rescale_grad": rescale_grad(kv_type, cfg.batch_size, num_workers),
        "clip_gradient": None,
    }
    if cfg.optimizer in ("sgd", "nag"):
        spec["momentum"] = cfg.mom
    updates = num_workers if kv_type == "dist_async" else 1
    steps = lr_steps(cfg.lr_step_epochs, epoch_size, updates)
    if steps and cfg.lr_factor != 1.0:
        spec["lr_scheduler"] = {"name": "multifactor", "step": steps, "factor": cfg.lr_factor}
    return spec


def checkpoint_path(prefix: str | os.PathLike[str], epoch: int, batch: int = 0) -> Path:
    """``<prefix>-<epoch, 4 digits>.pt`` after ``epoch`` whole epochs, as MXNet names ``.params``
    files; ``<prefix>-<epoch>-<batch, 6 digits>.pt`` for ``batch`` batches into the next epoch
    (``--checkpoint-every-batches``)."""
    if batch:
        return Path(f"{os.fspath(prefix)}-{epoch:04d}-{batch:06d}.pt")
    return Path(f"{os.fspath(prefix)}-{epoch:04d}.pt")


#: what follows the prefix in a checkpoint's name (a temporary, ``NAME.pt.<pid>.<hex>.tmp``, never matches)
_CHECKPOINT_NAME = re.compile(r"-(\d{4,})(?:-(\d{6,}))?\.pt")


def list_checkpoints(prefix: str | os.PathLike[str]) -> list[tuple[tuple[int, int], Path]]:
    """The checkpoint files of ``prefix`` by name, newest position ``(epoch, batch)`` first.

    Only names are read: whether a file is complete is :func:`newest_checkpoint`'s question.
    """
    base = Path(prefix)
    try:
        names = os.listdir(base.parent)
    except OSError:
        return []
    found = []
    for name in names:
        m = _CHECKPOINT_NAME.fullmatch(name[len(base.name):]) if name.startswith(base.name) else None
        if m:
            found.append(((int(m[1]), int(m[2] or 0)), base.parent / name))
    return sorted(found, reverse=True)


def newest_checkpoint(prefix: str | os.PathLike[str], network: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest complete checkpoint of ``prefix`` and its state, or None when there is none.

    A file that does not load, or whose content does not say the position its name says,
    is skipped with a warning: the writer renames a file into place only once it is whole
    (:func:`save_checkpoint`), so such a file was cut or damaged by something else, and an
    older checkpoint is the one to trust.

    Raises:
        FitError: the newest complete checkpoint holds another network (a usage mistake).
    """
    for (epoch, batch), path in list_checkpoints(prefix):
        try:
            state = read_checkpoint(path)
        except FitError as e:
            log.warning("Skipping %s", e)
            continue
        if (state.get("epoch"), state.get("batch", 0)) != (epoch, batch) or not {"model", "optimizer"} <= set(state):
            log.warning("Skipping checkpoint %s: its content is not that of position epoch %d batch %d",
                        path, epoch, batch)
            continue
        _check_network(path, state, network)
        return path, state
    return None


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a crash of the machine, not only of the process)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write ``state`` with torch.save atomically: a temporary file beside it, fsync, rename.

    A process killed during the write leaves only the temporary (``NAME.pt.<pid>.<hex>.tmp``),
    which no checkpoint name matches; the file of the name is whole or absent.

    Raises:
        FitError: the file cannot be written (one line).
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save(state, f))
    except OSError as e:
        raise FitError(f"cannot write checkpoint {path}: {e.strerror or e}") from None
    _fsync_dir(path.parent)


def remove_checkpoints(prefix: str | os.PathLike[str], before: tuple[int, int]) -> None:
    """Delete the within-epoch checkpoints of ``prefix`` older than position ``before`` (a newer
    one is on disk), and temporaries that a killed writer left; whole-epoch ones stay."""
    for (epoch, batch), path in list_checkpoints(prefix):
        if batch and (epoch, batch) < before:
            with contextlib.suppress(OSError):
                path.unlink()
    base = Path(prefix)
    with contextlib.suppress(OSError):
        for name in os.listdir(base.parent):
            if name.startswith(base.name) and name.endswith(".tmp") and ".pt." in name:
                with contextlib.suppress(OSError):
                    (base.parent / name).unlink()


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Read a checkpoint of :func:`save_checkpoint`, of any network; raises FitError with one line."""
    if not path.is_file():
        raise FitError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for a bad file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FitError(f"cannot read checkpoint {path}: {reason}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise FitError(f"{path} is not a train_mnist checkpoint")
    return state


def _check_network(path: Path, state: dict[str, Any], network: str) -> None:
    if state.get("network") != network:
        raise FitError(f"checkpoint {path} holds a {state.get('network')} network, not {network}")


def load_checkpoint(path: Path, network: str) -> dict[str, Any]:
    """Read a checkpoint of :func:`save_checkpoint` for ``network``; raises FitError with one line."""
    state = read_checkpoint(path)
    _check_network(path, state, network)
    return state


def _check_resumable(path: Path, state: dict[str, Any], cfg: TrainConfig, num_workers: int) -> None:
    """A checkpoint taken inside an epoch continues that epoch's data order, which only the same
    batch size, examples, seed and number of workers give again."""
    saved = state.get("config", {})
    then = (saved.get("batch_size"), saved.get("num_examples"), saved.get("seed"), state.get("num_workers"))
    now = (cfg.batch_size, cfg.num_examples, cfg.seed, num_workers)
    if then != now:
        raise FitError(f"checkpoint {path} stopped inside an epoch of a run with --batch-size {then[0]}, "
                       f"--num-examples {then[1]}, --seed {then[2]} on {then[3]} worker(s); this run has "
                       f"{now[0]}, {now[1]}, {now[2]} on {now[3]}: resume with the same")


class Replicas:
    """One copy of the model per device, and the tensors the kvstore reads and writes."""

    def __init__(self, network: str, devices: Sequence[torch.device], seed: int,
                 channels_last: bool | None) -> None:
        base = create_model(network, seed=seed)
        self.devices = list(devices)
        self.models: list[nn.Module] = []
        for dev in self.devices:
            cl = channels_last if channels_last is not None else dev.type == "cpu"
            m = create_model(network, seed=None, channels_last=cl and network == "lenet")
            m.load_state_dict(base.state_dict())
            self.models.append(m.to(dev))
        self.names = [n for n, _ in self.models[0].named_parameters()]
        # Walking a module's parameters costs tens of microseconds; a step needs them three
        # times (gradients out, weights back, gradients cleared), so they are listed once.
        self.params = [list(m.parameters()) for m in self.models]
        # Detached views share the parameters' storage: the kvstore writes weights into them.
        self.weights = [[p.detach() for p in ps] for ps in self.params]

    @property
    def model(self) -> nn.Module:
        return self.models[0]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in self.models[0].state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for m in self.models:
            m.load_state_dict(state)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor,
                         slices: Sequence[slice]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Forward and backward of each device's slice; the summed-loss gradients land in ``.grad``.

        Returns:
            per device, the loss sum and the number of correct predictions (0-d tensors).
        """
        losses, correct = [], []
        for model, dev, sl in zip(self.models, self.devices, slices):
            xs = x[sl].to(dev, non_blocking=True)
            ys = y[sl].to(dev, non_blocking=True)
            out = model(xs)
            loss = F.cross_entropy(out, ys, reduction="sum")
            loss.backward()
            losses.append(loss.detach())
            correct.append((out.detach().argmax(1) == ys).sum())
        return losses, correct

    def grads(self) -> list[list[torch.Tensor]]:
        """Per parameter, the gradient of every device."""
        return [[p.grad for p in ps] for ps in zip(*self.params)]

    def outs(self) -> list[list[torch.Tensor]]:
        """Per parameter, the weight tensor of every device."""
        return [list(w) for w in zip(*self.weights)]

    def zero_grad(self) -> None:
        for ps in self.params:
            for p in ps:
                p.grad = None


class Overlap:
    """Gradients leave while backward is still running (:data:`OVERLAPPED` stores, one device).

    Backward produces the last layer's gradients first. Each parameter's gradient
    is pushed in backward order, in buckets of at least :data:`BUCKET_BYTES`, from a
    hook that runs as soon as autograd has written it (``register_post_accumulate_grad_hook``):
    the servers receive, sum and update the big layers while the worker computes
    the gradients of the first ones, as MXNet's engine does. :meth:`finish` pushes
    what is left and pulls every key, which waits only for the last bucket's round.
    A push copies what it sends (or ZeroMQ does), so the gradients may go at once.

    The kvstore's client belongs to the thread that trains: a hook that runs on
    another one (autograd runs a GPU's backward on a thread of its own) only
    collects, and :meth:`finish` sends it all. Where the cores are the limit
    this changes nothing (lenet, 2 workers and a server on 2 cores: 1,942 against
    1,945 samples/s per worker, median of 8); where the link takes time without
    taking a core, it hides fc1's transfer (the same over a 1 Gbit/s link: 1,021
    against 848).
    """

    #: A bucket leaves once it holds this many bytes of gradients (LeNet's fc1 is 1.6 MB,
    #: the MLP's 0.4 MB in all: one bucket for the MLP, two for LeNet).
    BUCKET_BYTES = 1 << 20

    def __init__(self, kv: Any, params: Sequence[torch.nn.Parameter], keys: Sequence[int]) -> None:
        self.kv = kv
        self.params, self.all_keys = list(params), list(keys)
        self._empty_bucket()
        self.pushed = False  # a bucket has left during this step's backward
        self.thread = threading.get_ident()
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(k)) for p, k in zip(params, keys)]

    def _hook(self, key: int) -> Any:
        def ready(p: torch.Tensor) -> None:
            g = p.grad
            assert g is not None
            self.keys.append(key)
            self.grads.append(g)
            self.bytes += g.numel() * g.element_size()
            if self.bytes >= self.BUCKET_BYTES and threading.get_ident() == self.thread:
                self._flush()
        return ready

    def _empty_bucket(self) -> None:
        self.keys: list[int] = []
        self.grads: list[torch.Tensor] = []
        self.bytes = 0

    def _flush(self) -> None:
        if self.keys:
            self.kv.push(self.keys, self.grads)
            self.pushed = True
            self._empty_bucket()

    def finish(self, outs: list[list[torch.Tensor]]) -> None:
        """Push the rest, then receive every key's new weights into ``outs``.

        When no bucket has left yet (a small model: all of it is one bucket), one
        ``pushpull`` of the gradients does it, which costs less than a push and a pull.
        """
        if not self.pushed:
            self._empty_bucket()
            self.kv.pushpull(self.all_keys, [[p.grad] for p in self.params], outs)
            return
        self._flush()
        self.pushed = False
        self.kv.pull(self.all_keys, outs)

    def close(self) -> None:
        """Remove the hooks (the model trains on without them)."""
        for h in self.handles:
            h.remove()
        self._empty_bucket()
        self.pushed = False

    def __enter__(self) -> Overlap:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def to_images(images: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """uint8 ``(N, 28, 28)`` to float32 ``(N, 1, 28, 28)`` in [0, 1], as MXNet's example scales."""
    return torch.from_numpy(images).to(device).unsqueeze(1).float().div_(255.0)


def evaluate(model: nn.Module, images: np.ndarray, labels: np.ndarray, device: torch.device) -> float:
    """Accuracy of ``model`` on a whole set, in batches of 1,000."""
    model.eval()
    correct = 0
    x_all = torch.from_numpy(images)
    y_all = torch.from_numpy(labels.astype(np.int64))
    with torch.inference_mode():
        for lo in range(0, len(labels), VALIDATION_BATCH):
            x = to_images(x_all[lo:lo + VALIDATION_BATCH].numpy(), device)
            y = y_all[lo:lo + VALIDATION_BATCH].to(device)
            correct += int((model(x).argmax(1) == y).sum())
    model.train()
    return correct / len(labels)


class _Bar:
    """A tqdm progress bar over an epoch's batches, or nothing."""

    def __init__(self, enabled: bool, total: int, epoch: int) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"Epoch[{epoch}]", unit="batch", leave=False,
                            file=sys.stderr, dynamic_ncols=True)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def postfix(self, **kw: Any) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**kw, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def _logging_around_bar(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[logging.getLogger("trainer")]):
        yield


#: the plot's colours: what ``tests`` count the points of (see ``plot_history``)
PLOT_INTERVAL_COLOR = "#1f77b4"    # train loss / accuracy every --disp-batches batches
PLOT_EPOCH_TRAIN_COLOR = "#ff7f0e"  # train loss / accuracy per epoch
PLOT_VALIDATION_COLOR = "#2ca02c"   # validation accuracy per epoch


def plot_history(path: str | os.PathLike[str], history: Sequence[dict[str, Any]], title: str,
                 intervals: Sequence[dict[str, Any]] = ()) -> None:
    """Loss and accuracy per epoch and per ``--disp-batches`` interval, drawn with matplotlib (Agg).

    The x axis counts epochs: an epoch's points sit at its end (1, 2, ...), an interval's at the
    fraction of its epoch done (0.25 after a quarter of the first epoch). Interval points are
    small dots joined by a faint line (blue, drawn on top), epoch points larger (train: orange
    squares, validation: green diamonds), each series in a colour of its own.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] + 1 for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    if intervals:
        xs = [p["x"] for p in intervals]
        for ax, key in ((ax_loss, "loss"), (ax_acc, "accuracy")):
            ax.plot(xs, [p[key] for p in intervals], color=PLOT_INTERVAL_COLOR, alpha=0.35, linewidth=1)
            # on top (zorder 3): an epoch's larger marker must not hide an interval's point
            ax.plot(xs, [p[key] for p in intervals], linestyle="none", marker="o", markersize=4,
                    color=PLOT_INTERVAL_COLOR, zorder=3, label=f"train, every {intervals[0]['batches']} batches")
    ax_loss.plot(epochs, [h["train_loss"] for h in history], marker="s", markersize=7,
                 color=PLOT_EPOCH_TRAIN_COLOR, label="train, per epoch")
    ax_acc.plot(epochs, [h["train_accuracy"] for h in history], marker="s", markersize=7,
                color=PLOT_EPOCH_TRAIN_COLOR, label="train, per epoch")
    ax_acc.plot(epochs, [h["validation_accuracy"] for h in history], marker="D", markersize=7,
                color=PLOT_VALIDATION_COLOR, label="validation, per epoch")
    ax_loss.set_ylabel("cross-entropy per sample")
    ax_acc.set_ylabel("accuracy")
    last = max(epochs + [p["x"] for p in intervals], default=1)
    for ax in (ax_loss, ax_acc):
        ax.set_xlabel("epoch")
        ax.set_xlim(0, last + 0.05 * max(last, 1))
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        if not intervals:
            ax.xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


# --- the loop ------------------------------------------------------------------------


def plot_title(cfg: TrainConfig, kv_type: str, num_workers: int) -> str:
    """The plot's title, which names the worker it shows: the interval and training figures are
    rank 0's own (each worker trains on its shard); the validation accuracy is of the weights
    every worker shares."""
    workers = f"{num_workers} worker{'s' if num_workers != 1 else ''}"
    return f"{cfg.network}, kv-store {kv_type}, batch {cfg.batch_size}: worker 0's curves (of {workers})"


def fit(cfg: TrainConfig, kv: Any, data: MNIST, *, plot: str | None = None,
        metrics: MetricsFile | None = None) -> dict[str, Any]:
    """Train ``cfg.network`` on this worker's shards through ``kv``; return the summary.

    Every worker calls this with the same configuration. Rank 0 writes the
    checkpoints and the plot; ``metrics`` (this worker's ``--metrics-file``) gets a line
    per logged interval and per epoch.

    Raises:
        FitError: a bad configuration or checkpoint, with a one-line message.
    """
    rank, num_workers, kv_type = kv.rank, kv.num_workers, kv.type
    devices = [torch.device(d) for d in cfg.devices]
    work_load = cfg.work_load or tuple(1.0 for _ in devices)
    if len(work_load) != len(devices):
        raise FitError(f"the work-load list {_fmt_list(work_load)} has {len(work_load)} entries for "
                       f"{len(devices)} devices")
    slices = split_batch(cfg.batch_size, work_load)
    num_train = len(data.train_labels)
    if not 1 <= cfg.num_examples <= num_train:
        raise FitError(f"--num-examples {cfg.num_examples} must be between 1 and {num_train}, the training set size")
    epoch_size = batches_per_epoch(cfg.num_examples, num_workers, cfg.batch_size)
    if cfg.load_epoch and cfg.resume:
        raise FitError("use --resume or --load-epoch, not both")
    if (cfg.load_epoch or cfg.resume or cfg.checkpoint_every_batches) and not cfg.model_prefix:
        raise FitError(f"{_resume_flag(cfg)} needs --model-prefix")
    begin_epoch = cfg.load_epoch or 0
    if begin_epoch >= cfg.num_epochs:
        raise FitError(f"--load-epoch {begin_epoch} leaves nothing to train with --num-epochs {cfg.num_epochs}")

    if rank == 0 and cfg.model_prefix:
        # Before the first epoch, not after it: a checkpoint that cannot be written is a usage error.
        folder = checkpoint_path(cfg.model_prefix, 1).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FitError(f"--model-prefix {cfg.model_prefix}: cannot create {folder}: {e.strerror or e}") from None

    torch.manual_seed(cfg.seed)
    replicas = Replicas(cfg.network, devices, cfg.seed, cfg.channels_last)
    history: list[dict[str, Any]] = []
    intervals: list[dict[str, Any]] = []  # one point per --disp-batches line, for the plot
    checkpoint, path = None, None
    if rank == 0 and cfg.load_epoch:
        path = checkpoint_path(cfg.model_prefix or "", cfg.load_epoch)
        checkpoint = load_checkpoint(path, cfg.network)
    elif rank == 0 and cfg.resume:
        found = newest_checkpoint(cfg.model_prefix or "", cfg.network)
        if found:
            path, checkpoint = found
            if checkpoint.get("batch", 0):
                _check_resumable(path, checkpoint, cfg, num_workers)
    if checkpoint is not None and path is not None:
        try:
            replicas.load_state_dict(checkpoint["model"])
        except RuntimeError as e:
            raise FitError(f"checkpoint {path} does not fit {cfg.network}: {str(e).splitlines()[0]}") from None
        history = list(checkpoint.get("history", []))
        intervals = list(checkpoint.get("intervals", []))
        if cfg.load_epoch:
            log.info('Loaded checkpoint from "%s" (epoch %d)', path, cfg.load_epoch)

    keys = list(range(len(replicas.names)))
    # Rank 0's weights win; every worker starts from them.
    kv.init(keys, [w for w in replicas.weights[0]])
    kv.pull(keys, replicas.outs())
    position = (begin_epoch, 0)
    restored = bool(cfg.load_epoch)
    if cfg.resume:
        restored, position = _rank0_position(kv, checkpoint)
        _log_resume(cfg, rank, path, restored, position)
        if rank == 0:
            remove_checkpoints(cfg.model_prefix or "", (0, 0))  # the temporaries of a killed writer
    spec = optimizer_spec(cfg, kv_type, num_workers, epoch_size, replicas.names)
    kv.set_optimizer(spec)
    if restored:  # every worker calls it (a collective), rank 0's states are used
        states = checkpoint["optimizer"] if checkpoint is not None else _empty_states(kv)
        kv.set_optimizer_states(states)
    if kv_type.startswith("dist"):
        log.info("Resizing training data to %d batches per machine", epoch_size)
    # A replacement of a lost worker (--restart-scope process) goes on where that one was: the
    # servers counted its pushes, so the job makes as many updates as an uninterrupted run.
    resumed_step = getattr(kv, "resume_step", None)
    if resumed_step is not None:
        position = resume_position(position, resumed_step, epoch_size)
        log.info("Replacing a lost worker: going on at epoch %d batch %d (step %d of this attempt, "
                 "from the servers)", *position, resumed_step)

    def save(epoch_done: int, batch: int) -> None:
        """Rank 0 writes the checkpoint of this position; then the older within-epoch ones go."""
        if rank != 0 or not cfg.model_prefix:
            return
        target = checkpoint_path(cfg.model_prefix, epoch_done, batch)
        save_checkpoint(target, {
            "format": CHECKPOINT_FORMAT,
            "network": cfg.network,
            "epoch": epoch_done,
            "batch": batch,
            "num_workers": num_workers,
            "model": replicas.state_dict(),
            "optimizer": kv.get_optimizer_states(),
            "history": history,
            "intervals": intervals,
            "config": _jsonable(asdict(cfg)),
        })
        remove_checkpoints(cfg.model_prefix, (epoch_done, batch))
        log.info('Saved checkpoint to "%s"', target)

    train_x = torch.from_numpy(data.train_images).unsqueeze(1)  # uint8, scaled per batch
    train_y = torch.from_numpy(data.train_labels.astype(np.int64))
    summary_epochs: list[dict[str, Any]] = []
    for epoch in range(position[0], cfg.num_epochs):
        first = position[1] if epoch == position[0] else 0
        order = torch.from_numpy(epoch_batches(num_train=num_train, num_examples=cfg.num_examples,
                                               epoch=epoch, seed=cfg.seed, rank=rank,
                                               num_workers=num_workers, batch_size=cfg.batch_size))
        tic = time.time()
        correct, loss, kv_time = _train_epoch(cfg, kv, replicas, keys, slices, train_x, train_y, order, epoch,
                                              intervals, first=first, save=save, metrics=metrics)
        toc = time.time()
        samples = (epoch_size - first) * cfg.batch_size
        log.info("Epoch[%d] Train-accuracy=%f", epoch, correct / samples)
        log.info("Epoch[%d] Time cost=%.3f", epoch, toc - tic)
        record = {
            "epoch": epoch,
            "time": round(toc - tic, 4),
            "samples_per_sec": round(samples / (toc - tic), 2),
            "train_accuracy": correct / samples,
            "train_loss": loss / samples,
            "kvstore_time": round(kv_time, 4),
        }
        if first:
            record["first_batch"] = first  # resumed inside this epoch: the figures cover the rest
        val_acc = evaluate(replicas.model, data.test_images, data.test_labels, devices[0])
        record["validation_accuracy"] = val_acc
        history.append(record)
        summary_epochs.append(record)
        if metrics is not None:
            metrics.write("epoch", **record)
        if (epoch + 1) % cfg.save_period == 0 or cfg.checkpoint_every_batches:
            save(epoch + 1, 0)
        log.info("Epoch[%d] Validation-accuracy=%f", epoch, val_acc)

    if plot and rank == 0:
        title = plot_title(cfg, kv_type, num_workers)
        try:
            plot_history(plot, history, title, intervals)
        except (OSError, ValueError) as e:  # (the format and directory were checked before training)
            raise FitError(f"--plot {plot}: cannot write it: {' '.join(str(e).split())}") from None
        log.info('Saved the plot to "%s"', plot)
    if not summary_epochs:  # resumed from the last epoch's checkpoint: nothing was left to train
        summary_epochs.append({"epoch": cfg.num_epochs - 1, "time": 0.0, "train_accuracy": None,
                               "validation_accuracy": evaluate(replicas.model, data.test_images,
                                                               data.test_labels, devices[0])})
    total_time = sum(e["time"] for e in summary_epochs)
    total_samples = sum(epoch_size - e.get("first_batch", 0) for e in summary_epochs
                        if e["train_accuracy"] is not None) * cfg.batch_size
    return {
        "network": cfg.network,
        "kv_store": kv_type,
        "rank": rank,
        "num_workers": num_workers,
        "devices": [str(d) for d in devices],
        "batch_size": cfg.batch_size,
        "batches_per_epoch": epoch_size,
        "parameters": num_parameters(replicas.model),
        "samples_per_sec": round(total_samples / total_time, 2) if total_time > 0 else None,
        "epoch_times": [e["time"] for e in summary_epochs],
        "train_accuracy": summary_epochs[-1]["train_accuracy"],
        "validation_accuracy": summary_epochs[-1]["validation_accuracy"],
        "epochs": summary_epochs,
        **({"resumed_at_step": resumed_step} if resumed_step is not None else {}),
    }


#: the kvstore key through which rank 0 tells every worker where a ``--resume`` starts
RESUME_KEY = "resume-position"


def _resume_flag(cfg: TrainConfig) -> str:
    if cfg.load_epoch:
        return "--load-epoch"
    return "--resume" if cfg.resume else "--checkpoint-every-batches"


def _rank0_position(kv: Any, checkpoint: dict[str, Any] | None) -> tuple[bool, tuple[int, int]]:
    """Whether rank 0 found a checkpoint, and its ``(epoch, batch)``, on every worker.

    Only rank 0 reads the checkpoint (its weights and optimizer states reach the others through
    ``kv.init`` and ``kv.set_optimizer_states``, as for ``--load-epoch``); the position travels the
    same way, as a key whose value is rank 0's. So every worker continues from the checkpoint
    rank 0 chose, even one that a file listing on another host would not show yet.
    """
    mine = torch.zeros(3, dtype=torch.float64)
    if checkpoint is not None:
        mine = torch.tensor([1, checkpoint["epoch"], checkpoint.get("batch", 0)], dtype=torch.float64)
    kv.init(RESUME_KEY, mine)
    kv.pull(RESUME_KEY, out=mine)
    found, epoch, batch = (int(v) for v in mine.tolist())
    return bool(found), (epoch, batch)


def _log_resume(cfg: TrainConfig, rank: int, path: Path | None, found: bool, position: tuple[int, int]) -> None:
    attempt = f" (attempt {cfg.attempt})" if cfg.attempt is not None else ""
    if not found:
        log.info("No complete checkpoint of %s: training from scratch%s", cfg.model_prefix, attempt)
    elif rank == 0:
        log.info('Resuming from checkpoint "%s" at epoch %d batch %d%s', path, *position, attempt)
    else:
        log.info("Resuming from rank 0's checkpoint at epoch %d batch %d%s", *position, attempt)


def _train_epoch(cfg: TrainConfig, kv: Any, replicas: Replicas, keys: list[int], slices: list[slice],
                 train_x: torch.Tensor, train_y: torch.Tensor, order: torch.Tensor,
                 epoch: int, intervals: list[dict[str, Any]] | None = None, *, first: int = 0,
                 save: Callable[[int, int], None] | None = None,
                 metrics: MetricsFile | None = None) -> tuple[int, float, float]:
    """One epoch of this worker's batches from batch ``first`` on (a resumed epoch skips the
    batches done); logs MXNet's Speedometer lines (and appends each line's window to
    ``intervals``: ``x`` in epochs, ``accuracy``, ``loss`` per sample; and writes it to
    ``metrics``). With
    ``cfg.checkpoint_every_batches`` K, ``save(epoch, b)`` runs after every K-th batch but the last
    (the epoch's own checkpoint follows that one).

    Returns:
        the number of correct predictions, the summed loss, and the seconds spent in the
        kvstore after backward (the gradient exchange and, for dist_*, waiting for the other
        workers; the pushes that :class:`Overlap` makes during backward count as backward).
    """
    # Running totals stay on their devices; reading them (which waits for a GPU) happens only
    # when a line is logged and at the end.
    correct_acc = [torch.zeros((), dtype=torch.int64, device=d) for d in replicas.devices]
    loss_acc = [torch.zeros((), dtype=torch.float64, device=d) for d in replicas.devices]
    shown_correct = 0
    shown_loss = 0.0
    window_samples = 0
    kv_time = 0.0
    # Parameter servers and one device: gradients leave during backward. Several devices sum
    # theirs first, and dist_allreduce's push is a blocking collective: nothing would overlap.
    overlap = (Overlap(kv, replicas.params[0], keys)
               if kv.type in OVERLAPPED and len(replicas.models) == 1 else None)
    bar = _Bar(cfg.progress, len(order) - first, epoch)
    window_tic = time.time()
    with _logging_around_bar(cfg.progress), (overlap or contextlib.nullcontext()):
        for nbatch in range(first, len(order)):
            idx = order[nbatch]
            x = train_x.index_select(0, idx).float().div_(255.0)
            y = train_y.index_select(0, idx)
            losses, correct = replicas.forward_backward(x, y, slices)
            t_kv = time.perf_counter()
            if overlap is not None:
                overlap.finish(replicas.outs())
            else:
                kv.pushpull(keys, replicas.grads(), replicas.outs())
            kv_time += time.perf_counter() - t_kv
            replicas.zero_grad()
            for acc, c in zip(correct_acc, correct):
                acc += c
            for acc, loss in zip(loss_acc, losses):
                acc += loss
            window_samples += cfg.batch_size
            bar.update()
            if cfg.disp_batches and nbatch % cfg.disp_batches == 0:
                # MXNet's Speedometer: the clock starts at batch 0, then one line every
                # disp_batches batches with the accuracy since the previous line.
                now = time.time()
                if nbatch > first:
                    total = sum(int(c) for c in correct_acc)
                    speed = window_samples / max(now - window_tic, 1e-9)
                    accuracy = (total - shown_correct) / window_samples
                    log.info("Epoch[%d] Batch [%d-%d]\tSpeed: %.2f samples/sec\taccuracy=%f",
                             epoch, nbatch - cfg.disp_batches, nbatch, speed, accuracy)
                    bar.postfix(speed=f"{speed:.0f}/s", acc=f"{accuracy:.4f}")
                    total_loss = sum(float(v) for v in loss_acc)
                    window_loss = (total_loss - shown_loss) / window_samples
                    shown_loss = total_loss
                    if intervals is not None:
                        intervals.append({"x": epoch + (nbatch + 1) / len(order), "accuracy": accuracy,
                                          "loss": window_loss, "batches": cfg.disp_batches})
                    if metrics is not None:
                        metrics.write("interval", epoch=epoch, batch=nbatch, batches=cfg.disp_batches,
                                      samples_per_sec=round(speed, 2), accuracy=accuracy, loss=window_loss)
                    shown_correct, window_samples = total, 0
                window_tic = now
            done = nbatch + 1
            if save is not None and cfg.checkpoint_every_batches and done % cfg.checkpoint_every_batches == 0 \
                    and done < len(order):
                save(epoch, done)
    bar.close()
    return sum(int(c) for c in correct_acc), sum(float(v) for v in loss_acc), kv_time


def _empty_states(kv: Any) -> dict[str, Any]:
    """What a worker other than rank 0 passes to the collective ``set_optimizer_states``."""
    from trainer.kvbase import STATES_FORMAT

    return {"format": STATES_FORMAT, "optimizer": None, "states": {}}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
