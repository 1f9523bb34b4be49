"""Free TCP ports on 127.0.0.1 for child processes that bind them a moment later (demo, tests).

Binding port 0 lets the kernel choose, but it chooses from the ephemeral range, the one it also
draws every outgoing connection's local port from: between the pick and the child's bind, any
connection on the machine may take the port (a test run here saw Envoy fail with `Address already
in use` that way). These come from below that range, and one process never hands a port out twice.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_LOWEST = 10000
_TRIES = 1000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# SystemRandom: test frameworks reseed the module's generator, and two processes drawing the same
# sequence would collide.
_random = random.SystemRandom()
_handed_out: set[int] = set()


def _ephemeral_start() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(count: int) -> list[int]:
    """`count` distinct ports nothing listens on now, below the ephemeral range when it leaves room."""
    highest = _ephemeral_start() - 1
    if highest - _LOWEST < 4 * count:
        return _kernel_ports(count)
    picked: list[int] = []
    with contextlib.ExitStack() as held:
        for _ in range(_TRIES):
            if len(picked) == count:
                break
            port = _random.randint(_LOWEST, highest)
            if port in _handed_out or port in picked:
                continue
            sock = held.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            picked.append(port)
        else:
            raise OSError(f"no {count} free ports between {_LOWEST} and {highest} after {_TRIES} tries")
    _handed_out.update(picked)
    return picked


def free_port() -> int:
    return free_ports(1)[0]


def _kernel_ports(count: int) -> list[int]:
    """Ports the kernel chooses (held together while picked, so no repeats)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
