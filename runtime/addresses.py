"""The address a host advertises: what clients and peers on other machines dial.

Bound to a specific address, that address. Bound to every interface (0.0.0.0 or
::), the source address of the route towards the peers (the UDP ``connect``
trick: the kernel picks the interface and no packet is sent), else of the route
towards any address, else the first non-loopback address of an interface that is
up. Never loopback: ``gethostbyname(gethostname())`` is 127.0.0.1 or 127.0.1.1
on stock Linux, which is how a client on another machine got a handle it could
not reach.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys

from .errors import ConfigError

WILDCARD = ("0.0.0.0", "::", "[::]", "")
_ANY_ROUTE = ("198.51.100.1", "2001:db8::1")  # documentation ranges: only the route lookup, never traffic


def split(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); a one-line ConfigError otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host:
        raise ConfigError(f"'{address}': expected HOST:PORT")
    return host.strip("[]"), int(port)


def join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _usable(ip: str) -> bool:
    a = ipaddress.ip_address(ip)
    return not (a.is_loopback or a.is_unspecified or a.is_link_local)


def route_source(dest: str) -> str | None:
    """The local address the kernel would use to reach ``dest`` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in dest else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((dest, 9))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return ip if _usable(ip) else None


def interface_addresses() -> list[str]:
    """IPv4 addresses of the interfaces that are up (Linux: SIOCGIFADDR per interface)."""
    out: list[str] = []
    if sys.platform.startswith("linux"):
        import fcntl

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    req = struct.pack("256s", name.encode()[:15])
                    out.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]))
                except OSError:
                    continue
    try:
        out += [ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    return [ip for ip in dict.fromkeys(out) if _usable(ip)]


def advertise(bind_host: str, port: int, peers: tuple[str, ...] = ()) -> str:
    """The ``host:port`` to advertise for a server bound to ``bind_host:port``."""
    if bind_host not in WILDCARD:
        return join(bind_host.strip("[]"), port)
    for dest in [split(p)[0] for p in peers] + list(_ANY_ROUTE):
        try:
            dest = socket.getaddrinfo(dest, None)[0][4][0]
        except OSError:
            continue
        if (ip := route_source(dest)) is not None:
            return join(ip, port)
    if ips := interface_addresses():
        return join(ips[0], port)
    raise ConfigError("cannot find a non-loopback address to advertise; pass --advertise HOST:PORT")
