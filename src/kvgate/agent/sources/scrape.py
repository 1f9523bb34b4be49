"""Fetch the local engine's /metrics page: the I/O half of `kvgate.agent.sources.engines`.

A plain HTTP/1.1 GET over one kept-alive connection, on an asyncio Protocol rather than aiohttp's
client: this runs every 100 ms, and at that cadence a scrape cost about 0.9 ms of CPU through
aiohttp against 0.35 ms here, a quarter of the agent's 2% CPU budget. It reads what a node-local
Prometheus endpoint sends: http:// only, Content-Length, chunked or close-delimited bodies. It asks
for no compression (aiohttp asked for gzip, which the agent then had to inflate) and follows no
redirects (one is an error naming its target, to put in --engine-metrics).
The engine's longest request is not on that page: the scraper asks the same server's /v1/models for
it (kvgate.agent.sources.engines.model_card) until it answers, and again after a failed scrape, since
an engine that went away may come back with another --max-model-len.
A total timeout well under the sampling period bounds each scrape, so a slow engine costs one stale
sample, not a late stream. Any failure drops the connection; the next scrape opens a new one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
from typing import NamedTuple, cast
from urllib.parse import urlsplit

from kvgate.agent.sources.engines import EngineReading, read_engine_page
from kvgate.agent.sources.engines.model_card import read_max_model_len
from kvgate.digits import INT64_MAX, whole_number
from kvgate.errors import ConfigError, HeadroomError

_HEX = re.compile(rb"[0-9A-Fa-f]+")
_MAX_HEAD = 64 * 1024
MODELS_PATH = "/v1/models"
# While the engine has not named its max_model_len (still loading, or a page without it), it is asked
# again this often: one small GET, not one per scrape.
MODELS_RETRY_S = 10.0


class MetricsUrl(NamedTuple):
    host: str
    port: int
    authority: str  # the Host header: host[:port], without any userinfo
    target: str  # path and query


def metrics_url(url: str, flag: str) -> MetricsUrl:
    """The parts of an http:// URL; ConfigError naming `flag` for anything else."""
    parts = urlsplit(url)
    try:
        port = parts.port or 80
    except ValueError as exc:
        raise ConfigError(f"{flag} {url!r}: {exc}") from exc
    if parts.scheme != "http" or not parts.hostname:
        raise ConfigError(f"{flag} must be an http://HOST[:PORT]/PATH URL, got {url!r}")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return MetricsUrl(parts.hostname, port, parts.netloc.rpartition("@")[2], target)


class EngineScraper:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self._timeout_s = timeout_s
        self._where = metrics_url(url, "engine metrics URL")
        self._request = _get_request(self._where.target, self._where.authority, "text/plain")
        self._models_request = _get_request(MODELS_PATH, self._where.authority, "application/json")
        self._idle: _Connection | None = None
        self._max_model_len: int | None = None
        self._models_asked_at = -math.inf

    async def scrape(self) -> str:
        try:
            response = await self._get(self._request)
        except TimeoutError as exc:
            raise HeadroomError(f"engine metrics {self.url}: no answer within {self._timeout_s}s") from exc
        except (OSError, _BadResponse) as exc:
            raise HeadroomError(f"engine metrics {self.url}: {str(exc) or type(exc).__name__}") from exc
        if response.status != 200:
            location = response.headers.get("location")
            moved = f" (redirects to {location})" if location else ""
            raise HeadroomError(f"engine metrics {self.url}: HTTP {response.status}{moved}")
        # Prometheus text is UTF-8 by spec.
        return response.body.decode("utf-8", errors="replace")

    async def sample(self) -> EngineReading:
        try:
            reading = read_engine_page(await self.scrape())
        except HeadroomError:
            self._max_model_len, self._models_asked_at = None, -math.inf
            raise
        now = asyncio.get_running_loop().time()
        if self._max_model_len is None and now - self._models_asked_at >= MODELS_RETRY_S:
            self._models_asked_at = now
            self._max_model_len = await self._ask_max_model_len()
        if self._max_model_len is None:
            return reading
        return dataclasses.replace(reading, max_model_len=self._max_model_len)

    async def _ask_max_model_len(self) -> int | None:
        """The engine's /v1/models figure; None when it does not answer with one (never an error: the
        node is then only not limited by it)."""
        try:
            response = await self._get(self._models_request)
        except (TimeoutError, OSError, _BadResponse):
            return None
        return read_max_model_len(response.body) if response.status == 200 else None

    async def close(self) -> None:
        if self._idle is not None:
            self._idle.close()
            self._idle = None

    async def _get(self, request: bytes) -> Response:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        connection, self._idle = self._idle, None
        if connection is None or not connection.open:
            async with asyncio.timeout_at(deadline):
                _, connection = await loop.create_connection(_Connection, self._where.host, self._where.port)
        answer = connection.get(request)
        # A bare timer that fails the answer, not asyncio.timeout (a timer, then cancelling this task):
        # on a kept-alive connection this is most of a scrape's bookkeeping, and it costs half as much.
        expiry = loop.call_at(deadline, _time_out, answer)
        try:
            response = await answer
        except BaseException:
            # Timed out, failed or cancelled halfway: what is left on the wire is unusable.
            connection.close()
            raise
        finally:
            expiry.cancel()
        if response.reusable:
            self._idle = connection
        else:
            connection.close()
        return response


def _get_request(target: str, authority: str, accept: str) -> bytes:
    return (
        f"GET {target} HTTP/1.1\r\nHost: {authority}\r\nAccept: {accept}\r\nUser-Agent: kvgate-agent\r\n\r\n"
    ).encode()


def _time_out(answer: asyncio.Future[Response]) -> None:
    if not answer.done():
        answer.set_exception(TimeoutError())


class _BadResponse(Exception):
    """The engine answered something that is not an HTTP/1.x response this client can read."""


class Response(NamedTuple):
    """An HTTP response as parse_response reads it."""

    status: int
    headers: dict[str, str]  # names lowercased
    body: bytes
    reusable: bool  # the connection can carry another request


class _Connection(asyncio.Protocol):
    """One connection to the engine, carrying one request at a time."""

    def __init__(self) -> None:
        self.open = True
        self._transport: asyncio.Transport | None = None
        self._received = bytearray()
        self._answer: asyncio.Future[Response] | None = None

    def get(self, request: bytes) -> asyncio.Future[Response]:
        assert self._transport is not None, "connected by create_connection"
        self._received.clear()
        self._answer = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return self._answer

    def close(self) -> None:
        self.open = False
        if self._transport is not None:
            self._transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._received += data
        self._settle(eof=False)

    def eof_received(self) -> bool:
        self._settle(eof=True)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._settle(eof=True)

    def _settle(self, eof: bool) -> None:
        answer = self._answer
        if answer is None or answer.done():
            return
        try:
            response = parse_response(self._received, eof)
        except _BadResponse as exc:
            answer.set_exception(exc)
            return
        if response is not None:
            answer.set_result(response)
        elif eof:
            answer.set_exception(_BadResponse("the engine closed the connection mid-response"))


def parse_response(data: bytes | bytearray, eof: bool) -> Response | None:
    """The response at the start of `data`; None while more is needed (`eof`: no more will come)."""
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        if len(data) > _MAX_HEAD:
            raise _BadResponse(f"no end of headers in {_MAX_HEAD} bytes")
        return None
    status_line, *lines = bytes(data[:head_end]).decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest.partition(" ")[0]
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or whole_number(code, maximum=999) is None:
        raise _BadResponse(f"not an HTTP/1.x response: {status_line[:80]!r}")
    headers = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon:
            raise _BadResponse(f"malformed header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    if headers.get("content-encoding", "identity").lower() != "identity":
        raise _BadResponse(f"unrequested Content-Encoding {headers['content-encoding']!r}")
    reusable = version == "HTTP/1.1" and "close" not in headers.get("connection", "").lower()
    start = head_end + 4
    body: bytes | None
    if code in ("204", "304"):
        body = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        body = _dechunk(data, start)
    elif "content-length" in headers:
        length = whole_number(headers["content-length"], maximum=INT64_MAX)
        if length is None:
            raise _BadResponse(f"bad Content-Length {headers['content-length'][:40]!r}")
        end = start + length
        body = bytes(data[start:end]) if len(data) >= end else None
    else:
        body, reusable = (bytes(data[start:]) if eof else None), False
    return None if body is None else Response(int(code), headers, body, reusable)


def _dechunk(data: bytes | bytearray, at: int) -> bytes | None:
    """The body of a chunked message from `at`; None until its last chunk and trailers are in."""
    chunks = []
    while True:
        line_end = data.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = bytes(data[at:line_end]).partition(b";")[0].strip()
        if not _HEX.fullmatch(size):
            raise _BadResponse(f"bad chunk size line {bytes(data[at : at + 40])!r}")
        length, at = int(size, 16), line_end + 2
        if length == 0:
            break
        if len(data) < at + length + 2:
            return None
        if data[at + length : at + length + 2] != b"\r\n":
            raise _BadResponse("a chunk longer than its size line says")
        chunks.append(bytes(data[at : at + length]))
        at += length + 2
    # Trailer fields, if any, up to the closing empty line.
    while (line_end := data.find(b"\r\n", at)) > at:
        at = line_end + 2
    return None if line_end < 0 else b"".join(chunks)
