"""`kvgate queue`'s error boundary, and a fuzz of every header, query parameter and path id it reads,
through its real aiohttp app (QueueService over SQLite with FakeHeadroom, as test_queue_service builds
it, and engines that answer at once), sent as raw HTTP bytes so that latin-1 bytes reach it the way a
client sends them. Every request gets a defined status (200, 202, 400, 404, 405, 409, 413, 415, 429);
never a 500, never the internal_error row (a queue bug hiding behind a 503). What the queue did not
expect is that row: 503 with Retry-After, logged once with the request id, counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_queue_service import BODY as CHAT_BODY
from test_queue_service import CHAT as CHAT_PATH
from test_queue_service import _Answer, queue, run

from kvgate.agent.in_process import FakeHeadroom
from kvgate.config import parse_config
from kvgate.queue.batchstore import BatchStore
from kvgate.queue.jobs import JobRequest
from kvgate.queue.live import Head
from kvgate.queue.metrics import QueueMetrics
from kvgate.queue.service import QueueService

DEFINED = {200, 202, 400, 404, 405, 409, 413, 415, 429}

NUMBERISH = [
    "²",
    "٣",
    "\uff11",  # full-width one
    "1.5",
    "-1",
    "+3",
    "1e3",
    "0",
    "007",
    "20",
    "10000",
    "10001",
    "9" * 5000,
    "99999999999999999999999",
    "",
    " ",
    "\t7 ",
]
# What a header can carry: no CR, LF or NUL (HTTP framing); any other byte, latin-1 ones included.
header_text = st.one_of(
    st.sampled_from(NUMBERISH),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n\x00"), max_size=30),
    st.binary(max_size=30).map(lambda raw: raw.replace(b"\r", b"").replace(b"\n", b"").replace(b"\0", b"")),
)
# A query value or a path segment: any text or bytes, percent-encoded (invalid UTF-8 included).
url_text = st.one_of(
    st.sampled_from(NUMBERISH),
    st.text(max_size=30),
    st.binary(max_size=30),
).map(
    lambda value: quote(value.encode("utf-8", "surrogatepass") if isinstance(value, str) else value, safe="")
)

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()
ANTHROPIC = json.dumps(
    {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "x"}]}
).encode()


class InstantEngines:
    """Engines that answer every call at once, so held requests are answered without waiting."""

    @asynccontextmanager
    async def send(
        self, endpoint: str, request: JobRequest, headers: Mapping[str, str]
    ) -> AsyncIterator[_Answer]:
        yield _Answer(Head(200, "application/json"), b'{"ok": true}')


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The queue's app on its own event loop in a thread, for the blocking raw-socket client below."""
    store = tmp_path_factory.mktemp("fuzz-queue") / "queue.db"
    loop = asyncio.new_event_loop()
    ready: concurrent.futures.Future[int] = concurrent.futures.Future()
    stop = asyncio.Event()

    async def serve() -> None:
        try:
            config = parse_config("headroom: {agents: ['fake:1']}\n")
            source = FakeHeadroom(time.monotonic, stale_after_s=3600)
            source.add_node("node-a", 100_000)
            service = QueueService(
                config, f"sqlite:///{store}", "replica-1", source=source, engines=InstantEngines()
            )
            await service.start()
            server = TestServer(service.app())
            await server.start_server()
        except BaseException as error:
            ready.set_exception(error)
            raise
        ready.set_result(server.port)
        try:
            await stop.wait()
        finally:
            await server.close()
            await service.stop()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),))
    thread.start()
    try:
        yield ready.result(timeout=30)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def send(port: int, method: str, target: str, headers: list[tuple[str, bytes]], body: bytes = b"") -> Answer:
    """One raw HTTP/1.1 request; `target` and header values go out byte for byte."""
    lines = [f"{method} {target} HTTP/1.1".encode("latin-1"), b"host: queue", b"connection: close"]
    lines += [name.encode() + b": " + value for name, value in headers]
    lines.append(b"content-length: %d" % len(body))
    with socket.create_connection(("127.0.0.1", port), timeout=20) as connection:
        connection.sendall(b"\r\n".join(lines) + b"\r\n\r\n" + body)
        received = b""
        while chunk := connection.recv(65536):
            received += chunk
    head, _, rest = received.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    found = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        found[name.strip().lower()] = value.strip()
    return Answer(int(status_line.split(" ")[1]), found, rest)


def assert_defined(answer: Answer) -> None:
    assert answer.status in DEFINED, (answer.status, answer.body[:300])
    assert answer.headers.get("x-kvgate-reason") != "internal_error", answer.body[:300]
    if answer.headers.get("content-type", "").startswith("application/json"):
        json.loads(answer.body)


def _raw(value: str | bytes) -> bytes:
    if isinstance(value, bytes):
        return value
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


prefer = st.one_of(
    header_text,
    header_text.map(lambda value: f"wait={value!s}" if isinstance(value, str) else b"wait=" + value),
    st.sampled_from(["respond-async", "respond-async, wait=²", "wait=²"]),
)
# Every header the queue reads of an inference request, each present or not.
SUBMIT_HEADERS = {
    "prefer": prefer,
    "x-kvgate-priority": st.one_of(st.sampled_from(["high", "low"]), header_text),
    "x-kvgate-tenant": header_text,
    "x-kvgate-tokens": st.one_of(st.sampled_from(["1200", "0", "1000000000"]), header_text),
    "x-request-id": header_text,
    "content-type": st.one_of(st.just("application/json"), header_text),
    "content-encoding": st.one_of(st.sampled_from(["gzip", "identity"]), header_text),
    "traceparent": header_text,
    "tracestate": header_text,
    "accept": header_text,
}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["/v1/chat/completions", "/v1/messages", "/v1/completions", "/v1/nope"]),
    st.fixed_dictionaries({}, optional=SUBMIT_HEADERS),
    st.sampled_from([CHAT, ANTHROPIC, b"{broken", b""]),
)
def test_every_header_of_an_inference_request_gets_a_defined_status(
    port: int, path: str, headers: dict[str, str | bytes], body: bytes
) -> None:
    sent = [(name, _raw(value)) for name, value in headers.items()]
    assert_defined(send(port, "POST", path, sent, body))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(
        [
            ("GET", "/v1/kvgate/jobs/{}"),
            ("DELETE", "/v1/kvgate/jobs/{}"),
            ("GET", "/v1/batches?limit={}"),
            ("GET", "/v1/batches?after={}"),
            ("GET", "/v1/batches?limit={}&after={}"),
            ("GET", "/v1/files?purpose={}&limit={}"),
            ("GET", "/v1/files?after={}"),
            ("GET", "/v1/batches/{}"),
            ("POST", "/v1/batches/{}/cancel"),
            ("GET", "/v1/files/{}"),
            ("GET", "/v1/files/{}/content"),
            ("DELETE", "/v1/files/{}"),
        ]
    ),
    url_text,
)
def test_every_query_parameter_and_id_gets_a_defined_status(
    port: int, request_line: tuple[str, str], value: str
) -> None:
    method, target = request_line
    assert_defined(send(port, method, target.format(value, value), []))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "input_file_id": st.one_of(st.text(max_size=20), st.integers(), st.none()),
            "endpoint": st.one_of(st.just("/v1/chat/completions"), st.text(max_size=20)),
            "completion_window": st.one_of(st.just("24h"), st.text(max_size=5), st.integers()),
            "metadata": st.one_of(
                st.dictionaries(st.text(max_size=5), st.text(max_size=5)), st.text(max_size=5)
            ),
        },
    ),
    st.fixed_dictionaries({}, optional={"x-kvgate-tenant": header_text, "x-kvgate-priority": header_text}),
)
def test_every_batch_parameter_and_header_gets_a_defined_status(
    port: int, params: dict[str, object], headers: dict[str, str | bytes]
) -> None:
    sent = [("content-type", b"application/json"), *((n, _raw(v)) for n, v in headers.items())]
    assert_defined(send(port, "POST", "/v1/batches", sent, json.dumps(params).encode()))


def test_the_issue_20_inputs_are_answered_not_500(port: int) -> None:
    """`Prefer: wait=²` as UTF-8 was a 500 (held or deferred), and so was `?limit=²` on the Batch list."""
    held = send(port, "POST", "/v1/chat/completions", [("prefer", "wait=²".encode())], CHAT)
    assert held.status == 200 and held.body == b'{"ok": true}', "held, and answered with the engine's answer"
    deferred = send(
        port, "POST", "/v1/chat/completions", [("prefer", "respond-async, wait=²".encode())], CHAT
    )
    assert deferred.status == 202
    listed = send(port, "GET", "/v1/batches?limit=%C2%B2", [])
    assert listed.status == 400
    error = json.loads(listed.body)["error"]
    assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error"
    assert "limit: '²' is not a whole number from 1 to 10000" in error["message"]
    tenant = send(port, "POST", "/v1/chat/completions", [("x-kvgate-tenant", b"\xb2\xff")], CHAT)
    assert (
        tenant.status == 400
        and "x-kvgate-tenant header is not UTF-8 text" in json.loads(tenant.body)["error"]["message"]
    )


def test_list_parameters_that_do_not_read_are_refused_with_400(tmp_path: Path) -> None:
    """`limit` is a whole number from 1 to 10000 in ASCII digits (issue 20: `?limit=²` was a 500)."""

    async def scenario() -> None:
        async with queue(tmp_path) as q:
            for path in ("/v1/batches", "/v1/files"):
                assert (await q.client.get(q.server.make_url(path))).status == 200, "20 when absent"
                assert (await q.client.get(q.server.make_url(f"{path}?limit=10000"))).status == 200
                for limit in ("²", "٣", "0", "10001", "-1", "1.5", "", "9" * 5000):
                    answer = await q.client.get(q.server.make_url(path).with_query(limit=limit))
                    assert answer.status == 400, (path, limit)
                    error = (await answer.json())["error"]
                    assert error["code"] == "invalid_request" and error["message"].startswith("limit: ")

    run(scenario)


def test_an_exception_the_queue_did_not_expect_is_a_503_with_retry_after_logged_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    counted: list[str] = []

    async def planted(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("planted")

    monkeypatch.setattr(BatchStore, "batches", planted)
    monkeypatch.setattr(QueueMetrics, "internal_error", lambda _self, route: counted.append(route))

    async def scenario() -> None:
        async with queue(tmp_path) as q:
            answer = await q.client.get(q.server.make_url("/v1/batches"), headers={"x-request-id": "req-9"})
            assert answer.status == 503
            assert answer.headers["x-kvgate-reason"] == "internal_error"
            assert answer.headers["retry-after"] == "1"
            error = (await answer.json())["error"]
            assert (error["code"], error["type"]) == ("internal_error", "server_error")

    run(scenario)
    assert counted == ["/v1/batches"]
    failures = [r for r in caplog.records if "internal_error" in r.getMessage()]
    assert len(failures) == 1 and "req-9" in failures[0].getMessage()


def test_a_gzip_request_is_inflated_once(tmp_path: Path) -> None:
    """aiohttp's server inflates gzip before the handler reads it: the intake must not inflate it again
    (a valid gzip request was refused 400), and a body that is not what its encoding says is a 400."""

    async def scenario() -> None:
        async with queue(tmp_path) as q:
            headers = {"content-encoding": "gzip", "prefer": "respond-async"}
            answer = await q.client.post(
                q.server.make_url(CHAT_PATH), data=gzip.compress(CHAT_BODY), headers=headers
            )
            assert answer.status == 202, await answer.text()
            broken = await q.client.post(q.server.make_url(CHAT_PATH), data=CHAT_BODY, headers=headers)
            assert broken.status == 400
            assert (await broken.json())["error"]["code"] == "invalid_request"

    run(scenario)
