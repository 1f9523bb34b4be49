"""Per-route policy from Envoy's ext_proc metadata, and the client's Prefer hints: pure rules."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvgate.config import ModelConfig, ModelPolicy
from kvgate.config.routekeys import MAX_TOKENS, ROUTE_POLICY_KEYS, Kind, RouteKey
from kvgate.policy import Reason, Route
from kvgate.policy.route import (
    MAX_WAIT_S,
    NO_HINTS,
    NO_ROUTE_POLICY,
    ClientHints,
    LimitsCapped,
    RoutePolicy,
    async_allowed,
    deferred,
    effective_model,
    limits_capped,
    read_prefer,
    read_route_policy,
)

POLICIES = {
    "batch": ModelPolicy(max_total_tokens=32768, async_mode="prefer"),
    "tight": ModelPolicy(4000, 8000),
}
MODEL = ModelConfig()
PRIORITIES = ("high", "normal", "low")


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
        PRIORITIES,
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
        PRIORITIES,
    )
    assert read.policy == RoutePolicy(ModelPolicy(default_output_tokens=512))
    assert read.problems == (
        f"x-kvgate-max-total-tokens: 'lots' is not a whole number from 1 to {MAX_TOKENS}",
        f"x-kvgate-interactive-max-tokens: '0' is not a whole number from 1 to {MAX_TOKENS}",
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


def test_where_layers_meet_the_total_wins_and_the_cap_is_said_once() -> None:
    lower_total = RoutePolicy(ModelPolicy(max_total_tokens=2000))
    strict = effective_model(MODEL, lower_total, POLICIES)
    assert (strict.interactive_max_tokens, strict.max_total_tokens) == (2000, 2000)
    assert limits_capped(MODEL, lower_total, POLICIES) == LimitsCapped(
        "its interactive limit 4096 exceeds its total limit 2000; 2000 applies to both", contradiction=False
    ), "a lower total meeting the model's own interactive limit: expected, said without alarm"
    contradiction = RoutePolicy(ModelPolicy(interactive_max_tokens=9000, max_total_tokens=3000))
    assert effective_model(MODEL, contradiction, POLICIES).interactive_max_tokens == 3000
    capped = limits_capped(MODEL, contradiction, POLICIES)
    assert capped is not None and capped.contradiction, "the route's own values contradict each other"
    assert "interactive limit 9000 exceeds its total limit 3000" in capped.message
    named = RoutePolicy(ModelPolicy(max_total_tokens=3000), "tight")
    assert limits_capped(MODEL, named, POLICIES) == LimitsCapped(
        "its interactive limit 4000 exceeds its total limit 3000; 3000 applies to both", contradiction=True
    ), "its named policy's interactive limit counts as the route's own"
    assert limits_capped(MODEL, RoutePolicy(ModelPolicy(max_total_tokens=5000)), POLICIES) is None


def test_the_one_rule_lives_on_the_types_it_is_read_from() -> None:
    assert ModelPolicy(9000, 3000).contradiction() == (
        "interactive_max_tokens (9000) must not exceed max_total_tokens (3000)"
    )
    assert ModelPolicy(interactive_max_tokens=9000).contradiction() is None, "one layer of several"
    over = ModelConfig(interactive_max_tokens=9000, max_total_tokens=3000)
    assert over.contradiction() == ModelPolicy(9000, 3000).contradiction()
    assert over.capped().interactive_max_tokens == 3000
    assert MODEL.capped() is MODEL


def test_prefer_header() -> None:
    assert read_prefer(None) is NO_HINTS
    assert read_prefer("respond-async, wait=10") == ClientHints(10.0, True)
    assert read_prefer('wait="5"; foo=bar') == ClientHints(5.0, False)
    assert read_prefer("return=minimal, wait=soon") == NO_HINTS, "what it does not understand is ignored"
    # Issue 20: '\xb2' (a latin-1 header's 0xB2 byte) passes str.isdigit() but not float().
    for unreadable in ("\xb2", "\u0663", "\uff11", "1.5", "-1", "+1", "1_0", "", " ", "9" * 5000):
        assert read_prefer(f"wait={unreadable}").wait_s is None, unreadable
    assert read_prefer(f"wait={MAX_WAIT_S}").wait_s == MAX_WAIT_S
    assert read_prefer(f"wait={MAX_WAIT_S + 1}").wait_s is None


@given(st.text(max_size=60))
def test_any_prefer_header_parses(header: str) -> None:
    """Never raises; a wait it reads is a whole number of seconds within RFC 9111's bound."""
    hints = read_prefer(header)
    assert hints.wait_s is None or (hints.wait_s == int(hints.wait_s) and 0 <= hints.wait_s <= MAX_WAIT_S)


WRITTEN_WAITS = ["wait={}", ' wait = "{}" ', "respond-async, wait={};x=y"]


@given(st.integers(0, MAX_WAIT_S), st.sampled_from(WRITTEN_WAITS))
def test_a_whole_wait_is_read_exactly(seconds: int, written: str) -> None:
    assert read_prefer(written.format(seconds)).wait_s == seconds


@given(st.text(alphabet=st.characters(blacklist_characters=',;"'), max_size=30))
def test_a_wait_that_is_not_ascii_digits_is_ignored(value: str) -> None:
    digits = value.strip(" \t")
    if not (digits.isascii() and digits.isdigit()):
        assert read_prefer(f"wait={value}").wait_s is None


@given(st.text(alphabet=st.characters(categories=["Nd", "No"]), min_size=1, max_size=6))
def test_digits_of_other_scripts_never_count(value: str) -> None:
    if not value.isascii():
        assert read_prefer(f"wait={value}").wait_s is None
        read = read_route_policy([("x-kvgate-max-total-tokens", value)], POLICIES, PRIORITIES)
        assert read.policy == NO_ROUTE_POLICY and len(read.problems) == 1


@given(st.sampled_from(ROUTE_POLICY_KEYS), st.text(max_size=30))
def test_any_route_metadata_value_is_read_or_named_never_raises(key: RouteKey, value: str) -> None:
    read = read_route_policy([(key.metadata, value)], POLICIES, PRIORITIES)
    if read.problems:
        assert read.policy == NO_ROUTE_POLICY
        (problem,) = read.problems
        assert problem.startswith(f"{key.metadata}: ")
    elif key.kind is Kind.TOKENS:
        digits = value.strip(" \t")
        assert digits.isascii() and digits.isdigit()
        assert getattr(read.policy.overrides, str(key.policy_field)) == int(digits)


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
