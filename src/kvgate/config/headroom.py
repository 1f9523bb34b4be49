"""The gate's `headroom:` config section: which agents to follow and how patiently.

Agents come from a static list of host:port and/or a DNS name (name:port, typically a Kubernetes
headless service) re-resolved every `resolve_interval_s`; each address found is one agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.addresses import split_host_port
from kvgate.bounds import at_least
from kvgate.errors import ConfigError


@dataclass(frozen=True, slots=True)
class HeadroomSettings:
    agents: tuple[str, ...] = ()
    dns: str | None = None
    resolve_interval_s: float = field(default=10.0, metadata=at_least(0.1))
    # A node whose last message is older than this is stale (3.5 periods of the default 100 ms).
    stale_after_s: float = field(default=0.35, metadata=at_least(0.01))
    # No message for this long on an open stream: the agent is hung; drop the stream and reconnect.
    idle_timeout_s: float = field(default=1.0, metadata=at_least(0.05))
    reserve_timeout_s: float = field(default=0.05, metadata=at_least(0.001))
    # Safety net only: the gate releases at the end of the request; a lost release expires here.
    lease_s: float = field(default=600.0, metadata=at_least(1))
    reconnect_initial_s: float = field(default=0.1, metadata=at_least(0.001))
    reconnect_max_s: float = field(default=5.0, metadata=at_least(0.001))

    def __post_init__(self) -> None:
        for i, agent in enumerate(self.agents):
            split_host_port(agent, f"headroom.agents[{i}]")
        if self.dns is not None:
            split_host_port(self.dns, "headroom.dns")
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ConfigError("headroom.reconnect_max_s must be >= headroom.reconnect_initial_s")
