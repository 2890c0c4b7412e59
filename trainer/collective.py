"""``dist_allreduce``: the kvstore as collective communication, with torch.distributed.

Where the parameter-server stores (``dist_sync``) send every gradient to servers that sum it and
update the weights, this store keeps the weights on every worker and sums the gradients with one
``all_reduce`` per push (gloo on the CPU, NCCL when the values are on a GPU); then each worker
applies the same optimizer step to the same weights, so the workers stay identical without a
server. With the same ``rescale_grad`` (``1/(N*b)``, as ``dist_sync``) it trains the same model
as ``dist_sync``: one model and one command compare parameter servers with allreduce::

    pslaunch -n 2 -s 1 python scripts/train_mnist.py --kv-store dist_sync
    pslaunch -n 2 --tracker torch python scripts/train_mnist.py --kv-store dist_allreduce

It needs torch.distributed's env:// contract (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``): ``pslaunch --tracker torch`` (or torchrun) sets it. The process group starts
with the first ``init`` (its backend follows the values' device); ``init`` broadcasts rank 0's
values, and ``set_optimizer_states`` rank 0's states, as the parameter-server stores keep rank 0's.
``--gpus`` under this store lists the host's GPUs, and each worker takes its share by
``LOCAL_RANK`` (:func:`worker_gpus`): ``cuda:LOCAL_RANK`` with one GPU per worker.

This module is imported by :func:`trainer.kvstore.create` only for ``dist_allreduce``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch

import pscontract as pc
from trainer.kv.errors import KVConfigError
from trainer.kvbase import InProcessUpdates, by_key, sum_values

TYPE = "dist_allreduce"
_NEEDED = (pc.TORCH_RANK, pc.WORLD_SIZE, pc.MASTER_ADDR, pc.MASTER_PORT)


def worker_gpus(gpus: Sequence[int], environ: Mapping[str, str]) -> list[int]:
    """This worker's share of the host's ``gpus``: the ``LOCAL_RANK``-th of ``LOCAL_WORLD_SIZE``
    equal blocks (all of them for one worker per host).

    Raises:
        ValueError: fewer GPUs than workers on the host, or a number that does not divide evenly.
    """
    local = int(environ.get(pc.LOCAL_RANK) or 0)
    per_host = int(environ.get(pc.LOCAL_WORLD_SIZE) or 1)
    if per_host <= 1:
        return list(gpus)
    if len(gpus) < per_host or len(gpus) % per_host:
        raise ValueError(f"--gpus {','.join(map(str, gpus))}: {per_host} workers share this host "
                         f"({pc.LOCAL_WORLD_SIZE}); list a multiple of {per_host} GPUs (each worker takes its "
                         f"share by {pc.LOCAL_RANK})")
    share = len(gpus) // per_host
    return list(gpus[local * share:(local + 1) * share])


class AllreduceStore(InProcessUpdates):
    """``dist_allreduce`` (see the module docstring). Create it with ``kvstore.create``."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        super().__init__(TYPE)
        environ = os.environ if environ is None else environ
        missing = [k for k in _NEEDED if not environ.get(k)]
        if missing:
            raise KVConfigError(f"{TYPE} needs torch.distributed's variables ({', '.join(missing)} not set): start "
                                "the workers with pslaunch --tracker torch (or torchrun)")
        try:
            self._rank, self._world = int(environ[pc.TORCH_RANK]), int(environ[pc.WORLD_SIZE])
        except ValueError:
            raise KVConfigError(f"{TYPE}: {pc.TORCH_RANK} and {pc.WORLD_SIZE} must be integers") from None
        import torch.distributed as dist

        self._dist = dist
        self._started = False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_workers(self) -> int:
        return self._world

    # -- the process group -------------------------------------------------------------------

    def _start(self, device: torch.device) -> None:
        if self._started:
            return
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self._dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        self._started = True

    def _allreduce(self, tensors: list[torch.Tensor], op: str = "sum", src: int = 0) -> None:
        """Sum ``tensors`` over the workers in place (or, ``op="broadcast"``, take ``src``'s), one
        collective per device and dtype: every key of a push travels in one flat buffer."""
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.device, t.dtype), []).append(t)
        for group in by_kind.values():
            flat = group[0].reshape(-1) if len(group) == 1 and group[0].is_contiguous() else \
                torch.cat([t.reshape(-1) for t in group])
            if op == "broadcast":
                self._dist.broadcast(flat, src=src)
            else:
                self._dist.all_reduce(flat)
            if len(group) > 1 or flat.data_ptr() != group[0].data_ptr():
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    # -- the KVStore interface -------------------------------------------------------------------

    def init(self, key: Any, value: Any) -> None:
        groups = by_key(key, value, "value")
        fresh = []
        for k, vals in groups:
            if k in self._store:
                raise KVConfigError(f"key {k!r} was already initialised; init each key once")
            fresh.append((k, vals[0].detach().to(vals[0].device, copy=True)))
        if not fresh:
            return
        self._start(fresh[0][1].device)
        self._allreduce([t for _, t in fresh], op="broadcast")  # rank 0's values win
        self._store.update(fresh)

    def push(self, key: Any, value: Any, priority: int = 0) -> None:
        groups = by_key(key, value, "value")
        merged = []
        for k, vals in groups:
            stored = self._stored(k)
            if vals[0].shape != stored.shape:
                raise KVConfigError(f"key {k!r} holds shape {tuple(stored.shape)}, got {tuple(vals[0].shape)}")
            merged.append(sum_values(vals, stored.device).to(stored.dtype))
        self._allreduce(merged)  # the sum over every worker's devices
        for (k, _), m in zip(groups, merged):
            if self._updater is not None:
                self._updater(k, self._store[k], m)  # the same step on every worker
            else:
                self._store[k].copy_(m)

    def pull(self, key: Any, out: Any, priority: int = 0) -> None:
        for k, outs in by_key(key, out, "out"):
            stored = self._stored(k)
            for o in outs:
                if o.shape != stored.shape:
                    raise KVConfigError(f"key {k!r} holds shape {tuple(stored.shape)}, but the out tensor has "
                                        f"{tuple(o.shape)}")
                o.copy_(stored)

    def set_optimizer_states(self, states: dict[str, Any]) -> None:
        if self._started:  # rank 0's copy wins, as on the parameter servers
            box = [states if self._rank == 0 else None]
            self._dist.broadcast_object_list(box, src=0)
            states = box[0]
        super().set_optimizer_states(states)

    def barrier(self) -> None:
        if self._started:
            self._dist.barrier()

    def close(self) -> None:
        if self._started:
            self._started = False
            self._dist.barrier()  # nobody leaves while another still needs it
            self._dist.destroy_process_group()
