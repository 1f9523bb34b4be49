"""host:port strings, as config files and command lines write them."""

from __future__ import annotations

from kvgate.digits import whole_number
from kvgate.errors import ConfigError

HIGHEST_PORT = 65535
# What a metrics flag takes instead of an address.
OFF = "off"


def split_host_port(address: str, where: str = "address", allow_port_zero: bool = False) -> tuple[str, int]:
    """("host", port) from "host:port" or "[v6]:port"; ConfigError naming `where` otherwise.

    Port 0 (the kernel picks one) only with `allow_port_zero`: for a server that reports the port it
    got, where tests start it; anywhere else it would listen where nobody looks for it."""
    host, sep, port_text = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        # "agent::1" or "::1:80": which colon ends the host is a guess; an IPv6 host comes in brackets.
        raise ConfigError(
            f"{where}: expected host:port, with an IPv6 host in brackets ([::1]:80), got {address!r}"
        )
    lowest = 0 if allow_port_zero else 1
    port = whole_number(port_text, minimum=lowest, maximum=HIGHEST_PORT)
    if not sep or not host or port is None:
        raise ConfigError(
            f"{where}: expected host:port, got {address!r} (a port from {lowest} to {HIGHEST_PORT})"
        )
    return host, port


def listen_or_off(address: str, where: str) -> str | None:
    """A metrics flag's address, checked; None for "off"."""
    if address == OFF:
        return None
    split_host_port(address, where)
    return address


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
