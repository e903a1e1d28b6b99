"""Finding services by DNS name: a compose service scaled to N replicas, or a Kubernetes headless Service,
resolves to one address per replica."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_ipv4(host: str, port: int) -> list[str]:
    """Every IPv4 address a name has."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})
