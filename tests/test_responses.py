"""The ext_proc answers the gate builds from decisions, read back as Envoy reads them."""

from __future__ import annotations

from envoy.config.core.v3.base_pb2 import HeaderValueOption

from kvgate.gate import responses
from kvgate.policy import Reason, Route

LONG = Route("long", Reason.LONG, 9000, "node-a.engine:8000")
ACTIONS = HeaderValueOption.HeaderAppendAction


def set_headers(route: Route, session: str | None) -> dict[str, tuple[str, int]]:
    answer = responses.route_after_body(route, ("x-kvgate-pool", "x-evil"), {}, "kvgate", session)
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
    answer = responses.route_after_body(LONG, (), {}, "kvgate", "req-1")
    assert answer.dynamic_metadata.fields["kvgate"].struct_value.fields["session"].string_value == "req-1"
