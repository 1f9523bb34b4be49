"""The OpenAI Batch API, served by the queue: batches of jobs from a file (kvgate.queue.files_http).

    POST /v1/batches   GET /v1/batches[/{id}]   POST /v1/batches/{id}/cancel

Paths and objects follow the official `openai` SDK (openai 3.57.0: `resources/batches.py` posts
`input_file_id`, `endpoint`, `completion_window`, `metadata` to `/batches`). A batch's lines are
admitted like any request, by the gate's rules: a line the gate would refuse (too long, invalid), or
one bigger than every node, is written to the error file and the rest run; a malformed file (bad
JSON, wrong url, repeated custom_id) fails the batch with its line numbers. Its lines are counted
before any is parsed: a file past queue.max_batch_lines fails, and one past the room left under
queue.max_jobs gets 429, without being read into memory.

A batch is its tenant's (x-kvgate-tenant, `anonymous` without one), and so are its lines and its
output and error files; its input must be a file of the same tenant. Another tenant's batch is not
found (404), and lists hold only the caller's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from aiohttp import web

from kvgate.config import Config
from kvgate.headroom.snapshot import NodeView
from kvgate.policy import Refusal
from kvgate.queue import placement
from kvgate.queue.app import error_boundary, respond
from kvgate.queue.batches import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    Batch,
    BatchStatus,
    Counts,
    batch_json,
    metadata_problem,
    page,
)
from kvgate.queue.batchfile import (
    BatchLine,
    LineProblem,
    LineSplitter,
    count_problem,
    read_lines,
    requests_in,
)
from kvgate.queue.batchstore import BatchStore
from kvgate.queue.files_http import paging
from kvgate.queue.filestore import FileStore
from kvgate.queue.intake import Intake
from kvgate.queue.jobs import JobError, JobRequest, NewJob, new_id
from kvgate.queue.metrics import QueueMetrics
from kvgate.queue.refusals import QueueRefusals
from kvgate.queue.settle import Settler
from kvgate.queue.store import JobStore, Limits, QueueFull


@dataclasses.dataclass(frozen=True, slots=True)
class _Submitter:
    """Who created a batch: its lines inherit the tenant, priority and tenant class."""

    tenant: str
    priority: int
    tenant_class: str | None


class BatchApi:
    def __init__(
        self,
        *,
        config: Config,
        batches: BatchStore,
        files: FileStore,
        jobs: JobStore,
        settler: Settler,
        intake: Intake,
        nodes: Callable[[], tuple[NodeView, ...]],
        refusals: QueueRefusals,
        metrics: QueueMetrics,
        executor: Executor,
    ) -> None:
        self._config = config
        self._batches = batches
        self._files = files
        self._jobs = jobs
        self._settler = settler
        self._intake = intake
        self._nodes = nodes
        self._refusals = refusals
        self._metrics = metrics
        self._executor = executor
        self._limits = Limits(config.queue.max_jobs, config.queue.max_tokens_waiting)
        # The whole app's error boundary (kvgate.queue.app.error_boundary), under the name the
        # service registers it by.
        self.store_errors = error_boundary(refusals, metrics)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list_batches)
        app.router.add_get("/v1/batches/{id}", self.show)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel)

    async def create(self, request: web.Request) -> web.Response:
        tenant = self._intake.tenant(request.headers)
        try:
            params = await request.json()
        except ValueError:
            return respond(self._refusals.invalid("The body is not JSON."))
        problem = _check_create(params)
        if problem is not None:
            return respond(self._refusals.invalid(problem))
        stored = await self._files.file(params["input_file_id"], tenant)
        if stored is None or stored.purpose != "batch":
            return respond(self._refusals.not_found(f"batch input file {params['input_file_id']!r}"))
        now = time.time()
        endpoint = params["endpoint"]
        batch = Batch(
            id=new_id("batch_"),
            status=BatchStatus.IN_PROGRESS,
            endpoint=endpoint,
            input_file_id=stored.id,
            completion_window=params["completion_window"],
            tenant=tenant,
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS[params["completion_window"]],
            counts=Counts(0),
            metadata=params.get("metadata"),
            in_progress_at=now,
        )
        read = await self._read(stored.id, endpoint)
        if isinstance(read, QueueFull):
            self._metrics.admitted("batch", "429")
            return respond(self._refusals.queue_full(read.why, 0))
        lines, problems = read
        jobs: list[NewJob] = []
        if problems:
            batch = dataclasses.replace(
                batch, status=BatchStatus.FAILED, failed_at=now, in_progress_at=None,
                errors=tuple(p.as_json() for p in problems),
            )  # fmt: skip
        else:
            submitter = _Submitter(
                batch.tenant,
                self._intake.priority(request.headers),
                self._intake.tenant_class(request.headers),
            )
            nodes = self._nodes()
            loop = asyncio.get_running_loop()
            jobs = await loop.run_in_executor(self._executor, self._line_jobs, batch, lines, submitter, nodes)
            batch = dataclasses.replace(batch, counts=Counts(len(jobs)))
        created = await self._batches.create(batch, jobs, self._limits)
        if isinstance(created, QueueFull):
            self._metrics.admitted("batch", "429")
            return respond(self._refusals.queue_full(created.why, sum(j.tokens for j in jobs)))
        for job in jobs:
            self._metrics.admitted("batch", "refused" if job.error else "accepted")
        if jobs and all(job.error is not None for job in jobs):
            settled = await self._settler.settle(batch.id)
            created = settled or created
        return web.json_response(batch_json(created))

    async def _read(
        self, file_id: str, endpoint: str
    ) -> tuple[list[BatchLine], list[LineProblem]] | QueueFull:
        """A file's requests, or the problems that make it no batch; QueueFull when its lines would
        not fit under queue.max_jobs. The lines are counted, and the bounds checked, before any line is
        parsed (or the file held whole in memory)."""
        requests = await self._requests_in(file_id)
        too_many = count_problem(requests, self._config.queue.max_batch_lines)
        if too_many is not None:
            return [], [too_many]
        full = await self._jobs.room(self._limits, requests)
        if full is not None:
            return full
        raw = await self._lines_of(file_id)
        return await asyncio.get_running_loop().run_in_executor(self._executor, read_lines, raw, endpoint)

    async def _requests_in(self, file_id: str) -> int:
        """The requests a file holds, counted without parsing; it stops reading once past
        queue.max_batch_lines."""
        splitter = LineSplitter()
        requests = 0
        async for chunk in self._files.chunks(file_id):
            requests += requests_in(splitter.feed(chunk))
            if requests > self._config.queue.max_batch_lines:
                return requests
        return requests + requests_in(splitter.end())

    async def _lines_of(self, file_id: str) -> list[bytes]:
        splitter = LineSplitter()
        lines: list[bytes] = []
        async for chunk in self._files.chunks(file_id):
            lines += splitter.feed(chunk)
        return lines + splitter.end()

    def _line_jobs(
        self, batch: Batch, lines: Sequence[BatchLine], submitter: _Submitter, nodes: tuple[NodeView, ...]
    ) -> list[NewJob]:
        """Each line as a job; lines the gate would refuse, or no node could ever hold, already failed."""
        jobs = []
        for line in lines:
            assessed = self._intake.assess(batch.endpoint, line.body, None)
            job = NewJob(
                id=new_id("job_"),
                request=JobRequest(batch.endpoint, (("content-type", "application/json"),), line.body),
                tokens=0 if isinstance(assessed, Refusal) else assessed.tokens,
                priority=submitter.priority,
                tenant=submitter.tenant,
                model=None if isinstance(assessed, Refusal) else assessed.model,
                batch_id=batch.id,
                custom_id=line.custom_id,
                line=line.line,
                expires_at=batch.expires_at,
                charge=None if isinstance(assessed, Refusal) else assessed.charge,
                tenant_class=submitter.tenant_class,
            )
            if isinstance(assessed, Refusal):
                job = dataclasses.replace(
                    job,
                    tokens=assessed.tokens,
                    error=JobError(self._refusals.code(assessed.reason), assessed.message),
                )
            elif placement.fit(nodes, assessed.tokens) is placement.Fit.TOO_BIG:
                job = dataclasses.replace(job, error=placement.too_big_error(nodes, assessed.tokens))
            jobs.append(job)
        return jobs

    async def show(self, request: web.Request) -> web.Response:
        batch = await self._batches.batch(request.match_info["id"], self._intake.tenant(request.headers))
        if batch is None:
            return respond(self._refusals.not_found(f"batch {request.match_info['id']!r}"))
        return web.json_response(batch_json(batch))

    async def list_batches(self, request: web.Request) -> web.Response:
        tenant = self._intake.tenant(request.headers)
        after, limit = paging(request)
        batches, more = await self._batches.batches(tenant, after, limit)
        return web.json_response(page([batch_json(b) for b in batches], more))

    async def cancel(self, request: web.Request) -> web.Response:
        batch = await self._batches.cancel(request.match_info["id"], self._intake.tenant(request.headers))
        if batch is None:
            return respond(self._refusals.not_found(f"batch {request.match_info['id']!r}"))
        settled = await self._settler.settle(batch.id)
        return web.json_response(batch_json(settled or batch))


def _check_create(params: Any) -> str | None:
    if not isinstance(params, dict):
        return "The body must be a JSON object."
    if not isinstance(params.get("input_file_id"), str):
        return "input_file_id is required."
    if params.get("endpoint") not in ENDPOINTS:
        return f"endpoint must be one of {', '.join(ENDPOINTS)}, got {params.get('endpoint')!r}."
    if params.get("completion_window") not in COMPLETION_WINDOWS:
        return f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}."
    return metadata_problem(params.get("metadata"))
