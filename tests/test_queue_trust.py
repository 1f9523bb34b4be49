"""What the queue takes from the headers of a request that reached it (issue 27, security review
findings 7 and 8): the gate's `x-kvgate-tokens` can only add to the queue's own estimate, so a caller
that reaches the queue directly cannot shrink its reservation; the priority and tenant the gate
forwards (`x-kvgate-priority`, `x-kvgate-tenant`, Envoy's after authentication) are stored with the
job, and a batch's lines inherit them."""

from __future__ import annotations

import json
from pathlib import Path

from test_queue_batch import create, jsonl, line
from test_queue_service import CHAT, next_call, queue, run
from waiting import until_async

# About 3,000 prompt tokens, plus the default output budget: far more than one token.
LONG = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 3000}]}).encode()


def test_a_direct_callers_tokens_header_does_not_shrink_the_reservation(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            url = q.server.make_url(CHAT)
            own = await (await q.client.post(url, data=LONG, headers={"prefer": "respond-async"})).json()
            assert own["estimated_tokens"] > 3000
            forged = await q.client.post(
                url, data=LONG, headers={"prefer": "respond-async", "x-kvgate-tokens": "1"}
            )
            job = await forged.json()
            assert forged.status == 202 and job["estimated_tokens"] == own["estimated_tokens"]
            q.engines.answer(await next_call(q, 0))
            running = await next_call(q, 1)
            assert running.job_id == job["id"]
            reserved = q.source.reserved_tokens("node-a")
            assert reserved == own["estimated_tokens"], "the job runs on a reservation of its real size"
            q.engines.answer(running)
            # The gate's estimate may be the larger one (its route's policy): that one is kept.
            gate = {"prefer": "respond-async", "x-kvgate-tokens": "9000"}
            larger = await (await q.client.post(url, data=LONG, headers=gate)).json()
            assert larger["estimated_tokens"] == 9000

    run(scenario)


def test_the_forwarded_priority_and_tenant_are_stored_and_batch_lines_inherit_them(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with queue(tmp_path) as q:
            q.source.update("node-a", used_tokens=9_500)  # nothing runs: the jobs stay as stored
            headers = {"x-kvgate-priority": "high", "x-kvgate-tenant": "acme"}
            job = await q.defer(8000, **{k.replace("-", "_"): v for k, v in headers.items()})
            found = await q.job(job, "acme")
            assert (found["priority"], found["tenant"]) == ("high", "acme")
            assert (await q.job(await q.defer(8000)))["priority"] == "normal", "none forwarded: the default"
            created = await (await create(q, jsonl(line("a")), **headers)).json()
            assert created["status"] == "in_progress"

            async def lines() -> list[tuple[int, str]] | None:
                async with q.service.jobs.database.transaction() as tx:
                    rows = await tx.execute(
                        "SELECT priority, tenant FROM kvgate_jobs WHERE batch_id = ?", (created["id"],)
                    )
                return [(int(r[0]), str(r[1])) for r in rows] or None

            assert await until_async(lines, "the batch's lines") == [(0, "acme")]

    run(scenario)
