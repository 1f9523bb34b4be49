"""Per-route policy from Envoy's ext_proc metadata, and the client's Prefer hints: pure rules."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvgate.config import ModelConfig, ModelPolicy
from kvgate.policy import Reason, Route
from kvgate.policy.route import (
    NO_HINTS,
    NO_ROUTE_POLICY,
    ClientHints,
    RoutePolicy,
    async_allowed,
    deferred,
    effective_model,
    limits_problem,
    read_prefer,
    read_route_policy,
)

POLICIES = {
    "batch": ModelPolicy(max_total_tokens=32768, async_mode="prefer"),
    "tight": ModelPolicy(4000, 8000),
}
MODEL = ModelConfig()


def test_route_values_are_read_and_other_metadata_ignored() -> None:
    read = read_route_policy(
        [
            ("user-agent", "grpc-c++"),
            ("x-kvgate-max-total-tokens", "2000"),
            ("x-kvgate-default-output-tokens", "256"),
            ("x-kvgate-async", "never"),
            ("x-kvgate-model-policy", "batch"),
        ],
        POLICIES,
    )
    assert read.problems == ()
    assert read.policy == RoutePolicy(
        ModelPolicy(max_total_tokens=2000, default_output_tokens=256, async_mode="never"), "batch"
    )


def test_bad_values_are_named_and_ignored() -> None:
    read = read_route_policy(
        [
            ("x-kvgate-max-total-tokens", "lots"),
            ("x-kvgate-interactive-max-tokens", "0"),
            ("x-kvgate-async", "sometimes"),
            ("x-kvgate-model-policy", "nope"),
            ("x-kvgate-default-output-tokens", "512"),
        ],
        POLICIES,
    )
    assert read.policy == RoutePolicy(ModelPolicy(default_output_tokens=512))
    assert read.problems == (
        "x-kvgate-max-total-tokens: 'lots' is not a whole number >= 1",
        "x-kvgate-interactive-max-tokens: '0' is not a whole number >= 1",
        "x-kvgate-async: 'sometimes' is not one of prefer, allow, never",
        "x-kvgate-model-policy: no policy 'nope' in kvgate.yaml's policies (known: batch, tight)",
    )


def test_precedence_route_over_its_named_policy_over_the_model_entry() -> None:
    model = ModelConfig(match="llama-*", max_total_tokens=16384, default_output_tokens=1024)
    assert effective_model(model, NO_ROUTE_POLICY, POLICIES) is model
    named = effective_model(model, RoutePolicy(model_policy="batch"), POLICIES)
    assert (named.max_total_tokens, named.async_mode, named.default_output_tokens) == (32768, "prefer", 1024)
    route = RoutePolicy(ModelPolicy(max_total_tokens=20000), "batch")
    assert effective_model(model, route, POLICIES).max_total_tokens == 20000, "the route's own value wins"
    assert effective_model(model, route, POLICIES).match == "llama-*"


def test_a_lower_total_lowers_the_interactive_limit_with_it() -> None:
    strict = effective_model(MODEL, RoutePolicy(ModelPolicy(max_total_tokens=2000)), POLICIES)
    assert (strict.interactive_max_tokens, strict.max_total_tokens) == (2000, 2000)
    assert limits_problem(MODEL, RoutePolicy(ModelPolicy(max_total_tokens=2000)), POLICIES) is None
    contradiction = RoutePolicy(ModelPolicy(interactive_max_tokens=9000, max_total_tokens=3000))
    assert effective_model(MODEL, contradiction, POLICIES).interactive_max_tokens == 3000
    assert "interactive limit 9000 exceeds its total limit 3000" in str(
        limits_problem(MODEL, contradiction, POLICIES)
    )


def test_prefer_header() -> None:
    assert read_prefer(None) is NO_HINTS
    assert read_prefer("respond-async, wait=10") == ClientHints(10.0, True)
    assert read_prefer('wait="5"; foo=bar') == ClientHints(5.0, False)
    assert read_prefer("return=minimal, wait=soon") == NO_HINTS, "what it does not understand is ignored"


@given(st.text(max_size=60))
def test_any_prefer_header_parses(header: str) -> None:
    hints = read_prefer(header)
    assert hints.wait_s is None or hints.wait_s >= 0


def test_async_mode_and_the_clients_respond_async() -> None:
    long = Route("long", Reason.LONG, 9000)
    asks = ClientHints(respond_async=True)
    prefer = ModelConfig(async_mode="prefer")
    assert deferred(long, prefer, NO_HINTS, False) == Route("async", Reason.ASYNC, 9000)
    assert deferred(long, MODEL, asks, async_default=True) == Route("async", Reason.ASYNC, 9000)
    assert deferred(long, MODEL, asks, async_default=False) is None, "hints only lower what the route allows"
    assert deferred(long, ModelConfig(async_mode="never"), asks, True) is None
    assert deferred(Route("interactive", Reason.SHORT, 900), prefer, asks, True) is None
    assert [
        async_allowed(ModelConfig(async_mode=m), d) for m in (None, "allow", "never") for d in (0, 1)
    ] == [
        False,
        True,
        True,
        True,
        False,
        False,
    ]
