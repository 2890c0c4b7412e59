"""Optimizers for update-on-kvstore: a fixed registry built from a JSON spec.

The servers (numpy) and the ``local``/``device`` stores (torch) share this
code: the arithmetic uses Python's in-place operators, which both array types
implement, plus the few functions of an :class:`ArrayOps` table.

A spec is a JSON-able dict, for example::

    {"name": "sgd", "learning_rate": 0.05, "momentum": 0.9, "wd": 1e-4,
     "wd_mult": {"1": 0.0, "3": 0.0}, "rescale_grad": 1 / 128, "clip_gradient": None,
     "lr_scheduler": {"name": "multifactor", "step": [938, 1876], "factor": 0.1}}

Semantics follow MXNet 1.x: the learning rate comes from the scheduler at
``num_update``, the largest per-key update count seen by this updater (so on
a server it counts that server's updates); Adam's bias correction uses the
key's own count. ``wd_mult`` maps a key (as a string) to a factor on ``wd``
(MXNet gives biases 0, see :func:`wd_mult_for`); a key not listed gets 1.
Nothing here is ever unpickled: only names in
:data:`OPTIMIZERS` and :data:`SCHEDULERS` can be built.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from typing import Any, Callable

import numpy as np


class OptimizerError(ValueError):
    """An optimizer spec is invalid; the message names the field and the rule."""


class ArrayOps:
    """The array functions the optimizers need, for numpy arrays (the default).

    ``foreach`` is None, or an object whose methods apply one operation to a
    list of arrays in one call (torch's ``_foreach_*``): ``mul_(xs, scalar)``,
    ``mul(xs, scalar)`` (new arrays), ``add_(xs, ys, alpha)`` (``x += alpha * y``)
    and ``clamp_(xs, lo, hi)``; with it, :meth:`Updater.update_many` runs one
    multi-array step for all keys instead of one per key.
    """

    foreach: Any = None

    @staticmethod
    def zeros_like(a: Any) -> Any:
        return np.zeros_like(a)

    @staticmethod
    def sqrt(a: Any) -> Any:
        return np.sqrt(a)

    @staticmethod
    def divide(a: Any, b: Any, out: Any) -> Any:
        return np.divide(a, b, out=out)

    @staticmethod
    def clip_(a: Any, bound: float) -> Any:
        return np.clip(a, -bound, bound, out=a)

    @staticmethod
    def scale_into(a: Any, scalar: float, out: Any) -> Any:
        """``out = scalar * a`` without a temporary array."""
        return np.multiply(a, scalar, out=out)


NUMPY_OPS = ArrayOps()


# --- learning-rate schedulers ------------------------------------------------------


def _number(spec: Mapping[str, Any], name: str, default: float, where: str,
            minimum: float | None = None, maximum: float | None = None) -> float:
    value = spec.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OptimizerError(f"{where}: {name}={value!r} must be a finite number")
    if minimum is not None and value < minimum:
        raise OptimizerError(f"{where}: {name}={value!r} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise OptimizerError(f"{where}: {name}={value!r} must be at most {maximum}")
    return float(value)


def _check_keys(spec: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise OptimizerError(f"{where}: unknown option {unknown[0]!r}; "
                             f"known: {', '.join(sorted(allowed))}")


class MultiFactorScheduler:
    """``lr = base_lr * factor ** (number of steps s with num_update > s)`` (MXNet's)."""

    name = "multifactor"

    def __init__(self, spec: Mapping[str, Any], base_lr: float) -> None:
        where = "lr_scheduler multifactor"
        _check_keys(spec, {"name", "step", "factor"}, where)
        step = spec.get("step")
        if (not isinstance(step, (list, tuple)) or not step
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in step)):
            raise OptimizerError(f"{where}: step={step!r} must be a non-empty list of integers >= 1")
        if any(b <= a for a, b in zip(step, step[1:])):
            raise OptimizerError(f"{where}: step={list(step)!r} must be strictly increasing")
        self.step = [int(s) for s in step]
        self.factor = _number(spec, "factor", 1.0, where, 0.0, 1.0)
        self.base_lr = base_lr

    def __call__(self, num_update: int) -> float:
        passed = sum(1 for s in self.step if num_update > s)
        return self.base_lr * self.factor ** passed

    def to_spec(self) -> dict[str, Any]:
        return {"name": self.name, "step": list(self.step), "factor": self.factor}


class FactorScheduler:
    """``lr = max(base_lr * factor ** floor((num_update - 1) / step), stop_factor_lr)``."""

    name = "factor"

    def __init__(self, spec: Mapping[str, Any], base_lr: float) -> None:
        where = "lr_scheduler factor"
        _check_keys(spec, {"name", "step", "factor", "stop_factor_lr"}, where)
        step = spec.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise OptimizerError(f"{where}: step={step!r} must be an integer >= 1")
        self.step = step
        self.factor = _number(spec, "factor", 1.0, where, 0.0, 1.0)
        self.stop_factor_lr = _number(spec, "stop_factor_lr", 1e-8, where, 0.0)
        self.base_lr = base_lr

    def __call__(self, num_update: int) -> float:
        passed = max(0, (num_update - 1) // self.step)
        return max(self.base_lr * self.factor ** passed, self.stop_factor_lr)

    def to_spec(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "factor": self.factor,
                "stop_factor_lr": self.stop_factor_lr}


SCHEDULERS: dict[str, Callable[[Mapping[str, Any], float], Any]] = {
    "multifactor": MultiFactorScheduler,
    "factor": FactorScheduler,
}


# --- optimizers --------------------------------------------------------------------


class Optimizer:
    """Base class: common hyper-parameters and validation.

    Subclasses define ``name``, ``defaults`` (their extra hyper-parameters),
    :meth:`create_state` and :meth:`step`. ``step`` may overwrite ``grad``:
    the callers always pass a buffer they own.
    """

    name = ""
    default_lr = 0.01
    defaults: dict[str, float] = {}

    def __init__(self, spec: Mapping[str, Any]) -> None:
        where = f"optimizer {self.name}"
        common = {"name", "learning_rate", "wd", "wd_mult", "rescale_grad", "clip_gradient",
                  "lr_scheduler", "begin_num_update"}
        _check_keys(spec, common | set(self.defaults), where)
        self.learning_rate = _number(spec, "learning_rate", self.default_lr, where, 0.0)
        self.wd = _number(spec, "wd", 0.0, where, 0.0)
        mult = spec.get("wd_mult") or {}
        if not isinstance(mult, Mapping):
            raise OptimizerError(f"{where}: wd_mult must be a dict of key -> factor")
        self.wd_mult = {str(k): _number(mult, k, 1.0, f"{where}: wd_mult", 0.0) for k in mult}
        self.rescale_grad = _number(spec, "rescale_grad", 1.0, where)
        clip = spec.get("clip_gradient")
        self.clip_gradient = None if clip is None or clip == -1 else _number(
            spec, "clip_gradient", 0.0, where, 0.0)
        begin = spec.get("begin_num_update", 0)
        if not isinstance(begin, int) or isinstance(begin, bool) or begin < 0:
            raise OptimizerError(f"{where}: begin_num_update={begin!r} must be an integer >= 0")
        self.begin_num_update = begin
        self.hyper = {k: _number(spec, k, v, where) for k, v in self.defaults.items()}
        sched = spec.get("lr_scheduler")
        self.lr_scheduler = None
        if sched is not None:
            if not isinstance(sched, Mapping) or not isinstance(sched.get("name"), str):
                raise OptimizerError(f"{where}: lr_scheduler must be a dict with a 'name'")
            sname = sched["name"].lower().replace("scheduler", "").replace("_", "")
            cls = SCHEDULERS.get(sname)
            if cls is None:
                raise OptimizerError(f"{where}: unknown lr_scheduler {sched['name']!r}; "
                                     f"known: {', '.join(SCHEDULERS)}")
            self.lr_scheduler = cls(sched, self.learning_rate)

    def lr(self, num_update: int) -> float:
        return self.lr_scheduler(num_update) if self.lr_scheduler else self.learning_rate

    def to_spec(self) -> dict[str, Any]:
        """The normalized JSON spec (what travels to the servers)."""
        spec: dict[str, Any] = {"name": self.name, "learning_rate": self.learning_rate,
                                "wd": self.wd, "wd_mult": dict(self.wd_mult),
                                "rescale_grad": self.rescale_grad,
                                "clip_gradient": self.clip_gradient,
                                "begin_num_update": self.begin_num_update}
        spec.update(self.hyper)
        spec["lr_scheduler"] = self.lr_scheduler.to_spec() if self.lr_scheduler else None
        return spec

    def key_wd(self, key: Hashable) -> float:
        """The weight decay of ``key``: ``wd`` times its ``wd_mult`` (default 1)."""
        return self.wd * self.wd_mult.get(str(key), 1.0)

    def _prepare(self, weight: Any, grad: Any, wd: float, ops: ArrayOps,
                 wd_first: bool = False) -> None:
        """``grad = clip(rescale * grad) + wd * weight`` in place (Adam: wd before clip)."""
        if self.rescale_grad != 1.0:
            grad *= self.rescale_grad
        if wd_first and wd:
            grad += wd * weight
        if self.clip_gradient is not None:
            ops.clip_(grad, self.clip_gradient)
        if not wd_first and wd:
            grad += wd * weight

    def create_state(self, weight: Any, ops: ArrayOps) -> dict[str, Any]:
        raise NotImplementedError

    def step(self, weight: Any, grad: Any, state: dict[str, Any], lr: float, wd: float,
             count: int, ops: ArrayOps) -> None:
        raise NotImplementedError


class SGD(Optimizer):
    """SGD with momentum and weight decay (MXNet ``sgd_mom_update``)."""

    name = "sgd"
    defaults = {"momentum": 0.0}

    def create_state(self, weight: Any, ops: ArrayOps) -> dict[str, Any]:
        return {"mom": ops.zeros_like(weight)} if self.hyper["momentum"] else {}

    def step(self, weight: Any, grad: Any, state: dict[str, Any], lr: float, wd: float,
             count: int, ops: ArrayOps) -> None:
        # MXNet's mom = momentum * mom - lr * (rescale * grad + wd * weight), weight += mom,
        # in passes over the arrays without a temporary (grad, ours, holds the wd term):
        # on a server these arrays are megabytes, and a temporary costs its page faults.
        scale = self.rescale_grad
        if self.clip_gradient is not None:
            grad *= scale
            ops.clip_(grad, self.clip_gradient)
            scale = 1.0
        grad *= -lr * scale
        mom = state.get("mom")
        if mom is None:
            if wd:  # the decay from the weight before this step
                weight *= 1.0 - lr * wd
            weight += grad
            return
        mom *= self.hyper["momentum"]
        mom += grad
        if wd:
            ops.scale_into(weight, -lr * wd, grad)
            mom += grad
        weight += mom

    def step_many(self, weights: list[Any], grads: list[Any], states: list[dict[str, Any]],
                  lr: float, wds: list[float], ops: ArrayOps) -> None:
        """:meth:`step` for many keys with one ``lr`` (``wds``: each key's weight decay),
        in a few multi-array calls: ``ops.foreach``.

        The same arithmetic with MXNet's meaning, arranged so that ``grads`` are
        only read: ``mom = momentum * mom - lr * (rescale * grad + wd * weight)``,
        ``weight += mom`` (without momentum ``weight -= lr * (...)``).
        """
        f = ops.foreach
        scale = self.rescale_grad
        if self.clip_gradient is not None:
            grads = f.mul(grads, scale)
            f.clamp_(grads, -self.clip_gradient, self.clip_gradient)
            scale = 1.0
        decay: dict[float, tuple[list[Any], list[Any]]] = {}
        momentum = self.hyper["momentum"]
        targets = [st["mom"] for st in states] if momentum else weights
        for wd, target, weight in zip(wds, targets, weights):
            if wd:
                pair = decay.get(wd)
                if pair is None:
                    pair = decay[wd] = ([], [])
                pair[0].append(target)
                pair[1].append(weight)
        if momentum:
            f.mul_(targets, momentum)
            f.add_(targets, grads, -lr * scale)
            for wd, (moms, ws) in decay.items():
                f.add_(moms, ws, -lr * wd)
            f.add_(weights, targets, 1.0)
        else:
            for wd, (ws, _) in decay.items():  # w - lr * wd * w, from the weight before
                f.mul_(ws, 1.0 - lr * wd)
            f.add_(weights, grads, -lr * scale)


class NAG(Optimizer):
    """Nesterov momentum, as MXNet 1.x's ``NAG`` optimizer."""

    name = "nag"
    defaults = {"momentum": 0.0}

    def create_state(self, weight: Any, ops: ArrayOps) -> dict[str, Any]:
        return {"mom": ops.zeros_like(weight)} if self.hyper["momentum"] else {}

    def step(self, weight: Any, grad: Any, state: dict[str, Any], lr: float, wd: float,
             count: int, ops: ArrayOps) -> None:
        self._prepare(weight, grad, wd, ops)
        mom = state.get("mom")
        if mom is not None:
            momentum = self.hyper["momentum"]
            mom *= momentum
            mom += grad
            grad += momentum * mom
        grad *= lr
        weight -= grad


class Adam(Optimizer):
    """Adam with MXNet's bias correction folded into the learning rate."""

    name = "adam"
    default_lr = 0.001
    defaults = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}

    def create_state(self, weight: Any, ops: ArrayOps) -> dict[str, Any]:
        return {"mean": ops.zeros_like(weight), "var": ops.zeros_like(weight)}

    def step(self, weight: Any, grad: Any, state: dict[str, Any], lr: float, wd: float,
             count: int, ops: ArrayOps) -> None:
        b1, b2, eps = self.hyper["beta1"], self.hyper["beta2"], self.hyper["epsilon"]
        self._prepare(weight, grad, wd, ops, wd_first=True)
        lr_t = lr * math.sqrt(1.0 - b2 ** count) / (1.0 - b1 ** count)
        mean, var = state["mean"], state["var"]
        mean *= b1
        mean += (1.0 - b1) * grad
        var *= b2
        grad *= grad
        grad *= 1.0 - b2
        var += grad
        denom = ops.sqrt(var)
        denom += eps
        ops.divide(mean, denom, out=denom)
        denom *= lr_t
        weight -= denom


OPTIMIZERS: dict[str, type[Optimizer]] = {"sgd": SGD, "nag": NAG, "adam": Adam}


def create_optimizer(spec: Mapping[str, Any]) -> Optimizer:
    """Build an optimizer from a JSON spec; raise :class:`OptimizerError` on a bad one."""
    if not isinstance(spec, Mapping):
        raise OptimizerError(f"an optimizer spec must be a dict such as {{'name': 'sgd'}}, "
                             f"got {type(spec).__name__}")
    name = spec.get("name")
    cls = OPTIMIZERS.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise OptimizerError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
    return cls(spec)


class Updater:
    """Applies an optimizer per key and keeps the per-key states and update counts.

    Args:
        optimizer: the optimizer.
        ops: array functions for the arrays passed in (numpy by default).
        wd_key: maps a state key to the key its ``wd_mult`` entry is looked up
            by (a server's state keys are ``(key id, part)``: the key id).
    """

    def __init__(self, optimizer: Optimizer, ops: ArrayOps = NUMPY_OPS,
                 wd_key: Callable[[Hashable], Hashable] | None = None) -> None:
        self.optimizer = optimizer
        self.ops = ops
        self.wd_key = wd_key
        self.states: dict[Hashable, dict[str, Any]] = {}
        self.counts: dict[Hashable, int] = {}
        self.num_update = optimizer.begin_num_update

    def __call__(self, key: Hashable, weight: Any, grad: Any) -> None:
        """Update ``weight`` in place from ``grad`` (which it may overwrite)."""
        count = self.counts.get(key, self.optimizer.begin_num_update) + 1
        self.counts[key] = count
        if count > self.num_update:
            self.num_update = count
        state = self.states.get(key)
        if state is None:
            state = self.states[key] = self.optimizer.create_state(weight, self.ops)
        opt = self.optimizer
        wd = opt.key_wd(key if self.wd_key is None else self.wd_key(key))
        opt.step(weight, grad, state, opt.lr(self.num_update), wd, count, self.ops)

    def update_many(self, keys: list[Hashable], weights: list[Any], grads: list[Any]) -> None:
        """:meth:`__call__` for several keys at once; ``grads`` are left as they are.

        With multi-array functions (``ops.foreach``) and an optimizer that has
        ``step_many`` (sgd), the keys are grouped by learning rate and weight decay
        and each group takes one multi-array step; otherwise one key at a time.
        """
        opt = self.optimizer
        step_many = getattr(opt, "step_many", None)
        if step_many is None or self.ops.foreach is None:
            for key, weight, grad in zip(keys, weights, grads):
                self(key, weight, grad.clone() if hasattr(grad, "clone") else grad.copy())
            return
        # keys grouped by learning rate (one group unless their update counts differ)
        groups: dict[float, tuple[list[Any], list[Any], list[dict[str, Any]], list[float]]] = {}
        begin = opt.begin_num_update
        counts, states, wd_key = self.counts, self.states, self.wd_key
        for key, weight, grad in zip(keys, weights, grads):
            count = counts.get(key, begin) + 1
            counts[key] = count
            if count > self.num_update:
                self.num_update = count
            state = states.get(key)
            if state is None:
                state = states[key] = opt.create_state(weight, self.ops)
            lr = opt.lr(self.num_update)
            group = groups.get(lr)
            if group is None:
                group = groups[lr] = ([], [], [], [])
            group[0].append(weight)
            group[1].append(grad)
            group[2].append(state)
            group[3].append(opt.key_wd(key if wd_key is None else wd_key(key)))
        for lr, (ws, gs, sts, wds) in groups.items():
            step_many(ws, gs, sts, lr, wds, self.ops)

    def get_states(self) -> dict[Hashable, tuple[int, dict[str, Any]]]:
        """``{key: (count, {state name: array})}`` for every key updated so far."""
        return {k: (self.counts.get(k, 0), self.states.get(k, {})) for k in self.counts}

    def set_states(self, states: Mapping[Hashable, tuple[int, Mapping[str, Any]]]) -> None:
        """Restore :meth:`get_states` output (arrays are used as given)."""
        for key, (count, arrays) in states.items():
            self.counts[key] = int(count)
            self.states[key] = dict(arrays)
            self.num_update = max(self.num_update, int(count))
