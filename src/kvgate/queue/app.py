"""The queue's HTTP face for inference requests: held and deferred jobs, and the jobs resource.

    POST <any inference path>         a job; held (answered on this connection) unless the request
                                      says `Prefer: respond-async` (RFC 7240): then 202 + Location
    GET    /v1/kvgate/jobs/{id}       the job (id, or the request's x-request-id), with the engine's
                                      answer once it ended
    DELETE /v1/kvgate/jobs/{id}       cancel it

A job is its tenant's (x-kvgate-tenant, `anonymous` without one): another tenant's id or request id
is not found (404), and a request that comes with another tenant's x-request-id becomes a job of its
own; only a job of the same tenant with that request id is attached to.

Every request is committed to the store before anything is answered. A held request is answered
with the engine's own status, headers and body (streamed as the engine streams, when the job runs on
this replica). A job that has not started within `queue.max_hold_s` of its arrival is cancelled and
answered 429. A job whose client left before it started waits `queue.reattach_s` for the client to
come back with the same x-request-id, then is cancelled (kvgate.queue.live). A job that started is
answered when it ends, however long the run, and kept for its client to find by its x-request-id.

No 500 for anything a client sent: `error_boundary`, the whole app's middleware, answers what a
handler raised from the one refusal table (kvgate.policy.refusals).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from typing import Any, Protocol

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kvgate.config import Config
from kvgate.errors import RequestError, StoreError
from kvgate.headroom.snapshot import NodeView
from kvgate.names import JOB_ID_HEADER, TOKENS_HEADER
from kvgate.policy import Reason, Refusal
from kvgate.policy.refusals import INTERNAL_ERROR, HttpAnswer, error_body, refusal_for
from kvgate.policy.route import read_prefer
from kvgate.queue import placement
from kvgate.queue.intake import Assessed, Intake, text_header
from kvgate.queue.jobs import Job, JobError, JobRequest, JobState, NewJob, describe, new_id
from kvgate.queue.live import LiveRun, LiveRuns, Signals
from kvgate.queue.metrics import QueueMetrics
from kvgate.queue.refusals import QueueRefusals
from kvgate.queue.store import CLIENT_GONE, Limits, QueueFull
from kvgate.request import Api, api_for_path

log = logging.getLogger(__name__)

JOBS_PATH = "/v1/kvgate/jobs"
# A held request looks at the store this often even without an event (a missed notification).
POLL_S = 5.0
HOLD_TIMEOUT = "hold_timeout"
# Framing of the request as it arrived: the stored body is inflated and sent with its own length.
_NOT_FORWARDED = frozenset({"content-length", "content-encoding", "transfer-encoding", "host"})


class JobsStore(Protocol):
    async def add(self, job: NewJob, limits: Limits) -> Job | QueueFull: ...

    async def get(self, key: str, tenant: str) -> Job | None: ...

    async def position(self, job: Job) -> int: ...

    async def cancel(
        self, key: str, tenant: str, error: JobError, *, queued_only: bool = False
    ) -> Job | None: ...


def prefers_async(values: Iterable[str]) -> bool:
    """Whether the Prefer header(s) ask for `respond-async`, read by the gate's rule (RFC 7240)."""
    return read_prefer(", ".join(values)).respond_async


def respond(answer: HttpAnswer, job_id: str | None = None) -> web.Response:
    headers = dict(answer.headers)
    if job_id is not None:
        headers[JOB_ID_HEADER] = job_id
    return web.Response(status=answer.status, body=answer.body, headers=headers)


def error_boundary(refusals: QueueRefusals, metrics: QueueMetrics) -> Middleware:
    """The queue's one error boundary, the whole app's middleware: aiohttp's own answers (404 of an
    unknown path, 405, 413) pass; the store out of reach is 503 `store_unavailable`; a RequestError is
    the client's (400 `invalid_request` and kin); anything else is 503 `internal_error`, logged once
    with the request id and counted by route (kvgate_queue_internal_errors_total), never a 500."""

    @web.middleware
    async def answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except web.RequestPayloadError:
            # aiohttp could not inflate the body its Content-Encoding names (see `_still_encoded`).
            message = "The request body cannot be read: it is not what its Content-Encoding says."
            return respond(refusals.invalid(message))
        except StoreError:
            return respond(refusals.store_unavailable())
        except RequestError as error:
            return respond(refusals.gate(refusal_for(error), api_for_path(request.path)))
        except Exception:
            route = request.match_info.route.resource
            where = route.canonical if route is not None else "(none)"
            log.exception(
                "queue: %s %s (x-request-id %s) failed; answered 503 internal_error",
                request.method,
                where,
                ascii(request.headers.get("x-request-id", "")),
            )
            metrics.internal_error(where)
            return respond(refusals.gate(INTERNAL_ERROR, api_for_path(request.path)))

    return answer_errors


class JobsApp:
    def __init__(
        self,
        *,
        config: Config,
        store: JobsStore,
        intake: Intake,
        nodes: Callable[[], tuple[NodeView, ...]],
        live: LiveRuns,
        signals: Signals,
        abort: Callable[[str], None],
        refusals: QueueRefusals,
        metrics: QueueMetrics,
        executor: Executor,
    ) -> None:
        self._config = config
        self._settings = config.queue
        self._store = store
        self._intake = intake
        self._nodes = nodes
        self._live = live
        self._signals = signals
        self._abort = abort
        self._refusals = refusals
        self._metrics = metrics
        self._executor = executor
        self._limits = Limits(config.queue.max_jobs, config.queue.max_tokens_waiting)
        self._forward = config.queue.forward_headers

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(JOBS_PATH + "/{key}", self.show)
        app.router.add_delete(JOBS_PATH + "/{key}", self.cancel)
        app.router.add_post("/{tail:.*}", self.submit)

    async def submit(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        api = api_for_path(request.path)
        contract = "deferred" if prefers_async(request.headers.getall("prefer", [])) else "held"
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            limit = self._config.request.max_body_bytes
            return self._refused(contract, self._refusals.gate(_too_large(limit), api))
        assessed = await loop.run_in_executor(
            self._executor,
            self._intake.assess,
            request.path,
            body,
            request.headers.get(TOKENS_HEADER),
            _still_encoded(request),
        )
        if isinstance(assessed, Refusal):
            return self._refused(contract, self._refusals.gate(assessed, api))
        nodes = self._nodes()
        if placement.fit(nodes, assessed.tokens) is placement.Fit.TOO_BIG:
            error = placement.too_big_error(nodes, assessed.tokens)
            return self._refused(
                contract, self._refusals.queue(Reason.EXCEEDS_NODE_CAPACITY, error.message, api)
            )
        try:
            added = await self._store.add(self._new_job(request, assessed, contract), self._limits)
        except StoreError:
            return self._refused(contract, self._refusals.store_unavailable())
        if isinstance(added, QueueFull):
            return self._refused(contract, self._refusals.queue_full(added.why, assessed.tokens, api))
        self._metrics.admitted(contract, "accepted")
        if contract == "deferred":
            return await self._accepted(added)
        return await self._hold(request, added, arrived, assessed.api)

    def _refused(self, contract: str, answer: HttpAnswer) -> web.Response:
        self._metrics.admitted(contract, str(answer.status))
        return respond(answer)

    def _new_job(self, request: web.Request, assessed: Assessed, contract: str) -> NewJob:
        """The job to store; InvalidRequestError (400) for a header it keeps that is not text."""
        headers = {
            name: value
            for name in self._forward
            if name not in _NOT_FORWARDED and (value := text_header(request.headers, name)) is not None
        }
        headers.setdefault("content-type", "application/json")
        return NewJob(
            id=new_id("job_"),
            request=JobRequest(request.path_qs, tuple(headers.items()), assessed.body),
            tokens=assessed.tokens,
            priority=self._intake.priority(request.headers),
            tenant=self._intake.tenant(request.headers),
            model=assessed.model,
            stream=assessed.stream,
            request_id=text_header(request.headers, "x-request-id") or None,
            charge=assessed.charge,
            tenant_class=self._intake.tenant_class(request.headers),
            hold_s=self._settings.reattach_s if contract == "held" and self._settings.reattach_s else None,
        )

    async def _accepted(self, job: Job) -> web.Response:
        body = await self._described(job)
        return web.json_response(
            body,
            status=202,
            headers={
                "location": f"{JOBS_PATH}/{job.id}",
                "preference-applied": "respond-async",
                JOB_ID_HEADER: job.id,
            },
        )

    async def show(self, request: web.Request) -> web.Response:
        tenant = self._intake.tenant(request.headers)
        try:
            job = await self._store.get(request.match_info["key"], tenant)
            if job is None:
                return respond(self._refusals.not_found(f"job {request.match_info['key']!r}"))
            return web.json_response(await self._described(job), headers={JOB_ID_HEADER: job.id})
        except StoreError:
            return respond(self._refusals.store_unavailable())

    async def cancel(self, request: web.Request) -> web.Response:
        key = request.match_info["key"]
        tenant = self._intake.tenant(request.headers)
        try:
            job = await self._store.cancel(
                key, tenant, JobError("cancelled", f"Cancelled by DELETE {JOBS_PATH}/{key}.")
            )
        except StoreError:
            return respond(self._refusals.store_unavailable())
        if job is None:
            return respond(self._refusals.not_found(f"job {key!r}"))
        self._abort(job.id)
        return web.json_response(await self._described(job), headers={JOB_ID_HEADER: job.id})

    async def _described(self, job: Job) -> dict[str, Any]:
        position = None
        if job.state is JobState.QUEUED:
            # The job is committed whatever happens here: a lost position must not turn a 202 into a 500.
            with contextlib.suppress(StoreError):
                position = await self._store.position(job)
        return describe(job, self._config.admission.priorities, position)

    async def _hold(self, request: web.Request, job: Job, arrived: float, api: Api) -> web.StreamResponse:
        deadline = arrived + self._settings.max_hold_s
        with self._signals.watch(job.id, request.transport) as watch:
            while True:
                live = self._live.get(job.id)
                # An attempt that already ended is in the store (its result is written before it ends).
                if live is not None and not live.ended:
                    answered = await self._follow(request, job, live)
                    if answered is not None:
                        return answered
                    continue
                try:
                    current = await self._store.get(job.id, job.tenant)
                except StoreError:
                    current = job
                if current is None:
                    return respond(self._refusals.not_found(f"job {job.id!r}"), job.id)
                if current.terminal:
                    return self._final(current, api)
                remaining = deadline - asyncio.get_running_loop().time()
                if current.state is not JobState.QUEUED:
                    # Running on another replica: its answer comes, whatever the hold's deadline.
                    await watch.wait(POLL_S)
                    continue
                if remaining <= 0:
                    refused = await self._give_up(request, job, api)
                    if refused is not None:
                        return refused
                    continue  # it started meanwhile
                await watch.wait(min(remaining, POLL_S))

    async def _follow(self, request: web.Request, job: Job, live: LiveRun) -> web.StreamResponse | None:
        """The answer of the attempt running here; None when the store has the rest to say (it went back
        to the queue unseen, or ended without an answer). The hold's deadline bounds the wait for a
        node, not the run: a job that started is the engine's work under way (and charged to its
        tenant), and cancelling it at the deadline answered 429 for work the engine then threw away.
        The run is bounded by queue.engine_timeout_s."""
        while live.head is None and not live.ended:
            await live.wait(POLL_S)
        head = live.head
        if head is not None and job.stream and head.ok and not live.requeued:
            return await self._relay(request, job, live)
        while not live.ended:
            await live.wait(POLL_S)
        if head is None or live.error is not None or live.requeued:
            return None
        headers = {"content-type": head.content_type, JOB_ID_HEADER: job.id}
        return web.Response(status=head.status, body=b"".join(live.chunks), headers=headers)

    async def _relay(self, request: web.Request, job: Job, live: LiveRun) -> web.StreamResponse:
        assert live.head is not None
        response = web.StreamResponse(
            status=live.head.status, headers={"content-type": live.head.content_type, JOB_ID_HEADER: job.id}
        )
        try:
            await response.prepare(request)
            async for chunk in live.follow():
                await response.write(chunk)
            if live.error is not None:
                # Cut mid-stream: an error event, which the openai SDK raises as APIError
                # (openai 3.57.0, _streaming.py: a data line whose JSON has "error").
                rule = self._refusals.rule(Reason.ENGINE_FAILED)
                await response.write(b"data: " + error_body(rule, live.error.message, None) + b"\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left; the job's answer is kept for GET by request id
        return response

    async def _give_up(self, request: web.Request, job: Job, api: Api) -> web.StreamResponse | None:
        """The hold ran out: cancel the job and answer 429 (unless it ended meanwhile); None when it
        started meanwhile (its answer comes)."""
        if request.transport is None or request.transport.is_closing():
            # Nobody to answer: the job stays queue.reattach_s, for its client to come back for.
            return web.Response(status=499)
        error = JobError(HOLD_TIMEOUT, f"Held for {self._settings.max_hold_s:g} s without a node free.")
        try:
            current = await self._store.cancel(job.id, job.tenant, error, queued_only=True)
        except StoreError:
            return respond(self._refusals.store_unavailable(), job.id)
        if current is not None and current.state is JobState.RUNNING:
            return None
        self._abort(job.id)
        if current is not None and current.terminal:
            return self._final(current, api)
        return respond(self._refusals.hold_timeout(self._settings.max_hold_s, api), job.id)

    def _final(self, job: Job, api: Api | None) -> web.Response:
        """An ended job as its held client gets it: the engine's answer, or why there is none."""
        if job.result is not None:
            headers = {"content-type": job.result.content_type, JOB_ID_HEADER: job.id}
            return web.Response(status=job.result.status, body=job.result.body, headers=headers)
        error = job.error or JobError(job.state.value, f"The job ended {job.state.value}.")
        if job.state is JobState.CANCELLED and error.code == HOLD_TIMEOUT:
            return respond(self._refusals.hold_timeout(self._settings.max_hold_s, api), job.id)
        if job.state is JobState.CANCELLED and error.code == CLIENT_GONE:
            # Its hold lapsed while this client waited: this replica could not renew it in the store.
            return respond(self._refusals.store_unavailable(), job.id)
        reason = _REASONS.get(error.code, Reason.JOB_CANCELLED)
        return respond(self._refusals.queue(reason, error.message, api), job.id)


# What aiohttp's server inflates itself before a handler reads the body (aiohttp 3.x http_parser:
# an ASCII Content-Encoding that, lower-cased, is one of these; `auto_decompress` is on by default).
_INFLATED_BY_AIOHTTP = frozenset({"gzip", "deflate", "br", "zstd"})


def _still_encoded(request: web.Request) -> str | None:
    """The Content-Encoding the body read still has: none when aiohttp has already inflated it (the
    intake would otherwise inflate it twice and refuse a valid gzip request)."""
    encoding = request.headers.get("content-encoding")
    if encoding is not None and encoding.isascii() and encoding.lower() in _INFLATED_BY_AIOHTTP:
        return None
    return encoding


_REASONS: Mapping[str, Reason] = {
    "exceeds_node_capacity": Reason.EXCEEDS_NODE_CAPACITY,
    "engine_failed": Reason.ENGINE_FAILED,
}


def _too_large(limit: int) -> Refusal:
    return Refusal(Reason.BODY_TOO_LARGE, f"The request body exceeds {limit} bytes.")
