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
    node6 gpus=0,2             # the GPUs this host's workers may use (also gpus=0-3, gpus=0-1,4)
    node7 spare                # a spare: not used at first; takes the place of a host left out
    node8 spare slots=2        # (``--max-restarts``; docs/restarts.md, "Hosts that fail")

A bad line raises :class:`ConfigError` as ``FILE:LINE: what is wrong``.

``-H`` also takes the hosts inline, comma-separated, in the same grammar
(``-H h1,h2:2222,alice@h3``, ``-H 'h1 slots=2,h2'``; a bare number after ``gpus=`` continues
its list: ``-H 'h1 gpus=0,2,h2'``): a value that names an
existing file (or contains ``/``, or is ``-`` for stdin) is a hostfile, anything else
a list (:func:`read_hosts`).

Limits, so that a mistaken or hostile ``-H`` fails at once with one line: a hostfile
is a regular file (or ``-``) of at most :data:`MAX_HOSTFILE_BYTES`, a line at most
:data:`MAX_LINE` characters, a host name at most 253 (DNS's limit), ``slots=`` at
most :data:`~launcher.spec.job.MAX_PROCESSES`, ``gpus=`` at most :data:`MAX_GPUS` indices below
:data:`MAX_GPUS`.
"""

from __future__ import annotations

import ipaddress
import os
import re
import stat
import sys
from typing import BinaryIO, Iterable, Optional

from ..errors import ConfigError
from .job import MAX_PROCESSES, Host

MAX_HOSTFILE_BYTES = 1024 * 1024  # 1 MiB: tens of thousands of hosts
MAX_LINE = 4096
MAX_NAME = 253  # a DNS name's limit
MAX_USER = 256

_NAME_RE = r"^[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$"
_USER_RE = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
_KNOWN_KEYS = ("slots", "gpus")
#: the bare word after a host that makes it a spare (:attr:`~launcher.spec.job.Host.spare`)
SPARE = "spare"
MAX_GPUS = 1024  # GPU indices of one host: a bound on a typo
_GPU_ITEM = re.compile(r"(\d{1,4})(?:-(\d{1,4}))?")


def _port(text: str, where: str) -> int:
    if not text.isdigit() or len(text) > 5 or not 1 <= int(text) <= 65535:
        raise ConfigError(f"{where}: port {text!r} is not a number from 1 to 65535")
    return int(text)


def parse_host(token: str, where: str = "<host>") -> Host:
    """Parse ``[user@]host[:port]`` (IPv6 as ``[addr]:port`` or a bare address)."""
    user = None
    if len(token) > MAX_USER + MAX_NAME + 8:
        raise ConfigError(f"{where}: a host of {len(token):,} characters is too long (a host name has at most "
                          f"{MAX_NAME})")
    if "@" in token:
        user, _, token = token.rpartition("@")
        if len(user) > MAX_USER:
            raise ConfigError(f"{where}: a user name of {len(user)} characters is too long (at most {MAX_USER})")

        if not re.match(_USER_RE, user):
            raise ConfigError(f"{where}: bad user name {user!r} "
                              "(letters, digits, '.', '_', '-'; not starting with '-')")
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
    if len(name) > MAX_NAME:
        raise ConfigError(f"{where}: a host name of {len(name)} characters is too long (at most {MAX_NAME})")

    if ":" not in name and not re.match(_NAME_RE, name):
        raise ConfigError(f"{where}: bad host name {name!r} (letters, digits, '.', '-', '_'; not starting with '-')")
    return Host(name=name, port=port, user=user, origin=where)


def _check_ipv6(name: str, where: str) -> None:
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
    gpus: Optional[tuple[int, ...]] = None
    spare = False
    for extra in tokens[1:]:
        key, eq, value = extra.partition("=")
        if extra == SPARE:
            if spare:
                raise ConfigError(f"{where}: {SPARE} given twice")
            spare = True
            continue
        if not eq:
            raise ConfigError(f"{where}: unexpected {extra!r} after the host; only {SPARE} and key=value settings "
                              f"may follow ({', '.join(_KNOWN_KEYS)})")
        if key not in _KNOWN_KEYS:
            raise ConfigError(f"{where}: unknown setting {key!r}; known: {', '.join(_KNOWN_KEYS)}")
        if key == "gpus":
            if gpus is not None:
                raise ConfigError(f"{where}: gpus given twice")
            gpus = parse_gpus(value, where)
            continue
        if not value.isdigit() or len(value) > 6 or not 1 <= int(value) <= MAX_PROCESSES:
            shown = value if len(value) <= 30 else value[:30] + "..."
            raise ConfigError(f"{where}: slots={shown!r} must be a whole number from 1 to {MAX_PROCESSES:,}")
        if slots is not None:
            raise ConfigError(f"{where}: slots given twice")
        slots = int(value)
    return Host(name=host.name, port=host.port, user=host.user, slots=slots, origin=where, gpus=gpus, spare=spare)


def parse_gpus(value: str, where: str) -> tuple[int, ...]:
    """``gpus=0,2`` / ``0-3`` / ``0-1,4``: a host's GPU indices (as ``CUDA_VISIBLE_DEVICES`` numbers
    them there), in the order given, each once.

    >>> parse_gpus("0-1,4", "h:1")
    (0, 1, 4)
    """
    shown = value if len(value) <= 30 else value[:30] + "..."
    usage = f"{where}: gpus={shown!r}: give the host's GPU indices, e.g. gpus=0,2 or gpus=0-3"
    out: list[int] = []
    for item in value.split(","):
        m = _GPU_ITEM.fullmatch(item)
        if m is None:
            raise ConfigError(usage)
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo or hi >= MAX_GPUS:
            raise ConfigError(f"{usage} (a range runs upwards, indices below {MAX_GPUS})")
        out.extend(range(lo, hi + 1))
        if len(out) > MAX_GPUS:
            raise ConfigError(f"{usage} (at most {MAX_GPUS} GPUs)")
    if len(set(out)) != len(out):
        twice = next(g for i, g in enumerate(out) if g in out[:i])
        raise ConfigError(f"{where}: gpus={shown}: GPU {twice} is listed twice")
    return tuple(out)


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


def parse_host_list(text: str, source: str = "-H") -> tuple[Host, ...]:
    """An inline ``-H`` list: hostfile lines separated by commas (``h1,h2:2222,alice@h3 slots=2``).

    Each item is named ``-H item N`` in messages.
    """
    items = _join_gpu_lists(text.split(","))
    hosts = []
    for number, item in enumerate(items, 1):
        where = f"{source} item {number}"
        if "#" in item:
            raise ConfigError(f"{where}: '#' is not allowed in a -H list (comments belong in a hostfile)")
        if not item.strip():
            raise ConfigError(f"{where}: empty host in the -H list {_short(text)!r}; separate hosts by single "
                              "commas, e.g. -H h1,h2:2222,alice@h3")
        host = parse_line(item, where)
        assert host is not None
        hosts.append(host)
    return tuple(hosts)


def _join_gpu_lists(items: list[str]) -> list[str]:
    """The ``-H`` list's items with a ``gpus=`` list's commas put back: after an item whose last
    setting is ``gpus=...``, an item that is a bare number or range (``2``, ``4-5``) is the next
    GPU of that list, not a host (``-H 'h1 gpus=0,2 slots=2,h2'`` is h1 with GPUs 0 and 2 and two
slots, then h2)."""
    out: list[str] = []
    for item in items:
        first = item.split()[0] if item.split() else ""
        if out and _GPU_ITEM.fullmatch(first) and not item[:1].isspace() and out[-1].split() and \
                out[-1].split()[-1].startswith("gpus=") and not out[-1][-1].isspace():
            out[-1] += "," + item.strip()
        else:
            out.append(item)
    return out


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def is_host_list(value: str, exists: Optional[bool] = None) -> bool:
    """Whether ``-H value`` is an inline list rather than a file.

    A file when it exists, when it is ``-`` (stdin), or when it contains ``/`` (a path that
    does not exist is then a missing file, not a host); a list otherwise.
    """
    if value == "-" or "/" in value:
        return False
    return not (os.path.exists(value) if exists is None else exists)


def read_hosts(value: str, stdin: Optional[BinaryIO] = None) -> tuple[Host, ...]:
    """``-H value``: a hostfile (:func:`read_hostfile`) or an inline list (:func:`parse_host_list`)."""
    if len(value) > MAX_LINE:
        raise ConfigError(f"-H: a value of {len(value):,} characters is too long (at most {MAX_LINE}); "
                          "write the hosts into a file")
    if is_host_list(value):
        return parse_host_list(value)
    return read_hostfile(value, stdin)


def _read_bounded(f: BinaryIO, source: str) -> bytes:
    data = f.read(MAX_HOSTFILE_BYTES + 1)
    if len(data) > MAX_HOSTFILE_BYTES:
        raise ConfigError(f"hostfile {source} is larger than {MAX_HOSTFILE_BYTES // 1024} KiB; is it really a "
                          "hostfile? (one host per line)")
    return data


def read_hostfile(path: str, stdin: Optional[BinaryIO] = None) -> tuple[Host, ...]:
    """Read and parse a hostfile (``-``: standard input); a bad file raises :class:`ConfigError`.

    Only a regular file (or ``-``) is read, at most :data:`MAX_HOSTFILE_BYTES`: a device
    (``/dev/zero``), a FIFO or a directory is refused before anything is read from it.
    """
    if path == "-":
        source = "<stdin>"
        data = _read_bounded(stdin if stdin is not None else sys.stdin.buffer, source)
    else:
        source = path
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; O_NOCTTY: a terminal must not
            # become ours. Whether it is a regular file is asked of the open file, not the name.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
        except OSError as e:
            raise ConfigError(f"cannot read hostfile {path}: {e.strerror or e}") from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ConfigError(f"hostfile {path} is {kind}; give a regular file, - for standard input, or "
                              "hosts inline: -H h1,h2:2222")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as f:
            try:
                data = _read_bounded(f, source)
            except OSError as e:
                raise ConfigError(f"cannot read hostfile {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"hostfile {source} is not UTF-8 text") from None
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if len(line) > MAX_LINE:
            raise ConfigError(f"{source}:{number}: a line of {len(line):,} characters is too long (at most "
                              f"{MAX_LINE}); one host per line")
    return parse_lines(lines, source)
