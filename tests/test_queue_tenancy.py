"""The queue serves each tenant only its own (issue 27, security review finding 1).

Tenant B (`mallory`) gets 404 for tenant A's (`alice`) input file, batch, output file and job, by id
and in lists, and cannot delete or cancel them; a request with A's x-request-id becomes B's own job
and never returns A's completion. The tenant is Envoy's x-kvgate-tenant; none is `anonymous`.
Stores made before tenancy (schema version 1) are brought up to date on both databases.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
from postgres import PostgresServer, postgres_server
from test_queue_batch import jsonl, line
from test_queue_service import BODY, CHAT, Queue, next_call, queue, run
from waiting import until_async

from kvgate.queue import schema
from kvgate.queue.filestore import FileStore
from kvgate.queue.jobs import JobCharge, JobRequest, NewJob, new_id
from kvgate.queue.store import JobStore, Limits, QueueFull
from kvgate.queue.stores import open_database

ALICE = {"x-kvgate-tenant": "alice"}
MALLORY = {"x-kvgate-tenant": "mallory"}
ROOMY = Limits(max_jobs=1000, max_tokens_waiting=10**9)


async def call(
    q: Queue, method: str, path: str, headers: dict[str, str], **kwargs: Any
) -> aiohttp.ClientResponse:
    return await q.client.request(method, q.server.make_url(path), headers=headers, **kwargs)


async def upload(q: Queue, content: bytes, headers: dict[str, str]) -> dict[str, Any]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename="in.jsonl", content_type="application/jsonl")
    response = await call(q, "POST", "/v1/files", headers, data=form)
    assert response.status == 200, await response.text()
    found: dict[str, Any] = await response.json()
    return found


async def assert_not_found(response: aiohttp.ClientResponse) -> None:
    """404 with the queue's OpenAI-shaped error, naming nothing of the other tenant's object."""
    assert response.status == 404, (response.method, response.url, await response.text())
    error = (await response.json())["error"]
    assert (error["code"], error["type"]) == ("not_found", "not_found_error")


async def alices_things(q: Queue) -> dict[str, str]:
    """Alice's input file, a completed batch with its output file, and an answered job."""
    uploaded = await upload(q, jsonl(line("a1")), ALICE)
    params = {"input_file_id": uploaded["id"], "endpoint": CHAT, "completion_window": "24h"}
    created = await (await call(q, "POST", "/v1/batches", ALICE, json=params)).json()
    q.engines.answer(await next_call(q, 0))
    deferred = {**ALICE, "prefer": "respond-async", "x-request-id": "alice-1"}
    job = await (await call(q, "POST", CHAT, deferred, data=BODY)).json()
    q.engines.answer(await next_call(q, 1))
    await q.job_in(job["id"], "succeeded", tenant="alice")

    async def output_written() -> str | None:
        batch = await (await call(q, "GET", f"/v1/batches/{created['id']}", ALICE)).json()
        return batch["output_file_id"] if batch["status"] == "completed" else None

    output = await until_async(output_written, "alice's batch to complete")
    return {"file": uploaded["id"], "batch": created["id"], "output": output, "job": job["id"]}


def test_another_tenant_gets_404_for_files_batches_outputs_and_jobs_by_id_and_in_lists(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            alice = await alices_things(q)
            for path in (
                f"/v1/files/{alice['file']}",
                f"/v1/files/{alice['file']}/content",
                f"/v1/files/{alice['output']}",
                f"/v1/files/{alice['output']}/content",
                f"/v1/batches/{alice['batch']}",
                f"/v1/kvgate/jobs/{alice['job']}",
                "/v1/kvgate/jobs/alice-1",
            ):
                for headers in (MALLORY, {}):  # a named tenant, and anonymous
                    await assert_not_found(await call(q, "GET", path, headers))
            for method, path in (
                ("DELETE", f"/v1/files/{alice['file']}"),
                ("DELETE", f"/v1/files/{alice['output']}"),
                ("POST", f"/v1/batches/{alice['batch']}/cancel"),
                ("DELETE", f"/v1/kvgate/jobs/{alice['job']}"),
                ("DELETE", "/v1/kvgate/jobs/alice-1"),
            ):
                await assert_not_found(await call(q, method, path, MALLORY))
            params = {"input_file_id": alice["file"], "endpoint": CHAT, "completion_window": "24h"}
            await assert_not_found(await call(q, "POST", "/v1/batches", MALLORY, json=params))
            for path in ("/v1/files", "/v1/batches", f"/v1/files?after={alice['output']}"):
                listed = await (await call(q, "GET", path, MALLORY)).json()
                assert listed["data"] == [] and listed["has_more"] is False, (path, listed)
            # Alice still has all of it: nothing was deleted or cancelled by mallory.
            files = await (await call(q, "GET", "/v1/files", ALICE)).json()
            assert {f["id"] for f in files["data"]} == {alice["file"], alice["output"]}
            batches = await (await call(q, "GET", "/v1/batches", ALICE)).json()
            assert [b["id"] for b in batches["data"]] == [alice["batch"]]
            assert batches["data"][0]["status"] == "completed"
            output = await (await call(q, "GET", f"/v1/files/{alice['output']}/content", ALICE)).read()
            assert json.loads(output)["custom_id"] == "a1"
            job = await q.job("alice-1", "alice")
            assert job["status"] == "succeeded" and job["tenant"] == "alice"

    run(scenario)


def test_another_tenants_request_id_makes_a_job_of_ones_own_and_never_returns_its_answer(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            deferred = {"prefer": "respond-async", "x-request-id": "alice-req-3"}
            alice = await (await call(q, "POST", CHAT, {**ALICE, **deferred}, data=BODY)).json()
            q.engines.answer(await next_call(q, 0))
            await q.job_in(alice["id"], "succeeded", tenant="alice")
            # Deferred: a new job of mallory's, not alice's answered one.
            mallory = await call(q, "POST", CHAT, {**MALLORY, **deferred}, data=BODY)
            assert mallory.status == 202
            job = await mallory.json()
            assert job["id"] != alice["id"] and job["tenant"] == "mallory" and job["response"] is None
            assert (await q.job("alice-req-3", "mallory"))["id"] == job["id"]
            # Held, and anonymous: waits for an engine call of its own, which answers it.
            held = asyncio.ensure_future(call(q, "POST", CHAT, {"x-request-id": "alice-req-3"}, data=BODY))
            running = await next_call(q, 1)
            assert running.job_id == job["id"]
            q.engines.answer(running)
            own = await next_call(q, 2)
            assert own.job_id not in (alice["id"], job["id"])
            q.engines.answer(own)
            answer = await held
            assert answer.status == 200 and await answer.json() == {"job": own.job_id}
            assert (await q.job("alice-req-3", "alice"))["id"] == alice["id"]

    run(scenario)


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'queue.db'}"
    url: str = request.getfixturevalue("postgres").new_database()
    return url


def new_job(tenant: str, request_id: str | None) -> NewJob:
    request = JobRequest(CHAT, (("content-type", "application/json"),), b"{}")
    return NewJob(new_id("job_"), request, 1000, 1, tenant, request_id=request_id)


def test_a_request_id_names_one_job_per_tenant(store_url: str) -> None:
    async def scenario() -> None:
        store = JobStore(open_database(store_url))
        await store.start()
        try:
            first = await store.add(new_job("alice", "req-1"), ROOMY)
            again = await store.add(new_job("alice", "req-1"), ROOMY)
            other = await store.add(new_job("mallory", "req-1"), ROOMY)
            assert not isinstance(first, QueueFull) and not isinstance(again, QueueFull)
            assert not isinstance(other, QueueFull)
            assert again.id == first.id and other.id != first.id and other.tenant == "mallory"
            found = await store.get("req-1", "mallory")
            assert found is not None and found.id == other.id
            assert await store.get(first.id, "mallory") is None
        finally:
            await store.close()

    run(scenario)


# The tables as kvgate wrote them before issue 27 (schema version 1, commit e6ea293), with a few rows.
CREATED = float(int(time.time()) - 3600)


def _v1_statements(serial_key: str, blob: str) -> list[str]:
    return [
        f"""CREATE TABLE kvgate_jobs (seq {serial_key}, id TEXT NOT NULL UNIQUE, request_id TEXT UNIQUE,
            state TEXT NOT NULL, priority INTEGER NOT NULL, tenant TEXT NOT NULL, tokens BIGINT NOT NULL,
            model TEXT, stream INTEGER NOT NULL, path TEXT NOT NULL, headers TEXT NOT NULL,
            body {blob} NOT NULL, created_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION,
            started_at DOUBLE PRECISION, finished_at DOUBLE PRECISION, attempts INTEGER NOT NULL DEFAULT 0,
            owner TEXT, lease_until DOUBLE PRECISION, node TEXT, reservation TEXT, batch_id TEXT,
            custom_id TEXT, line INTEGER, result_status INTEGER, result_type TEXT, result_body {blob},
            error_code TEXT, error_message TEXT)""",
        "CREATE INDEX kvgate_jobs_waiting ON kvgate_jobs "
        "(state, priority, tenant, seq, tokens, attempts, id)",
        "CREATE INDEX kvgate_jobs_batch ON kvgate_jobs (batch_id, line)",
        "CREATE INDEX kvgate_jobs_finished ON kvgate_jobs (finished_at)",
        f"""CREATE TABLE kvgate_files (id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
            bytes BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL, content {blob} NOT NULL)""",
        """CREATE TABLE kvgate_batches (id TEXT PRIMARY KEY, status TEXT NOT NULL, endpoint TEXT NOT NULL,
            input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, tenant TEXT NOT NULL, metadata TEXT,
            errors TEXT, total INTEGER NOT NULL, completed INTEGER, failed INTEGER, output_file_id TEXT,
            error_file_id TEXT, created_at DOUBLE PRECISION NOT NULL, in_progress_at DOUBLE PRECISION,
            expires_at DOUBLE PRECISION, finalizing_at DOUBLE PRECISION, completed_at DOUBLE PRECISION,
            failed_at DOUBLE PRECISION, expired_at DOUBLE PRECISION, cancelling_at DOUBLE PRECISION,
            cancelled_at DOUBLE PRECISION)""",
        "INSERT INTO kvgate_jobs (id, request_id, state, priority, tenant, tokens, stream, path, headers, "
        "body, created_at) VALUES ('job_old', 'req-old', 'queued', 1, 'alice', 1000, 0, "
        f"'/v1/chat/completions', '[]', '', {CREATED})",
        f"INSERT INTO kvgate_files VALUES ('file-in', 'batch', 'in.jsonl', 3, {CREATED}, 'abc')",
        f"INSERT INTO kvgate_files VALUES ('file-orphan', 'batch', 'x.jsonl', 3, {CREATED}, 'xyz')",
        "INSERT INTO kvgate_batches (id, status, endpoint, input_file_id, completion_window, tenant, total, "
        "created_at) VALUES ('batch_old', 'completed', '/v1/chat/completions', 'file-in', '24h', 'alice', 0, "
        f"{CREATED})",
    ]


def _make_v1(store_url: str) -> None:
    if store_url.startswith("sqlite:///"):
        with sqlite3.connect(store_url.removeprefix("sqlite:///")) as connection:
            for statement in _v1_statements("INTEGER PRIMARY KEY AUTOINCREMENT", "BLOB"):
                connection.execute(statement.replace("'abc'", "X'616263'").replace("'xyz'", "X'78797a'"))
        return
    with psycopg.connect(store_url, autocommit=True) as connection:
        for statement in _v1_statements("BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY", "BYTEA"):
            connection.execute(statement)  # type: ignore[arg-type]


def test_a_store_made_before_tenancy_is_brought_up_to_date(store_url: str) -> None:
    """Files take the tenant of the batch naming them (else none: never served, swept at expiry), their
    content moves to chunks, and request ids become unique per tenant; jobs keep their age order."""
    _make_v1(store_url)

    async def scenario() -> None:
        database = open_database(store_url)
        store, files = JobStore(database), FileStore(database)
        await store.start()
        try:
            inherited = await files.file("file-in", "alice")
            assert inherited is not None and inherited.bytes == 3
            assert inherited.expires_at == pytest.approx(CREATED + schema.LEGACY_FILE_TTL_S)
            assert b"".join([chunk async for chunk in files.chunks("file-in")]) == b"abc"
            for tenant in ("alice", "anonymous"):
                assert await files.file("file-orphan", tenant) is None, "an owner no request can be"
            old = await store.get("req-old", "alice")
            assert old is not None and old.id == "job_old"
            other = await store.add(new_job("mallory", "req-old"), ROOMY)
            assert not isinstance(other, QueueFull) and other.id != "job_old"
            charged = await store.add(
                dataclasses.replace(
                    new_job("alice", None), charge=JobCharge(700, 300), tenant_class="partners"
                ),
                ROOMY,
            )
            assert not isinstance(charged, QueueFull)
            heads = sorted(await store.waiting(8), key=lambda w: w.seq)
            assert [w.id for w in heads] == ["job_old", other.id, charged.id], "new jobs are younger"
            assert [w.charge for w in heads] == [None, None, JobCharge(700, 300)], "old rows keep no charge"
            assert [w.tenant_class for w in heads] == [None, None, "partners"], "nor a tenant class"
        finally:
            await store.close()
        again = JobStore(open_database(store_url))  # a second start finds version 4: nothing to do
        await again.start()
        await again.close()

    run(scenario)
