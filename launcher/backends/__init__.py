"""Backend registry: ``--launcher NAME`` -> a :class:`~launcher.backends.base.Backend` class.

Backends are registered by name with a factory that imports the module only
when that backend is used, so an optional dependency (paramiko, drmaa, skein)
is needed only by the jobs that use it.
"""

from __future__ import annotations

import importlib
from typing import Callable

from ..errors import BackendUnavailableError
from .base import Backend

_REGISTRY: dict[str, Callable[[], type[Backend]]] = {}


def register(name: str, factory: Callable[[], type[Backend]]) -> None:
    """Register ``factory`` (returning a Backend class) under ``name``."""
    if name in _REGISTRY and _REGISTRY[name] is not factory:
        raise ValueError(f"backend {name!r} is already registered")
    _REGISTRY[name] = factory


def _lazy(module: str, attr: str) -> Callable[[], type[Backend]]:
    def factory() -> type[Backend]:
        return getattr(importlib.import_module(module, __name__), attr)
    return factory


def available() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> type[Backend]:
    """The Backend class for ``name``; a one-line error when it is not available."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise BackendUnavailableError(
            f"the {name} backend is not available yet in this version of pslaunch "
            f"(available: {', '.join(available())}); --dry-run still shows the plan") from None
    cls = factory()
    if cls.name != name:
        raise BackendUnavailableError(f"backend {name!r} resolved to a class named {cls.name!r}")
    return cls


register("local", _lazy(".local", "LocalBackend"))
register("mpi", _lazy(".mpi", "MPIBackend"))
register("ssh", _lazy(".ssh", "SSHBackend"))
register("sge", _lazy(".sge", "SGEBackend"))
register("yarn", _lazy(".yarn", "YarnBackend"))
