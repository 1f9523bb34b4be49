"""What the queue learns of a request before it becomes a job: its tokens, model, stream flag,
priority and tenant.

Every request, and every Batch API line, is parsed and estimated exactly as the gate does, with the
same model entries, and one the gate would refuse with 413 is refused the same way. A request the
gate routed here also carries the gate's estimate in `x-kvgate-tokens` (which may be larger: the
route's policy is the gate's to apply); the job reserves the larger of the two. The header is never
trusted to shrink a job: Envoy strips a client's copy at its edge, but a caller that reaches the
queue directly could send `x-kvgate-tokens: 1` (issue 27). Synchronous and CPU-bound: the HTTP layer
runs it on a thread.

Tenant and priority are Envoy's (`x-kvgate-tenant`, `x-kvgate-priority`: set after it authenticated
the request, a client's copies removed at the edge) and forwarded by the gate; an absent tenant is
`anonymous`, and the priority rank is kvgate.policy.identity's rule, the gate's. So is the tenant class
(`x-kvgate-tenant-class`), which Envoy's route table sets on a classed route's requests to the queue
(kvgate.envoyconfig.bootstrap); a class kvgate.yaml's `fairness.classes` does not have is ignored, as
the gate ignores it.
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
from kvgate.names import TENANT_CLASS_HEADER, TENANT_HEADER
from kvgate.policy import Reason, Refusal, decide, thresholds
from kvgate.policy.identity import Priorities, read_priority, read_tenant
from kvgate.policy.models import ModelMatcher
from kvgate.policy.refusals import refusal_for
from kvgate.queue.jobs import JobCharge
from kvgate.request import Api, ParseLimits, api_for_path, decompress, parse_body

# A tenant name longer than this is refused (400): it is stored with every job and file, and is a
# metric label.
MAX_TENANT_CHARS = 256


@dataclass(frozen=True, slots=True)
class Assessed:
    api: Api
    tokens: int
    model: str | None
    stream: bool
    body: bytes  # as the engine must get it (inflated when the client compressed it)
    charge: JobCharge | None = None


class Intake:
    def __init__(self, config: Config) -> None:
        self._config = config
        self._models = ModelMatcher(config)
        self._limits = ParseLimits(config.request.max_messages, config.request.max_json_depth)
        self._estimators: dict[tuple[str | None, PromptCosts], Estimator] = {}
        # Open every tokenizer now: a missing file stops start-up, not a request.
        for model in (config.default_model, *config.models):
            self._estimator(model)
        self._priorities = Priorities(config.admission.priorities, config.admission.default_priority)

    def priority(self, headers: Mapping[str, str]) -> int:
        """The rank of the priority the gate forwarded (the default's when there is none)."""
        return self._priorities.rank(read_priority(headers.get(self._config.admission.priority_header)))

    def tenant(self, headers: Mapping[str, str]) -> str:
        """Whose the request is: x-kvgate-tenant, or `anonymous` when absent or blank;
        InvalidRequestError (400) when it is not text or longer than MAX_TENANT_CHARS."""
        tenant = read_tenant(text_header(headers, TENANT_HEADER))
        if len(tenant) > MAX_TENANT_CHARS:
            message = f"The {TENANT_HEADER} header is longer than {MAX_TENANT_CHARS} characters."
            raise InvalidRequestError(message)
        return tenant

    def tenant_class(self, headers: Mapping[str, str]) -> str | None:
        """The class of fairness settings the request's route gives its tenant; None when it names none
        or one that kvgate.yaml's `fairness.classes` does not have."""
        name = headers.get(TENANT_CLASS_HEADER)
        return name if name in self._config.fairness.classes else None

    def assess(
        self, path: str, body: bytes, gate_tokens: str | None, content_encoding: str | None = None
    ) -> Assessed | Refusal:
        """`gate_tokens`: the request's x-kvgate-tokens header, if any: the job reserves the larger of
        it and the queue's own estimate."""
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
        model = self._models.lookup(shape.model)
        estimate = self._estimator(model).estimate_sync(shape, thresholds(model))
        decision = decide(estimate.prompt_tokens, estimate.output_tokens, model)
        if isinstance(decision, Refusal):
            return decision
        # The gate's header can only add (its route may allow more output); one that does not read as
        # a count is ignored.
        tokens = max(decision.tokens, whole_number(gate_tokens, minimum=1, maximum=MAX_TOKENS) or 0)
        charge = JobCharge(estimate.likely_prompt_tokens, estimate.output_tokens)
        return Assessed(api, tokens, shape.model, shape.stream, data, charge)

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
