"""What every kvstore type shares: the :class:`KVStore` interface, MXNet's argument forms, and
the in-process optimizer of the ``local``, ``device`` and ``dist_allreduce`` stores.

:mod:`trainer.kvstore` (``local``, ``device``, the parameter-server stores and ``create``) and
:mod:`trainer.collective` (``dist_allreduce``) build on it; neither imports the other's internals.
"""

from __future__ import annotations

from typing import Any, Union

import numpy as np
import torch

from trainer.kv.errors import KVConfigError
from trainer.kv.optim import ArrayOps, OptimizerError, Updater, create_optimizer

Key = Union[int, str]
#: The ``format`` of what :meth:`KVStore.get_optimizer_states` returns.
STATES_FORMAT = "pslaunch-kv-optimizer-states/1"


class _TorchForeach:
    """Multi-tensor operations (torch's ``_foreach_*``): one call for a list of tensors."""

    @staticmethod
    def mul_(xs: list[torch.Tensor], scalar: float) -> None:
        torch._foreach_mul_(xs, scalar)

    @staticmethod
    def mul(xs: list[torch.Tensor], scalar: float) -> list[torch.Tensor]:
        return list(torch._foreach_mul(xs, scalar))

    @staticmethod
    def add_(xs: list[torch.Tensor], ys: list[torch.Tensor], alpha: float) -> None:
        torch._foreach_add_(xs, ys, alpha=alpha)

    @staticmethod
    def clamp_(xs: list[torch.Tensor], lo: float, hi: float) -> None:
        torch._foreach_clamp_min_(xs, lo)
        torch._foreach_clamp_max_(xs, hi)


class _TorchOps(ArrayOps):
    """The optimizer's array functions for torch tensors (any device)."""

    foreach = _TorchForeach()

    @staticmethod
    def zeros_like(a: Any) -> Any:
        return torch.zeros_like(a)

    @staticmethod
    def sqrt(a: Any) -> Any:
        return torch.sqrt(a)

    @staticmethod
    def divide(a: Any, b: Any, out: Any) -> Any:
        return torch.div(a, b, out=out)

    @staticmethod
    def clip_(a: Any, bound: float) -> Any:
        return a.clamp_(-bound, bound)

    @staticmethod
    def scale_into(a: Any, scalar: float, out: Any) -> Any:
        return torch.mul(a, scalar, out=out)


TORCH_OPS = _TorchOps()


# --- argument normalization ---------------------------------------------------------------


def _tensor(v: Any, what: str) -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v) if not v.flags.writeable else v)
    raise KVConfigError(f"{what} must be a torch tensor or a numpy array, got {type(v).__name__}")


def _check_key(k: Any) -> Key:
    if isinstance(k, bool) or not isinstance(k, (int, str)):
        raise KVConfigError(f"a key must be an int or a str, got {k!r}")
    return k


def by_key(key: Any, value: Any, what: str) -> list[tuple[Key, list[torch.Tensor]]]:
    """``(key, value)`` as ``[(key, [tensor per device]), ...]``, MXNet style."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise KVConfigError(f"{len(key)} keys need a list of {len(key)} {what}s")
        out = []
        for k, v in zip(key, value):  # the training loop's case first: no isinstance chains
            if type(k) is not int and type(k) is not str:
                k = _check_key(k)
            out.append((k, [v] if type(v) is torch.Tensor else _devices(v, what)))
        return out
    return [(_check_key(key), _devices(value, what))]


def _devices(v: Any, what: str) -> list[torch.Tensor]:
    items = list(v) if isinstance(v, (list, tuple)) else [v]
    if not items:
        raise KVConfigError(f"an empty list is not a {what}")
    out = [t if type(t) is torch.Tensor else _tensor(t, what) for t in items]
    shape = out[0].shape
    for t in out[1:]:
        if t.shape != shape:
            raise KVConfigError(f"the {what}s of one key must have one shape: "
                                f"{tuple(shape)} and {tuple(t.shape)}")
    return out


def sum_values(values: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """A new tensor holding the sum of ``values``, on ``device`` (None: the first value's)."""
    dev = values[0].device if device is None else device
    acc = values[0].detach().to(dev, copy=True)
    for v in values[1:]:
        acc += v.detach().to(dev)
    return acc


# --- the stores ------------------------------------------------------------------------------


class KVStore:
    """The common interface (see :mod:`trainer.kvstore`). Create one with ``kvstore.create``."""

    def __init__(self, kvtype: str) -> None:
        self._type = kvtype
        self._updater: Updater | None = None
        self._spec: dict[str, Any] | None = None

    @property
    def type(self) -> str:
        """The store type: local, device, dist_sync, dist_device_sync or dist_async."""
        return self._type

    @property
    def rank(self) -> int:
        """This worker's rank (``DMLC_TASK_ID`` under pslaunch); 0 for local stores."""
        return 0

    @property
    def num_workers(self) -> int:
        """The number of workers; 1 for local stores."""
        return 1

    def init(self, key: Any, value: Any) -> None:
        """Register ``key`` (int or str, or a list of keys) with its initial value.

        Every worker calls it with the same keys, shapes and order; rank 0's
        value wins. It does not write into ``value``: pull to start from it.

        Args:
            key: a key or a list of keys.
            value: a tensor (or numpy array), a list of per-device tensors (the
                first is used), or one such entry per key.

        Raises:
            KVConfigError: a key initialised twice, a bad key or value type.
        """
        raise NotImplementedError

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        """Push a value, or the sum of a list of per-device values, for each key.

        With an optimizer set, the store applies it (update on kvstore);
        without one, the store keeps the sum (over workers, for dist_sync).
        ``priority`` is accepted for MXNet compatibility and ignored.

        Raises:
            KVConfigError: the key is not initialised or the shape differs.
            KVStoreError: a server refused an earlier request (dist).
            KVAbortError: the job was aborted (dist).
        """
        raise NotImplementedError

    def pull(self, key: Any, out: Any, priority: int = 0) -> None:
        """Copy the current value of each key into ``out`` (a tensor or a list of tensors).

        For dist stores the value includes this worker's own earlier pushes
        (dist_sync: the round they belong to has completed).
        """
        raise NotImplementedError

    def pushpull(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        """Push ``value`` and pull the result into ``out``, in one round trip when distributed."""
        self.push(key, value, priority)
        self.pull(key, out, priority)

    def set_optimizer(self, spec: dict[str, Any]) -> None:
        """Apply updates with an optimizer from the registry (sgd, nag, adam).

        Args:
            spec: a JSON-able dict such as ``{"name": "sgd", "learning_rate": 0.05,
                "momentum": 0.9, "wd": 1e-4, "rescale_grad": 1 / 128,
                "lr_scheduler": {"name": "multifactor", "step": [938], "factor": 0.1}}``.
                dist stores send it (as JSON) to the servers; every worker calls this.
                ``wd_mult`` maps keys (as strings) to factors on ``wd``; a dist store
                needs those keys initialised first, and a ``dist_async`` store needs
                an optimizer before its first push.

        Raises:
            KVConfigError: an unknown optimizer, option or scheduler, or a bad value.
        """
        raise NotImplementedError

    def get_optimizer_states(self) -> dict[str, Any]:
        """Everything needed to resume the optimizer: ``{"format", "optimizer",
        "states": {key: {"count": updates, "arrays": {name: CPU tensor}}}}``
        (fetched from the servers for dist stores)."""
        raise NotImplementedError

    def set_optimizer_states(self, states: dict[str, Any]) -> None:
        """Restore :meth:`get_optimizer_states` output (dist: rank 0's copy is used). The
        states go to the optimizer set with :meth:`set_optimizer`, if any (its hyper-parameters
        win); else the saved optimizer is installed."""
        raise NotImplementedError

    def barrier(self) -> None:
        """Wait for every worker (a no-op for a single process); with ``dist_async``,
        this worker's pushes have been applied by the time it returns."""

    def close(self) -> None:
        """End the job (dist: final barrier, rank 0 stops the servers)."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close()

    def _adopt_optimizer(self, spec: dict[str, Any]) -> Any:
        """The optimizer ``spec`` describes (a one-line KVConfigError if it is not one); its
        normalized spec becomes this store's, for get_optimizer_states()."""
        try:
            opt = create_optimizer(spec)
        except OptimizerError as e:
            raise KVConfigError(str(e)) from None
        self._spec = opt.to_spec()
        return opt

    @staticmethod
    def _states_dict(spec: dict[str, Any] | None, per_key: dict[Any, tuple[int, dict[str, Any]]]
                     ) -> dict[str, Any]:
        return {"format": STATES_FORMAT, "optimizer": spec,
                "states": {k: {"count": int(c), "arrays": dict(a)} for k, (c, a) in per_key.items()}}

    @staticmethod
    def _parse_states(states: dict[str, Any]) -> tuple[dict[str, Any] | None,
                                                       dict[Any, tuple[int, dict[str, Any]]]]:
        if not isinstance(states, dict) or states.get("format") != STATES_FORMAT:
            raise KVConfigError("not optimizer states from get_optimizer_states() "
                                f"(expected format {STATES_FORMAT!r})")
        per_key = {}
        for k, entry in states.get("states", {}).items():
            per_key[k] = (int(entry["count"]), {n: _tensor(a, "state") for n, a in
                                                 entry["arrays"].items()})
        return states.get("optimizer"), per_key


class InProcessUpdates(KVStore):
    """A store whose values and optimizer live in this process (``local``, ``device``,
    ``dist_allreduce``): a key's value in ``_store``, the updater and its states here."""

    def __init__(self, kvtype: str) -> None:
        super().__init__(kvtype)
        self._store: dict[Key, torch.Tensor] = {}

    def _stored(self, k: Key) -> torch.Tensor:
        s = self._store.get(k)
        if s is None:
            raise KVConfigError(f"key {k!r} is not initialised: call kv.init({k!r}, value) first")
        return s

    def set_optimizer(self, spec: dict[str, Any]) -> None:
        self._updater = Updater(self._adopt_optimizer(spec), TORCH_OPS)

    def get_optimizer_states(self) -> dict[str, Any]:
        if self._updater is None:
            return self._states_dict(None, {})
        per_key = {k: (c, {n: a.detach().to("cpu", copy=True) for n, a in arrays.items()})
                   for k, (c, arrays) in self._updater.get_states().items()}
        return self._states_dict(self._spec, per_key)

    def set_optimizer_states(self, states: dict[str, Any]) -> None:
        spec, per_key = self._parse_states(states)
        if self._updater is None:
            if spec is None:
                raise KVConfigError("no optimizer: call kv.set_optimizer(...) first")
            self.set_optimizer(spec)
        assert self._updater is not None
        restored = {}
        for k, (count, arrays) in per_key.items():
            stored = self._stored(k)
            restored[k] = (count, {n: a.to(stored.device, stored.dtype, copy=True).reshape(
                stored.shape) for n, a in arrays.items()})
        self._updater.set_states(restored)
