"""The backend registry: ``--launcher NAME`` -> a :class:`~launcher.backends.base.Backend` class.

The one list of backends. The CLI takes ``--launcher``'s choices and every backend's own
options from here; nothing else in the launcher names a backend. Each backend is registered
with its module and class; a module is imported on first use, and its optional dependencies
(paramiko, drmaa, skein) only when a job uses it.
"""

from __future__ import annotations

import importlib

from ..errors import BackendUnavailableError
from .base import Backend

_REGISTRY: dict[str, tuple[str, str]] = {}


def register(name: str, module: str, attr: str) -> None:
    """Register the class ``attr`` of ``module`` (relative to this package) as backend ``name``."""
    if name in _REGISTRY and _REGISTRY[name] != (module, attr):
        raise ValueError(f"backend {name!r} is already registered")
    _REGISTRY[name] = (module, attr)


def available() -> list[str]:
    """The backend names, sorted."""
    return sorted(_REGISTRY)


def get(name: str) -> type[Backend]:
    """The Backend class for ``name``; a one-line error when it is not available."""
    try:
        module, attr = _REGISTRY[name]
    except KeyError:
        raise BackendUnavailableError(
            f"unknown launcher {name!r}: choose one of {', '.join(available())}") from None
    cls = getattr(importlib.import_module(module, __name__), attr)
    if cls.name != name:
        raise BackendUnavailableError(f"backend {name!r} resolved to a class named {cls.name!r}")
    return cls


def classes() -> list[type[Backend]]:
    """Every backend class, in name order (imports every backend module)."""
    return [get(name) for name in available()]


register("local", ".local", "LocalBackend")
register("mpi", ".mpi", "MPIBackend")
register("ssh", ".ssh", "SSHBackend")
register("sge", ".sge", "SGEBackend")
register("yarn", ".yarn", "YarnBackend")
register("slurm", ".slurm", "SlurmBackend")
register("ray", ".ray", "RayBackend")
register("k8s", ".k8s", "K8sBackend")
