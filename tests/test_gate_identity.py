"""Who a request is from and how much it matters, as the gate reads it, and the gate's own bound on
the large bodies it reads at once (issue 27: trust boundaries)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from kvgate.config import Config, RequestConfig
from kvgate.gate import pipeline as pipeline_module
from kvgate.gate.pipeline import Pipeline, RequestHead, estimator_factory, request_head
from kvgate.policy import Decision, Reason, Refusal
from kvgate.policy.identity import Priorities, read_priority
from kvgate.policy.route import NO_ROUTE_POLICY, RoutePolicy, read_route_policy
from kvgate.request import Api

PRIORITIES = Priorities(("high", "normal", "low"), "normal")


def test_an_identity_without_a_known_priority_gets_the_default() -> None:
    assert PRIORITIES.effective(None, None) == "normal"
    assert PRIORITIES.effective("urgent", None) == "normal"
    assert PRIORITIES.effective("low", None) == "low"
    assert PRIORITIES.effective("high", None) == "high"


def test_the_route_caps_the_identitys_priority_and_never_raises_it() -> None:
    assert PRIORITIES.effective("high", "normal") == "normal"
    assert PRIORITIES.effective("high", "low") == "low"
    assert PRIORITIES.effective(None, "low") == "low", "the default is capped too"
    assert PRIORITIES.effective("low", "high") == "low", "a cap is not a floor"
    assert PRIORITIES.rank("high") < PRIORITIES.rank("normal") < PRIORITIES.rank("low")
    assert PRIORITIES.rank("bogus") == PRIORITIES.rank("normal")


def test_a_default_outside_the_names_is_misuse() -> None:
    with pytest.raises(ValueError, match="urgent"):
        Priorities(("high", "low"), "urgent")


def test_priority_header_values_are_read_as_names() -> None:
    assert read_priority(" High\t") == "high"
    assert read_priority("") is None
    assert read_priority(None) is None


def test_the_routes_max_priority_is_read_and_an_unknown_name_reported() -> None:
    names = PRIORITIES.names
    read = read_route_policy([("x-kvgate-max-priority", "Normal")], {}, names)
    assert read.problems == () and read.policy == RoutePolicy(max_priority="normal")
    bad = read_route_policy([("x-kvgate-max-priority", "vip")], {}, names)
    assert bad.policy == RoutePolicy()
    assert bad.problems == (
        "x-kvgate-max-priority: 'vip' is not one of admission.priorities ['high', 'normal', 'low']",
    )


def _head(headers: dict[str, str], route: RoutePolicy = NO_ROUTE_POLICY) -> RequestHead:
    values = {":path": "/v1/chat/completions", ":method": "POST", **headers}
    return request_head(values.get, True, "x-kvgate-priority", route)


def test_the_head_carries_envoys_tenant_and_anonymous_without_one() -> None:
    assert _head({"x-kvgate-tenant": " acme "}).tenant == "acme"
    assert _head({}).tenant == "anonymous"
    assert _head({"x-kvgate-tenant": "  "}).tenant == "anonymous"


def test_the_pipeline_admits_with_the_capped_priority() -> None:
    pipeline = Pipeline(Config(), estimator_factory())
    try:
        assert pipeline.priority(_head({"x-kvgate-priority": "high"})) == "high"
        capped = _head({"x-kvgate-priority": "high"}, RoutePolicy(max_priority="low"))
        assert pipeline.priority(capped) == "low"
        assert pipeline.priority(_head({})) == "normal"
    finally:
        pipeline.close()


def _big_chat(size: int) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * size}]}).encode()


def test_large_bodies_past_the_byte_budget_are_refused_retryably(monkeypatch: Any) -> None:
    """Parsing holds several times a body's size, so the gate reads at most
    request.max_bytes_in_flight of large bodies at once; one body alone is always read."""
    started, release = threading.Event(), threading.Event()
    parse = pipeline_module._shape_or_none

    def held_parse(*args: Any) -> Any:
        started.set()
        assert release.wait(timeout=60), "the test never released the first parse"
        return parse(*args)

    monkeypatch.setattr(pipeline_module, "_shape_or_none", held_parse)
    budget = 3 * 1024 * 1024
    pipeline = Pipeline(Config(request=RequestConfig(max_bytes_in_flight=budget)), estimator_factory())
    first_body, second_body = _big_chat(budget - 100_000), _big_chat(2 * 1024 * 1024 + 10)
    head = _head({"content-type": "application/json"})
    assert head.api is Api.CHAT

    async def scenario() -> tuple[Decision, Decision, Decision]:
        first = asyncio.create_task(pipeline.on_body(head, first_body))
        await asyncio.to_thread(started.wait, 60)
        second = await pipeline.on_body(head, second_body)
        release.set()
        done = await first
        third = await pipeline.on_body(head, second_body)
        return done.decision, second.decision, third.decision

    try:
        first, second, third = asyncio.run(scenario())
    finally:
        release.set()
        pipeline.close()
    # Bodies this long are read, then refused as too long: what matters is that they were read.
    assert first.reason is Reason.TOO_LONG, "one body alone is read even near the budget"
    assert isinstance(second, Refusal) and second.reason is Reason.OVERLOADED
    assert third.reason is Reason.TOO_LONG, "the budget is given back when a body has been read"


def test_one_body_larger_than_the_budget_is_still_read_alone() -> None:
    pipeline = Pipeline(Config(request=RequestConfig(max_bytes_in_flight=1024)), estimator_factory())
    try:
        outcome = asyncio.run(pipeline.on_body(_head({}), _big_chat(3 * 1024 * 1024)))
    finally:
        pipeline.close()
    assert outcome.decision.reason is Reason.TOO_LONG, "read (and sized), not refused as overloaded"
