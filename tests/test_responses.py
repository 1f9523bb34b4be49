"""The ext_proc answers the gate builds from decisions, read back as Envoy reads them."""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderValueOption

from kvgate.gate import responses
from kvgate.policy import Reason, Route

LONG = Route("long", Reason.LONG, 9000, "node-a.engine:8000")
ACME = responses.Identity("acme", "low")
ACTIONS = HeaderValueOption.HeaderAppendAction


def set_headers(route: Route, session: str | None) -> dict[str, tuple[str, int]]:
    answer = responses.route_after_body(
        route, ("x-kvgate-pool", "x-evil"), {}, "kvgate", identity=ACME, session=session
    )
    mutation = answer.request_body.response.header_mutation
    assert list(mutation.remove_headers) == ["x-evil"], "a forged routing header is overwritten, not removed"
    return {h.header.key: (h.header.raw_value.decode(), h.append_action) for h in mutation.set_headers}


def test_a_reserved_request_names_its_reservation_to_the_engine_over_the_clients_session() -> None:
    headers = set_headers(LONG, "req-1")
    assert headers["x-session-id"] == ("req-1", ACTIONS.OVERWRITE_IF_EXISTS_OR_ADD)
    assert headers["x-kvgate-endpoint"] == ("node-a.engine:8000", ACTIONS.OVERWRITE_IF_EXISTS_OR_ADD)
    assert headers["x-kvgate-tokens"] == ("9000", ACTIONS.OVERWRITE_IF_EXISTS_OR_ADD)


def test_a_request_without_a_reservation_gets_no_session() -> None:
    assert "x-session-id" not in set_headers(Route("interactive", Reason.SHORT, 300), None)


def test_the_session_is_in_the_metadata_for_the_one_round_trip_set_up() -> None:
    answer = responses.route_after_body(LONG, (), {}, "kvgate", identity=ACME, session="req-1")
    assert answer.dynamic_metadata.fields["kvgate"].struct_value.fields["session"].string_value == "req-1"


def test_the_tenant_and_the_admitted_priority_go_upstream_over_what_came_in() -> None:
    """Envoy set both after authentication (a client's copies never get that far): they are forwarded
    for the queue, the priority as the route capped it, and never removed as forged."""
    forged = ("x-kvgate-tenant", "x-kvgate-priority", "x-evil")
    answer = responses.route_after_body(LONG, forged, {}, "kvgate", identity=ACME)
    mutation = answer.request_body.response.header_mutation
    assert list(mutation.remove_headers) == ["x-evil"]
    headers = {h.header.key: (h.header.raw_value.decode(), h.append_action) for h in mutation.set_headers}
    assert headers["x-kvgate-tenant"] == ("acme", ACTIONS.OVERWRITE_IF_EXISTS_OR_ADD)
    assert headers["x-kvgate-priority"] == ("low", ACTIONS.OVERWRITE_IF_EXISTS_OR_ADD)
    fields = answer.dynamic_metadata.fields["kvgate"].struct_value.fields
    assert fields["priority"].string_value == "low", "the one-round-trip set-up copies it from here"
