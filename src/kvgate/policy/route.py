"""Policy set where the mesh is configured, and what the client may ask: pure parsing and precedence.

An Envoy route or virtual host sets a request's limits with its ext_proc per-route override
(`typed_per_filter_config` → `ExtProcPerRoute.overrides.grpc_initial_metadata`); Envoy merges the
route's entries over its virtual host's and sends them as the gRPC metadata of the ext_proc stream.
The gate reads them here:

    x-kvgate-interactive-max-tokens   a number: the interactive pool's limit for these requests
    x-kvgate-max-total-tokens         a number: the largest total admitted at all (above it: refused)
    x-kvgate-default-output-tokens    a number: the output budget charged when the client names none
    x-kvgate-model-policy             the name of an entry of kvgate.yaml's `policies:`
    x-kvgate-async                    prefer | allow | never: the async pool for long requests
    x-kvgate-max-priority             a name of admission.priorities: the highest priority a request
                                      on this route gets, whatever its identity carries
                                      (kvgate.policy.identity)
    x-kvgate-tenant-class             the name of an entry of kvgate.yaml's `fairness.classes`: the
                                      weight and caps of the tenants whose requests the route
                                      carries, where their own entry does not set them
                                      (kvgate.policy.tenant_book)

The keys, their kinds and bounds are the one table of kvgate.config.routekeys; numbers are read by
kvgate.digits (ASCII digits only, bounded). Precedence, written once (`effective_model`): Envoy
route > Envoy virtual host > model entry > default. The numbers and `x-kvgate-async` the route sets
win over its named policy's, which win over the model entry's. A value that does not parse is
reported and ignored: the request keeps its model's policy for that key. Where the layers meet with
an interactive limit above the total limit, the total wins (`ModelConfig.capped`; why, in
kvgate.config.limits_contradiction), and `limits_capped` says so for the gate to report once.

The client's own hints (RFC 7240 `Prefer`) can only lower what the route allows: `wait=N` bounds
how long the gate holds the request waiting for capacity, `respond-async` asks for the async pool
where the route allows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from kvgate.config import ModelConfig, ModelPolicy
from kvgate.config.routekeys import ASYNC_MODES, BY_METADATA, BY_NAME, Kind, RouteKey
from kvgate.digits import NotWhole, read_whole, whole_number
from kvgate.policy.decision import Reason, Route

# The metadata keys the gate reads from the ext_proc stream.
ROUTE_KEYS = frozenset(BY_METADATA)
# RFC 9111 delta-seconds: a cache treats anything larger as 2^31. So does `Prefer: wait`.
MAX_WAIT_S = 2**31


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """What the request's Envoy route (merged over its virtual host) says; None where it is silent."""

    overrides: ModelPolicy = field(default_factory=ModelPolicy)
    model_policy: str | None = None
    max_priority: str | None = None
    tenant_class: str | None = None


NO_ROUTE_POLICY = RoutePolicy()


@dataclass(frozen=True, slots=True)
class RoutePolicyRead:
    policy: RoutePolicy
    problems: tuple[str, ...]  # one line per value ignored, naming the key and the value


def read_route_policy(
    metadata: Iterable[tuple[str, str]],
    policies: Mapping[str, ModelPolicy],
    priorities: tuple[str, ...],
    tenant_classes: Collection[str] = (),
) -> RoutePolicyRead:
    """The route policy from the ext_proc stream's metadata (other metadata is ignored)."""
    values: dict[str, object] = {}
    problems = []
    for name, raw in metadata:
        key = BY_METADATA.get(name)
        if key is None:
            continue
        value = _read_value(key, raw, policies, priorities, tenant_classes)
        if isinstance(value, _Problem):
            problems.append(value.line)
        else:
            values[key.name] = value
    model_policy = values.pop("model_policy", None)
    max_priority = values.pop("max_priority", None)
    tenant_class = values.pop("tenant_class", None)
    overrides = ModelPolicy(**{BY_NAME[name].policy_field: value for name, value in values.items()})  # type: ignore[arg-type]
    policy = RoutePolicy(overrides, model_policy, max_priority, tenant_class)  # type: ignore[arg-type]
    return RoutePolicyRead(policy, tuple(problems))


@dataclass(frozen=True, slots=True)
class _Problem:
    line: str  # the key, the value, and what is wrong with it


def _read_value(
    key: RouteKey,
    raw: str,
    policies: Mapping[str, ModelPolicy],
    priorities: tuple[str, ...],
    tenant_classes: Collection[str],
) -> object:
    """One metadata value as its key's kind reads it, or the _Problem with it."""
    name, value = key.metadata, raw.strip(" \t")
    if key.kind is Kind.TENANT_CLASS:
        if value in tenant_classes:
            return value
        known = ", ".join(sorted(tenant_classes)) or "none"
        return _Problem(f"{name}: no class {raw!r} in kvgate.yaml's fairness.classes (known: {known})")
    if key.kind is Kind.POLICY:  # x-kvgate-model-policy: names a whole layer
        if value in policies:
            return value
        known = ", ".join(sorted(policies)) or "none"
        return _Problem(f"{name}: no policy {raw!r} in kvgate.yaml's policies (known: {known})")
    if key.kind is Kind.PRIORITY:
        if value.lower() in priorities:
            return value.lower()
        return _Problem(f"{name}: {raw!r} is not one of admission.priorities {list(priorities)}")
    if key.kind is Kind.TOKENS:
        number = read_whole(raw, minimum=key.minimum, maximum=key.maximum)
        return _Problem(number.describe(name)) if isinstance(number, NotWhole) else number
    if value in ASYNC_MODES:
        return value
    return _Problem(f"{name}: {raw!r} is not one of {', '.join(ASYNC_MODES)}")


def _layered(model: ModelConfig, route: RoutePolicy, policies: Mapping[str, ModelPolicy]) -> ModelConfig:
    layers = [policies[route.model_policy]] if route.model_policy is not None else []
    layers.append(route.overrides)
    changes = {
        name.name: value
        for layer in layers
        for name in dataclasses.fields(layer)
        if (value := getattr(layer, name.name)) is not None
    }
    return dataclasses.replace(model, **changes) if changes else model


def effective_model(
    model: ModelConfig, route: RoutePolicy, policies: Mapping[str, ModelPolicy]
) -> ModelConfig:
    """The model entry with the route's named policy, then the route's own values, laid over it;
    an interactive limit above the total is capped to it (`ModelConfig.capped`)."""
    return _layered(model, route, policies).capped()


@dataclass(frozen=True, slots=True)
class LimitsCapped:
    """Where a route's layers met with an interactive limit above the total limit (the total won)."""

    message: str
    # The route's own layers (its values, its named policy) set the interactive limit above it: a
    # contradiction `kvgate envoy-config` refuses. False: a lower total met the model's own limit.
    contradiction: bool


def limits_capped(
    model: ModelConfig, route: RoutePolicy, policies: Mapping[str, ModelPolicy]
) -> LimitsCapped | None:
    """What `effective_model` capped, for the gate to report once per model and route; None when
    nothing was."""
    layered = _layered(model, route, policies)
    if layered.contradiction() is None:
        return None
    named = policies[route.model_policy] if route.model_policy is not None else ModelPolicy()
    asked = route.overrides.interactive_max_tokens or named.interactive_max_tokens
    interactive, total = layered.interactive_max_tokens, layered.max_total_tokens
    return LimitsCapped(
        f"its interactive limit {interactive} exceeds its total limit {total}; {total} applies to both",
        contradiction=asked is not None,
    )


@dataclass(frozen=True, slots=True)
class ClientHints:
    """RFC 7240 preferences the gate honours; they can only lower what the route allows."""

    wait_s: float | None = None  # Prefer: wait=N
    respond_async: bool = False  # Prefer: respond-async


NO_HINTS = ClientHints()


def read_prefer(header: str | None) -> ClientHints:
    """`Prefer: respond-async, wait=10` → ClientHints(10.0, True); anything else is ignored (RFC
    7240: a server ignores preferences it does not understand), a wait that is not a whole number
    of seconds included: the request keeps the route's wait."""
    if not header:
        return NO_HINTS
    wait_s = None
    respond_async = False
    for preference in header.split(","):
        # RFC 7240's whitespace is SP and HTAB (OWS, RFC 9110 5.6.3): "wait=0\r" is not a wait.
        name, _, value = preference.split(";", 1)[0].strip(" \t").partition("=")
        name = name.strip(" \t").lower()
        if name == "respond-async":
            respond_async = True
        elif name == "wait":
            seconds = whole_number(value.strip(" \t").strip('"'), maximum=MAX_WAIT_S)
            if seconds is not None:
                wait_s = float(seconds)
    return ClientHints(wait_s, respond_async)


def async_allowed(model: ModelConfig, default: bool) -> bool:
    """Whether a long request may go to the async pool (`default`: admission.async_fallback)."""
    if model.async_mode is None:
        return default
    return model.async_mode != "never"


def deferred(route: Route, model: ModelConfig, hints: ClientHints, async_default: bool) -> Route | None:
    """The async-pool route of a long request that goes there at once: its route prefers the async
    pool, or the client asks (`Prefer: respond-async`) where the route allows it. None otherwise."""
    if route.reason is not Reason.LONG:
        return None
    if model.async_mode == "prefer" or (hints.respond_async and async_allowed(model, async_default)):
        return Route(model.pools.async_, Reason.ASYNC, route.tokens)
    return None
