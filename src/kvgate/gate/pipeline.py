"""One request's way through the gate, free of Envoy types: headers → body → shape → estimate → decision.

The ext_proc adapter (`processor.py`) feeds it what Envoy sends and turns its decisions into
ProcessingResponses. The seam is one-way: this module knows nothing of the adapter, and the adapter
knows nothing past this module (no admission, no tickets): an admitted request's Outcome carries what
ends its reservation (`Reserved.release`). Work that can take milliseconds (inflating and parsing
multi-megabyte bodies) runs on a thread pool with a bounded queue, so one huge prompt never stalls the
event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from kvgate.config import AdmissionConfig, Config, ModelConfig
from kvgate.errors import ConfigError, RequestError
from kvgate.estimate import Estimator, PromptCosts, TokenEstimate, Unavailable, build_estimator
from kvgate.gate.admission import Admission, Ticket
from kvgate.gate.reservation_ids import ReservationIds
from kvgate.names import ANONYMOUS_TENANT, PREFER_HEADER, TENANT_HEADER
from kvgate.policy import Decision, Reason, Refusal, Route, decide, thresholds
from kvgate.policy.endpoints import Subset
from kvgate.policy.identity import Priorities, read_priority, read_tenant
from kvgate.policy.models import ModelMatcher
from kvgate.policy.nodes import Affinity
from kvgate.policy.output_lengths import OutputLengths
from kvgate.policy.overflow import no_healthy_node
from kvgate.policy.refusals import refusal_for
from kvgate.policy.route import (
    NO_HINTS,
    NO_ROUTE_POLICY,
    ROUTE_KEYS,
    ClientHints,
    RoutePolicy,
    async_allowed,
    deferred,
    effective_model,
    limits_capped,
    read_prefer,
    read_route_policy,
)
from kvgate.request import (
    Api,
    Body,
    ParseLimits,
    RequestShape,
    api_for_path,
    decompress,
    is_json_content_type,
    parse_body,
)
from kvgate.request.prefix import prefix_chain, renders_definitions_first
from kvgate.telemetry import GateMetrics

log = logging.getLogger(__name__)

# Bodies above this size are parsed off the event loop, and compressed ones always (zlib lets go of
# the GIL while it inflates). The decoder holds the GIL, so a thread frees the loop only every switch
# interval (5 ms): a parse shorter than that holds the loop as long either way, and the hand-off costs
# the request itself (1 MB: +0.3-0.5 ms). msgspec reads 0.5-3 ms per MB (ASCII prose to escaped
# CJK): up to 2 MiB a body is parsed in place.
OFFLOAD_BYTES = 2 * 1024 * 1024
# Distinct route policies (and model x route combinations) remembered; they come from Envoy's
# configuration, so a handful in practice.
_ROUTE_CACHE_LIMIT = 1024

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
    # The identity's priority and tenant, as Envoy set them after authentication (kvgate.policy.identity).
    priority: str | None = None
    tenant: str = ANONYMOUS_TENANT
    request_id: str = ""
    # W3C trace context from Envoy (traceparent / tracestate), empty when the request has none.
    trace_context: tuple[tuple[str, str], ...] = ()
    # What the Envoy route says (from the stream's gRPC metadata), and what the client prefers.
    route: RoutePolicy = NO_ROUTE_POLICY
    hints: ClientHints = NO_HINTS
    # An endpoint picker's gateway allows only these engines (kvgate.policy.endpoints); None: any.
    subset: Subset = None


HeaderReader = Callable[[str], "str | None"]


def request_head(
    read: HeaderReader, has_body: bool, priority_header: str, route: RoutePolicy = NO_ROUTE_POLICY
) -> RequestHead:
    """The RequestHead of one request, however Envoy sent its headers: `read(name)` is a request
    header's value (pseudo-headers such as ":path" included) or None when the request lacks it."""
    path = read(":path") or ""
    content_type = read("content-type")
    return RequestHead(
        path=path,
        method=read(":method") or "",
        api=api_for_path(path),
        content_type=content_type,
        content_encoding=read("content-encoding"),
        has_body=has_body,
        declares_json=is_json_content_type(content_type),
        priority=read_priority(read(priority_header)),
        tenant=read_tenant(read(TENANT_HEADER)),
        # Envoy sets x-request-id on every request. It is the client's to choose: logs and the queue's
        # job alias only, never a reservation's id (kvgate.gate.reservation_ids).
        request_id=read("x-request-id") or uuid.uuid4().hex,
        trace_context=tuple((name, value) for name in _TRACE_HEADERS if (value := read(name)) is not None),
        route=route,
        hints=read_prefer(read(PREFER_HEADER)),
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
        TENANT_HEADER,
        PREFER_HEADER,
        *_TRACE_HEADERS,
    )


# Called once, with the output tokens the request generated by its engine's answer (0: not read).
Release = Callable[[int], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Reserved:
    """What a node's agent reserved for an admitted request, and what ends it: `release`, made by the
    admission, called once when the request ends (Envoy closes its stream). `move` hands it to the
    engine the gateway really sent the request to (an endpoint picker's served endpoint): the
    reservation that replaces it, or None when it was only given back. `first_token` tells its agent
    the engine started answering (an endpoint picker sees the answer)."""

    session: str  # the gate's reservation id (kvgate.gate.reservation_ids), not the client's
    charged_tokens: int  # what the agent added to its reserved tokens (less with shared prefixes)
    cached_tokens: int  # prompt tokens the engine is expected to find in its prefix cache
    release: Release
    move: Callable[[str], Awaitable[Reserved | None]]
    first_token: Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Outcome:
    decision: Decision
    shape: RequestShape | None = None
    estimate: TokenEstimate | None = None
    reserved: Reserved | None = None
    # A request that named no output budget: whose output lengths its answer teaches, and its `n`
    # (kvgate.policy.output_lengths; Pipeline.observe_output).
    learns: Learns | None = None


@dataclass(frozen=True, slots=True)
class Learns:
    key: tuple[ModelConfig, RoutePolicy]
    n: int


def wait_bound(admission: AdmissionConfig, model: ModelConfig, hints: ClientHints) -> float:
    """How long a long request may wait in the gate for room. One that would go to the async pool
    after admission.max_wait_s is held instead, up to admission.max_hold_s (docs/operations.md,
    "Holding a request in the gate"); the client's `Prefer: wait=N` only shortens the wait."""
    bound = admission.max_wait_s
    if admission.max_hold_s > bound and async_allowed(model, admission.async_fallback):
        bound = admission.max_hold_s
    return bound if hints.wait_s is None else min(hints.wait_s, bound)


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


def _estimator(estimators: EstimatorFactory, config: Config, model: ModelConfig) -> Estimator:
    """The model's estimator; a tokenizer that cannot be loaded named by the config key that gave it."""
    try:
        return estimators(model)
    except ConfigError as exc:
        key = "default_model" if model is config.default_model else f"models[{config.models.index(model)}]"
        raise ConfigError(f"{config.source}: {key}.tokenizer: {exc}") from exc


class Pipeline:
    def __init__(
        self,
        config: Config,
        estimators: EstimatorFactory,
        admission: Admission | None = None,
        offload_slots: int = 32,
        telemetry: GateMetrics | None = None,
    ) -> None:
        self._config = config
        self._admission = admission
        self._metrics = telemetry or GateMetrics()
        self._routes: dict[tuple[tuple[str, str], ...], RoutePolicy] = {}
        self._effective: dict[tuple[ModelConfig, RoutePolicy], ModelConfig] = {}
        self._parse_limits = ParseLimits(config.request.max_messages, config.request.max_json_depth)
        self._models = ModelMatcher(config)
        # Built at start-up: a missing tokenizer file fails here, not on a request. Model entries are
        # frozen values, so they key the table themselves.
        self._estimators = {
            model: _estimator(estimators, config, model) for model in (config.default_model, *config.models)
        }
        self._executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgate-body")
        self._offload_slots = asyncio.Semaphore(offload_slots)
        self._offloaded_bytes = 0  # of the bodies being read off the loop now (request.max_bytes_in_flight)
        self._priorities = Priorities(config.admission.priorities, config.admission.default_priority)
        self._reservation_ids = ReservationIds()
        self._outputs = OutputLengths()
        # An endpoint picker names an engine for every request it routes (kvgate.gate.picker).
        self._picks_endpoints = config.server.protocol == "endpoint-picker"

    def priority(self, head: RequestHead) -> str:
        """The priority the request is admitted and forwarded with (kvgate.policy.identity)."""
        return self._priorities.effective(head.priority, head.route.max_priority)

    def exact_counts_pending(self) -> int:
        return sum(e.pending for e in self._distinct_estimators())

    def estimate_corrections(self) -> list[tuple[float, dict[str, str]]]:
        """Per model entry, the factor its fast estimates are corrected by (kvgate.estimate.correction)."""
        return [(e.correction.factor, {"model": model.match}) for model, e in self._estimators.items()]

    def _distinct_estimators(self) -> list[Estimator]:
        # Models share estimators (one per tokenizer and costs).
        return list({id(e): e for e in self._estimators.values()}.values())

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for estimator in self._distinct_estimators():
            estimator.close()

    def route_policy(self, metadata: Iterable[tuple[str, str]]) -> RoutePolicy:
        """The route's policy from the ext_proc stream's metadata. A value that does not parse is
        logged once per route (per distinct set of values) and counted, and the request keeps its
        model's policy for that key."""
        pairs = tuple((key, value) for key, value in metadata if key in ROUTE_KEYS)
        if not pairs:
            return NO_ROUTE_POLICY
        policy = self._routes.get(pairs)
        if policy is None:
            read = read_route_policy(
                pairs, self._config.policies, self._config.admission.priorities, self._config.fairness.classes
            )
            for problem in read.problems:
                log.warning("Envoy route policy: ignored %s", problem)
                self._metrics.route_policy_ignored(problem.split(":", 1)[0])
            if len(self._routes) >= _ROUTE_CACHE_LIMIT:
                self._routes.clear()
            policy = self._routes[pairs] = read.policy
        return policy

    def effective(self, model: ModelConfig, route: RoutePolicy) -> ModelConfig:
        """The model entry with the route's policy laid over it (kvgate.policy.route)."""
        if route is NO_ROUTE_POLICY:
            return model
        key = (model, route)
        effective = self._effective.get(key)
        if effective is None:
            capped = limits_capped(model, route, self._config.policies)
            if capped is not None and capped.contradiction:
                # A route policy `kvgate envoy-config` refuses: a warning and a count.
                log.warning("Envoy route policy for model %s: %s", model.match, capped.message)
                self._metrics.route_policy_ignored("limits")
            elif capped is not None:
                log.info("Envoy route policy for model %s: %s", model.match, capped.message)
            if len(self._effective) >= _ROUTE_CACHE_LIMIT:
                self._effective.clear()
            effective = self._effective[key] = effective_model(model, route, self._config.policies)
        return effective

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
            return self._named(Route(self._config.default_model.pools.interactive, Reason.NO_BODY), head)
        if head.api is None:
            return self._named(self.passthrough(head), head)
        return None

    async def on_body(self, head: RequestHead, body: Body) -> Outcome:
        outcome = await self._decide(head, body)
        if not self._picks_endpoints:
            return outcome
        return dataclasses.replace(outcome, decision=self._named(outcome.decision, head))

    def _named(self, decision: Decision, head: RequestHead) -> Decision:
        """An endpoint picker's decision names an engine: a route that reserved none gets the least
        busy interactive engines the gateway allows (kvgate.policy.endpoints), or a 503."""
        if not self._picks_endpoints or not isinstance(decision, Route) or decision.endpoint is not None:
            return decision
        if self._admission is None:
            return no_healthy_node(decision)
        return self._admission.pick_unreserved(decision, head.subset)

    async def _decide(self, head: RequestHead, body: Body) -> Outcome:
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
        entry = self._models.lookup(shape.model)
        model = self.effective(entry, head.route)
        learns = None
        if shape.output_budget is None and model.default_output_tokens != entry.default_output_tokens:
            # The route's default output budget, charged as the budget the client did not name.
            shape = dataclasses.replace(shape, output_budget=model.default_output_tokens * shape.n)
        elif shape.output_budget is None:
            # What such requests to this model and route have produced, once the gate has seen it.
            learns = Learns((entry, head.route), shape.n)
            learned = self._outputs.budget(learns.key, model.max_total_tokens // 2)
            if learned is not None:
                shape = dataclasses.replace(shape, output_budget=learned * shape.n)
        estimate = await self._estimators[entry].estimate(shape, thresholds(model))
        if isinstance(estimate, Unavailable):
            return Outcome(Refusal(Reason.OVERLOADED, estimate.message), shape)
        decision = decide(estimate.prompt_tokens, estimate.output_tokens, model)
        if not isinstance(decision, Route):
            return Outcome(decision, shape, estimate)
        to_async = deferred(decision, model, head.hints, self._config.admission.async_fallback)
        if to_async is not None:
            return Outcome(to_async, shape, estimate)
        if self._admission is None:
            return Outcome(decision, shape, estimate, learns=learns)
        affinity = (
            self._affinity(head, body, shape, estimate, entry) if decision.reason is Reason.LONG else None
        )
        admitted = await self._admission.admit(
            decision,
            model,
            self.priority(head),
            self._reservation_ids.next(),
            wait_bound(self._config.admission, model, head.hints),
            affinity=affinity,
            output_tokens=estimate.output_tokens,
            subset=head.subset,
            tenant=head.tenant,
            tenant_class=head.route.tenant_class,
            charged_prompt_tokens=estimate.likely_prompt_tokens,
        )
        ticket = admitted.ticket
        if ticket is None:
            return Outcome(admitted.decision, shape, estimate, learns=learns)
        return Outcome(admitted.decision, shape, estimate, self._reserved(ticket), learns)

    def _reserved(self, ticket: Ticket) -> Reserved:
        admission = self._admission
        assert admission is not None, "a ticket comes from the admission"

        async def move(endpoint: str) -> Reserved | None:
            moved = await admission.move(ticket, endpoint)
            return None if moved is None else self._reserved(moved)

        release = functools.partial(admission.release, ticket)
        first_token = functools.partial(admission.first_token, ticket)
        return Reserved(
            ticket.request_id, ticket.charged_tokens, ticket.cached_tokens, release, move, first_token
        )

    def observe_output(self, learns: Learns, completion_tokens: int) -> None:
        """The answer to a request that named no output budget reported `completion_tokens` (over its
        `n` choices): the next such requests are charged what these produce (output_lengths)."""
        self._outputs.observe(learns.key, completion_tokens // max(1, learns.n))

    def _affinity(
        self, head: RequestHead, body: Body, shape: RequestShape, estimate: TokenEstimate, entry: ModelConfig
    ) -> Affinity | None:
        """A long request's prompt as prefix blocks, to place it where its prefix is (placement:)."""
        placement = self._config.placement
        # Compressed bodies are not searched for tool definitions, which would come first in the prompt.
        if (
            not placement.prefix_affinity
            or head.content_encoding
            # Only `in` is asked of it, which a bytearray answers as bytes do.
            or renders_definitions_first(cast(bytes, body))
        ):
            return None
        text_tokens = estimate.prompt_tokens - self._estimators[entry].fixed_prompt_tokens(shape)
        chain = prefix_chain(
            shape.texts, text_tokens, placement.block_tokens, placement.max_blocks, shape.model or ""
        )
        return None if chain is None else Affinity(chain, placement.load_bound)

    async def _understand(self, api: Api, head: RequestHead, body: Body) -> RequestShape | Refusal | None:
        """The request's shape; None when the body is not JSON and did not claim to be."""
        limits = self._config.request
        if len(body) > limits.max_body_bytes:
            return Refusal(Reason.BODY_TOO_LARGE, f"The request body exceeds {limits.max_body_bytes} bytes.")
        if len(body) <= OFFLOAD_BYTES and not head.content_encoding:
            return _shape_or_none(api, head, body, limits.max_decompressed_bytes, self._parse_limits)
        # A compressed body may inflate to the cap, and is charged so.
        charge = limits.max_decompressed_bytes if head.content_encoding else len(body)
        if self._offload_slots.locked() or (
            self._offloaded_bytes and self._offloaded_bytes + charge > limits.max_bytes_in_flight
        ):
            return Refusal(
                Reason.OVERLOADED, "The gateway is busy reading other large requests; retry shortly."
            )
        self._offloaded_bytes += charge
        try:
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
        finally:
            self._offloaded_bytes -= charge


def _shape_or_none(
    api: Api, head: RequestHead, body: Body, max_decompressed: int, limits: ParseLimits
) -> RequestShape | None:
    """Parse the body; None when it is not JSON and did not claim to be (pass it through untouched)."""
    data = decompress(body, head.content_encoding, max_decompressed)
    if head.declares_json:
        return parse_body(api, data, limits)
    try:
        return parse_body(api, data, limits)
    except RequestError:
        return None
