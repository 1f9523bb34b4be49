"""The gate's `headroom:` config section: which agents to follow, how patiently, and which engine
endpoints to take from them.

Agents come from a static list of host:port and/or a DNS name (name:port, typically a Kubernetes
headless service) re-resolved every `resolve_interval_s`; each address found is one agent.

An agent's messages name its node's engine (NodeHeadroom.endpoint); the gate pins the requests it
admits there (x-kvgate-endpoint), and Envoy connects to it as told, with the client's prompt and
Authorization header. So the gate takes an endpoint (`EndpointRule`) only when every address of its
host is an address of the agent itself (the host the gate connects to for it; a name, with every
address it resolves to) or lies in `allowed_endpoints` (CIDRs or addresses; a host name there is
taken as written), and, when `endpoint_ports` is set, only on one of those ports. That confines a
misbehaving agent to its own host; it does not tell a real agent from a pod that poses as one on its
own address (TLS to the agents, with their certificates' names checked, does: docs/tls.md).

How long an agent may stay silent follows what it says it does (NodeHeadroom.heartbeat_ms). An agent
that sends every period (heartbeat 0) is stale after `stale_after_s` without a message and hung
(its stream dropped and reopened) after `idle_timeout_s`. One that sends on change sends at least
every heartbeat, so it is stale only after `STALE_HEARTBEATS` (3) heartbeats without a message, and
hung after `HUNG_HEARTBEATS` (5): a quiet node is neither (kvgate.agent.push). The heartbeat is
believed up to `MAX_HEARTBEAT_S` (10 s), so no agent can make itself fresh for long by claiming a
long one.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from kvgate.addresses import split_host_port
from kvgate.bounds import at_least
from kvgate.errors import ConfigError

# Missed heartbeats before a node is stale, and before its stream is taken for hung. Three leave room
# for a late tick or two on a busy host; hung comes later, since reconnecting costs more than skipping.
STALE_HEARTBEATS = 3
HUNG_HEARTBEATS = 5
MAX_HEARTBEAT_S = 10.0
# A gate's reservation lease (headroom.lease_s): renewed every third of it while the request lives.
DEFAULT_LEASE_S = 30.0

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class HeadroomSettings:
    agents: tuple[str, ...] = ()
    dns: str | None = None
    resolve_interval_s: float = field(default=10.0, metadata=at_least(0.1))
    # A node whose last message is older than this is stale (3.5 periods of the default 100 ms), or
    # than STALE_HEARTBEATS of its agent's heartbeats when that is longer (see the module doc).
    stale_after_s: float = field(default=0.35, metadata=at_least(0.01))
    # No message for this long on an open stream, or for HUNG_HEARTBEATS of the agent's heartbeats
    # when that is longer: the agent is hung; drop the stream and reconnect.
    idle_timeout_s: float = field(default=1.0, metadata=at_least(0.05))
    reserve_timeout_s: float = field(default=0.05, metadata=at_least(0.001))
    # The gate releases at the end of the request and renews every third of the lease while the
    # request lives (kvgate.gate.leases): a gate that dies holds its KV one lease at most.
    lease_s: float = field(default=DEFAULT_LEASE_S, metadata=at_least(1))
    reconnect_initial_s: float = field(default=0.1, metadata=at_least(0.001))
    reconnect_max_s: float = field(default=5.0, metadata=at_least(0.001))
    # Where agents' engine endpoints may be besides the agent's own host: CIDRs, IP addresses or host
    # names (taken as written). The chart's GPU nodes need their node network here: the engine
    # listens on the node's address, the agent on its pod's.
    allowed_endpoints: tuple[str, ...] = ()
    # The ports agents' engine endpoints may use; empty: any port.
    endpoint_ports: tuple[int, ...] = field(default=(), metadata={"min": 1, "max": 65535})

    def __post_init__(self) -> None:
        for i, agent in enumerate(self.agents):
            split_host_port(agent, f"headroom.agents[{i}]")
        if self.dns is not None:
            split_host_port(self.dns, "headroom.dns")
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ConfigError("headroom.reconnect_max_s must be >= headroom.reconnect_initial_s")
        self.endpoint_rule()  # ConfigError, naming the entry, at load time

    def endpoint_rule(self) -> EndpointRule:
        return EndpointRule.parse(self.allowed_endpoints, self.endpoint_ports)


def silence_allowed(floor_s: float, heartbeat_ms: int, heartbeats: int) -> float:
    """`floor_s`, or `heartbeats` of an agent's heartbeat when longer (0: it sends every period)."""
    return max(floor_s, heartbeats * min(heartbeat_ms / 1000, MAX_HEARTBEAT_S))


def stale_after(stale_after_s: float, heartbeat_ms: int) -> float:
    """How old a node's latest message may be while it is fresh."""
    return silence_allowed(stale_after_s, heartbeat_ms, STALE_HEARTBEATS)


def hung_after(idle_timeout_s: float, heartbeat_ms: int) -> float:
    """How long a stream may stay silent before it is reopened."""
    return silence_allowed(idle_timeout_s, heartbeat_ms, HUNG_HEARTBEATS)


def ip_or_none(host: str) -> IpAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class EndpointRule:
    """Which engine endpoints the gate takes from an agent (see the module doc). Pure: the headroom
    view resolves names and asks."""

    networks: tuple[IpNetwork, ...] = ()
    names: frozenset[str] = frozenset()  # host names taken as written (lower case)
    ports: frozenset[int] = frozenset()  # empty: any port

    @classmethod
    def parse(cls, allowed: tuple[str, ...], ports: tuple[int, ...]) -> EndpointRule:
        """From headroom.allowed_endpoints and headroom.endpoint_ports; ConfigError names the entry."""
        networks: list[IpNetwork] = []
        names: set[str] = set()
        for i, entry in enumerate(allowed):
            where = f"headroom.allowed_endpoints[{i}]"
            if "/" in entry or ip_or_none(entry) is not None:
                try:
                    networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError as exc:
                    raise ConfigError(f"{where}: not a CIDR or IP address: {exc}") from exc
            elif _is_host_name(entry):
                names.add(entry.lower())
            else:
                raise ConfigError(f"{where}: expected a CIDR, an IP address or a host name, got {entry!r}")
        for i, port in enumerate(ports):
            if not 1 <= port <= 65535:
                raise ConfigError(f"headroom.endpoint_ports[{i}]: must be a port (1-65535), got {port}")
        return cls(tuple(networks), frozenset(names), frozenset(ports))

    def named(self, host: str) -> bool:
        """Whether `host` is allowed by name: its addresses need not be looked up."""
        return host.lower() in self.names

    def problem(
        self, host: str, port: int, addresses: frozenset[IpAddress], agent: frozenset[IpAddress]
    ) -> str:
        """Why the endpoint `host`:`port` (its host's `addresses`) is refused for an agent answering
        from `agent`'s addresses; "" when it is taken."""
        if self.ports and port not in self.ports:
            return f"port {port} is not in headroom.endpoint_ports {sorted(self.ports)}"
        if self.named(host):
            return ""
        if not addresses:
            return f"{host} has no address"
        foreign = sorted(str(a) for a in addresses if a not in agent and not self._allowed(a))
        if foreign:
            own = ", ".join(sorted(map(str, agent))) or "unknown"
            return (
                f"{host} ({', '.join(foreign)}) is not the agent's own host ({own}) "
                "nor in headroom.allowed_endpoints"
            )
        return ""

    def _allowed(self, address: IpAddress) -> bool:
        return any(address in network for network in self.networks)


def _is_host_name(text: str) -> bool:
    labels = text.rstrip(".").split(".")
    return 0 < len(text) <= 253 and all(
        0 < len(label) <= 63 and label.replace("-", "").isalnum() and label.isascii() for label in labels
    )
