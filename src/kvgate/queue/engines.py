"""Sending a job to the engine of the node that reserved for it: aiohttp, HTTP/1.1, straight to the
node's endpoint (`NodeHeadroom.endpoint`, the address the agent announces), never through a pool.

Connection failures and bodies cut short become EngineFailure here. Leaving the `send` block before
the answer was read whole closes the connection, which is how an engine learns to abort a request
(vLLM and SGLang abort on client disconnect).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import aiohttp

from kvgate.queue.jobs import JobRequest
from kvgate.queue.live import Head


class EngineFailure(Exception):
    """The engine gave no complete answer (refused the connection, dropped it, or timed out)."""


class EngineAnswer:
    def __init__(self, response: aiohttp.ClientResponse, endpoint: str) -> None:
        self._response = response
        self._endpoint = endpoint
        self.head = Head(response.status, response.headers.get("content-type", "application/octet-stream"))
        self.complete = False

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineFailure(f"engine {self._endpoint} cut its answer short: {exc!r}") from exc
        self.complete = True


class HttpEngines:
    def __init__(self, timeout_s: float, connect_timeout_s: float = 5.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No connection limit: how many jobs run at once is the agents' reservations' business.
            connector = aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    @asynccontextmanager
    async def send(
        self, endpoint: str, request: JobRequest, headers: Mapping[str, str]
    ) -> AsyncIterator[EngineAnswer]:
        all_headers = {**dict(request.headers), **headers}
        try:
            response = await self._client().post(
                f"http://{endpoint}{request.path}", data=request.body, headers=all_headers
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineFailure(f"engine {endpoint} did not answer: {exc!r}") from exc
        answer = EngineAnswer(response, endpoint)
        try:
            yield answer
        finally:
            if answer.complete:
                response.release()
            else:
                response.close()
