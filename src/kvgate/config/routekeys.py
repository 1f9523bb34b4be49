"""The keys an Envoy route may set for the requests it carries, declared once.

One row per key: the gRPC metadata key Envoy sends on the ext_proc stream (`x-kvgate-*`), its name
in `route_policies:` (`kvgate envoy-config`) and, camel-cased, in the chart's `envoy.routePolicies`,
the ModelPolicy field it sets, its kind and its bounds. kvgate.policy.route reads the metadata by
this table, kvgate.envoyconfig.routepolicy writes it in this order, ModelConfig and ModelPolicy take
their bounds from it, and a test holds the chart's template and values schema to it (the chart cannot
import Python).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, get_args

from kvgate.names import (
    ROUTE_ASYNC,
    ROUTE_DEFAULT_OUTPUT_TOKENS,
    ROUTE_INTERACTIVE_MAX_TOKENS,
    ROUTE_MAX_PRIORITY,
    ROUTE_MAX_TOTAL_TOKENS,
    ROUTE_MODEL_POLICY,
    ROUTE_TENANT_CLASS,
)

AsyncMode = Literal["prefer", "allow", "never"]
ASYNC_MODES: tuple[str, ...] = get_args(AsyncMode)

# Far past any context window: every token count a route or kvgate.yaml sets stays below it.
MAX_TOKENS = 1_000_000_000


class Kind(enum.Enum):
    TOKENS = "tokens"  # a whole number of tokens, from `minimum` to MAX_TOKENS
    POLICY = "policy"  # the name of an entry of kvgate.yaml's `policies:`
    ASYNC = "async"  # one of ASYNC_MODES
    PRIORITY = "priority"  # the name of one of kvgate.yaml's admission.priorities
    TENANT_CLASS = "tenant_class"  # the name of an entry of kvgate.yaml's fairness.classes


@dataclass(frozen=True, slots=True)
class RouteKey:
    metadata: str  # the x-kvgate-* gRPC metadata key
    name: str  # the key in route_policies: (snake_case); the chart's is `chart`
    kind: Kind
    # The ModelPolicy field it sets; None for the keys that are not a model's limits (model_policy
    # names a whole policy, max_priority caps the request's priority: kvgate.policy.identity,
    # tenant_class names the settings of the tenants the route carries: kvgate.policy.tenant_book).
    policy_field: str | None
    minimum: int = 0

    @property
    def chart(self) -> str:
        """The key in the chart's envoy.routePolicies (camelCase)."""
        first, *rest = self.name.split("_")
        return first + "".join(word.capitalize() for word in rest)

    @property
    def maximum(self) -> int:
        return MAX_TOKENS

    def bounds(self) -> dict[str, float]:
        """Field metadata for the config loader (kvgate.bounds' shape, with a maximum)."""
        return {"min": self.minimum, "max": self.maximum}


_T, _P, _A, _R, _C = Kind.TOKENS, Kind.POLICY, Kind.ASYNC, Kind.PRIORITY, Kind.TENANT_CLASS

# In the order Envoy metadata is written (kvgate envoy-config, the chart).
# fmt: off
ROUTE_POLICY_KEYS: tuple[RouteKey, ...] = (
    RouteKey(ROUTE_INTERACTIVE_MAX_TOKENS, "interactive_max_tokens", _T, "interactive_max_tokens", 1),
    RouteKey(ROUTE_MAX_TOTAL_TOKENS,       "max_total_tokens",       _T, "max_total_tokens",       1),
    RouteKey(ROUTE_DEFAULT_OUTPUT_TOKENS,  "default_output_tokens",  _T, "default_output_tokens",  0),
    RouteKey(ROUTE_MODEL_POLICY,           "model_policy",           _P, None),
    RouteKey(ROUTE_ASYNC,                  "async",                  _A, "async_mode"),
    RouteKey(ROUTE_MAX_PRIORITY,           "max_priority",           _R, None),
    RouteKey(ROUTE_TENANT_CLASS,           "tenant_class",           _C, None),
)
# fmt: on
BY_METADATA = MappingProxyType({key.metadata: key for key in ROUTE_POLICY_KEYS})
BY_NAME = MappingProxyType({key.name: key for key in ROUTE_POLICY_KEYS})
_BY_FIELD = {key.policy_field: key for key in ROUTE_POLICY_KEYS if key.policy_field is not None}


def bounds(policy_field: str) -> dict[str, float]:
    """`field(metadata=bounds("max_total_tokens"))`: the table's bounds for a config field."""
    return _BY_FIELD[policy_field].bounds()
