"""Hostfile grammar.

One host per line::

    # comments and blank lines are ignored
    node1                      # dmlc style
    node2:2222                 # ssh port
    alice@node3                # ssh user
    alice@10.0.0.4:2222        # both
    [fe80::1]:2222             # IPv6 with a port (brackets required then)
    fe80::2                    # IPv6 without a port
    node5 slots=4              # MPI style: at most 4 of this job's processes here

A bad line raises :class:`ConfigError` as ``FILE:LINE: what is wrong``.
"""

from __future__ import annotations

import re
from typing import Iterable

from ..errors import ConfigError
from .job import Host

_NAME_RE = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")
_USER_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_KNOWN_KEYS = ("slots",)


def _port(text: str, where: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ConfigError(f"{where}: port {text!r} is not a number from 1 to 65535")
    return int(text)


def parse_host(token: str, where: str = "<host>") -> Host:
    """Parse ``[user@]host[:port]`` (IPv6 as ``[addr]:port`` or a bare address)."""
    user = None
    if "@" in token:
        user, _, token = token.rpartition("@")
        if not _USER_RE.match(user):
            raise ConfigError(f"{where}: bad user name {user!r} (letters, digits, '.', '_', '-'; not starting with '-')")
    port = None
    if token.startswith("["):
        close = token.find("]")
        if close < 0:
            raise ConfigError(f"{where}: missing ']' after IPv6 address {token!r}")
        name, rest = token[1:close], token[close + 1:]
        if rest:
            if not rest.startswith(":"):
                raise ConfigError(f"{where}: expected ':PORT' after ']' in {token!r}")
            port = _port(rest[1:], where)
        _check_ipv6(name, where)
    elif token.count(":") > 1:
        name = token
        _check_ipv6(name, where)
    elif ":" in token:
        name, _, p = token.partition(":")
        port = _port(p, where)
    else:
        name = token
    if ":" not in name and not _NAME_RE.match(name):
        raise ConfigError(f"{where}: bad host name {name!r} (letters, digits, '.', '-', '_'; not starting with '-')")
    return Host(name=name, port=port, user=user, origin=where)


def _check_ipv6(name: str, where: str) -> None:
    import ipaddress

    try:
        ipaddress.IPv6Address(name)
    except ValueError:
        raise ConfigError(f"{where}: {name!r} is not a valid IPv6 address (write [addr]:port for a port)") from None


def parse_line(line: str, where: str) -> Host | None:
    """One line -> a :class:`Host`, or ``None`` for a blank or comment line."""
    text = line.split("#", 1)[0].strip()
    if not text:
        return None
    tokens = text.split()
    host = parse_host(tokens[0], where)
    slots = None
    for extra in tokens[1:]:
        key, eq, value = extra.partition("=")
        if not eq:
            raise ConfigError(f"{where}: unexpected {extra!r} after the host; only key=value settings may follow "
                              f"({', '.join(_KNOWN_KEYS)})")
        if key not in _KNOWN_KEYS:
            raise ConfigError(f"{where}: unknown setting {key!r}; known: {', '.join(_KNOWN_KEYS)}")
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{where}: slots={value!r} must be a whole number of at least 1")
        if slots is not None:
            raise ConfigError(f"{where}: slots given twice")
        slots = int(value)
    return Host(name=host.name, port=host.port, user=host.user, slots=slots, origin=where)


def parse_lines(lines: Iterable[str], source: str) -> tuple[Host, ...]:
    """Parse hostfile lines; ``source`` names the file in messages."""
    hosts = []
    for number, line in enumerate(lines, 1):
        host = parse_line(line, f"{source}:{number}")
        if host is not None:
            hosts.append(host)
    if not hosts:
        raise ConfigError(f"{source}: no hosts found; write one host per line (see hosts.example)")
    return tuple(hosts)


def read_hostfile(path: str) -> tuple[Host, ...]:
    """Read and parse a hostfile; unreadable files raise :class:`ConfigError`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read hostfile {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"hostfile {path} is not UTF-8 text") from None
    return parse_lines(text.splitlines(), path)
