"""One request's way through the gate, free of Envoy types: headers → body → shape → estimate → decision.

The ext_proc adapter (`processor.py`) feeds it what Envoy sends and turns its decisions into
ProcessingResponses. Work that can take milliseconds (inflating and parsing multi-megabyte bodies)
runs on a thread pool with a bounded queue, so one huge prompt never stalls the event loop.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvgate.config import Config, ModelConfig
from kvgate.errors import RequestError
from kvgate.estimate import Estimator, PromptCosts, TokenEstimate, Unavailable, build_estimator
from kvgate.gate.admission import Admission, Ticket
from kvgate.policy import Decision, Reason, Refusal, Route, decide, thresholds
from kvgate.policy.models import ModelMatcher
from kvgate.policy.refusals import Refusals, refusal_for
from kvgate.request import (
    Api,
    ParseLimits,
    RequestShape,
    api_for_path,
    decompress,
    is_json_content_type,
    parse_body,
)

# Bodies above this size are inflated and parsed off the event loop (json.loads runs ~30 ms per 10 MB).
OFFLOAD_BYTES = 256 * 1024

_TRACE_HEADERS = ("traceparent", "tracestate")


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the gate reads from request headers, each fact read once (see `request_head`)."""

    path: str
    method: str
    api: Api | None  # the inference API the path addresses; None: not one the gate interprets
    content_type: str | None
    content_encoding: str | None
    has_body: bool
    declares_json: bool = False  # Content-Type says JSON: a body that does not parse is the client's error
    priority: str | None = None
    request_id: str = ""
    # W3C trace context from Envoy (traceparent / tracestate), empty when the request has none.
    trace_context: tuple[tuple[str, str], ...] = ()


HeaderReader = Callable[[str], "str | None"]


def request_head(read: HeaderReader, has_body: bool, priority_header: str) -> RequestHead:
    """The RequestHead of one request, however Envoy sent its headers: `read(name)` is a request
    header's value (pseudo-headers such as ":path" included) or None when the request lacks it."""
    path = read(":path") or ""
    content_type = read("content-type")
    priority = read(priority_header)
    return RequestHead(
        path=path,
        method=read(":method") or "",
        api=api_for_path(path),
        content_type=content_type,
        content_encoding=read("content-encoding"),
        has_body=has_body,
        declares_json=is_json_content_type(content_type),
        priority=priority.strip().lower() if priority is not None else None,
        # Envoy sets x-request-id on every request; a request id is what reservations are keyed by.
        request_id=read("x-request-id") or uuid.uuid4().hex,
        trace_context=tuple((name, value) for name in _TRACE_HEADERS if (value := read(name)) is not None),
    )


def headers_read(priority_header: str) -> tuple[str, ...]:
    """Every header `request_head` reads, for set-ups that must list them (one round trip)."""
    return (
        ":path",
        ":method",
        "x-request-id",
        "content-type",
        "content-encoding",
        priority_header.lower(),
        *_TRACE_HEADERS,
    )


@dataclass(frozen=True, slots=True)
class Outcome:
    decision: Decision
    shape: RequestShape | None = None
    estimate: TokenEstimate | None = None
    ticket: Ticket | None = None


EstimatorFactory = Callable[[ModelConfig], Estimator]


def estimator_factory() -> EstimatorFactory:
    """Estimators built once per distinct (tokenizer, costs) and shared by the models that use them."""
    built: dict[tuple[Path | None, PromptCosts], Estimator] = {}

    def for_model(model: ModelConfig) -> Estimator:
        path = Path(model.tokenizer) if model.tokenizer else None
        costs = PromptCosts(
            image_tokens=model.image_tokens,
            message_overhead_tokens=model.message_overhead_tokens,
            default_output_tokens=model.default_output_tokens,
        )
        key = (path, costs)
        if key not in built:
            built[key] = build_estimator(path, costs)
        return built[key]

    return for_model


class Pipeline:
    def __init__(
        self,
        config: Config,
        estimators: EstimatorFactory,
        admission: Admission | None = None,
        offload_slots: int = 32,
    ) -> None:
        self._config = config
        self._admission = admission
        self.refusals = Refusals(config.refusals.too_long_status, config.admission.retry_after_s)
        self._parse_limits = ParseLimits(config.request.max_messages, config.request.max_json_depth)
        self._models = ModelMatcher(config)
        # Built at start-up: a missing tokenizer file fails here, not on a request. Model entries are
        # frozen values, so they key the table themselves.
        self._estimators = {model: estimators(model) for model in (config.default_model, *config.models)}
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgate-body")
        self._offload_slots = asyncio.Semaphore(offload_slots)

    def exact_counts_pending(self) -> int:
        return sum(e.pending for e in self._distinct_estimators())

    def _distinct_estimators(self) -> list[Estimator]:
        # Models share estimators (one per tokenizer and costs).
        return list({id(e): e for e in self._estimators.values()}.values())

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for estimator in self._distinct_estimators():
            estimator.close()

    def passthrough(self, head: RequestHead) -> Decision:
        """A request the gate does not interpret: the default pool, or a refusal in `reject` mode."""
        if self._config.request.unparsed == "reject":
            if head.api is None:
                return Refusal(Reason.UNKNOWN_PATH, f"This gateway serves no inference API at {head.path}.")
            return Refusal(Reason.UNSUPPORTED, "This gateway only accepts JSON inference API requests.")
        return Route(self._config.default_model.pools.interactive, Reason.UNPARSED)

    def on_headers(self, head: RequestHead) -> Decision | None:
        """Decide from headers alone when the body cannot matter; None means: wait for the body.

        The Content-Type does not decide: on an inference path a JSON body is sized whatever its
        Content-Type says (`curl -d` sends form-encoded JSON, and engines parse it anyway).
        """
        if not head.has_body:
            return Route(self._config.default_model.pools.interactive, Reason.NO_BODY)
        if head.api is None:
            return self.passthrough(head)
        return None

    async def on_body(self, head: RequestHead, body: bytes) -> Outcome:
        if head.api is None:
            return Outcome(self.passthrough(head))
        try:
            shape = await self._understand(head.api, head, body)
        except RequestError as error:
            return Outcome(refusal_for(error))
        if isinstance(shape, Refusal):
            return Outcome(shape)
        if shape is None:
            return Outcome(self.passthrough(head))
        model = self._models.lookup(shape.model)
        estimate = await self._estimators[model].estimate(shape, thresholds(model))
        if isinstance(estimate, Unavailable):
            return Outcome(Refusal(Reason.OVERLOADED, estimate.message), shape)
        decision = decide(estimate.prompt_tokens, estimate.output_tokens, model)
        if self._admission is None or not isinstance(decision, Route):
            return Outcome(decision, shape, estimate)
        admitted = await self._admission.admit(decision, model, head.priority, head.request_id)
        return Outcome(admitted.decision, shape, estimate, admitted.ticket)

    async def release(self, ticket: Ticket) -> None:
        assert self._admission is not None
        await self._admission.release(ticket)

    async def _understand(self, api: Api, head: RequestHead, body: bytes) -> RequestShape | Refusal | None:
        """The request's shape; None when the body is not JSON and did not claim to be."""
        limits = self._config.request
        if len(body) > limits.max_body_bytes:
            return Refusal(Reason.BODY_TOO_LARGE, f"The request body exceeds {limits.max_body_bytes} bytes.")
        if len(body) <= OFFLOAD_BYTES and not head.content_encoding:
            return _shape_or_none(api, head, body, limits.max_decompressed_bytes, self._parse_limits)
        if self._offload_slots.locked():
            return Refusal(
                Reason.OVERLOADED, "The gateway is busy reading other large requests; retry shortly."
            )
        async with self._offload_slots:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._executor,
                _shape_or_none,
                api,
                head,
                body,
                limits.max_decompressed_bytes,
                self._parse_limits,
            )


def _shape_or_none(
    api: Api, head: RequestHead, body: bytes, max_decompressed: int, limits: ParseLimits
) -> RequestShape | None:
    """Parse the body; None when it is not JSON and did not claim to be (pass it through untouched)."""
    data = decompress(body, head.content_encoding, max_decompressed)
    if head.declares_json:
        return parse_body(api, data, limits)
    try:
        return parse_body(api, data, limits)
    except RequestError:
        return None
