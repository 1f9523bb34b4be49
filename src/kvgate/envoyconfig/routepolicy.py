"""Policy per host and per route, laid out as Envoy's route table carries it.

An entry names hosts (none: every host) and/or a path prefix, and the values the gate reads from the
ext_proc stream's gRPC metadata (kvgate.policy.route). Envoy takes them from a virtual host's or a
route's `typed_per_filter_config` (ExtProcPerRoute `overrides.grpc_initial_metadata`), once per
request, from the route chosen when the request's headers arrive, before the gate has answered
(`Filter::mergePerRouteConfig`, called from `decodeHeaders`), and lays the route's entries over its
virtual host's key by key (`mergeGrpcInitialMetadata`; both in envoyproxy/envoy
source/extensions/filters/http/ext_proc/ext_proc.cc).

The layout, the same in `kvgate envoy-config` and in the Helm chart (a test keeps the two equal):
- the entries that name the same hosts share one virtual host, named after the first of them; the one
  among them without a path prefix is that virtual host's policy. Host lists that overlap without being
  the same are refused: Envoy takes each domain in one virtual host only;
- an entry with a path prefix becomes, in each virtual host it applies to (its hosts', or every virtual
  host when it names none), a copy of the pool routes under that prefix (`path_separated_prefix`, so
  /v1/chat does not match /v1/chatty), longest prefix first. An every-host entry and a host's entry with
  the same prefix make one set of routes, the host's values winning key by key.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.config import AsyncMode, ModelPolicy, limits_contradiction, parse_yaml_as
from kvgate.config.routekeys import ROUTE_POLICY_KEYS, bounds
from kvgate.errors import ConfigError

# Names end up in Kubernetes object names (the chart's Istio and Envoy Gateway modes): DNS labels.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$")
# A name of kvgate.yaml's that a route gives: a priority as admission.priorities spells them (the gate
# reads them in lower case), a tenant class of fairness.classes.
_CONFIG_NAME = re.compile(r"^[a-z0-9][-_a-z0-9]{0,62}$")
# What path_separated_prefix accepts: a path, no query or fragment, no trailing slash ("/" alone is the
# whole host: leave the prefix out instead).
_PATH_PREFIX = re.compile(r"^/[^?#]*[^/?#]$")

# (x-kvgate-* key, RoutePolicy attribute), in the order the metadata is written: the route-policy
# table's (kvgate.config.routekeys); a key that is a Python keyword (async) has a trailing underscore.
METADATA_FIELDS = tuple(
    (key.metadata, key.name + "_" if keyword.iskeyword(key.name) else key.name) for key in ROUTE_POLICY_KEYS
)

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """One entry of `route_policies:` (the chart's envoy.routePolicies, in snake_case)."""

    name: str = ""
    hosts: tuple[str, ...] = ()
    path_prefix: str | None = None
    interactive_max_tokens: int | None = field(default=None, metadata=bounds("interactive_max_tokens"))
    max_total_tokens: int | None = field(default=None, metadata=bounds("max_total_tokens"))
    default_output_tokens: int | None = field(default=None, metadata=bounds("default_output_tokens"))
    # The name of an entry of kvgate.yaml's `policies:`.
    model_policy: str | None = None
    async_: AsyncMode | None = None
    # The highest priority requests on these routes get: a name of kvgate.yaml's admission.priorities,
    # which the gate checks (it reports and ignores a name it does not know).
    max_priority: str | None = None
    # The name of an entry of kvgate.yaml's fairness.classes: the weight and caps of the tenants whose
    # requests these routes carry, where their own entry does not set them (kvgate.policy.tenant_book).
    tenant_class: str | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ConfigError(
                f"name: {self.name!r} must be a DNS label of at most 40 characters (a-z, 0-9, '-')"
            )
        if not self.hosts and self.path_prefix is None:
            raise ConfigError("needs hosts or path_prefix: a policy for every request belongs in kvgate.yaml")
        if self.path_prefix is not None and not _PATH_PREFIX.match(self.path_prefix):
            raise ConfigError(
                f"path_prefix: {self.path_prefix!r} must start with '/', not end with '/', "
                "and hold no '?' or '#'"
            )
        if self.max_priority is not None and not _CONFIG_NAME.match(self.max_priority):
            raise ConfigError(
                f"max_priority: {self.max_priority!r} must be a priority name (a-z, 0-9, '-', '_'), "
                "one of kvgate.yaml's admission.priorities"
            )
        if self.tenant_class is not None and not _CONFIG_NAME.match(self.tenant_class):
            raise ConfigError(
                f"tenant_class: {self.tenant_class!r} must be a class name (a-z, 0-9, '-', '_'), "
                "an entry of kvgate.yaml's fairness.classes"
            )
        if not self.values():
            raise ConfigError(
                "sets nothing: give at least one of " + ", ".join(key.name for key in ROUTE_POLICY_KEYS)
            )
        # Refused where it is written (kvgate.config.limits_contradiction says why).
        contradiction = limits_contradiction(self.interactive_max_tokens, self.max_total_tokens)
        if contradiction is not None:
            raise ConfigError(contradiction)

    def values(self) -> dict[str, str]:
        """The gRPC metadata this entry sets, by x-kvgate-* key."""
        found: dict[str, str] = {}
        for key, name in METADATA_FIELDS:
            value = getattr(self, name)
            if value is not None:
                found[key] = str(value)
        return found


@dataclass(frozen=True, slots=True)
class RoutePoliciesFile:
    route_policies: tuple[RoutePolicy, ...] = ()


@dataclass(frozen=True, slots=True)
class PolicyPath:
    prefix: str
    # The route's own entries; Envoy lays them over its virtual host's.
    metadata: Metadata


@dataclass(frozen=True, slots=True)
class PolicyHost:
    name: str
    domains: tuple[str, ...]
    # The virtual host's entries (empty when only path entries name these hosts).
    metadata: Metadata
    paths: tuple[PolicyPath, ...]


@dataclass(frozen=True, slots=True)
class RouteLayout:
    hosts: tuple[PolicyHost, ...] = ()
    # Path entries for every host: the default virtual host's (and every policy host's).
    paths: tuple[PolicyPath, ...] = ()


def ordered(values: Mapping[str, str]) -> Metadata:
    """Metadata in the fixed key order, so two renderings of the same policy are equal."""
    return tuple((key, values[key]) for key, _ in METADATA_FIELDS if key in values)


def _paths(by_prefix: Mapping[str, Mapping[str, str]]) -> tuple[PolicyPath, ...]:
    """Longest prefix first: Envoy takes the first route that matches."""
    return tuple(
        PolicyPath(prefix, ordered(by_prefix[prefix]))
        for prefix in sorted(by_prefix, key=lambda p: (-len(p), p))
    )


@dataclass
class _Group:
    name: str
    hosts: tuple[str, ...]
    metadata: dict[str, str] | None = None
    paths: dict[str, dict[str, str]] = field(default_factory=dict)


def layout(
    entries: Iterable[RoutePolicy],
    policies: Mapping[str, ModelPolicy],
    source: str,
    tenant_classes: Collection[str] = (),
) -> RouteLayout:
    """Group `entries` into virtual hosts and route sets; ConfigError naming the entry on a conflict or
    on a policy or tenant class the config does not have."""
    groups: list[_Group] = []
    every_host: dict[str, dict[str, str]] = {}
    names: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"{source}: route_policies[{i}] ({entry.name})"
        if entry.name in names:
            raise ConfigError(f"{where}: name used twice")
        names.add(entry.name)
        if entry.model_policy is not None and entry.model_policy not in policies:
            known = ", ".join(sorted(policies)) or "none"
            raise ConfigError(
                f"{where}: model_policy {entry.model_policy!r} is not an entry of the config's "
                f"policies: (known: {known})"
            )
        if entry.tenant_class is not None and entry.tenant_class not in tenant_classes:
            known = ", ".join(sorted(tenant_classes)) or "none"
            raise ConfigError(
                f"{where}: tenant_class {entry.tenant_class!r} is not an entry of the config's "
                f"fairness.classes (known: {known})"
            )
        if not entry.hosts:
            assert entry.path_prefix is not None
            if entry.path_prefix in every_host:
                raise ConfigError(f"{where}: path_prefix {entry.path_prefix} is given twice for every host")
            every_host[entry.path_prefix] = entry.values()
            continue
        group = _group_for(groups, entry, where)
        if entry.path_prefix is None:
            if group.metadata is not None:
                raise ConfigError(
                    f"{where}: hosts {', '.join(group.hosts)} already have a policy without path_prefix"
                )
            group.metadata = entry.values()
        elif entry.path_prefix in group.paths:
            raise ConfigError(f"{where}: path_prefix {entry.path_prefix} is given twice for these hosts")
        else:
            group.paths[entry.path_prefix] = entry.values()
    hosts = tuple(
        PolicyHost(
            name=group.name,
            domains=group.hosts,
            metadata=ordered(group.metadata or {}),
            paths=_paths(
                {
                    p: every_host.get(p, {}) | group.paths.get(p, {})
                    for p in every_host.keys() | group.paths.keys()
                }
            ),
        )
        for group in groups
    )
    return RouteLayout(hosts=hosts, paths=_paths(every_host))


def _group_for(groups: list[_Group], entry: RoutePolicy, where: str) -> _Group:
    wanted = set(entry.hosts)
    if len(wanted) != len(entry.hosts):
        raise ConfigError(f"{where}: a host is listed twice")
    for group in groups:
        if set(group.hosts) == wanted:
            return group
        shared = wanted & set(group.hosts)
        if shared:
            raise ConfigError(
                f"{where}: host {sorted(shared)[0]} is also in route policy {group.name!r} with other hosts; "
                "entries for the same host must list the same hosts (Envoy puts a domain in one virtual host)"
            )
    group = _Group(entry.name, tuple(sorted(wanted)))
    groups.append(group)
    return group


def load_route_policies(path: Path) -> tuple[RoutePolicy, ...]:
    """`route_policies:` from a YAML file, each key checked as kvgate.yaml's are."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--route-policies: cannot read {path}: {exc}") from exc
    return parse_yaml_as(RoutePoliciesFile, text, str(path)).route_policies
