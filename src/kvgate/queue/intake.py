"""What the queue learns of a request before it becomes a job: its tokens, model, stream flag,
priority and tenant.

A request the gate routed here carries the gate's estimate in `x-kvgate-tokens` (Envoy strips any
client copy at its edge, so the queue trusts it); the queue still parses the body for the model and
`stream`. A request without it, and every Batch API line (they never pass the gate), is parsed and
estimated exactly as the gate does, with the same model entries, and one the gate would refuse with
413 is refused the same way. Synchronous and CPU-bound: the HTTP layer runs it on a thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvgate.config import Config, ModelConfig
from kvgate.config.routekeys import MAX_TOKENS
from kvgate.digits import whole_number
from kvgate.errors import InvalidRequestError, RequestError
from kvgate.estimate import Estimator, PromptCosts, local_estimator
from kvgate.policy import Reason, Refusal, decide, thresholds
from kvgate.policy.models import ModelMatcher
from kvgate.policy.refusals import refusal_for
from kvgate.request import Api, ParseLimits, api_for_path, decompress, parse_body


@dataclass(frozen=True, slots=True)
class Assessed:
    api: Api
    tokens: int
    model: str | None
    stream: bool
    body: bytes  # as the engine must get it (inflated when the client compressed it)


class Intake:
    def __init__(self, config: Config) -> None:
        self._config = config
        self._models = ModelMatcher(config)
        self._limits = ParseLimits(config.request.max_messages, config.request.max_json_depth)
        self._estimators: dict[tuple[str | None, PromptCosts], Estimator] = {}
        # Open every tokenizer now: a missing file stops start-up, not a request.
        for model in (config.default_model, *config.models):
            self._estimator(model)
        ranks = {name: rank for rank, name in enumerate(config.admission.priorities)}
        self._ranks = ranks
        self._default_rank = ranks[config.admission.default_priority]

    def priority(self, headers: Mapping[str, str]) -> int:
        value = headers.get(self._config.admission.priority_header, "").strip().lower()
        return self._ranks.get(value, self._default_rank)

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant header's value, or the default tenant; InvalidRequestError when it is not text."""
        tenant = text_header(headers, self._config.queue.tenant_header) or ""
        return tenant.strip() or self._config.queue.default_tenant

    def assess(
        self, path: str, body: bytes, gate_tokens: str | None, content_encoding: str | None = None
    ) -> Assessed | Refusal:
        """`gate_tokens`: the request's x-kvgate-tokens header, if any."""
        api = api_for_path(path)
        if api is None:
            return Refusal(Reason.UNKNOWN_PATH, f"{path} is not an inference API the queue runs.")
        if len(body) > self._config.request.max_body_bytes:
            limit = self._config.request.max_body_bytes
            return Refusal(Reason.BODY_TOO_LARGE, f"The request body exceeds {limit} bytes.")
        try:
            data = decompress(body, content_encoding, self._config.request.max_decompressed_bytes)
            shape = parse_body(api, data, self._limits)
        except RequestError as error:
            return refusal_for(error)
        # The gate's own header; anything that does not read as a count is estimated here instead.
        tokens = whole_number(gate_tokens, minimum=1, maximum=MAX_TOKENS)
        if tokens is None:
            model = self._models.lookup(shape.model)
            estimate = self._estimator(model).estimate_sync(shape, thresholds(model))
            decision = decide(estimate.prompt_tokens, estimate.output_tokens, model)
            if isinstance(decision, Refusal):
                return decision
            tokens = decision.tokens
        return Assessed(api, tokens, shape.model, shape.stream, data)

    def _estimator(self, model: ModelConfig) -> Estimator:
        costs = PromptCosts(model.image_tokens, model.message_overhead_tokens, model.default_output_tokens)
        key = (model.tokenizer, costs)
        if key not in self._estimators:
            path = Path(model.tokenizer) if model.tokenizer else None
            self._estimators[key] = local_estimator(path, costs)
        return self._estimators[key]


def text_header(headers: Mapping[str, str], name: str) -> str | None:
    """A header the queue stores or forwards: None when absent; InvalidRequestError (400) when its
    bytes are not UTF-8 text (aiohttp hands them over as surrogate escapes, which no store holds)."""
    value = headers.get(name)
    if value is not None and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(f"The {name} header is not UTF-8 text.") from None
    return value
