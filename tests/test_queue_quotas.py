"""The queue's files are bounded by default (issue 27, security review finding 5): per-tenant quotas
on files, bytes and concurrent uploads, a total for all tenants, no compressed uploads, lines counted
before parsing, and an expiry after which files are swept and their disk given back. In-process (see
test_queue_service); the memory of real uploads is measured in test_queue_uploads."""

from __future__ import annotations

import asyncio
import gzip
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from test_queue_batch import content, create, ended, jsonl, line
from test_queue_service import Queue, next_call, queue, run
from test_queue_tenancy import postgres, store_url  # noqa: F401 (fixtures: SQLite and PostgreSQL)
from waiting import until_async

import kvgate.queue.batch_http
from kvgate.queue.batches import MAX_EXPIRY_S
from kvgate.queue.filestore import FileStore, Limit, OverQuota, Quota
from kvgate.queue.store import JobStore
from kvgate.queue.stores import open_database

MiB = 1024 * 1024


async def upload(
    q: Queue, data: bytes, tenant: str = "anonymous", **fields: str
) -> tuple[int, dict[str, Any]]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    for name, value in fields.items():
        form.add_field(name, value)
    # A stream, not bytes: aiohttp warns (an error here) on large bytes bodies.
    form.add_field("file", io.BytesIO(data), filename="in.jsonl", content_type="application/jsonl")
    response = await q.client.post(
        q.server.make_url("/v1/files"), data=form, headers={"x-kvgate-tenant": tenant}
    )
    return response.status, await response.json()


async def store_rows(q: Queue, sql: str, *params: object) -> list[tuple[Any, ...]]:
    async with q.service.jobs.database.transaction() as tx:
        return await tx.execute(sql, params)


BOUNDARY = "kvgate-test-boundary"
FORM_TYPE = f"multipart/form-data; boundary={BOUNDARY}"
FORM_HEAD = (
    f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=purpose\r\n\r\nbatch\r\n"
    f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=file; filename=in.jsonl\r\n\r\n"
).encode()
FORM_TAIL = f"\r\n--{BOUNDARY}--\r\n".encode()


def assert_refused(status: int, body: dict[str, Any], wanted: int, quota: str) -> None:
    """Refused with `wanted` and an OpenAI-shaped error naming the quota's key."""
    assert status == wanted, (status, body)
    assert f"queue.{quota}" in body["error"]["message"], body
    assert set(body["error"]) >= {"message", "type", "code"}


def test_files_bytes_and_the_total_are_bounded_per_tenant_and_each_refusal_names_its_quota(
    tmp_path: Path,
) -> None:
    quotas = (
        "max_files_per_tenant: 3, max_file_bytes_per_tenant: 3000000, max_file_bytes_total: 5000000, "
        "max_file_bytes: 2500000"
    )

    async def scenario() -> None:
        async with queue(tmp_path, quotas) as q:
            small = jsonl(line("a"))
            for _ in range(3):
                assert (await upload(q, small, "acme"))[0] == 200
            assert_refused(*await upload(q, small, "acme"), 429, "max_files_per_tenant")
            assert (await upload(q, small, "globex"))[0] == 200, "another tenant has its own quota"
            two_mb = b"x" * (2 * MiB)
            assert (await upload(q, two_mb, "globex"))[0] == 200
            assert_refused(*await upload(q, two_mb, "globex"), 413, "max_file_bytes_per_tenant")
            assert_refused(*await upload(q, b"x" * 2_600_000, "initech"), 413, "max_file_bytes")
            assert (await upload(q, two_mb, "initech"))[0] == 200
            assert_refused(*await upload(q, two_mb, "hooli"), 429, "max_file_bytes_total")
            # What a refused upload had written is gone: only the accepted files are left.
            rows = await store_rows(q, "SELECT tenant, status FROM kvgate_files ORDER BY tenant")
            assert [r[0] for r in rows] == ["acme"] * 3 + ["globex"] * 2 + ["initech"]
            assert {r[1] for r in rows} == {"processed"}
            (chunks,) = await store_rows(q, "SELECT count(*) FROM kvgate_file_chunks")
            assert int(chunks[0]) == 3 + 1 + 2 + 2, "one chunk per small file, two per 2 MiB one"

    run(scenario)


def test_concurrent_uploads_are_bounded_per_tenant(tmp_path: Path) -> None:
    headers = {"content-type": FORM_TYPE, "x-kvgate-tenant": "acme"}

    async def scenario() -> None:
        async with queue(tmp_path, "max_uploads_per_tenant: 1") as q:
            resume = asyncio.Event()

            async def slow_body() -> AsyncIterator[bytes]:
                yield FORM_HEAD + b"x" * 1000
                await resume.wait()
                yield FORM_TAIL

            async def uploading() -> bool:
                rows = await store_rows(q, "SELECT id FROM kvgate_files WHERE status = 'uploading'")
                return bool(rows)

            url = q.server.make_url("/v1/files")
            first = asyncio.ensure_future(q.client.post(url, data=slow_body(), headers=headers))
            await until_async(uploading, "the first upload to begin")
            assert_refused(*await upload(q, b"{}", "acme"), 429, "max_uploads_per_tenant")
            assert (await upload(q, b"{}", "globex"))[0] == 200
            resume.set()
            done = await first
            assert done.status == 200 and (await done.json())["bytes"] == 1000
            assert (await upload(q, b"{}", "acme"))[0] == 200, "its slot is free again"

    run(scenario)


def test_a_compressed_upload_is_refused_before_it_is_read(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            body = gzip.compress(FORM_HEAD + jsonl(line("a")) + FORM_TAIL)
            headers = {"content-encoding": "gzip", "content-type": FORM_TYPE}
            response = await q.client.post(q.server.make_url("/v1/files"), data=body, headers=headers)
            assert response.status == 415
            error = (await response.json())["error"]
            assert error["code"] == "unsupported_content_encoding" and "uncompressed" in error["message"]
            assert await store_rows(q, "SELECT id FROM kvgate_files") == []

    run(scenario)


def test_lines_are_counted_and_the_bounds_checked_before_any_line_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[int] = []

    def read_lines(*args: Any, **kwargs: Any) -> Any:
        parsed.append(1)
        raise AssertionError("a line was parsed")

    monkeypatch.setattr(kvgate.queue.batch_http, "read_lines", read_lines)

    async def scenario() -> None:
        async with queue(tmp_path, "max_jobs: 2, max_batch_lines: 3") as q:
            too_many = await create(q, jsonl(*(line(f"r{i}") for i in range(4))))
            failed = await too_many.json()
            assert too_many.status == 200 and failed["status"] == "failed"
            assert failed["errors"]["data"][0]["code"] == "too_many_requests"
            no_room = await create(q, jsonl(*(line(f"r{i}") for i in range(3))))
            assert no_room.status == 429 and no_room.headers["x-kvgate-reason"] == "queue_full"
            assert "queue.max_jobs is 2" in (await no_room.json())["error"]["message"]
            assert parsed == []

    run(scenario)


def test_files_expire_by_default_or_as_asked_and_the_sweep_gives_their_disk_back(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path, "file_ttl_s: 7200") as q:
            status, plain = await upload(q, jsonl(line("a")))
            assert status == 200 and plain["expires_at"] == plain["created_at"] + 7200
            asked = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
            status, hour = await upload(q, jsonl(line("a")), **asked)
            assert status == 200 and hour["expires_at"] == hour["created_at"] + 3600
            longest = {**asked, "expires_after[seconds]": str(MAX_EXPIRY_S)}
            status, capped = await upload(q, jsonl(line("a")), **longest)
            assert status == 200 and capped["expires_at"] == capped["created_at"] + 7200, "queue.file_ttl_s"
            for wrong in (
                {**asked, "expires_after[seconds]": "60"},
                {**asked, "expires_after[anchor]": "now"},
            ):
                status, body = await upload(q, b"{}", **wrong)
                assert status == 400 and "expires_after" in body["error"]["message"]
            status, big = await upload(q, b"x" * (6 * MiB))
            assert status == 200
            (pages_full,) = await store_rows(q, "PRAGMA page_count")
            await store_rows(q, "UPDATE kvgate_files SET expires_at = 1 WHERE id = ?", big["id"])
            gone = await q.client.get(q.server.make_url(f"/v1/files/{big['id']}"))
            assert gone.status == 404, "expired: gone for readers at once"
            await q.service.sweep()
            chunks = await store_rows(
                q, "SELECT count(*) FROM kvgate_file_chunks WHERE file_id = ?", big["id"]
            )
            assert int(chunks[0][0]) == 0
            ((mode,),) = await store_rows(q, "PRAGMA auto_vacuum")
            ((free,),) = await store_rows(q, "PRAGMA freelist_count")
            ((pages,),) = await store_rows(q, "PRAGMA page_count")
            assert (mode, free) == (2, 0), "incremental auto-vacuum, and nothing left free"
            assert pages < pages_full[0] - (5 * MiB) // 4096, "the 6 MiB went back to the disk"
            listed = await (await q.client.get(q.server.make_url("/v1/files"))).json()
            assert {f["id"] for f in listed["data"]} == {plain["id"], hour["id"], capped["id"]}

    run(scenario)


def test_a_finished_batchs_output_files_expire_as_files_do_and_are_swept(tmp_path: Path) -> None:
    """Outputs are kept queue.file_ttl_s after the batch ends (OpenAI's 30 days by default): a client
    may fetch them any time within its 24-hour completion window and after."""

    async def scenario() -> None:
        async with queue(tmp_path, "file_ttl_s: 7200") as q:
            created = await (await create(q, jsonl(line("a")))).json()
            q.engines.answer(await next_call(q, 0))
            done = await ended(q, created["id"])
            output = await q.client.get(q.server.make_url(f"/v1/files/{done['output_file_id']}"))
            described = await output.json()
            assert described["expires_at"] - done["completed_at"] in (7200, 7201, 7202), described
            assert [x["custom_id"] for x in await content(q, done["output_file_id"])] == ["a"]
            await store_rows(q, "UPDATE kvgate_files SET expires_at = 1 WHERE id = ?", done["output_file_id"])

            async def expired() -> bool:
                found = await q.client.get(q.server.make_url(f"/v1/files/{done['output_file_id']}"))
                return found.status == 404

            await until_async(expired, "the output file to expire")
            started = time.monotonic()
            await q.service.sweep()
            assert time.monotonic() - started < 10
            left = await store_rows(q, "SELECT id FROM kvgate_files WHERE id = ?", done["output_file_id"])
            assert left == []
            kept = await q.client.get(q.server.make_url(f"/v1/batches/{created['id']}"))
            assert kept.status == 200, "the batch itself is kept as long as its input may be"

    run(scenario)


def test_the_file_store_keeps_quotas_uploads_and_expiry_on_both_databases(store_url: str) -> None:  # noqa: F811
    quota = Quota(files=2, uploads=1, bytes=10, total_bytes=15)

    async def scenario() -> None:
        database = open_database(store_url)
        jobs, files = JobStore(database), FileStore(database)
        await jobs.start()
        try:
            assert await files.begin("f1", "a", quota) is None
            assert _limit(await files.begin("f2", "a", quota)) is Limit.UPLOADS
            assert await files.append("f1", "a", 0, b"12345", quota) is None
            assert _limit(await files.append("f1", "a", 1, b"123456", quota)) is Limit.BYTES
            assert await files.files("a", None, None, 10) == ([], False), "not listed while uploading"
            stored = await files.finish("f1", "batch", "in.jsonl", 3600)
            assert stored is not None and (stored.tenant, stored.bytes) == ("a", 5)
            assert stored.expires_at == pytest.approx(stored.created_at + 3600)
            assert b"".join([chunk async for chunk in files.chunks("f1")]) == b"12345"
            assert await files.begin("f2", "a", quota) is None
            await files.drop("f2")
            assert await files.begin("g1", "b", quota) is None
            assert await files.append("g1", "b", 0, b"x" * 10, quota) is None
            assert await files.begin("h1", "c", quota) is None
            assert _limit(await files.append("h1", "c", 0, b"y", quota)) is Limit.TOTAL
            assert [f.id for f in (await files.files("a", None, None, 10))[0]] == ["f1"]
            assert await files.file("f1", "b") is None and not await files.delete("f1", "b")
            assert await files.sweep(upload_timeout_s=0) == 2, "the uploads still running: g1, h1"
            assert _limit(await files.append("g1", "b", 1, b"x", quota)) is Limit.TIMEOUT
            async with database.transaction() as tx:
                await tx.execute("UPDATE kvgate_files SET expires_at = 1 WHERE id = 'f1'")
            assert await files.file("f1", "a") is None, "expired: gone for readers at once"
            assert await files.sweep(upload_timeout_s=3600) == 1
            async with database.transaction() as tx:
                assert await tx.execute("SELECT file_id FROM kvgate_file_chunks") == []
        finally:
            await jobs.close()

    run(scenario)


def _limit(over: OverQuota | None) -> Limit | None:
    return None if over is None else over.limit
