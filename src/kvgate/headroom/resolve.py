"""Turn the `headroom.dns` name into agent addresses (one per A/AAAA record of a headless service)."""

from __future__ import annotations

import asyncio
import socket
from typing import Protocol

from kvgate.addresses import join_host_port
from kvgate.errors import HeadroomError


class Resolver(Protocol):
    async def __call__(self, host: str, port: int) -> frozenset[str]: ...


async def resolve_agents(host: str, port: int) -> frozenset[str]:
    """Every address `host` resolves to, as host:port strings; HeadroomError when the lookup fails."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise HeadroomError(f"cannot resolve agents at {host}:{port}: {exc}") from exc
    return frozenset(join_host_port(str(info[4][0]), port) for info in infos)
