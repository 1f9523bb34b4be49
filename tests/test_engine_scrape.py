"""EngineScraper's HTTP/1.1 GET against real servers (aiohttp, prometheus_client) and scripted answers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web
from fixtures.engines import rules
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from test_sim_server import serving

from kvgate.agent.sources.engines import read_engine_page
from kvgate.agent.sources.engines.model_card import read_max_model_len
from kvgate.agent.sources.fake_engine import FakeEngineMetrics
from kvgate.agent.sources.scrape import EngineScraper, metrics_url, parse_response
from kvgate.errors import ConfigError, HeadroomError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
PAGE = FakeEngineMetrics(kv_usage=0.25).render()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())  # type: ignore[arg-type]


class Seen:
    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []


@asynccontextmanager
async def scripted(answer: bytes | Handler, keep_open: bool = True) -> AsyncIterator[tuple[str, Seen]]:
    """A server that sends `answer` to every request (hanging up after the first unless `keep_open`),
    or runs `answer` on every connection; yields its URL and what it saw."""
    seen = Seen()
    handlers: list[tuple[asyncio.Task[None], asyncio.StreamWriter]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.connections += 1
        task = asyncio.current_task()
        assert task is not None
        handlers.append((task, writer))
        try:
            if callable(answer):
                await answer(reader, writer)
                return
            while request := await reader.readuntil(b"\r\n\r\n"):
                seen.requests.append(request)
                writer.write(answer)
                await writer.drain()
                if not keep_open:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/metrics", seen
    finally:
        server.close()
        # Hang up on every client, and let the handlers see it and end before the loop does.
        for _, writer in handlers:
            writer.close()
        await asyncio.gather(*(task for task, _ in handlers))


def test_reads_the_fake_engine() -> None:
    async def scenario() -> None:
        engine = FakeEngineMetrics(kv_usage=0.5)
        scraper = EngineScraper(await engine.start(), 0.5)
        try:
            stats = [await scraper.sample() for _ in range(3)]
            assert [s.used_tokens for s in stats] == [20_000] * 3 and engine.scrapes == 3
        finally:
            await scraper.close()
            await engine.stop()

    run(scenario)


def test_one_kept_alive_connection_and_a_plain_get_without_compression() -> None:
    async def scenario() -> None:
        answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(PAGE), PAGE.encode())
        async with scripted(answer) as (url, seen):
            scraper = EngineScraper(url + "?x=1", 0.5)
            assert [await scraper.scrape() for _ in range(3)] == [PAGE] * 3
            await scraper.close()
        assert (seen.connections, len(seen.requests)) == (1, 3)
        request = seen.requests[0].decode()
        assert request.startswith("GET /metrics?x=1 HTTP/1.1\r\n")
        assert f"Host: {url.split('/')[2]}\r\n" in request
        assert "accept-encoding" not in request.lower()

    run(scenario)


def test_reads_chunked_bodies() -> None:
    async def scenario() -> None:
        async def metrics(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for line in PAGE.splitlines(keepends=True):
                await response.write(line.encode())
            await response.write_eof()
            return response

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        scraper = EngineScraper(f"http://127.0.0.1:{runner.addresses[0][1]}/metrics", 0.5)
        try:
            assert await scraper.scrape() == PAGE
            assert await scraper.scrape() == PAGE  # the connection is still in step
        finally:
            await scraper.close()
            await runner.cleanup()

    run(scenario)


def test_reads_prometheus_clients_own_http_server() -> None:
    registry = CollectorRegistry()
    Gauge("sglang:num_used_tokens", "used", registry=registry).set(51_200)
    Gauge("sglang:max_total_num_tokens", "max", registry=registry).set(204_800)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)

    async def scenario() -> None:
        scraper = EngineScraper(f"http://127.0.0.1:{port}/metrics", 1.0)
        try:
            for _ in range(2):
                stats = await scraper.sample()
                assert (stats.kind, stats.used_tokens, stats.capacity_tokens) == ("sglang", 51_200, 204_800)
        finally:
            await scraper.close()

    try:
        run(scenario)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_a_connection_closed_by_the_engine_is_replaced() -> None:
    async def scenario() -> None:
        body = PAGE.encode()
        closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        async with scripted(closing) as (url, seen):
            scraper = EngineScraper(url, 0.5)
            assert [await scraper.scrape() for _ in range(2)] == [PAGE, PAGE]
            await scraper.close()
        assert (seen.connections, len(seen.requests)) == (2, 2)

        async def one_then_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

        async with scripted(one_then_hang_up) as (url, seen):
            scraper = EngineScraper(url, 0.5)
            assert await scraper.scrape() == PAGE
            await asyncio.sleep(0.05)  # the server's close reaches the idle connection
            assert await scraper.scrape() == PAGE
            await scraper.close()
        assert seen.connections == 2

    run(scenario)


@pytest.mark.parametrize(
    ("wire", "body", "reusable"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello", True),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3;ext=1\r\nhel\r\n2\r\nlo\r\n0\r\nX-Trailer: t\r\n\r\n",
            b"hello",
            True,
        ),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 5\r\n\r\nhello", b"hello", False),
        (b"HTTP/1.0 200 OK\r\n\r\nhello", b"hello", False),  # delimited by the close
    ],
)
def test_a_response_is_complete_only_once_all_of_it_is_in(wire: bytes, body: bytes, reusable: bool) -> None:
    close_delimited = b"Content-Length" not in wire and b"chunked" not in wire
    for cut in range(len(wire)):
        assert parse_response(wire[:cut], eof=False) is None, cut
    response = parse_response(wire, eof=close_delimited)
    assert response is not None
    assert (response.status, response.body, response.reusable) == (200, body, reusable)


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"HTTP/1.1 500 Oops\r\nContent-Length: 4\r\n\r\noops", "HTTP 500"),
        (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "not an HTTP/1.x response"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\nxx", "Content-Encoding"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "closed the connection mid-response"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
    ],
)
def test_bad_answers_are_errors_naming_the_url(answer: bytes, message: str) -> None:
    async def scenario() -> None:
        async with scripted(answer, keep_open=False) as (url, _):
            scraper = EngineScraper(url, 0.5)
            with pytest.raises(HeadroomError, match=message) as caught:
                await scraper.scrape()
            assert url in str(caught.value)
            await scraper.close()

    run(scenario)


def test_a_redirect_names_its_target() -> None:
    async def scenario() -> None:
        answer = b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /metrics/\r\nContent-Length: 0\r\n\r\n"
        async with scripted(answer) as (url, _):
            scraper = EngineScraper(url, 0.5)
            with pytest.raises(HeadroomError, match="redirects to /metrics/"):
                await scraper.scrape()
            await scraper.close()

    run(scenario)


def test_silence_and_refusal_are_errors() -> None:
    async def scenario() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()

        async with scripted(silent) as (url, _):
            with pytest.raises(HeadroomError, match=r"no answer within 0\.05s"):
                await EngineScraper(url, 0.05).scrape()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            closed_port = s.getsockname()[1]
        with pytest.raises(HeadroomError, match=f"127.0.0.1:{closed_port}/metrics"):
            await EngineScraper(f"http://127.0.0.1:{closed_port}/metrics", 0.5).scrape()

    run(scenario)


@pytest.mark.parametrize(
    "url", ["https://127.0.0.1:8000/metrics", "127.0.0.1:8000/metrics", "http:///metrics", "http://h:99999/"]
)
def test_only_http_urls_are_accepted(url: str) -> None:
    with pytest.raises(ConfigError, match="--engine-metrics"):
        metrics_url(url, "--engine-metrics")


def test_url_parts() -> None:
    assert metrics_url("http://user:pw@[::1]:8000/m?a=b", "f") == ("::1", 8000, "[::1]:8000", "/m?a=b")
    assert metrics_url("http://engine", "f") == ("engine", 80, "engine", "/")


def test_scrapes_live_engine_pages_as_they_were_served() -> None:
    async def scenario() -> None:
        for name in (f"{rules.VLLM_VERSION}-load.txt", f"{rules.LLAMA_VERSION}-load.txt"):
            body = (rules.LIVE / name).read_bytes()
            answer = (
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: %d\r\n\r\n%s"
                % (
                    len(body),
                    body,
                )
            )
            async with scripted(answer) as (url, _):
                scraper = EngineScraper(url, 1.0)
                try:
                    assert await scraper.sample() == read_engine_page(body.decode())
                finally:
                    await scraper.close()

    run(scenario)


def _answer(status: str, body: bytes) -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status.encode(), len(body), body)


def test_the_engines_max_model_len_comes_from_its_v1_models_and_is_asked_again_after_a_failure() -> None:
    vllm_models = (
        b'{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm","root":"m",'
        b'"max_model_len":4096},{"id":"lora","object":"model","owned_by":"vllm","max_model_len":4096}]}'
    )
    answers = {"/metrics": _answer("200 OK", PAGE.encode()), "/v1/models": _answer("200 OK", vllm_models)}

    async def scenario() -> None:
        async def by_path(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while request := await reader.readuntil(b"\r\n\r\n"):
                path = request.split(b" ")[1].decode()
                asked.append(path)
                writer.write(answers[path])
                await writer.drain()

        asked: list[str] = []
        async with scripted(by_path) as (url, _):
            scraper = EngineScraper(url, 0.5)
            try:
                readings = [await scraper.sample() for _ in range(3)]
                assert [r.max_model_len for r in readings] == [4096] * 3
                assert asked == ["/metrics", "/v1/models", "/metrics", "/metrics"], (
                    "asked once, not per scrape"
                )
                answers["/metrics"] = _answer("503 Service Unavailable", b"")
                with pytest.raises(HeadroomError):
                    await scraper.sample()
                answers["/metrics"] = _answer("200 OK", PAGE.encode())
                answers["/v1/models"] = _answer("404 Not Found", b"")
                asked.clear()
                restarted = await scraper.sample()
                assert asked == ["/metrics", "/v1/models"], "an engine that went away is asked again"
                assert restarted.max_model_len is None, "a page without it says nothing"
            finally:
                await scraper.close()

    run(scenario)


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", b'{"data": {}}', b'{"data": [{"id": "m"}]}', b'{"data": [{"max_model_len": true}]}'],
)
def test_a_models_page_without_a_max_model_len_says_nothing(body: bytes) -> None:
    assert read_max_model_len(body) is None


def test_the_simulator_names_its_max_model_len_as_vllm_does() -> None:
    async def scenario() -> None:
        async with serving(kv_capacity_tokens=8192, max_model_len=2048) as base:
            scraper = EngineScraper(f"{base}/metrics", 1.0)
            try:
                assert (await scraper.sample()).max_model_len == 2048
            finally:
                await scraper.close()

    run(scenario)
