"""The OpenAI Files API, as the Batch API needs it, served by the queue.

    POST /v1/files (multipart: purpose=batch, file, expires_after[anchor], expires_after[seconds])
    GET /v1/files[?purpose&after&limit]   GET /v1/files/{id}   GET /v1/files/{id}/content
    DELETE /v1/files/{id}

As the official `openai` SDK sends and reads them (openai 3.57.0: `resources/files.py` posts
multipart to `/files`; `types/file_create_params.py`: `expires_after` {anchor: created_at, seconds
3600 to 2592000}, flattened by the SDK's multipart form as `expires_after[anchor]` and
`expires_after[seconds]`; `types/file_object.py`).

Every file is its tenant's (x-kvgate-tenant, `anonymous` without one): another tenant's id is not
found (404), and lists hold only the caller's. Bounded by default: per tenant a number of files,
bytes and concurrent uploads (429, or 413 for bytes, naming the quota), a total for all tenants, and
an expiry (queue.file_ttl_s, 30 days, or less when the upload asks). An upload is written to the
store a chunk at a time as it arrives, never held whole, and it must not be compressed: a
Content-Encoding is refused (415) before anything is read, since aiohttp would inflate it on the fly
and a 548 KB gzip body inflates to 191 MiB (issue 27).
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import BodyPartReader, web

from kvgate.config import Config
from kvgate.digits import NotWhole, read_whole
from kvgate.errors import InvalidRequestError, StoreError
from kvgate.policy import Reason, Refusal
from kvgate.policy.refusals import HttpAnswer
from kvgate.queue.app import respond
from kvgate.queue.batches import StoredFile, expiry_seconds, file_json, page
from kvgate.queue.filestore import CHUNK_BYTES, FileStore, Limit, OverQuota, Quota
from kvgate.queue.intake import Intake
from kvgate.queue.jobs import new_id
from kvgate.queue.refusals import QueueRefusals

_READ_CHUNK = 256 * 1024
_MAX_PAGE = 10_000
# The only Content-Encoding an upload may name (RFC 9110 8.4.1: identity is no encoding).
_PLAIN = ("", "identity")
# The form fields an upload may carry beside its file (others are skipped unread), and their size.
_FIELDS = frozenset({"purpose", "expires_after[anchor]", "expires_after[seconds]"})
_MAX_FIELD_BYTES = 1024
_TIMED_OUT = "The upload did not finish within queue.upload_timeout_s."


class FilesApi:
    def __init__(self, *, config: Config, files: FileStore, intake: Intake, refusals: QueueRefusals) -> None:
        self._settings = config.queue
        self._files = files
        self._intake = intake
        self._refusals = refusals
        self._quota = Quota.of(config.queue)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.list_files)
        app.router.add_get("/v1/files/{id}", self.show_file)
        app.router.add_get("/v1/files/{id}/content", self.file_content)
        app.router.add_delete("/v1/files/{id}", self.delete_file)

    async def upload(self, request: web.Request) -> web.Response:
        encoding = request.headers.get("content-encoding", "").strip().lower()
        if encoding not in _PLAIN:
            refusal = Refusal(
                Reason.UNSUPPORTED_ENCODING,
                f"Upload the file uncompressed: /v1/files takes no Content-Encoding (got {encoding[:40]!r}).",
            )
            return respond(self._refusals.gate(refusal))
        if not request.content_type.startswith("multipart/"):
            return respond(self._refusals.invalid("Upload the file as multipart/form-data."))
        tenant = self._intake.tenant(request.headers)
        file_id = new_id("file-")
        over = await self._files.begin(file_id, tenant, self._quota)
        if over is not None:
            return respond(self._over_quota(over))
        answer: web.Response | StoredFile | None = None
        try:
            answer = await self._receive(request, file_id, tenant)
        finally:
            if not isinstance(answer, StoredFile):
                # Refused, or the client went: what was written goes (or the sweep takes it, when the
                # store is out of reach now).
                with contextlib.suppress(StoreError):
                    await asyncio.shield(self._files.drop(file_id))
        if isinstance(answer, web.Response):
            return answer
        return web.json_response(file_json(answer))

    async def _receive(self, request: web.Request, file_id: str, tenant: str) -> web.Response | StoredFile:
        """Read the form, writing the file part to the store as it comes; the refusal, or the file."""
        reader = await request.multipart()
        fields: dict[str, str] = {}
        filename: str | None = None
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                await part.release()
                continue
            if part.name == "file":
                if filename is not None:
                    return respond(self._refusals.invalid("Send one 'file' part per upload."))
                filename = part.filename or "batch.jsonl"
                refused = await self._store_part(part, file_id, tenant)
                if refused is not None:
                    return refused
            elif part.name in _FIELDS:
                fields[part.name] = await _field(part)
            else:
                await part.release()
        purpose = fields.get("purpose", "").strip()
        if purpose != "batch":
            return respond(self._refusals.invalid(f"purpose must be 'batch' here, got {purpose!r}."))
        if filename is None:
            return respond(self._refusals.invalid("No 'file' part in the upload."))
        anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
        ttl = expiry_seconds(anchor, seconds, self._settings.file_ttl_s)
        if isinstance(ttl, str):
            return respond(self._refusals.invalid(ttl))
        stored = await self._files.finish(file_id, purpose, filename, ttl)
        if stored is None:
            return respond(self._over_quota(OverQuota(Limit.TIMEOUT, _TIMED_OUT)))
        return stored

    async def _store_part(self, part: BodyPartReader, file_id: str, tenant: str) -> web.Response | None:
        """Write the file part in chunks of CHUNK_BYTES, each within the quotas; the refusal, if any."""
        buffered: list[bytes] = []
        held = 0
        size = 0
        seq = 0
        while True:
            chunk = await part.read_chunk(_READ_CHUNK)
            size += len(chunk)
            if size > self._settings.max_file_bytes:
                limit = self._settings.max_file_bytes
                message = f"The file is larger than {limit} bytes (queue.max_file_bytes)."
                return respond(self._refusals.queue(Reason.BODY_TOO_LARGE, message))
            buffered.append(chunk)
            held += len(chunk)
            if held >= CHUNK_BYTES or (not chunk and held):
                over = await self._files.append(file_id, tenant, seq, b"".join(buffered), self._quota)
                if over is not None:
                    return respond(self._over_quota(over))
                buffered, held, seq = [], 0, seq + 1
            if not chunk:
                return None

    def _over_quota(self, over: OverQuota) -> HttpAnswer:
        if over.limit is Limit.BYTES:
            return self._refusals.queue(Reason.BODY_TOO_LARGE, over.message)
        if over.limit is Limit.TIMEOUT:
            return self._refusals.invalid(over.message)
        return self._refusals.queue(Reason.QUEUE_FULL, over.message)

    async def list_files(self, request: web.Request) -> web.Response:
        tenant = self._intake.tenant(request.headers)
        after, limit = paging(request)
        files, more = await self._files.files(tenant, request.query.get("purpose"), after, limit)
        return web.json_response(page([file_json(f) for f in files], more))

    async def show_file(self, request: web.Request) -> web.Response:
        stored = await self._files.file(request.match_info["id"], self._intake.tenant(request.headers))
        if stored is None:
            return respond(self._refusals.not_found(f"file {request.match_info['id']!r}"))
        return web.json_response(file_json(stored))

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        stored = await self._files.file(request.match_info["id"], self._intake.tenant(request.headers))
        if stored is None:
            return respond(self._refusals.not_found(f"file {request.match_info['id']!r}"))
        response = web.StreamResponse(headers={"content-type": "application/octet-stream"})
        response.content_length = stored.bytes
        await response.prepare(request)
        async for chunk in self._files.chunks(stored.id):
            await response.write(chunk)
        await response.write_eof()
        return response

    async def delete_file(self, request: web.Request) -> web.Response:
        file_id = request.match_info["id"]
        if not await self._files.delete(file_id, self._intake.tenant(request.headers)):
            return respond(self._refusals.not_found(f"file {file_id!r}"))
        return web.json_response({"id": file_id, "object": "file", "deleted": True})


async def _field(part: BodyPartReader) -> str:
    """A small form field's text; InvalidRequestError (400) past _MAX_FIELD_BYTES or not UTF-8."""
    data = b""
    while chunk := await part.read_chunk(_MAX_FIELD_BYTES + 1):
        data += chunk
        if len(data) > _MAX_FIELD_BYTES:
            message = f"The form field {part.name!r} is longer than {_MAX_FIELD_BYTES} bytes."
            raise InvalidRequestError(message)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequestError(f"The form field {part.name!r} is not UTF-8 text.") from None


def paging(request: web.Request) -> tuple[str | None, int]:
    """`after` and `limit` of a list request (OpenAI's: limit 1 to _MAX_PAGE, 20 when absent);
    InvalidRequestError (400) for a limit that is not a whole number in range."""
    limit = read_whole(request.query.get("limit", "20"), minimum=1, maximum=_MAX_PAGE)
    if isinstance(limit, NotWhole):
        raise InvalidRequestError(limit.describe("limit") + ".")
    return request.query.get("after"), limit
