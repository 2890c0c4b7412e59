"""Network interfaces and addresses: ``DMLC_INTERFACE`` and ``--host-ip``.

``DMLC_INTERFACE`` may be

* an interface name (``eth0``, ``lo``): that interface's first IPv4 address;
* a name prefix, as ps-lite allows (``eth`` matches ``eth0``): the first
  interface, in the kernel's order, whose name starts with it;
* a CIDR (``10.1.0.0/16``): the first local IPv4 address inside it, whatever
  the interface is called. This is the form to use when names differ between
  hosts.

This file depends on the standard library only: it travels in the bundle the
node programs run from (``launcher/node``), so a host where nothing is installed
resolves its own interface (the agent's interface request, the doctor's probe).
It also runs on its own: ``python3 netif.py SPEC`` prints JSON.
"""

from __future__ import annotations

import collections
import ctypes
import ipaddress
import json
import socket
import sys
from typing import Any, Sequence


class NetifError(Exception):
    """An interface spec matches nothing, or an address cannot be worked out."""


class Iface(collections.namedtuple("Iface", "name address prefixlen")):
    """One IPv4 address of an interface: ``(name, address, prefixlen)``."""

    __slots__ = ()
    name: str
    address: str
    prefixlen: int

    @property
    def network(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Interface(f"{self.address}/{self.prefixlen}").network


def _structs() -> tuple[Any, Any]:
    """ctypes' ``struct sockaddr_in`` and ``struct ifaddrs``."""
    class SockaddrIn(ctypes.Structure):
        _fields_ = [("sin_family", ctypes.c_ushort), ("sin_port", ctypes.c_uint16),
                    ("sin_addr", ctypes.c_ubyte * 4), ("sin_zero", ctypes.c_ubyte * 8)]

    class Ifaddrs(ctypes.Structure):
        pass

    Ifaddrs._fields_ = [
        ("ifa_next", ctypes.POINTER(Ifaddrs)),
        ("ifa_name", ctypes.c_char_p),
        ("ifa_flags", ctypes.c_uint),
        ("ifa_addr", ctypes.POINTER(SockaddrIn)),
        ("ifa_netmask", ctypes.POINTER(SockaddrIn)),
        ("ifa_ifu", ctypes.c_void_p),
        ("ifa_data", ctypes.c_void_p),
    ]
    return SockaddrIn, Ifaddrs


_IFF_UP = 0x1


def interfaces() -> list[Iface]:
    """Every IPv4 address of every interface that is up, in ``getifaddrs`` order."""
    _, ifaddrs = _structs()
    # dlopen(NULL): the C library is already loaded; find_library("c") would run ldconfig.
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise NetifError(f"getifaddrs failed: errno {ctypes.get_errno()}")
    out: list[Iface] = []
    try:
        node = head
        while node:
            ifa = node.contents
            addr = ifa.ifa_addr
            if addr and addr.contents.sin_family == socket.AF_INET and ifa.ifa_flags & _IFF_UP:
                ip = ".".join(str(b) for b in addr.contents.sin_addr)
                prefix = 32
                if ifa.ifa_netmask:
                    mask = int.from_bytes(bytes(ifa.ifa_netmask.contents.sin_addr), "big")
                    prefix = bin(mask).count("1")
                out.append(Iface(ifa.ifa_name.decode(errors="replace"), ip, prefix))
            node = ifa.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out


def describe(ifaces: Sequence[Iface]) -> str:
    """``"lo 127.0.0.1/8, eth0 10.0.0.2/24"``, for error messages."""
    return ", ".join(f"{i.name} {i.address}/{i.prefixlen}" for i in ifaces) or "none with IPv4"


def is_cidr(spec: str) -> bool:
    return "/" in spec


def match(spec: str, ifaces: Sequence[Iface]) -> Iface:
    """The interface address that ``spec`` selects (exact name, CIDR, then name prefix)."""
    spec = spec.strip()
    if not spec:
        raise NetifError("DMLC_INTERFACE is empty")
    if is_cidr(spec):
        try:
            net = ipaddress.IPv4Network(spec, strict=False)
        except ValueError:
            raise NetifError(f"DMLC_INTERFACE={spec!r} is not a valid IPv4 CIDR such as 10.1.0.0/16") from None
        for i in ifaces:
            if ipaddress.IPv4Address(i.address) in net:
                return i
        raise NetifError(f"no IPv4 address in {spec} (interfaces: {describe(ifaces)})")
    for i in ifaces:
        if i.name == spec:
            return i
    for i in ifaces:
        if i.name.startswith(spec):
            return i
    raise NetifError(f"DMLC_INTERFACE={spec} matches no interface with an IPv4 address "
                     f"(interfaces: {describe(ifaces)})")


def interface_address(spec: str) -> str:
    """This host's IPv4 address on the interface ``spec`` selects."""
    return match(spec, interfaces()).address


def interface_name(spec: str) -> str:
    """The name of the interface that ``spec`` (``DMLC_INTERFACE``) selects on this host."""
    return match(spec, interfaces()).name


def carrier_spec(interface: str | None, address: str | None) -> str | None:
    """What selects the interface a node's gloo and NCCL bind (``GLOO_SOCKET_IFNAME``,
    ``NCCL_SOCKET_IFNAME``): ``DMLC_INTERFACE`` when set; else the node's own address
    (``DMLC_NODE_HOST``, the one the other hosts reach it on) as a one-address CIDR, which
    selects the interface that carries it. None when neither is known, or the address is on
    loopback (every rank runs on this machine: gloo's own choice works there).

    Without it gloo binds the address the host's name resolves to, often 127.0.1.1, and
    publishes that to the other ranks ("Connection refused, remote=127.0.0.1")."""
    if interface and interface.strip():
        return interface.strip()
    if address and address.strip():
        try:
            ip = ipaddress.IPv4Address(address.strip())
        except ValueError:
            return None
        return None if ip.is_loopback else f"{ip}/32"  # (loopback: every rank is on this machine)
    return None


def carrier_name(interface: str | None, address: str | None, ifaces: Sequence[Iface] | None = None) -> str | None:
    """The name of the interface :func:`carrier_spec` selects here. A ``DMLC_INTERFACE`` that
    selects nothing raises :class:`NetifError` (the job's network is wrong); an address that no
    interface here carries (a NAT or a proxy in between) gives None: gloo then picks its own."""
    spec = carrier_spec(interface, address)
    if spec is None:
        return None
    ifaces = interfaces() if ifaces is None else ifaces
    try:
        return match(spec, ifaces).name
    except NetifError:
        if interface and interface.strip():
            raise
        return None


def route_source(dest: str) -> str:
    """The local address the kernel would use to reach ``dest`` (no packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((dest, 9))
        return s.getsockname()[0]
    except OSError as e:
        raise NetifError(f"no route from this host to {dest}: {e.strerror or e}") from None
    finally:
        s.close()


def resolve_ipv4(host: str) -> str:
    """``host`` as a dotted IPv4 address (zmq cannot bind or advertise a name)."""
    try:
        ipaddress.IPv4Address(host)
        return host
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise NetifError(f"cannot resolve host {host!r} to an IPv4 address: {e.strerror}") from None
    return str(infos[0][4][0])  # (an AF_INET address is a (host, port) pair)


def node_address(interface: str | None, scheduler: str | None, given: str | None = None) -> str:
    """A node's bind address (``DMLC_NODE_HOST``), worked out on the node, in ps-lite's order.

    ``given`` (the launcher's value, when it knew the address) as an IPv4 address; else the
    node's IPv4 address on ``interface`` (``DMLC_INTERFACE``: a name, prefix or CIDR); else the
    local address that routes to ``scheduler`` (``DMLC_PS_ROOT_URI``, a name or an address).
    The one rule for the node wrappers and for every process of the KVStore.
    """
    if given and given.strip():
        return resolve_ipv4(given.strip())
    if interface and interface.strip():
        return interface_address(interface)
    if not scheduler or not scheduler.strip():
        raise NetifError("neither DMLC_INTERFACE nor the scheduler's address is known")
    return route_source(resolve_ipv4(scheduler.strip()))


def guess_host_ip(mode: str = "auto") -> str:
    """dmlc's ``--host-ip`` rules: ``auto``/``ip`` (name lookup), ``dns`` (FQDN) or a literal."""
    if mode == "dns":
        return socket.getfqdn()
    if mode not in ("auto", "ip"):
        return mode
    try:
        ip = socket.gethostbyname(socket.getfqdn())
    except OSError:
        try:
            ip = socket.gethostbyname(socket.gethostname())
        except OSError:
            ip = "127.0.0.1"
    if ip.startswith("127."):
        # Loopback from the name lookup: take the first non-loopback address instead
        # (dmlc asks the routing table for 10.255.255.255, which fails without a route).
        for i in interfaces():
            if not i.address.startswith("127."):
                return i.address
    return ip


def _main(argv: list[str]) -> int:
    """``netif.py SPEC``: print ``{"address": ..., "interface": ...}`` or ``{"error": ...}``."""
    try:
        ifaces = interfaces()
        result: dict[str, object] = {"interfaces": [list(i) for i in ifaces]}
        if argv:
            chosen = match(argv[0], ifaces)
            result.update(address=chosen.address, interface=chosen.name)
    except NetifError as e:
        result = {"error": str(e)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
