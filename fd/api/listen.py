"""The API's port, bound before anything slow: ``fd serve`` binds it before the model loads, so a
port in use fails the start at once (one line), not after the load."""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass


@dataclass
class HeldPort:
    """An API's port, bound before anything slow (``fd serve`` binds it before the model
    loads), so that a port in use fails the start at once and not after the load. Bound, not
    listening: a client is refused until the API serves. One address (a host like 127.0.0.1 or
    0.0.0.0): its socket is handed to the site (:meth:`take`); several (``localhost``: IPv4
    and IPv6): held until the site binds them itself."""

    host: str
    port: int
    socks: list[socket.socket]

    def take(self) -> socket.socket | None:
        """The socket for the site to serve, or None (the site binds ``host``:``port``, which
        the held sockets are closed for)."""
        if len(self.socks) == 1:
            return self.socks.pop()
        self.close()
        return None

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []


def hold_port(host: str, port: int, reuse_port: bool = False) -> HeldPort:
    """Bind ``host``:``port`` as the API's site will (raises OSError naming the port if it is
    in use); see :class:`HeldPort`."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"--host {host}: {e.strerror}") from None
    addrs = list(dict.fromkeys((family, addr) for family, _, _, _, addr in infos))
    if port == 0 and len(addrs) > 1:  # (each would get a port of its own: the site picks)
        return HeldPort(host, port, [])
    socks: list[socket.socket] = []
    try:
        for family, addr in addrs:
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as asyncio's create_server)
            if reuse_port:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
    except OSError as e:
        for s in socks:
            s.close()
        if e.errno == errno.EADDRINUSE:
            raise OSError(
                f"port {port} on {host} is in use (another server listens there): give --port another"
            ) from None
        raise OSError(f"cannot bind {host}:{port}: {e.strerror or e}") from None
    return HeldPort(host, port, socks)
