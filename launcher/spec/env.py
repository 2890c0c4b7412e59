"""The launcher's side of the environment: what reaches a process, and what is never shown.

The contract itself (its names, and each role's variables) is :mod:`pscontract`. This module is
the launcher's policy around it. Precedence, highest first, for a server or worker:

1. the contract (:func:`pscontract.contract`): never taken from anywhere else;
2. ``--env-server`` / ``--env-worker`` for that role;
3. ``--env``;
4. the forwarded variables of the launcher's environment (:func:`forwarded`);
5. on a backend whose processes all run here, the launcher's whole inherited environment.

Values of variables with secret-looking names (:func:`is_secret`) never appear in logs, dry
runs, error reports or the summary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import pscontract as pc

FORWARD_PREFIXES = ("PS_", "DMLC_", "OMP_", "KMP_", "MXNET_", "AWS_")
# (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME: set in this shell, they win over the ones a torch job's
# hosts would get, launcher.spec.network, on every host)
FORWARD_NAMES = frozenset({"PYTHONPATH", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME",
                           "NCCL_SOCKET_IFNAME"})

_SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL")
REDACTED = "<redacted>"

_NAME_START = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_")
_NAME_CHARS = _NAME_START | frozenset("0123456789")


def is_valid_name(name: str) -> bool:
    """True for a portable environment variable name (``[A-Za-z_][A-Za-z0-9_]*``)."""
    return bool(name) and name[0] in _NAME_START and all(c in _NAME_CHARS for c in name)


def is_secret(name: str) -> bool:
    """True when a variable's value must never be shown (logs, dry runs, errors)."""
    upper = name.upper()
    return any(word in upper for word in _SECRET_WORDS) or upper.endswith("_KEY")


def redact(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` with every secret value replaced by ``<redacted>``."""
    return {k: (REDACTED if is_secret(k) else v) for k, v in env.items()}


class Redactor:
    """Hides known secret values in text: ``Redactor(values)(line)``.

    A value of 4 characters or more is hidden wherever it occurs; a shorter one only where it
    stands alone (not inside a longer word or number), so that a 2-character password does not
    turn every occurrence of those two letters into ``<redacted>``. Built once per job; a line
    without any secret costs one substring test per long value and one regex search.
    """

    def __init__(self, values: Iterable[str]) -> None:
        values = {v for v in values if v}
        self.values = tuple(sorted(values))  # (what a later Redactor may hide as well)
        self.long = tuple(sorted((v for v in values if len(v) >= 4), key=len, reverse=True))
        short = sorted((v for v in values if len(v) < 4), key=len, reverse=True)
        self.short = None
        if short:
            self.short = re.compile(r"(?<![A-Za-z0-9])(?:" + "|".join(map(re.escape, short)) + r")(?![A-Za-z0-9])")

    @classmethod
    def of(cls, env: Mapping[str, str]) -> Redactor:
        """The secret values of ``env`` (by name, :func:`is_secret`)."""
        return cls(v for k, v in env.items() if is_secret(k))

    def __bool__(self) -> bool:
        return bool(self.long) or self.short is not None

    def __call__(self, text: str) -> str:
        for v in self.long:
            if v in text:
                text = text.replace(v, REDACTED)
        if self.short is not None:
            text = self.short.sub(REDACTED, text)
        return text


def redact_text(text: str, env: Mapping[str, str]) -> str:
    """Replace every secret value of ``env`` that occurs in ``text`` (see :class:`Redactor`)."""
    return Redactor.of(env)(text)


def is_forwarded(name: str) -> bool:
    """True when the launcher carries ``name`` from its own environment to every node."""
    return name in FORWARD_NAMES or name.startswith(FORWARD_PREFIXES)


def forwarded(environ: Mapping[str, str], extra_names: Iterable[str] = (),
              owned: frozenset[str] = pc.CONTRACT) -> dict[str, str]:
    """The variables of ``environ`` that reach every node on every backend.

    ``PS_*``, ``DMLC_*`` (``DMLC_INTERFACE`` included), ``OMP_*``, ``KMP_*``,
    ``MXNET_*``, ``AWS_*``, ``PYTHONPATH``, ``LD_LIBRARY_PATH``,
    ``CUDA_VISIBLE_DEVICES``, ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``, plus
    ``extra_names``. Contract variables
    (``owned``: :func:`pscontract.owned` of the job's tracker) are left out:
    the launcher sets those itself.
    A name that is not a portable variable name (``PS_A$(id)``, set with
    ``env``) is never forwarded: YARN writes ``export NAME=...`` lines into a
    shell script and MPICH joins names with commas.
    """
    extra = set(extra_names)
    return {
        k: v for k, v in environ.items()
        if (is_forwarded(k) or k in extra) and k not in owned and k != pc.SUBMIT_CLUSTER and is_valid_name(k)
    }


@dataclass(frozen=True)
class Composed:
    """A process's final environment and the names whose other values lost to the contract."""

    env: dict[str, str]
    overridden: tuple[str, ...]


def compose(
    contract_env: Mapping[str, str],
    *,
    role_env: Mapping[str, str] = {},
    cli_env: Mapping[str, str] = {},
    forwarded_env: Mapping[str, str] = {},
    inherited: Mapping[str, str] | None = None,
    owned: frozenset[str] = pc.CONTRACT,
) -> Composed:
    """Merge the layers, lowest precedence first, and report overridden contract names.

    ``owned`` are the variables the launcher owns (:func:`pscontract.owned` of the job's
    tracker): no layer sets them. ``overridden`` lists those that the inherited environment,
    the forwarded set, ``--env`` or a per-role ``--env-*`` tried to set to a different value;
    the caller warns once about them.
    """
    env: dict[str, str] = {}
    overridden: set[str] = set()
    for layer in (inherited or {}, forwarded_env, cli_env, role_env):
        for k, v in layer.items():
            if k in owned:
                if k in contract_env and contract_env[k] != v:
                    overridden.add(k)
                elif k not in contract_env and k in (pc.ROLE, pc.ROOT_URI, pc.ROOT_PORT, pc.NODE_HOST):
                    overridden.add(k)
                continue
            env[k] = v
    env.update(contract_env)
    # Like torchrun: one OpenMP thread per process unless the user says otherwise.
    env.setdefault(pc.OMP_NUM_THREADS, "1")
    return Composed(env=env, overridden=tuple(sorted(overridden)))


def launcher_defaults(env: dict[str, str]) -> dict[str, str]:
    """Add the launcher's process defaults that only apply when unset.

    ``PYTHONUNBUFFERED=1`` so Python output reaches the console line by line,
    ``PYTHONFAULTHANDLER=1`` so ``--timeout`` can dump Python stacks.
    """
    env.setdefault(pc.PYTHONUNBUFFERED, "1")
    env.setdefault(pc.PYTHONFAULTHANDLER, "1")
    return env


