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

Precedence, written once (`effective_model`): Envoy route > Envoy virtual host > model entry >
default. The numbers and `x-kvgate-async` the route sets win over its named policy's, which win
over the model entry's. A value that does not parse is reported and ignored: the request keeps
its model's policy for that key.

The client's own hints (RFC 7240 `Prefer`) can only lower what the route allows: `wait=N` bounds
how long the gate holds the request waiting for capacity, `respond-async` asks for the async pool
where the route allows it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import get_args

from kvgate.config import AsyncMode, ModelConfig, ModelPolicy
from kvgate.names import (
    ROUTE_ASYNC,
    ROUTE_DEFAULT_OUTPUT_TOKENS,
    ROUTE_INTERACTIVE_MAX_TOKENS,
    ROUTE_MAX_TOTAL_TOKENS,
    ROUTE_MODEL_POLICY,
)
from kvgate.policy.decision import Reason, Route

_ASYNC_MODES: tuple[str, ...] = get_args(AsyncMode)
_NUMBERS = {
    ROUTE_INTERACTIVE_MAX_TOKENS: ("interactive_max_tokens", 1),
    ROUTE_MAX_TOTAL_TOKENS: ("max_total_tokens", 1),
    ROUTE_DEFAULT_OUTPUT_TOKENS: ("default_output_tokens", 0),
}
ROUTE_KEYS = frozenset((*_NUMBERS, ROUTE_MODEL_POLICY, ROUTE_ASYNC))


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    """What the request's Envoy route (merged over its virtual host) says; None where it is silent."""

    overrides: ModelPolicy = field(default_factory=ModelPolicy)
    model_policy: str | None = None


NO_ROUTE_POLICY = RoutePolicy()


@dataclass(frozen=True, slots=True)
class RoutePolicyRead:
    policy: RoutePolicy
    problems: tuple[str, ...]  # one line per value ignored, naming the key and the value


def read_route_policy(
    metadata: Iterable[tuple[str, str]], policies: Mapping[str, ModelPolicy]
) -> RoutePolicyRead:
    """The route policy from the ext_proc stream's metadata (other metadata is ignored)."""
    values: dict[str, object] = {}
    model_policy = None
    problems = []
    for key, raw in metadata:
        if key not in ROUTE_KEYS:
            continue
        value = raw.strip()
        if key in _NUMBERS:
            name, minimum = _NUMBERS[key]
            if not value.isdigit() or int(value) < minimum:
                problems.append(f"{key}: {raw!r} is not a whole number >= {minimum}")
                continue
            values[name] = int(value)
        elif key == ROUTE_ASYNC:
            if value not in _ASYNC_MODES:
                problems.append(f"{key}: {raw!r} is not one of {', '.join(_ASYNC_MODES)}")
                continue
            values["async_mode"] = value
        elif value not in policies:
            known = ", ".join(sorted(policies)) or "none"
            problems.append(f"{key}: no policy {raw!r} in kvgate.yaml's policies (known: {known})")
        else:
            model_policy = value
    return RoutePolicyRead(RoutePolicy(ModelPolicy(**values), model_policy), tuple(problems))  # type: ignore[arg-type]


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
    """The model entry with the route's named policy, then the route's own values, laid over it.

    A route that lowers the total limit below the interactive one lowers the interactive one with it
    (no request can be longer than the total anyway)."""
    result = _layered(model, route, policies)
    if result.interactive_max_tokens > result.max_total_tokens:
        return dataclasses.replace(result, interactive_max_tokens=result.max_total_tokens)
    return result


def limits_problem(model: ModelConfig, route: RoutePolicy, policies: Mapping[str, ModelPolicy]) -> str | None:
    """A route whose own interactive limit is above its total limit, for the log (the total wins)."""
    result = _layered(model, route, policies)
    named = policies[route.model_policy] if route.model_policy is not None else ModelPolicy()
    asked = route.overrides.interactive_max_tokens or named.interactive_max_tokens
    if asked is not None and result.interactive_max_tokens > result.max_total_tokens:
        return (
            f"its interactive limit {result.interactive_max_tokens} exceeds its total limit "
            f"{result.max_total_tokens}; {result.max_total_tokens} applies to both"
        )
    return None


@dataclass(frozen=True, slots=True)
class ClientHints:
    """RFC 7240 preferences the gate honours; they can only lower what the route allows."""

    wait_s: float | None = None  # Prefer: wait=N
    respond_async: bool = False  # Prefer: respond-async


NO_HINTS = ClientHints()


def read_prefer(header: str | None) -> ClientHints:
    """`Prefer: respond-async, wait=10` → ClientHints(10.0, True); anything else is ignored (RFC
    7240: a server ignores preferences it does not understand)."""
    if not header:
        return NO_HINTS
    wait_s = None
    respond_async = False
    for preference in header.split(","):
        name, _, value = preference.split(";", 1)[0].strip().partition("=")
        name = name.strip().lower()
        if name == "respond-async":
            respond_async = True
        elif name == "wait":
            number = value.strip().strip('"')
            if number.isdigit():
                wait_s = float(number)
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
