"""One request's way through the gate, free of Envoy types: headers → body → shape → estimate → decision.

The ext_proc adapter (`processor.py`) feeds it what Envoy sends and turns its decisions into
ProcessingResponses. Work that can take milliseconds (inflating and parsing multi-megabyte bodies)
runs on a thread pool with a bounded queue, so one huge prompt never stalls the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvgate.config import Config, ModelConfig
from kvgate.errors import RequestError
from kvgate.estimate import Estimator, PromptCosts, TokenEstimate, build_estimator
from kvgate.gate.admission import Admission, Ticket
from kvgate.policy import Decision, Reason, Refusal, Route, decide, thresholds
from kvgate.policy.models import ModelMatcher
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


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the gate reads from request headers."""

    path: str
    method: str
    content_type: str | None
    content_encoding: str | None
    has_body: bool
    priority: str | None = None
    request_id: str = ""
    # W3C trace context from Envoy (traceparent / tracestate), empty when the request has none.
    trace_context: tuple[tuple[str, str], ...] = ()


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
        self._parse_limits = ParseLimits(config.request.max_messages, config.request.max_json_depth)
        self._models = ModelMatcher(config)
        # Build every estimator at start-up: a missing tokenizer file fails here, not on a request.
        self._estimators = {id(model): estimators(model) for model in (config.default_model, *config.models)}
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

    def passthrough(self, reason: Reason) -> Decision:
        if self._config.request.unparsed == "reject":
            return Refusal(
                415 if reason is Reason.UNPARSED else 404,
                "unsupported_request",
                Reason.UNSUPPORTED,
                "This gateway only accepts JSON inference API requests.",
            )
        return Route(self._config.default_model.pools.interactive, reason)

    def on_headers(self, head: RequestHead) -> Decision | None:
        """Decide from headers alone when the body cannot matter; None means: wait for the body."""
        if not head.has_body:
            return Route(self._config.default_model.pools.interactive, Reason.NO_BODY)
        if api_for_path(head.path) is None:
            return self.passthrough(Reason.UNPARSED)
        if head.content_type and not is_json_content_type(head.content_type):
            return self.passthrough(Reason.UNPARSED)
        return None

    async def on_body(self, head: RequestHead, body: bytes) -> Outcome:
        api = api_for_path(head.path)
        if api is None:
            return Outcome(self.passthrough(Reason.UNPARSED))
        try:
            shape = await self._understand(api, head, body)
        except RequestError as error:
            return Outcome(refusal_for(error))
        if shape is None:
            return Outcome(self.passthrough(Reason.UNPARSED))
        model = self._models.lookup(shape.model)
        try:
            estimate = await self._estimators[id(model)].estimate(shape, thresholds(model))
        except RequestError as error:
            return Outcome(refusal_for(error), shape)
        decision = decide(estimate.prompt_tokens, estimate.output_tokens, model)
        if self._admission is None or not isinstance(decision, Route):
            return Outcome(decision, shape, estimate)
        admitted = await self._admission.admit(decision, model, head.priority, head.request_id)
        return Outcome(admitted.decision, shape, estimate, admitted.ticket)

    async def release(self, ticket: Ticket) -> None:
        assert self._admission is not None
        await self._admission.release(ticket)

    async def _understand(self, api: Api, head: RequestHead, body: bytes) -> RequestShape | None:
        limits = self._config.request
        if len(body) > limits.max_body_bytes:
            raise RequestError(
                413, "request_too_large", f"The request body exceeds {limits.max_body_bytes} bytes."
            )
        if len(body) <= OFFLOAD_BYTES and not head.content_encoding:
            return _shape_or_none(api, head, body, limits.max_decompressed_bytes, self._parse_limits)
        if self._offload_slots.locked():
            raise _OverloadedError
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


class _OverloadedError(RequestError):
    def __init__(self) -> None:
        super().__init__(503, "gateway_overloaded", "The gateway is busy reading other large requests.")


def _shape_or_none(
    api: Api, head: RequestHead, body: bytes, max_decompressed: int, limits: ParseLimits
) -> RequestShape | None:
    """Parse the body; None when it is not JSON and did not claim to be (pass it through untouched)."""
    data = decompress(body, head.content_encoding, max_decompressed)
    if is_json_content_type(head.content_type):
        return parse_body(api, data, limits)
    try:
        return parse_body(api, data, limits)
    except RequestError:
        return None


def refusal_for(error: RequestError) -> Refusal:
    """The refusal for a request the gate could not take: the client's fault (4xx) or the gateway's (503)."""
    if error.status == 503:
        # The gateway's own limits (tokenizer queue, offload slots): retryable, not the client's fault.
        return Refusal(
            503, error.code, Reason.OVERLOADED, error.message, retry_after_s=1, error_type="server_error"
        )
    reason = Reason.UNSUPPORTED if error.status == 415 else Reason.INVALID
    return Refusal(error.status, error.code, reason, error.message, error_type=error.error_type)
