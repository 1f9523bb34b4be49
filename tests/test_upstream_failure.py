"""A node that fails before it answers (issue 31's SIGTERM replay lost a long request the gate had
pinned to a node that was stopping): Envoy answers the refusal table's 503 upstream_unavailable with
Retry-After instead of its plain-text 503, in every shipped config and in `kvgate envoy-config`'s output
(the chart renders the same bootstrap: tests/test_chart_envoy.py); through the real Envoy for a pinned
request to a node that is gone and for a pool with no engine up; and the official openai SDK retries
it, each try through the gate again."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from envoy.config.core.v3.base_pb2 import HeaderValue, HeaderValueOption
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ProcessingRequest,
    ProcessingResponse,
)
from google.protobuf import json_format
from test_envoy_trust import bootstraps
from test_failopen import envoy_without_gate, serving, stack_ports

from kvgate.envoyconfig.upstream_failure import upstream_unavailable
from kvgate.harness.client import Reply, chat, post
from kvgate.harness.envoy import render_envoy
from kvgate.harness.stack import envoy_process
from kvgate.localports import free_port

ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"
HCM = "envoy.filters.network.http_connection_manager"


def local_replies(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The ingress listener's local_reply_config, through Envoy's own protobuf (so `503` and `'503'`,
    flow and block style, cannot differ)."""
    (listener, *_) = bootstrap["static_resources"]["listeners"]
    (manager,) = (f for f in listener["filter_chains"][0]["filters"] if f["name"] == HCM)
    message = json_format.ParseDict(
        manager["typed_config"]["local_reply_config"], http_connection_manager_pb2.LocalReplyConfig()
    )
    result: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return result


def test_every_bootstrap_answers_an_upstream_failure_with_the_refusal(tmp_path: Path) -> None:
    found = bootstraps(tmp_path)
    assert {"envoy.yaml", "envoy-one-trip.yaml", "envoy-inferencepool.yaml"} <= found.keys()
    expected = local_replies(found["envoy-config --round-trips 2"])
    for name, bootstrap in found.items():
        assert local_replies(bootstrap) == expected, name
    (mapper,) = expected["mappers"]
    answer = upstream_unavailable()
    assert mapper["status_code"] == answer.status == 503
    assert json.loads(mapper["body"]["inline_string"]) == json.loads(answer.body)
    added = [(h["header"]["key"], h["header"]["value"]) for h in mapper["headers_to_add"]]
    assert added == list(answer.headers)
    # Only the router's upstream failures before the response started: a gate refusal, a direct
    # response or the node's own answer carries none of these flags.
    assert mapper["filter"]["response_flag_filter"]["flags"] == ["UF", "UC", "UR", "UO", "UH", "URX"]


# --- through the real Envoy ---------------------------------------------------------------------------------


class PinningGate(external_processor_pb2_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """An ext_proc server that pins every request to `endpoint` in the long pool, as the gate pins a
    long request to the node that holds its reservation; it counts the streams (one per try)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.streams = 0
        self._lock = threading.Lock()

    def Process(self, requests: Iterator[ProcessingRequest], context: Any) -> Iterator[ProcessingResponse]:
        with self._lock:
            self.streams += 1
        decision = [("x-kvgate-pool", "long"), ("x-kvgate-endpoint", self.endpoint)]
        headers = [HeaderValue(key=key, raw_value=value.encode()) for key, value in decision]
        mutation = HeaderMutation(set_headers=[HeaderValueOption(header=header) for header in headers])
        for request in requests:
            if request.HasField("request_headers"):
                yield ProcessingResponse(request_headers=HeadersResponse(response=CommonResponse()))
            else:
                common = CommonResponse(header_mutation=mutation, clear_route_cache=True)
                yield ProcessingResponse(request_body=BodyResponse(response=common))


def assert_upstream_unavailable(reply: Reply) -> None:
    assert reply.status == 503, reply.body
    assert reply.headers["content-type"] == "application/json"
    assert reply.headers["x-kvgate-reason"] == "upstream_unavailable"
    assert reply.headers["retry-after"] == "1"
    assert reply.headers["retry-after-ms"] == "1000"
    error = reply.json()["error"]
    assert error["code"] == "upstream_unavailable" and error["type"] == "server_error"


@pytest.mark.slow
def test_a_request_pinned_to_a_node_that_is_gone_gets_a_retryable_refusal(tmp_path: Path) -> None:
    ports = stack_ports()
    gone = f"127.0.0.1:{free_port()}"  # a node that closed its listening socket (SIGTERM) or died
    config = render_envoy(ROOT / "envoy" / "envoy.yaml", tmp_path / "envoy.yaml", ports)
    with (
        serving(PinningGate(gone), ports["gate"]) as gate,
        envoy_without_gate(config, tmp_path, ports) as upstreams,
    ):
        assert_upstream_unavailable(post(ports["listener"], CHAT, chat("Summarize the attached contract.")))
        base_url = f"http://127.0.0.1:{ports['listener']}/v1"
        client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=2)
        with pytest.raises(openai.InternalServerError) as raised:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello."}])
        assert raised.value.status_code == 503
        assert raised.value.response.headers["x-kvgate-reason"] == "upstream_unavailable"
        # The first call's stream, then the SDK's three tries, each admitted by the gate again.
        assert gate.streams == 4
        assert upstreams.received == []


@pytest.mark.slow
def test_a_pool_with_no_engine_up_gets_the_refusal_in_one_trip_mode_too(tmp_path: Path) -> None:
    ports = stack_ports()  # nothing listens on any of them: no gate (a small body fails open), no engine
    config = render_envoy(ROOT / "envoy" / "envoy-one-trip.yaml", tmp_path / "envoy.yaml", ports)
    envoy = envoy_process(config, tmp_path, ports["admin"], ports["listener"])
    try:
        assert_upstream_unavailable(post(ports["listener"], CHAT, chat("Say hello.")))
    finally:
        envoy.stop()
