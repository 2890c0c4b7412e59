"""Exceptions of the KVStore. Every message is one line naming the problem and the fix."""

from __future__ import annotations


class KVStoreError(RuntimeError):
    """Base class of every KVStore error."""


class KVConfigError(KVStoreError, ValueError):
    """The environment or an argument is wrong (missing secret, bad key, bad shape...)."""


class KVTimeoutError(KVStoreError, TimeoutError):
    """A peer did not answer in time (start-up, handshake)."""


class KVAuthError(KVStoreError, PermissionError):
    """A peer rejected our job secret, or could not prove it knows it."""


class KVAbortError(KVStoreError):
    """The job was aborted: another node failed, or the scheduler was lost."""
