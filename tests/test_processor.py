"""The ext_proc adapter driven directly with ProcessingRequest messages: answers, traces, fuzzing."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    HttpTrailers,
    ProcessingRequest,
    ProcessingResponse,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvgate.config import Config, parse_config
from kvgate.errors import InvalidRequestError
from kvgate.gate.holding import MIN_NOTICE_S, holding
from kvgate.gate.pipeline import Outcome, Pipeline, Reserved, estimator_factory
from kvgate.gate.processor import (
    ATTRIBUTES_NAMESPACE,
    ExternalProcessor,
    header_attribute,
    request_attributes,
)
from kvgate.localports import free_port
from kvgate.policy import Reason, Route
from kvgate.telemetry import DecisionSpans, GateMetrics

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


async def never_moved(_endpoint: str) -> Reserved | None:
    """A reservation's move, where the test never serves the request elsewhere."""
    raise AssertionError("not moved in this test")


async def no_first_token() -> None:
    """A reservation's first token, where the dialect's gate never reads the answer."""
    raise AssertionError("the dialect's gate reads no answer")


def headers(path: str = "/v1/chat/completions", *, end: bool = False, **extra: str) -> ProcessingRequest:
    values = {":method": "POST", ":path": path, "content-type": "application/json", **extra}
    header_map = HeaderMap(headers=[HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()])
    return ProcessingRequest(request_headers=HttpHeaders(headers=header_map, end_of_stream=end))


def body(data: bytes, end: bool = True) -> ProcessingRequest:
    return ProcessingRequest(request_body=HttpBody(body=data, end_of_stream=end))


def one_trip_body(
    data: bytes, path: str = "/v1/chat/completions", *, end: bool = True, **request_headers: str
) -> ProcessingRequest:
    """The only message of a one-round-trip stream: the body, with the attributes Envoy evaluates
    from envoy-one-trip.yaml's request_attributes (a header the request lacks is left out)."""
    message = body(data, end)
    fields = message.attributes[ATTRIBUTES_NAMESPACE].fields
    fields["request.path"].string_value = path
    fields["request.method"].string_value = "POST"
    fields["request.id"].string_value = "req-1"
    for name, value in {"content-type": "application/json", **request_headers}.items():
        fields[header_attribute(name)].string_value = value
    return message


def make_processor(config: Config | None = None, spans: DecisionSpans | None = None) -> ExternalProcessor:
    config = config or Config()
    pipeline = Pipeline(config, estimator_factory())
    return ExternalProcessor(pipeline, config, GateMetrics(), spans)


class StreamContext:
    """What the processor reads of grpc.aio's ServicerContext: the stream's metadata."""

    def __init__(self, metadata: Sequence[tuple[str, str]]) -> None:
        self._metadata = tuple(metadata)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


def drive(
    processor: ExternalProcessor,
    messages: Sequence[ProcessingRequest],
    metadata: Sequence[tuple[str, str]] = (),
) -> list[ProcessingResponse]:
    async def requests() -> AsyncIterator[ProcessingRequest]:
        for message in messages:
            yield message

    async def run() -> list[ProcessingResponse]:
        context = StreamContext(metadata)
        return [response async for response in processor.Process(requests(), context)]  # type: ignore[arg-type]

    return asyncio.run(asyncio.wait_for(run(), 10))


def set_headers(response: ProcessingResponse) -> dict[str, str]:
    which = response.WhichOneof("response")
    if which == "immediate_response":
        mutation = response.immediate_response.headers
    else:
        mutation = getattr(response, which).response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def chat(text: str, **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}], **extra}).encode()


def test_short_chat_is_routed_in_the_body_response() -> None:
    first, second = drive(make_processor(), [headers(**{"x-kvgate-pool": "long"}), body(chat("hi"))])
    assert first.WhichOneof("response") == "request_headers"
    assert not first.request_headers.response.HasField("header_mutation")
    routed = set_headers(second)
    assert routed["x-kvgate-pool"] == "interactive"
    assert second.request_body.response.clear_route_cache
    assert second.dynamic_metadata.fields["kvgate"].struct_value.fields["pool"].string_value == "interactive"


def test_bodiless_request_is_answered_at_the_headers() -> None:
    (only,) = drive(make_processor(), [headers("/v1/models", end=True)])
    assert set_headers(only)["x-kvgate-reason"] == "no_body"
    assert not only.HasField("mode_override")


def test_unknown_path_skips_the_body() -> None:
    (only,) = drive(make_processor(), [headers("/v1/audio/speech")])
    assert set_headers(only)["x-kvgate-reason"] == "unparsed"
    assert only.mode_override.request_body_mode == 0  # NONE: Envoy does not buffer or send the body


def test_forged_headers_are_removed_even_when_we_do_not_set_them() -> None:
    _, routed = drive(
        make_processor(), [headers(**{"x-kvgate-node": "a", "x-kvgate-priority": "high"}), body(chat("x"))]
    )
    mutation = routed.request_body.response.header_mutation
    assert set(mutation.remove_headers) == {"x-kvgate-node"}
    # Priority and tenant are set over whatever arrived (Envoy strips a client's at its edge).
    forwarded = {h.header.key: h.header.raw_value for h in mutation.set_headers}
    assert forwarded["x-kvgate-priority"] == b"high" and forwarded["x-kvgate-tenant"] == b"anonymous"


def test_the_routes_cap_lowers_the_forwarded_priority() -> None:
    processor = make_processor()
    _, routed = drive(
        processor,
        [headers(**{"x-kvgate-priority": "high", "x-kvgate-tenant": "acme"}), body(chat("x"))],
        metadata=[("x-kvgate-max-priority", "low")],
    )
    forwarded = {
        h.header.key: h.header.raw_value for h in routed.request_body.response.header_mutation.set_headers
    }
    assert forwarded["x-kvgate-priority"] == b"low" and forwarded["x-kvgate-tenant"] == b"acme"


def test_chunked_body_is_collected_until_its_end() -> None:
    data = chat("hello " * 3000, max_tokens=2000)
    responses = drive(make_processor(), [headers(), body(data[:100], end=False), body(data[100:])])
    assert [r.WhichOneof("response") for r in responses] == [
        "request_headers",
        "request_body",
        "request_body",
    ]
    assert set_headers(responses[-1])["x-kvgate-pool"] == "long"


def test_refusals_are_immediate_json_responses() -> None:
    _, answer = drive(make_processor(), [headers(), body(b"{broken")])
    immediate = answer.immediate_response
    assert immediate.status.code == 400
    assert json.loads(immediate.body)["error"]["code"] == "invalid_request"


def test_gzip_bodies_are_offloaded_and_understood() -> None:
    data = gzip.compress(chat("word " * 30000))
    _, answer = drive(make_processor(), [headers(**{"content-encoding": "gzip"}), body(data)])
    assert answer.immediate_response.status.code == 413


def test_other_phases_get_a_matching_empty_answer() -> None:
    # Trailers that follow a streamed body, before the gate has its last piece (and so its answer).
    trailers = ProcessingRequest(request_trailers=HttpTrailers())
    _, _, last = drive(make_processor(), [headers(), body(chat("hi"), end=False), trailers])
    assert last.WhichOneof("response") == "request_trailers"


def follow_stream(
    processor: ExternalProcessor, messages: Sequence[ProcessingRequest]
) -> tuple[list[ProcessingResponse], bool]:
    """The answers to `messages` sent on a stream Envoy keeps open after them (as it does until the
    HTTP request ends), and whether the gate ended the stream itself before Envoy did."""

    async def run() -> tuple[list[ProcessingResponse], bool]:
        envoy_ends = asyncio.Event()
        asked_for_more = asyncio.Event()

        async def requests() -> AsyncIterator[ProcessingRequest]:
            for message in messages:
                yield message
            asked_for_more.set()
            await envoy_ends.wait()

        answers: list[ProcessingResponse] = []

        async def read() -> None:
            async for answer in processor.Process(requests(), StreamContext(())):  # type: ignore[arg-type]
                answers.append(answer)

        reading = asyncio.ensure_future(read())
        # Each message is answered before the next is read: after the last one's answers, the gate
        # either ends its stream or asks Envoy for the next message.
        asking = asyncio.ensure_future(asked_for_more.wait())
        await asyncio.wait((reading, asking), return_when=asyncio.FIRST_COMPLETED)
        ended_by_gate = reading.done()
        envoy_ends.set()
        asking.cancel()
        await reading
        await processor.drain_agent_calls()
        return answers, ended_by_gate

    return asyncio.run(asyncio.wait_for(run(), 10))


def test_a_request_that_holds_nothing_ends_its_stream_once_answered() -> None:
    # Two round trips: routed on the body; decided on the headers (no body; a path the gate skips).
    for messages in ([headers(), body(chat("hi"))], [headers("/v1/models", end=True)], [headers("/x")]):
        answers, ended_by_gate = follow_stream(make_processor(), messages)
        assert len(answers) == len(messages) and ended_by_gate, messages
    # One round trip, and a refusal.
    answers, ended_by_gate = follow_stream(make_processor(), [one_trip_body(chat("hi"))])
    assert ended_by_gate and set_headers(answers[0])["x-kvgate-pool"] == "interactive"
    answers, ended_by_gate = follow_stream(make_processor(), [headers(), body(b"{not json")])
    assert ended_by_gate and answers[-1].immediate_response.status.code == 400


def test_a_stream_still_waiting_for_its_body_is_not_ended() -> None:
    for messages in ([headers()], [headers(), body(chat("hi"), end=False)]):
        answers, ended_by_gate = follow_stream(make_processor(), messages)
        assert len(answers) == len(messages) and not ended_by_gate, messages


def test_a_reserved_request_keeps_its_stream_until_envoy_ends_it_and_is_released_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    released: list[bool] = []

    async def release(_generated_tokens: int) -> None:
        released.append(True)

    async def reserved(self: Pipeline, head: Any, data: bytes) -> Outcome:
        granted = Reserved("r-1", 9000, 0, release, never_moved, no_first_token)
        return Outcome(Route("long", Reason.LONG, 9000, "node-a.engine:8000"), reserved=granted)

    monkeypatch.setattr(Pipeline, "on_body", reserved)
    answers, ended_by_gate = follow_stream(make_processor(), [headers(), body(chat("hi"))])
    assert set_headers(answers[-1])["x-kvgate-pool"] == "long"
    assert not ended_by_gate, "the stream's end is the request's end, which releases the reservation"
    assert released == [True]


def test_a_span_per_decision_joins_envoys_trace() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    processor = make_processor(spans=DecisionSpans(provider))
    traceparent = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
    drive(processor, [headers(traceparent=traceparent), body(chat("hi", max_tokens=6000))])
    (span,) = exporter.get_finished_spans()
    assert span.name == "kvgate.decision"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
    assert span.attributes is not None
    assert span.attributes["kvgate.pool"] == "long"
    assert span.attributes["gen_ai.request.model"] == "m"
    assert span.attributes["gen_ai.request.max_tokens"] == 6000


def test_metadata_namespace_is_configurable() -> None:
    config = parse_config("server: {metadata_namespace: llm.routing}")
    pipeline = Pipeline(config, estimator_factory())
    processor = ExternalProcessor(pipeline, config, GateMetrics())
    _, routed = drive(processor, [headers(), body(chat("hi"))])
    assert "llm.routing" in routed.dynamic_metadata.fields


def test_one_trip_body_is_routed_by_its_attributes() -> None:
    (routed,) = drive(make_processor(), [one_trip_body(chat("hello " * 3000, max_tokens=2000))])
    metadata = routed.dynamic_metadata.fields["kvgate"].struct_value.fields
    assert metadata["pool"].string_value == "long"
    assert metadata["reason"].string_value == "long"
    assert metadata["tokens"].number_value > 5000
    assert metadata["method"].string_value == "fast"


def test_one_trip_reads_encoding_priority_and_trace_from_attributes() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traceparent = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
    message = one_trip_body(
        gzip.compress(chat("word " * 30000)), **{"content-encoding": "gzip", "traceparent": traceparent}
    )
    (answer,) = drive(make_processor(spans=DecisionSpans(provider)), [message])
    assert answer.immediate_response.status.code == 413
    (span,) = exporter.get_finished_spans()
    assert format(span.context.trace_id, "032x") == TRACE_ID


def test_one_trip_decides_what_two_trips_decide_on_headers() -> None:
    (plain,) = drive(make_processor(), [one_trip_body(b"hello", **{"content-type": "text/plain"})])
    assert plain.dynamic_metadata.fields["kvgate"].struct_value.fields["reason"].string_value == "unparsed"
    (unknown,) = drive(make_processor(), [one_trip_body(chat("hi"), "/v1/audio/speech")])
    assert unknown.dynamic_metadata.fields["kvgate"].struct_value.fields["reason"].string_value == "unparsed"
    assert not unknown.HasField("mode_override")


def test_one_trip_chunked_body_is_collected_until_its_end() -> None:
    data = chat("hello " * 3000, max_tokens=2000)
    first, last = drive(make_processor(), [one_trip_body(data[:100], end=False), body(data[100:])])
    assert first.WhichOneof("response") == "request_body"
    assert not first.HasField("dynamic_metadata")
    assert last.dynamic_metadata.fields["kvgate"].struct_value.fields["pool"].string_value == "long"


def test_body_without_headers_or_attributes_continues_and_says_what_to_configure(caplog: Any) -> None:
    (answer,) = drive(make_processor(), [body(chat("hi"))])
    assert answer.WhichOneof("response") == "request_body"
    assert not answer.HasField("dynamic_metadata")
    assert "request.headers['x-kvgate-priority']" in caplog.text


def test_request_attributes_follow_the_priority_header() -> None:
    attributes = request_attributes("X-Tenant-Priority")
    assert "request.headers['x-tenant-priority']" in attributes
    assert attributes[:3] == ("request.path", "request.method", "request.id")


header_values = st.text(max_size=40)
messages = st.one_of(
    st.builds(
        lambda path, ctype, enc, end: headers(
            path, end=end, **{"content-type": ctype, "content-encoding": enc}
        ),
        st.sampled_from(
            ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/embeddings", "/x", ""]
        ),
        st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]),
        st.sampled_from(["", "gzip", "deflate", "br", "identity"]),
        st.booleans(),
    ),
    st.builds(body, st.binary(max_size=200), st.booleans()),
    st.builds(
        lambda data, path, end: one_trip_body(data, path, end=end),
        st.binary(max_size=200),
        st.sampled_from(["/v1/chat/completions", "/v1/responses", "/x", ""]),
        st.booleans(),
    ),
    st.builds(
        lambda d, end: body(gzip.compress(d)[: len(d) // 2 + 5], end), st.binary(max_size=100), st.booleans()
    ),
    st.just(ProcessingRequest(request_trailers=HttpTrailers())),
    st.just(ProcessingRequest()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages, max_size=5))
def test_any_message_sequence_gets_a_defined_answer(sequence: list[ProcessingRequest]) -> None:
    """Arbitrary, out-of-order, truncated or empty messages: no crash, no hang, one answer per phase."""
    answers = drive(make_processor(), sequence)
    assert len(answers) <= len(sequence)
    for answer in answers:
        kind = answer.WhichOneof("response")
        assert kind is not None
        if kind == "immediate_response":
            assert 400 <= answer.immediate_response.status.code < 600
            assert set_headers(answer)["x-kvgate-reason"] != "internal_error", "a gate bug, not an answer"
            json.loads(answer.immediate_response.body)


def test_a_stream_ends_at_its_refusal_and_a_stray_piece_after_it_is_not_read() -> None:
    """A body the gate could not inflate is refused, and the stream ends there: a stray piece after it
    (no Envoy sends one, the fuzz above did) is never read, so it cannot find the pieces' buffer
    pinned by the refusal's traceback."""
    sequence = [
        headers(**{"content-type": "application/json", "content-encoding": "gzip"}),
        body(b"\x00", end=False),
        body(b"", end=True),
        body(b"\x00", end=False),
    ]
    _, ended_by_gate = follow_stream(make_processor(), sequence[:3])
    assert ended_by_gate
    answers = drive(make_processor(), sequence)
    assert [a.WhichOneof("response") for a in answers] == [
        "request_headers",
        "request_body",
        "immediate_response",
    ]
    assert set_headers(answers[2])["x-kvgate-reason"] == "invalid_request"


def test_the_gateways_own_overload_is_a_retryable_503_not_a_client_error() -> None:
    config = Config()
    processor = ExternalProcessor(
        Pipeline(config, estimator_factory(), offload_slots=0), config, GateMetrics()
    )
    _, answer = drive(processor, [headers(**{"content-encoding": "gzip"}), body(gzip.compress(chat("hi")))])
    immediate = answer.immediate_response
    assert immediate.status.code == 503
    assert set_headers(answer)["retry-after"] == "1"
    assert set_headers(answer)["x-kvgate-reason"] == "overloaded"
    assert json.loads(immediate.body)["error"]["type"] == "server_error"


def test_refusals_take_the_shape_of_the_api_called() -> None:
    anthropic = json.dumps(
        {"model": "m", "max_tokens": 20000, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    _, answer = drive(make_processor(), [headers("/v1/messages"), body(anthropic)])
    assert answer.immediate_response.status.code == 413
    error = json.loads(answer.immediate_response.body)
    assert error["type"] == "error"
    assert error["error"]["type"] == "request_too_large"
    assert "20000" in error["error"]["message"]
    _, openai = drive(make_processor(), [headers(), body(chat("hi", max_tokens=20000))])
    assert json.loads(openai.immediate_response.body)["error"]["code"] == "context_length_exceeded"
    assert "retry-after" not in set_headers(openai), "the same request would be refused again"


def test_too_long_status_is_configurable() -> None:
    processor = make_processor(parse_config("refusals: {too_long_status: 400}"))
    _, answer = drive(processor, [headers(), body(chat("hi", max_tokens=20000))])
    assert answer.immediate_response.status.code == 400
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "context_length_exceeded"


def test_a_json_body_is_sized_whatever_its_content_type_says() -> None:
    """`curl -d` sends form-encoded: the engine parses it anyway, so the gate must size it."""
    form = {"content-type": "application/x-www-form-urlencoded"}
    _, routed = drive(make_processor(), [headers(**form), body(chat("word " * 6000))])
    assert set_headers(routed)["x-kvgate-pool"] == "long"
    _, plain = drive(make_processor(), [headers(**form), body(b"a=1&b=2")])
    assert set_headers(plain)["x-kvgate-reason"] == "unparsed"


def test_a_buffered_body_is_whole_even_without_end_of_stream() -> None:
    """Envoy's request decompressor adds trailers: the BUFFERED body then comes without end_of_stream."""
    first = headers()
    first.protocol_config.request_body_mode = ProcessingMode.BUFFERED
    _, routed = drive(make_processor(), [first, body(chat("word " * 6000), end=False)])
    assert set_headers(routed)["x-kvgate-pool"] == "long"


def test_envoy_route_metadata_sets_the_limits() -> None:
    strict = [("x-kvgate-max-total-tokens", "2000")]
    _, refused = drive(make_processor(), [headers(), body(chat("word " * 1500))], strict)
    assert refused.immediate_response.status.code == 413
    assert "2000" in json.loads(refused.immediate_response.body)["error"]["message"]
    _, routed = drive(make_processor(), [headers(), body(chat("word " * 1500))])
    assert set_headers(routed)["x-kvgate-pool"] == "interactive"


def test_a_route_may_prefer_the_async_pool_through_a_named_policy() -> None:
    processor = make_processor(parse_config("policies: {batch: {async_mode: prefer}}"))
    _, routed = drive(
        processor, [headers(), body(chat("word " * 6000))], [("x-kvgate-model-policy", "batch")]
    )
    assert set_headers(routed)["x-kvgate-pool"] == "async"
    assert set_headers(routed)["x-kvgate-reason"] == "async"


def test_a_bad_route_value_is_logged_once_and_ignored(caplog: Any) -> None:
    processor = make_processor()
    bad = [("x-kvgate-max-total-tokens", "many")]
    for _ in range(3):
        _, routed = drive(processor, [headers(), body(chat("word " * 6000))], bad)
        assert set_headers(routed)["x-kvgate-pool"] == "long", "the model's own limits apply"
    assert caplog.text.count("x-kvgate-max-total-tokens: 'many' is not a whole number") == 1


def test_the_client_may_ask_for_the_async_pool_where_the_route_allows_it() -> None:
    long = [headers(prefer="respond-async"), body(chat("word " * 6000))]
    _, default = drive(make_processor(), long)
    assert set_headers(default)["x-kvgate-pool"] == "long", "admission.async_fallback is off by default"
    _, allowed = drive(make_processor(), long, [("x-kvgate-async", "allow")])
    assert set_headers(allowed)["x-kvgate-pool"] == "async"


def test_a_routes_default_output_budget_is_charged_when_the_client_names_none() -> None:
    budget = [("x-kvgate-default-output-tokens", "8000")]
    _, named = drive(make_processor(), [headers(), body(chat("hi", max_tokens=100))], budget)
    assert set_headers(named)["x-kvgate-pool"] == "interactive", "the client's own budget stands"
    _, unnamed = drive(make_processor(), [headers(), body(chat("hi"))], budget)
    assert set_headers(unnamed)["x-kvgate-pool"] == "long"
    assert int(set_headers(unnamed)["x-kvgate-tokens"]) > 8000


# --- the stream's error boundary: nothing the gate raises reaches Envoy -------------------------------------


class CountingMetrics(GateMetrics):
    """GateMetrics that also keep the internal errors where a test can read them."""

    def __init__(self) -> None:
        super().__init__()
        self.internal_errors: list[str] = []

    def internal_error(self, message: str) -> None:
        super().internal_error(message)
        self.internal_errors.append(message)


def counting_processor(config: Config | None = None) -> tuple[ExternalProcessor, CountingMetrics]:
    config = config or Config()
    metrics = CountingMetrics()
    pipeline = Pipeline(config, estimator_factory(), telemetry=metrics)
    return ExternalProcessor(pipeline, config, metrics), metrics


def planted(*_args: Any, **_kwargs: Any) -> Any:
    raise RuntimeError("planted")


def assert_internal_error(answer: ProcessingResponse) -> dict[str, Any]:
    immediate = answer.immediate_response
    assert immediate.status.code == 503
    sent = set_headers(answer)
    assert sent["x-kvgate-reason"] == "internal_error"
    assert (sent["retry-after"], sent["retry-after-ms"]) == ("1", "1000"), "SDKs retry it, a second later"
    error: dict[str, Any] = json.loads(immediate.body)
    return error


def test_an_exception_planted_in_the_pipeline_is_the_internal_error_row_and_ends_the_stream(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(Pipeline, "on_body", planted)
    processor, metrics = counting_processor()
    trailers = ProcessingRequest(request_trailers=HttpTrailers())
    answers = drive(processor, [headers(**{"x-request-id": "req-7"}), body(chat("hi")), trailers])
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "immediate_response"], (
        "answered once, and the stream ends there: the trailers are never read"
    )
    error = assert_internal_error(answers[1])
    assert error["error"]["code"] == "internal_error" and error["error"]["type"] == "server_error"
    assert metrics.internal_errors == ["request_body"]
    failures = [r for r in caplog.records if "internal_error" in r.getMessage()]
    assert len(failures) == 1 and "req-7" in failures[0].getMessage()
    assert failures[0].exc_info is not None and "planted" in str(failures[0].exc_info[1])


def test_one_trip_internal_errors_take_the_apis_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Pipeline, "on_headers", planted)
    processor, metrics = counting_processor()
    anthropic = json.dumps({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]})
    (answer,) = drive(processor, [one_trip_body(anthropic.encode(), "/v1/messages")])
    error = assert_internal_error(answer)
    assert error == {
        "type": "error",
        "error": {"type": "api_error", "message": "The gateway failed on this request; retry shortly."},
    }
    assert metrics.internal_errors == ["request_body"]


def test_a_failure_reading_the_route_policy_is_answered_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Pipeline, "route_policy", planted)
    processor, metrics = counting_processor()
    (answer,) = drive(processor, [headers()], [("x-kvgate-max-total-tokens", "2000")])
    assert_internal_error(answer)
    assert metrics.internal_errors == ["request_headers"]


def test_a_request_error_raised_anywhere_is_the_clients_refusal_not_an_internal_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unreadable(*_args: Any, **_kwargs: Any) -> Any:
        raise InvalidRequestError("The request cannot be read.")

    monkeypatch.setattr(Pipeline, "on_body", unreadable)
    processor, metrics = counting_processor()
    _, answer = drive(processor, [headers(), body(chat("hi"))])
    assert answer.immediate_response.status.code == 400
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "invalid_request"
    assert metrics.internal_errors == []


def test_a_reservation_held_when_the_gate_fails_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[str] = []

    async def release(_generated_tokens: int) -> None:
        released.append("r-1")

    async def reserved(self: Pipeline, head: Any, data: bytes) -> Outcome:
        granted = Reserved("r-1", 9000, 0, release, never_moved, no_first_token)
        return Outcome(Route("long", Reason.LONG, 9000, "node-a.engine:8000"), reserved=granted)

    monkeypatch.setattr(Pipeline, "on_body", reserved)
    processor, metrics = counting_processor()
    monkeypatch.setattr(metrics, "decision", planted)  # fails after the reservation was granted

    async def run() -> list[ProcessingResponse]:
        async def requests() -> AsyncIterator[ProcessingRequest]:
            for message in (headers(), body(chat("hi"))):
                yield message

        answers = [a async for a in processor.Process(requests(), StreamContext(()))]  # type: ignore[arg-type]
        await processor.drain_agent_calls()
        return answers

    _, answer = asyncio.run(asyncio.wait_for(run(), 10))
    assert_internal_error(answer)
    assert released == ["r-1"]


def test_internal_errors_are_exported_under_their_prometheus_names() -> None:
    """The exporter's rendering of the OpenTelemetry names: kvgate_gate_internal_errors_total (and the
    queue's kvgate_queue_internal_errors_total), scraped from a real metrics endpoint."""
    port = free_port()
    script = (
        "import sys, urllib.request\n"
        "from kvgate.telemetry import GateMetrics, start_prometheus\n"
        "from kvgate.queue.metrics import QueueMetrics\n"
        f"start_prometheus('127.0.0.1:{port}')\n"
        "GateMetrics().internal_error('request_body')\n"
        "QueueMetrics(lambda: None, lambda: 0).internal_error('/v1/batches')\n"
        f"print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=10).read().decode())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    for sample in (
        r'kvgate_gate_internal_errors_total\{[^}]*message="request_body"[^}]*\} 1\.0',
        r'kvgate_queue_internal_errors_total\{[^}]*route="/v1/batches"[^}]*\} 1\.0',
    ):
        assert re.search(f"^{sample}$", done.stdout, re.M), sample


def test_a_body_in_pieces_is_read_as_the_same_body_whole() -> None:
    for data in (
        chat("héllo " * 3000, max_tokens=2000),
        chat("hi") + b"}",
        b'{"messages": [], "user": "\xff"}',
    ):
        whole = drive(make_processor(), [headers(), body(data)])[-1]
        pieces = drive(make_processor(), [headers(), body(data[:7], end=False), body(data[7:])])[-1]
        assert pieces == whole


HOLDING = "admission: {max_wait_s: 0.2, max_hold_s: 10, async_fallback: true}"


def held_stream(
    processor: ExternalProcessor, until_answered: asyncio.Event
) -> tuple[asyncio.Task[list[ProcessingResponse]], asyncio.Queue[ProcessingResponse]]:
    """Process a headers-and-body stream in a task, each response put on the queue as it comes."""
    seen: asyncio.Queue[ProcessingResponse] = asyncio.Queue()

    async def requests() -> AsyncIterator[ProcessingRequest]:
        for message in (headers(), body(chat("hi"))):
            yield message
        await until_answered.wait()  # Envoy keeps the stream open while the request runs

    async def run() -> list[ProcessingResponse]:
        answers = []
        async for response in processor.Process(requests(), StreamContext(())):  # type: ignore[arg-type]
            answers.append(response)
            seen.put_nowait(response)
        return answers

    return asyncio.ensure_future(run()), seen


def test_a_body_whose_answer_waits_is_held_once_for_the_rest_of_the_longest_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def run() -> None:
        room = asyncio.Event()

        async def waits_for_room(self: Pipeline, head: Any, data: bytes) -> Outcome:
            await room.wait()
            return Outcome(Route("long", Reason.LONG, 9000, "node-a.engine:8000"))

        monkeypatch.setattr(Pipeline, "on_body", waits_for_room)
        answered = asyncio.Event()
        stream, seen = held_stream(make_processor(parse_config(HOLDING)), answered)
        assert (await seen.get()).WhichOneof("response") == "request_headers"
        hold = await seen.get()
        # Envoy ignores the other fields of a response that carries override_message_timeout.
        assert hold.WhichOneof("response") is None
        # Asked once the answer took half of max_wait_s (0.1 s): the rest of max_hold_s, plus a margin.
        assert hold.override_message_timeout.ToMilliseconds() == 10_000 - 100 + 2_000
        room.set()
        routed = await seen.get()
        assert set_headers(routed)["x-kvgate-pool"] == "long"
        answered.set()
        assert len(await stream) == 3

    asyncio.run(asyncio.wait_for(run(), 10))


def test_the_gate_holds_only_with_max_hold_s_above_max_wait_s() -> None:
    assert holding(parse_config("admission: {max_wait_s: 2, max_hold_s: 2}").admission) is None
    held = holding(parse_config("admission: {max_wait_s: 0, max_hold_s: 30}").admission)
    # A max_wait_s of 0 does not cost every request an extra message.
    assert held is not None and held.notice_s == MIN_NOTICE_S and held.longest_s == 30


def test_a_stream_that_ends_while_held_stops_the_wait_and_releases_what_it_reserved(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    released: list[str] = []

    async def release(_generated_tokens: int) -> None:
        released.append("r-1")

    async def run() -> None:
        waiting = asyncio.Event()
        stopped = asyncio.Event()

        async def waits_then_reserves(self: Pipeline, head: Any, data: bytes) -> Outcome:
            waiting.set()
            try:
                await asyncio.Event().wait()
            finally:
                stopped.set()
            raise AssertionError("unreachable")

        monkeypatch.setattr(Pipeline, "on_body", waits_then_reserves)
        processor = make_processor(parse_config(HOLDING))
        stream, seen = held_stream(processor, asyncio.Event())
        await seen.get()
        assert (await seen.get()).HasField("override_message_timeout")
        stream.cancel()  # Envoy (or the client) ends the stream while the request waits for room
        await stopped.wait()
        await processor.drain_agent_calls()

        # A held request's reservation is released when its stream ends.
        async def reserves(self: Pipeline, head: Any, data: bytes) -> Outcome:
            await asyncio.sleep(0.15)
            granted = Reserved("r-1", 9000, 0, release, never_moved, no_first_token)
            return Outcome(Route("long", Reason.LONG, 9000), reserved=granted)

        monkeypatch.setattr(Pipeline, "on_body", reserves)
        answered = asyncio.Event()
        stream, seen = held_stream(processor, answered)
        await seen.get()
        await seen.get()  # held
        await seen.get()  # routed
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
        await processor.drain_agent_calls()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert released == ["r-1"]
