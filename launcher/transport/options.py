"""``--ssh-*`` and ``--sync-*``: the ssh transport's options, apart from the transport."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from ..errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SSHOptions:
    """How to reach the hosts (``--ssh-*``) and what ``--sync-dst-dir`` sends (``--sync-*``).

    Validated here, so a connection never sees an impossible value.
    """

    user: Optional[str] = None
    port: Optional[int] = None
    key: Optional[str] = None
    connect_timeout: float = 10.0
    accept_new_host_keys: bool = False
    known_hosts: Optional[str] = None
    sync_exclude: tuple[str, ...] = (".git", "__pycache__")
    sync_delete: bool = False
    sync_no_gitignore: bool = False
    keepalive: float = 5.0

    def __post_init__(self) -> None:
        if self.port is not None and not 1 <= self.port <= 65535:
            raise ConfigError(f"--ssh-port {self.port}: must be a port number from 1 to 65535")
        if self.key and not os.path.isfile(self.key):
            raise ConfigError(f"--ssh-key {self.key}: no such file")
        for option, value in (("--ssh-connect-timeout", self.connect_timeout), ("--ssh-keepalive", self.keepalive)):
            if not value > 0:
                raise ConfigError(f"{option} must be positive")
