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
from typing import Any, NoReturn

import numpy as np  # noqa: E402
import torch  # noqa: E402

from trainer.kv.errors import (  # noqa: E402
    KVAbortError,
    KVAuthError,
    KVConfigError,
    KVStoreError,
    KVTimeoutError,
)
from trainer.kvbase import InProcessUpdates, Key, KVStore, by_key, sum_values  # noqa: E402

__all__ = ["create", "KVStore", "run_role", "KVStoreError", "KVConfigError", "KVAbortError",
           "KVAuthError", "KVTimeoutError", "TYPES"]

logger = logging.getLogger(__name__)

#: The store types :func:`create` accepts.
TYPES = ("local", "device", "dist_sync", "dist_device_sync", "dist_async", "dist_allreduce")
_ALIASES = {"dist": "dist_sync", "dist_sync_device": "dist_device_sync",
            "local_update_cpu": "local", "local_allreduce_cpu": "local",
            "local_allreduce_device": "device"}


def run_role() -> NoReturn:
    """Run the scheduler or server role named by ``DMLC_ROLE``, then exit the process."""
    from trainer.kv.role import run_role as role

    role(())


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


class _LocalStore(InProcessUpdates):
    """``local`` and ``device``: one process, several devices."""

    def __init__(self, kvtype: str) -> None:
        super().__init__(kvtype)
        self._on_device = kvtype == "device"

    def _home(self, v: torch.Tensor) -> torch.device:
        return v.device if self._on_device else torch.device("cpu")

    def init(self, key: Any, value: Any) -> None:
        for k, vals in by_key(key, value, "value"):
            if k in self._store:
                raise KVConfigError(f"key {k!r} was already initialised; init each key once")
            self._store[k] = vals[0].detach().to(self._home(vals[0]), copy=True)

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        keys, stored, merged = [], [], []
        cpu = None if self._on_device else torch.device("cpu")
        for k, vals in by_key(key, value, "value"):
            s = self._stored(k)
            if vals[0].shape != s.shape:
                raise KVConfigError(f"key {k!r} holds shape {tuple(s.shape)}, got "
                                    f"{tuple(vals[0].shape)}")
            if len(vals) == 1:  # read as it is (the updater leaves it alone), or converted
                m = vals[0].detach().to(s.device, s.dtype)
            else:
                m = sum_values(vals, cpu).to(s.device, s.dtype)
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
        for k, outs in by_key(key, out, "out"):
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

    @property
    def resume_step(self) -> int | None:
        """On a replacement of a lost worker (``PSLAUNCH_REPLACEMENT``): the step its
        predecessor had reached, from the servers, where training goes on; else None."""
        return self._client.resume_step

    def _merged(self, vals: list[torch.Tensor]) -> tuple[np.ndarray, bool]:
        if len(vals) == 1:
            return _flat_numpy(vals[0])
        dev = None if self._device_sum else torch.device("cpu")
        arr, _ = _flat_numpy(sum_values(vals, dev))
        return arr, True

    def _check(self, k: Key, t: torch.Tensor) -> None:
        shape = self._shapes.get(k)
        if shape is None:
            raise KVConfigError(f"key {k!r} is not initialised: call kv.init({k!r}, value) first, "
                                "on every worker")
        if t.shape != shape[0]:
            raise KVConfigError(f"key {k!r} holds shape {tuple(shape[0])}, got {tuple(t.shape)}")

    def init(self, key: Any, value: Any) -> None:
        groups = by_key(key, value, "value")
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
        groups = by_key(key, value, "value")
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
        groups = by_key(key, out, "out")
        dests = self._dests(groups)
        self._client.pull([k for k, _ in groups], dests)
        self._fan_out(groups, dests)

    def pushpull(self, key: Any, value: Any, out: Any, priority: int = 0) -> None:
        dest = self._direct(key, out)
        if dest is not None and type(value) is torch.Tensor:
            self._check(key, value)
            self._client.push((key,), (_flat_numpy(value)[0],), dests=(dest,), owned=True)
            return
        groups = by_key(key, value, "value")
        out_groups = by_key(key, out, "out")
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

