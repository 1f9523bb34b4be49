"""Recording HTTP upstreams, one aiohttp server per pool on a background thread.

Each answers every request with `{"pool": …, "body_bytes": …}`, after `x-test-delay` seconds when a
request asks for it, and records what it received (pool, path, headers, body size) and how many
requests were in flight at once.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiohttp import web

_MAX_BODY = 64 * 1024 * 1024


@dataclass
class Received:
    pool: str
    path: str
    headers: dict[str, str]
    body_bytes: int


@dataclass
class Upstreams:
    ports: dict[str, int]
    received: list[Received] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    max_in_flight: dict[str, int] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _runners: list[web.AppRunner] = field(default_factory=list)

    def start(self) -> None:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def launch() -> None:
            for pool, port in self.ports.items():
                app = web.Application(client_max_size=_MAX_BODY)
                app.router.add_route("*", "/{tail:.*}", self._handler(pool))
                runner = web.AppRunner(app, access_log=None)
                await runner.setup()
                await web.TCPSite(runner, "127.0.0.1", port).start()
                self._runners.append(runner)
            ready.set()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(launch())
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="kvgate-upstreams")
        self._thread.start()
        ready.wait(10)

    def _handler(self, pool: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            body = await request.read()
            headers = {k.lower(): v for k, v in request.headers.items()}
            self.received.append(Received(pool, request.path, headers, len(body)))
            self.in_flight[pool] = self.in_flight.get(pool, 0) + 1
            self.max_in_flight[pool] = max(self.max_in_flight.get(pool, 0), self.in_flight[pool])
            try:
                delay = float(headers.get("x-test-delay", "0"))
                if delay:
                    await asyncio.sleep(delay)
            finally:
                self.in_flight[pool] -= 1
            return web.json_response({"pool": pool, "body_bytes": len(body)})

        return handle

    def stop(self) -> None:
        if self._loop is None:
            return

        async def shutdown() -> None:
            for runner in self._runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop.close()
