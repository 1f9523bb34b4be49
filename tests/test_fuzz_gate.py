"""Fuzz: every header and route-metadata value the gate reads, through the real ExternalProcessor in
both Envoy set-ups (two round trips: headers then body; one: the body with its attributes), with
admission against FakeHeadroom. Each request gets a defined answer: a route, or a refusal from the
one table (400, 404, 413, 415, 429, 503); never a stream error (which Envoy, failing open, would turn
into an un-admitted request), never the internal_error row (a gate bug hiding behind a 503), and
every reservation granted is released.

The values include what broke the gate in issue 20 (`Prefer: wait=²`, byte 0xB2 read as latin-1),
digits of other scripts, huge, negative and decimal numbers, empty values, whitespace and raw bytes.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from test_processor import StreamContext, set_headers

from kvgate.agent.in_process import FakeHeadroom, ManualClock
from kvgate.config import parse_config
from kvgate.config.routekeys import ROUTE_POLICY_KEYS
from kvgate.gate.admission import Admission
from kvgate.gate.pipeline import Pipeline, estimator_factory
from kvgate.gate.processor import ATTRIBUTES_NAMESPACE, ExternalProcessor, header_attribute
from kvgate.names import META_RESERVED_TOKENS, PREFER_HEADER, PRIORITY_HEADER
from kvgate.telemetry import DecisionSpans, GateMetrics

CONFIG = parse_config("policies: {batch: {async_mode: prefer, max_total_tokens: 32768}}\n")
DEFINED = {400, 404, 413, 415, 429, 503}

# Numbers as clients write them wrong: other scripts' digits, signs, decimals, huge, padded, empty.
NUMBERISH = [
    "²",
    "٣",
    "\uff11",  # full-width one
    "³⁴",
    "1.5",
    "-1",
    "+3",
    "1e3",
    "0x10",
    "1_000",
    "9" * 5000,
    "99999999999999999999999",
    "",
    " ",
    "\t7 ",
    "0",
    "007",
    "5",
    '"5"',
    "NaN",
]
text = st.one_of(
    st.sampled_from(NUMBERISH),
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=40),
    st.binary(max_size=40).map(lambda raw: raw.decode("latin-1")),
)
prefer = st.one_of(
    text,
    text.map(lambda value: f"wait={value}"),
    text.map(lambda value: f"respond-async, wait={value}"),
    text.map(lambda value: f'wait="{value}"; respond-async'),
)
# Every header the gate reads (kvgate.gate.pipeline.headers_read), and the tenant's, which it does not.
HEADERS = {
    PREFER_HEADER: prefer,
    PRIORITY_HEADER: st.one_of(st.sampled_from(["high", "normal", "low", " HIGH "]), text),
    "x-tenant": text,
    "content-type": st.one_of(st.sampled_from(["application/json", "text/plain"]), text),
    "content-encoding": st.one_of(st.sampled_from(["gzip", "identity", "br"]), text),
    "traceparent": st.one_of(st.just("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), text),
    "tracestate": text,
    "x-request-id": text,
    ":method": st.one_of(st.just("POST"), text),
}
PATHS = st.one_of(
    st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/x"]),
    text.map(lambda value: "/v1/chat/completions?" + value),
    text,
)
METADATA_KEYS = [key.metadata for key in ROUTE_POLICY_KEYS]
metadata = st.lists(
    st.tuples(
        st.sampled_from([*METADATA_KEYS, "user-agent"]),
        st.one_of(text, st.sampled_from(["batch", "prefer", "allow", "never", "2000", "9000"])),
    ),
    max_size=4,
)


def _chat(words: int) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "word " * words}]}).encode()


BODIES = st.sampled_from(
    [
        _chat(3),
        _chat(6000),  # the long pool: a reservation on FakeHeadroom's node
        gzip.compress(_chat(3)),
        b"{broken",
        b"",
        json.dumps({"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}).encode(),
    ]
)


@dataclass(frozen=True)
class Request:
    two_trips: bool
    path: str
    headers: dict[str, str]
    body: bytes
    metadata: list[tuple[str, str]]


requests = st.builds(
    Request,
    st.booleans(),
    PATHS,
    st.fixed_dictionaries({}, optional=HEADERS),
    BODIES,
    metadata,
)


def _raw(value: str) -> bytes:
    """A header's bytes as a client sent them: latin-1 where it can be (0xB2 for '²'), else UTF-8."""
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8", "surrogatepass")


def messages(request: Request) -> list[ProcessingRequest]:
    if request.two_trips:
        values = {":path": request.path, **request.headers}
        header_map = HeaderMap(headers=[HeaderValue(key=k, raw_value=_raw(v)) for k, v in values.items()])
        return [
            ProcessingRequest(request_headers=HttpHeaders(headers=header_map, end_of_stream=False)),
            ProcessingRequest(request_body=HttpBody(body=request.body, end_of_stream=True)),
        ]
    message = ProcessingRequest(request_body=HttpBody(body=request.body, end_of_stream=True))
    fields = message.attributes[ATTRIBUTES_NAMESPACE].fields
    fields["request.path"].string_value = request.path
    for name, value in request.headers.items():
        key = {":method": "request.method", "x-request-id": "request.id"}.get(name) or header_attribute(name)
        fields[key].string_value = value
    return [message]


class CountingMetrics(GateMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.internal_errors = 0

    def internal_error(self, message: str) -> None:
        super().internal_error(message)
        self.internal_errors += 1


async def _through_the_gate(
    request: Request,
) -> tuple[list[ProcessingResponse], FakeHeadroom, CountingMetrics]:
    metrics = CountingMetrics()
    source = FakeHeadroom(ManualClock())
    source.add_node("node-a", 200_000)
    admission = Admission(CONFIG.admission, source, telemetry=metrics, clock=ManualClock())
    pipeline = Pipeline(CONFIG, estimator_factory(), admission, telemetry=metrics)
    processor = ExternalProcessor(pipeline, CONFIG, metrics, DecisionSpans(TracerProvider()))

    async def stream(sequence: Sequence[ProcessingRequest]) -> AsyncIterator[ProcessingRequest]:
        for message in sequence:
            yield message

    try:
        context = StreamContext(request.metadata)
        answers = [a async for a in processor.Process(stream(messages(request)), context)]  # type: ignore[arg-type]
        await processor.drain_agent_calls()
    finally:
        pipeline.close()
    return answers, source, metrics


def _messages_sent(request: Request, answers: list[ProcessingResponse]) -> int:
    """How many of the request's messages Envoy sends: after a headers answer that decides (a refusal,
    or a route that skips the body), none, and the gate has ended its stream."""
    first = answers[0] if answers else None
    if (
        request.two_trips
        and first is not None
        and (first.HasField("mode_override") or first.WhichOneof("response") == "immediate_response")
    ):
        return 1
    return len(messages(request))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests)
def test_every_header_and_route_value_gets_a_defined_answer(request: Request) -> None:
    answers, source, metrics = asyncio.run(asyncio.wait_for(_through_the_gate(request), 10))
    assert len(answers) == _messages_sent(request, answers), "one answer per message, and no stream error"
    assert metrics.internal_errors == 0
    reserved = 0
    for answer in answers:
        kind = answer.WhichOneof("response")
        assert kind in ("request_headers", "request_body", "immediate_response"), kind
        if kind == "immediate_response":
            assert answer.immediate_response.status.code in DEFINED
            assert set_headers(answer)["x-kvgate-reason"] != "internal_error"
            json.loads(answer.immediate_response.body)
        fields = answer.dynamic_metadata.fields["kvgate"].struct_value.fields
        reserved += META_RESERVED_TOKENS in fields
    assert len(source.released) == reserved, "every reservation granted is released"


def test_the_issue_20_header_is_admitted_not_passed_through() -> None:
    """`Prefer: wait=²` as the latin-1 byte 0xB2: a long chat still gets its pool and its reservation."""
    for two_trips in (True, False):
        request = Request(two_trips, "/v1/chat/completions", {PREFER_HEADER: "wait=²"}, _chat(6000), [])
        answers, source, _ = asyncio.run(_through_the_gate(request))
        assert set_headers(answers[-1])["x-kvgate-pool"] == "long"
        assert len(source.released) == 1
