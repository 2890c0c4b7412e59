"""Test-suite guard: Python sockets may only reach loopback and the test namespaces.

Installed in the pytest process by ``tests/conftest.py`` and in every Python
child through ``sitecustomize`` (this folder is put on PYTHONPATH, which the
launcher forwards to every node). A connect, sendto or bind to another address
is refused with PermissionError and logged to ``$PSLAUNCH_NETGUARD_LOG``; the
test session fails if that log is not empty.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

_ENV_LOG = "PSLAUNCH_NETGUARD_LOG"
_ENV_NETS = "PSLAUNCH_NETGUARD_NETS"
DEFAULT_NETS = "127.0.0.0/8,::1/128,10.200.0.0/16,10.201.0.0/16,10.202.0.0/16"

_installed = False


def _nets():
    spec = os.environ.get(_ENV_NETS) or DEFAULT_NETS
    return [ipaddress.ip_network(n.strip(), strict=False) for n in spec.split(",") if n.strip()]


def _allowed(family, address, nets, binding):
    if family not in (socket.AF_INET, socket.AF_INET6) or not isinstance(address, tuple):
        return True
    host = address[0]
    if binding and host in ("", "0.0.0.0", "::"):
        return True
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return True  # cannot resolve: the real call fails anyway
        return all(_allowed(family, (i[4][0],) + tuple(address[1:]), nets, binding) for i in infos)
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    return any(ip in n for n in nets if n.version == ip.version)


def _report(what, address):
    line = f"pid {os.getpid()} {what} {address!r} argv={sys.argv!r}\n"
    path = os.environ.get(_ENV_LOG)
    if path:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError:
            pass
    raise PermissionError(f"test network guard: {what} to {address!r} is outside loopback and the test namespaces")


def install():
    global _installed
    if _installed:
        return
    _installed = True
    nets = _nets()
    cls = socket.socket
    orig_connect, orig_connect_ex = cls.connect, cls.connect_ex
    orig_sendto, orig_bind = cls.sendto, cls.bind

    def connect(self, address):
        if not _allowed(self.family, address, nets, False):
            _report("connect", address)
        return orig_connect(self, address)

    def connect_ex(self, address):
        if not _allowed(self.family, address, nets, False):
            _report("connect", address)
        return orig_connect_ex(self, address)

    def sendto(self, data, *args):
        address = args[-1]
        if not _allowed(self.family, address, nets, False):
            _report("sendto", address)
        return orig_sendto(self, data, *args)

    def bind(self, address):
        if not _allowed(self.family, address, nets, True):
            _report("bind", address)
        return orig_bind(self, address)

    cls.connect, cls.connect_ex, cls.sendto, cls.bind = connect, connect_ex, sendto, bind
