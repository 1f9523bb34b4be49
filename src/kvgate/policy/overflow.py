"""What a request gets when its pool has no room for it: the async pool when there is one, else a
refusal the client may retry. The wording of every capacity refusal lives here."""

from __future__ import annotations

from kvgate.config import ModelConfig
from kvgate.policy.decision import Decision, Reason, Refusal, Route
from kvgate.policy.route import async_allowed


def overflow(route: Route, model: ModelConfig, reason: Reason, why: str, async_default: bool) -> Decision:
    """A long request that found no room (shed, queue full, waited in vain). `async_default` is
    admission.async_fallback, for models whose policy does not say."""
    if async_allowed(model, async_default):
        return Route(model.pools.async_, Reason.ASYNC, route.tokens)
    return Refusal(
        reason, f"No capacity for a {route.tokens}-token request now: {why}. Retry later.", route.tokens
    )


def no_healthy_node(route: Route) -> Refusal:
    return Refusal(
        Reason.NO_HEALTHY_NODE, "No long-context node is healthy and reachable. Retry later.", route.tokens
    )


def interactive_saturated(route: Route) -> Refusal:
    return Refusal(Reason.SHED, "The interactive pool is saturated. Retry later.", route.tokens)
