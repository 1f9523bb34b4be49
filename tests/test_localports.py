"""Ports for child processes: free, distinct, and out of the range outgoing connections draw from."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvgate import localports
from kvgate.localports import free_port, free_ports


def ephemeral_start() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_ports_are_distinct_free_and_below_the_ephemeral_range() -> None:
    ports = free_ports(20) + [free_port() for _ in range(20)]
    assert len(set(ports)) == 40, "no port is handed out twice"
    assert all(10000 <= port < ephemeral_start() for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        free = spare.getsockname()[1]
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        taken = listening.getsockname()[1]
        proposals = iter([taken, taken, free])
        monkeypatch.setattr(localports, "_random", SimpleNamespace(randint=lambda *_: next(proposals)))
        assert free_ports(1) == [free]
