"""An MXNet-shaped KVStore for PyTorch tensors: local, device and parameter-server stores.

Example:
    >>> from trainer import kvstore
    >>> kv = kvstore.create("local")
    >>> kv.init(3, torch.ones(2, 3))
    >>> kv.push(3, [torch.ones(2, 3), torch.ones(2, 3)])   # two "devices", summed
    >>> out = torch.empty(2, 3); kv.pull(3, out)             # out == 2

Types (matched like MXNet, by name):

* ``local``: values from several devices are summed on the CPU; the store lives on the CPU.
* ``device``: values are summed on the first value's device, where the store lives.
* ``dist_sync`` / ``dist_device_sync`` / ``dist_async``: through the parameter
  servers (:mod:`trainer.kv`); ``dist_device_sync`` sums the local devices on
  the first device before pushing. Rank 0's ``init`` value wins, and with
  ``set_optimizer`` the servers apply the updates (MXNet's update_on_kvstore),
  so ``pull`` returns weights.

Like ``import mxnet``, importing this module in a process whose ``DMLC_ROLE``
is ``scheduler`` or ``server`` runs that role and exits; torch is not
imported on those roles.
"""

from __future__ import annotations

import os

import pscontract as pc

if os.environ.get(pc.ROLE, "").strip().lower() in ("scheduler", "server"):
    from trainer.kv.role import run_role as _run_role

    _run_role()

import atexit  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from typing import Any, NoReturn, Union

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trainer.kv.errors import (  # noqa: E402
    KVAbortError,
    KVAuthError,
    KVConfigError,
    KVStoreError,
    KVTimeoutError,
)
from trainer.kv.optim import ArrayOps, OptimizerError, Updater, create_optimizer  # noqa: E402

__all__ = ["create", "KVStore", "run_role", "KVStoreError", "KVConfigError", "KVAbortError",
           "KVAuthError", "KVTimeoutError", "TYPES"]

logger = logging.getLogger(__name__)

Key = Union[int, str]
#: The store types :func:`create` accepts.
TYPES = ("local", "device", "dist_sync", "dist_device_sync", "dist_async", "dist_allreduce")
_ALIASES = {"dist": "dist_sync", "dist_sync_device": "dist_device_sync",
            "local_update_cpu": "local", "local_allreduce_cpu": "local",
            "local_allreduce_device": "device"}
STATES_FORMAT = "pslaunch-kv-optimizer-states/1"


def run_role() -> NoReturn:
    """Run the scheduler or server role named by ``DMLC_ROLE``, then exit the process."""
    from trainer.kv.role import run_role as role

    role(())


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


def _group(key: Any, value: Any, what: str) -> list[tuple[Key, list[torch.Tensor]]]:
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


def _sum(values: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """A new tensor holding the sum of ``values``, on ``device`` (None: the first value's)."""
    dev = values[0].device if device is None else device
    acc = values[0].detach().to(dev, copy=True)
    for v in values[1:]:
        acc += v.detach().to(dev)
    return acc


def _flat_numpy(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A flat numpy array with ``t``'s data, and whether it is a private copy."""
    if t.is_cpu and t.is_contiguous() and t.dtype is not torch.bfloat16:  # the common case
        return (t.detach() if t.requires_grad else t).numpy().reshape(-1), False
    if t.dtype == torch.bfloat16:
        raise KVConfigError("bfloat16 tensors cannot go through the kvstore; use float32 or float16")
    t = t.detach()
    if t.device.type == "cpu" and t.is_contiguous():
        return t.reshape(-1).numpy(), False
    return t.reshape(-1).to("cpu", copy=True).contiguous().numpy(), True


# --- the stores ------------------------------------------------------------------------------


class KVStore:
    """The common interface (see the module docstring). Create one with :func:`create`."""

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


class _InProcessUpdates(KVStore):
    """A store whose optimizer runs in this process (``local``, ``device``, ``dist_allreduce``):
    the updater and its states live here; a subclass says where a key's value is (``_stored``)."""

    def _stored(self, k: Key) -> torch.Tensor:
        raise NotImplementedError

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


class _LocalStore(_InProcessUpdates):
    """``local`` and ``device``: one process, several devices."""

    def __init__(self, kvtype: str) -> None:
        super().__init__(kvtype)
        self._on_device = kvtype == "device"
        self._store: dict[Key, torch.Tensor] = {}

    def _home(self, v: torch.Tensor) -> torch.device:
        return v.device if self._on_device else torch.device("cpu")

    def init(self, key: Any, value: Any) -> None:
        for k, vals in _group(key, value, "value"):
            if k in self._store:
                raise KVConfigError(f"key {k!r} was already initialised; init each key once")
            self._store[k] = vals[0].detach().to(self._home(vals[0]), copy=True)

    def _stored(self, k: Key) -> torch.Tensor:
        s = self._store.get(k)
        if s is None:
            raise KVConfigError(f"key {k!r} is not initialised: call kv.init({k!r}, value) first")
        return s

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        keys, stored, merged = [], [], []
        cpu = None if self._on_device else torch.device("cpu")
        for k, vals in _group(key, value, "value"):
            s = self._stored(k)
            if vals[0].shape != s.shape:
                raise KVConfigError(f"key {k!r} holds shape {tuple(s.shape)}, got "
                                    f"{tuple(vals[0].shape)}")
            if len(vals) == 1:  # read as it is (the updater leaves it alone), or converted
                m = vals[0].detach().to(s.device, s.dtype)
            else:
                m = _sum(vals, cpu).to(s.device, s.dtype)
            keys.append(k)
            stored.append(s)
            merged.append(m)
        if self._updater is not None:
            if len(set(keys)) == len(keys):  # one multi-tensor step for every key
                self._updater.update_many(keys, stored, merged)
            else:  # a key twice in one call: one step after the other, as MXNet does
                for k, s, m in zip(keys, stored, merged):
                    self._updater(k, s, m.clone())
        else:
            for s, m in zip(stored, merged):
                s.copy_(m)

    def pull(self, key: Any, out: Any, priority: int = 0) -> None:
        outs_all, srcs = [], []
        for k, outs in _group(key, out, "out"):
            stored = self._stored(k)
            for o in outs:
                if o.shape != stored.shape:
                    raise KVConfigError(f"key {k!r} holds shape {tuple(stored.shape)}, but the "
                                        f"out tensor has {tuple(o.shape)}")
                outs_all.append(o)
                srcs.append(stored)
        torch._foreach_copy_(outs_all, srcs)


# Open dist stores, kept alive until closed: a store the program dropped without
# close() still ends the job properly at exit (MXNet's destructor does that).
_live: set[_DistStore] = set()
_uncaught: list[BaseException] = []


def _excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
    _uncaught.append(exc)
    if isinstance(exc, (KVAbortError, KVAuthError, KVTimeoutError)):
        # The job failed elsewhere, or the cluster is unreachable: a traceback of
        # this worker would only hide the one line that says why.
        logger.error("kvstore: %s: %s", exc_type.__name__, exc)
        return
    _previous_hook(exc_type, exc, tb)


def _install_excepthook() -> None:
    global _previous_hook
    if sys.excepthook is not _excepthook:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


_previous_hook = sys.excepthook


def _at_exit() -> None:
    for store in list(_live):
        store._end_of_process()


class _DistStore(KVStore):
    """``dist_sync``, ``dist_device_sync`` and ``dist_async``: through the parameter servers."""

    def __init__(self, kvtype: str) -> None:
        super().__init__(kvtype)
        from pscontract import ClusterEnv, ClusterEnvError
        from trainer.kv.client import KVClient
        from trainer.kv.transport import check_dist_env, setup_logging

        try:
            env = ClusterEnv.from_environ(os.environ)
        except ClusterEnvError as e:
            raise KVConfigError(f"{kvtype}: {e}") from None
        if env.role != "worker":
            raise KVConfigError(f"a {kvtype} kvstore is created by workers, but {pc.ROLE}="
                                f"{env.role}: import trainer.kvstore first, it runs that role")
        setup_logging(env.verbose)
        _install_excepthook()
        self._device_sum = "device" in kvtype
        self._client = KVClient(env, check_dist_env(env), asynchronous=kvtype == "dist_async")
        self._shapes: dict[Key, tuple[torch.Size, torch.dtype]] = {}
        self._staging: dict[Key, np.ndarray] = {}
        _live.add(self)

    @property
    def rank(self) -> int:
        return self._client.rank

    @property
    def num_workers(self) -> int:
        return self._client.num_workers

    def _merged(self, vals: list[torch.Tensor]) -> tuple[np.ndarray, bool]:
        if len(vals) == 1:
            return _flat_numpy(vals[0])
        dev = None if self._device_sum else torch.device("cpu")
        arr, _ = _flat_numpy(_sum(vals, dev))
        return arr, True

    def _check(self, k: Key, t: torch.Tensor) -> None:
        shape = self._shapes.get(k)
        if shape is None:
            raise KVConfigError(f"key {k!r} is not initialised: call kv.init({k!r}, value) first, "
                                "on every worker")
        if t.shape != shape[0]:
            raise KVConfigError(f"key {k!r} holds shape {tuple(shape[0])}, got {tuple(t.shape)}")

    def init(self, key: Any, value: Any) -> None:
        groups = _group(key, value, "value")
        arrays = []
        for k, vals in groups:
            if k in self._shapes:
                raise KVConfigError(f"key {k!r} was already initialised; init each key once")
            arrays.append(_flat_numpy(vals[0])[0])
        self._client.init([k for k, _ in groups], arrays)
        for k, vals in groups:
            self._shapes[k] = (vals[0].shape, vals[0].dtype)

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        if type(value) is torch.Tensor and type(key) in (int, str):  # one key, one device
            self._check(key, value)
            arr, owned = _flat_numpy(value)
            self._client.push((key,), (arr,), owned=owned)
            return
        groups = _group(key, value, "value")
        arrays, owned = [], True
        for k, vals in groups:
            self._check(k, vals[0])
            arr, mine = self._merged(vals)
            arrays.append(arr)
            owned = owned and mine
        self._client.push([k for k, _ in groups], arrays, owned=owned)

    def _dests(self, groups: list[tuple[Key, list[torch.Tensor]]]) -> list[np.ndarray]:
        dests = []
        for k, outs in groups:
            self._check(k, outs[0])
            first = outs[0]
            if (first.device.type == "cpu" and first.is_contiguous()
                    and first.dtype == self._shapes[k][1]):
                dests.append(first.detach().reshape(-1).numpy())
            else:
                buf = self._staging.get(k)
                if buf is None:
                    dt = torch.empty(0, dtype=self._shapes[k][1]).numpy().dtype
                    buf = self._staging[k] = np.empty(first.numel(), dt)
                dests.append(buf)
        return dests

    def _fan_out(self, groups: list[tuple[Key, list[torch.Tensor]]],
                 dests: list[np.ndarray]) -> None:
        for (k, outs), dest in zip(groups, dests):
            src = outs[0]
            if dest is self._staging.get(k):  # not received in place: copy it over
                src = torch.from_numpy(dest).reshape(outs[0].shape)
                outs[0].copy_(src)
            for o in outs[1:]:
                o.copy_(src)

    def _direct(self, key: Any, out: Any) -> np.ndarray | None:
        """``out``'s own memory as a flat array when it can receive the value directly."""
        if (type(out) is torch.Tensor and type(key) in (int, str) and out.is_cpu
                and out.is_contiguous()):
            self._check(key, out)
            if out.dtype == self._shapes[key][1]:
                return (out.detach() if out.requires_grad else out).numpy().reshape(-1)
        return None

    def pull(self, key: Any, out: Any, priority: int = 0) -> None:
        dest = self._direct(key, out)
        if dest is not None:
            self._client.pull((key,), (dest,))
            return
        groups = _group(key, out, "out")
        dests = self._dests(groups)
        self._client.pull([k for k, _ in groups], dests)
        self._fan_out(groups, dests)

    def pushpull(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        dest = self._direct(key, out)
        if dest is not None and type(value) is torch.Tensor:
            self._check(key, value)
            self._client.push((key,), (_flat_numpy(value)[0],), dests=(dest,), owned=True)
            return
        groups = _group(key, value, "value")
        out_groups = _group(key, out, "out")
        arrays = []
        for k, vals in groups:
            self._check(k, vals[0])
            arrays.append(self._merged(vals)[0])
        dests = self._dests(out_groups)
        self._client.push([k for k, _ in groups], arrays, dests=dests, owned=True)
        self._fan_out(out_groups, dests)

    def set_optimizer(self, spec: dict[str, Any]) -> None:
        self._adopt_optimizer(spec)
        self._client.set_optimizer(self._spec)

    def get_optimizer_states(self) -> dict[str, Any]:
        spec, per_key = self._client.get_states()
        out = {}
        for k, (count, arrays) in per_key.items():
            shape = self._shapes[k][0]
            out[k] = (count, {n: torch.from_numpy(a).reshape(shape) for n, a in arrays.items()})
        return self._states_dict(spec, out)

    def set_optimizer_states(self, states: dict[str, Any]) -> None:
        spec, per_key = self._parse_states(states)
        flat = {}
        for k, (count, arrays) in per_key.items():
            if k not in self._shapes:
                raise KVConfigError(f"optimizer state for key {k!r}, which is not initialised")
            flat[k] = (count, {n: _flat_numpy(a)[0] for n, a in arrays.items()})
        # The optimizer this run set wins over the one saved with the states (a resumed run
        # with a new --lr uses it), as in the local stores; the saved one serves if none was set.
        self._client.set_states(self._spec if self._spec is not None else spec, flat)

    def barrier(self) -> None:
        self._client.barrier()

    def close(self) -> None:
        _live.discard(self)
        self._client.close()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        failed = exc is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None))
        if failed:
            _live.discard(self)
            self._client.fail(f"{exc_type.__name__}: {exc}")
        else:
            self.close()

    def _end_of_process(self) -> None:
        """At interpreter exit without close(): close, or report the uncaught exception."""
        _live.discard(self)
        client = self._client
        if client.closed:
            return
        try:
            if _uncaught:
                exc = _uncaught[-1]
                client.fail(f"{type(exc).__name__}: {exc}")
            elif client.aborted:
                client.fail(client.aborted)
            else:
                client.close()
        except KVStoreError as e:
            logger.error("kvstore: %s", e)


atexit.register(_at_exit)


def create(name: str = "local") -> KVStore:
    """Create a kvstore: ``local``, ``device``, ``dist_sync``, ``dist_device_sync``, ``dist_async`` or
    ``dist_allreduce`` (:mod:`trainer.collective`, under ``pslaunch --tracker torch``).

    Raises:
        KVConfigError: unknown type, or a dist type outside a job (no contract, no secret).
        KVStoreError: the parameter-server job could not be joined (timeout, auth, abort).
    """
    if not isinstance(name, str):
        raise KVConfigError(f"a kvstore type is a string such as 'dist_sync', got {name!r}")
    kvtype = _ALIASES.get(name.lower(), name.lower())
    if kvtype not in TYPES:
        raise KVConfigError(f"unknown kvstore type {name!r}; use one of {', '.join(TYPES)}")
    if kvtype == "dist_allreduce":  # no servers: torch.distributed (trainer.collective)
        from trainer.collective import AllreduceStore

        return AllreduceStore()
    if kvtype.startswith("dist"):
        return _DistStore(kvtype)
    return _LocalStore(kvtype)

