"""One process per port: a server's command checks its port before it starts anything.

Linux lets a second socket listen on a port when both set SO_REUSEPORT, and splits the connections
between them. gRPC servers set it unless told otherwise, so a second `kvgate agent` on a node's port
used to start without a word, and the gates' connections went half to each: one node, two ledgers,
over-admission. Every kvgate server turns it off, except the gate's own workers, which share their
port on purpose (`server.workers`). A bind alone would then refuse a taken port, but not in one line:
gRPC logs the failure itself first, and the agent and the gate open their metrics port before it. So
each command calls `check_listen` first; a bind that fails anyway (a race) still ends in ListenError.
"""

from __future__ import annotations

import errno
import socket

from kvgate.addresses import join_host_port
from kvgate.errors import ListenError


def check_listen(host: str, port: int, where: str) -> None:
    """ListenError naming `where` when something listens on `port` at an address `host` names, or
    when none of them can be bound (not this machine's, a port below 1024 without the right)."""
    if port == 0:
        return  # the kernel picks a free one
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # the server's own bind says what is wrong with the host
    failed: list[OSError] = []
    for family, kind, protocol, _, address in addresses:
        with socket.socket(family, kind, protocol) as probe:
            # As the servers bind: a port that only old connections hold (TIME_WAIT) is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise cannot_listen(host, port, where, exc) from None
                failed.append(exc)
    # gRPC listens on the addresses it can bind ("localhost" without IPv6: 127.0.0.1 alone).
    if len(failed) == len(addresses):
        raise cannot_listen(host, port, where, failed[0])


def cannot_listen(host: str, port: int, where: str, exc: OSError) -> ListenError:
    address = join_host_port(host, port)
    if exc.errno == errno.EADDRINUSE:
        return ListenError(f"{where} {address}: port {port} is in use by another process")
    return ListenError(f"{where} {address}: cannot listen there: {exc.strerror or exc}")
