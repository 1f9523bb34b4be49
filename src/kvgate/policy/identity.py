"""Who a request is from and how much it matters: its tenant, and its priority, which is what its
identity carries, clamped to what its Envoy route allows.

The tenant is Envoy's `x-kvgate-tenant`, set from the verified identity after Envoy removed any a
client sent; a request without one is `anonymous`, one tenant charged like any other (`read_tenant`:
the gate and the queue read it so).

Priority is never the client's to choose. Envoy removes any `x-kvgate-priority` a client sends, ahead
of every filter (the early header mutation), and sets it again only from a verified identity: a JWT
claim (`jwt_authn` claim_to_headers) or an `ext_authz` answer (docs/operations.md, "Security
model"). The route may cap it further with `x-kvgate-max-priority`.
The rule, written once (`Priorities.effective`): the identity's priority, or the default when it has
none or names no known priority, then no higher than the route's cap.

Names are `admission.priorities`, most important first; a rank is an index into them (0 = most
important), which is how the gate's wait and water levels and the queue's order compare requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.names import ANONYMOUS_TENANT


@dataclass(frozen=True, slots=True)
class Priorities:
    names: tuple[str, ...]  # most important first
    default: str

    def __post_init__(self) -> None:
        if self.default not in self.names:
            raise ValueError(f"default priority {self.default!r} is not one of {list(self.names)}")

    def rank(self, name: str | None) -> int:
        """The rank of a priority name; the default's for None or a name not listed."""
        names = self.names
        if name is not None and name in names:
            return names.index(name)
        return names.index(self.default)

    def effective(self, asked: str | None, route_cap: str | None) -> str:
        """The identity's priority (`asked`), made the default when unknown, no higher than the
        route's cap (`route_cap`, None: no cap)."""
        name = asked if asked is not None and asked in self.names else self.default
        if route_cap is not None and route_cap in self.names and self.rank(name) < self.rank(route_cap):
            return route_cap
        return name


def read_priority(value: str | None) -> str | None:
    """A priority header's value as a name (trimmed, lower case); None when absent or empty."""
    if value is None:
        return None
    name = value.strip(" \t").lower()
    return name or None


def read_tenant(value: str | None) -> str:
    """A tenant header's value, trimmed; ANONYMOUS_TENANT when absent or blank."""
    return (value or "").strip(" \t") or ANONYMOUS_TENANT
