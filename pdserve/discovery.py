"""Finding services by DNS name: a compose service scaled to N replicas, or a Kubernetes headless Service,
resolves to one address per replica."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_ipv4(host: str, port: int) -> list[str]:
    """Every IPv4 address a name has."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def routable(host: str) -> str:
    """An address other hosts can reach: a wildcard bind address becomes this host's own address (its name's, or
    else the address of the interface its default route uses)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks the route
                address = s.getsockname()[0]
            except OSError:
                address = "127.0.0.1"
        log.warning("host name %s does not resolve (%s); advertising %s", socket.gethostname(), e, address)
        return address
