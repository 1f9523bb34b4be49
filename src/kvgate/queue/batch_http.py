"""The OpenAI Batch API, served by the queue: files in, batches of jobs, files out.

    POST /v1/files (multipart: purpose=batch, file)   GET /v1/files[/{id}[/content]]   DELETE /v1/files/{id}
    POST /v1/batches   GET /v1/batches[/{id}]   POST /v1/batches/{id}/cancel

Paths and objects follow the official `openai` SDK (openai 3.57.0: `resources/files.py` posts
multipart to `/files` with `purpose` and `file`; `resources/batches.py` posts `input_file_id`,
`endpoint`, `completion_window`, `metadata` to `/batches`; `files.content` GETs `/files/{id}/content`).
A batch's lines are admitted like any request, by the gate's rules: a line the gate would refuse (too
long, invalid), or one bigger than every node, is written to the error file and the rest run; a
malformed file (bad JSON, wrong url, repeated custom_id) fails the batch with its line numbers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from aiohttp import BodyPartReader, web

from kvgate.config import Config
from kvgate.digits import NotWhole, read_whole
from kvgate.errors import InvalidRequestError
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
    StoredFile,
    batch_json,
    file_json,
    page,
)
from kvgate.queue.batchfile import BatchLine, read_lines
from kvgate.queue.batchstore import BatchStore
from kvgate.queue.intake import Intake
from kvgate.queue.jobs import JobError, JobRequest, NewJob, new_id
from kvgate.queue.metrics import QueueMetrics
from kvgate.queue.refusals import QueueRefusals
from kvgate.queue.settle import Settler
from kvgate.queue.store import Limits, QueueFull

_READ_CHUNK = 256 * 1024
_MAX_PAGE = 10_000


@dataclasses.dataclass(frozen=True, slots=True)
class _Submitter:
    """Who created a batch: its lines inherit the tenant and priority."""

    tenant: str
    priority: int


class BatchApi:
    def __init__(
        self,
        *,
        config: Config,
        batches: BatchStore,
        settler: Settler,
        intake: Intake,
        nodes: Callable[[], tuple[NodeView, ...]],
        refusals: QueueRefusals,
        metrics: QueueMetrics,
        executor: Executor,
    ) -> None:
        self._config = config
        self._batches = batches
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
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.list_files)
        app.router.add_get("/v1/files/{id}", self.show_file)
        app.router.add_get("/v1/files/{id}/content", self.file_content)
        app.router.add_delete("/v1/files/{id}", self.delete_file)
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.list_batches)
        app.router.add_get("/v1/batches/{id}", self.show)
        app.router.add_post("/v1/batches/{id}/cancel", self.cancel)

    async def upload(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            return respond(self._refusals.invalid("Upload the file as multipart/form-data."))
        reader = await request.multipart()
        purpose: str | None = None
        filename = "batch.jsonl"
        content: bytes | None = None
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                filename = part.filename or filename
                content = await self._read_limited(part)
                if content is None:
                    limit = self._config.queue.max_file_bytes
                    return respond(self._refusals.invalid(f"The file is larger than {limit} bytes."))
            else:
                await part.release()
        if purpose != "batch":
            return respond(self._refusals.invalid(f"purpose must be 'batch' here, got {purpose!r}."))
        if content is None:
            return respond(self._refusals.invalid("No 'file' part in the upload."))
        stored = StoredFile(new_id("file-"), purpose, filename, len(content), time.time())
        await self._batches.put_file(stored, content)
        return web.json_response(file_json(stored))

    async def _read_limited(self, part: BodyPartReader) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while chunk := await part.read_chunk(_READ_CHUNK):
            size += len(chunk)
            if size > self._config.queue.max_file_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    async def list_files(self, request: web.Request) -> web.Response:
        after, limit = _paging(request)
        files, more = await self._batches.files(request.query.get("purpose"), after, limit)
        return web.json_response(page([file_json(f) for f in files], more))

    async def show_file(self, request: web.Request) -> web.Response:
        stored = await self._batches.file(request.match_info["id"])
        if stored is None:
            return respond(self._refusals.not_found(f"file {request.match_info['id']!r}"))
        return web.json_response(file_json(stored))

    async def file_content(self, request: web.Request) -> web.Response:
        content = await self._batches.content(request.match_info["id"])
        if content is None:
            return respond(self._refusals.not_found(f"file {request.match_info['id']!r}"))
        return web.Response(body=content, content_type="application/octet-stream")

    async def delete_file(self, request: web.Request) -> web.Response:
        file_id = request.match_info["id"]
        if not await self._batches.delete_file(file_id):
            return respond(self._refusals.not_found(f"file {file_id!r}"))
        return web.json_response({"id": file_id, "object": "file", "deleted": True})

    async def create(self, request: web.Request) -> web.Response:
        try:
            params = await request.json()
        except ValueError:
            return respond(self._refusals.invalid("The body is not JSON."))
        problem = _check_create(params)
        if problem is not None:
            return respond(self._refusals.invalid(problem))
        stored = await self._batches.file(params["input_file_id"])
        if stored is None or stored.purpose != "batch":
            return respond(self._refusals.not_found(f"batch input file {params['input_file_id']!r}"))
        content = await self._batches.content(stored.id)
        assert content is not None
        now = time.time()
        endpoint = params["endpoint"]
        batch = Batch(
            id=new_id("batch_"),
            status=BatchStatus.IN_PROGRESS,
            endpoint=endpoint,
            input_file_id=stored.id,
            completion_window=params["completion_window"],
            tenant=self._intake.tenant(request.headers),
            created_at=now,
            expires_at=now + COMPLETION_WINDOWS[params["completion_window"]],
            counts=Counts(0),
            metadata=params.get("metadata"),
            in_progress_at=now,
        )
        loop = asyncio.get_running_loop()
        max_lines = self._config.queue.max_batch_lines
        lines, problems = await loop.run_in_executor(self._executor, read_lines, content, endpoint, max_lines)
        jobs: list[NewJob] = []
        if problems:
            batch = dataclasses.replace(
                batch, status=BatchStatus.FAILED, failed_at=now, in_progress_at=None,
                errors=tuple(p.as_json() for p in problems),
            )  # fmt: skip
        else:
            submitter = _Submitter(batch.tenant, self._intake.priority(request.headers))
            nodes = self._nodes()
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
        batch = await self._batches.batch(request.match_info["id"])
        if batch is None:
            return respond(self._refusals.not_found(f"batch {request.match_info['id']!r}"))
        return web.json_response(batch_json(batch))

    async def list_batches(self, request: web.Request) -> web.Response:
        after, limit = _paging(request)
        batches, more = await self._batches.batches(after, limit)
        return web.json_response(page([batch_json(b) for b in batches], more))

    async def cancel(self, request: web.Request) -> web.Response:
        batch = await self._batches.cancel(request.match_info["id"])
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
    metadata = params.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        return "metadata must be an object of strings."
    return None


def _paging(request: web.Request) -> tuple[str | None, int]:
    """`after` and `limit` of a list request (OpenAI's: limit 1 to _MAX_PAGE, 20 when absent);
    InvalidRequestError (400) for a limit that is not a whole number in range."""
    limit = read_whole(request.query.get("limit", "20"), minimum=1, maximum=_MAX_PAGE)
    if isinstance(limit, NotWhole):
        raise InvalidRequestError(limit.describe("limit") + ".")
    return request.query.get("after"), limit
