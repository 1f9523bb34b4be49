"""Open-loop HTTP/1.1 load at a fixed rate, and the minimal upstream that answers it.

Requests leave on a fixed schedule whatever the server does (open loop), over keep-alive connections
opened as needed, so a slow server shows up as latency, not as a lower request rate. Both ends speak
raw asyncio protocols on uvloop: at a few thousand requests per second each costs tens of
microseconds of CPU per request, so the load generator and the upstream stay small next to Envoy
and the ext_proc server they measure on the same cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import uvloop

_HEAD_END = b"\r\n\r\n"
_SLOW_S = 0.010
_LEAD_S = 0.005
_WINDOW_S = 0.010


@dataclass(frozen=True, slots=True)
class LoadResult:
    """One fixed-rate step: latencies from write to last response byte, and the sender's own lag."""

    rate: float
    planned: int
    sent: int
    completed: int
    errors: int
    elapsed_s: float
    latencies_s: tuple[float, ...]
    lag_p99_s: float
    aborted: bool

    def percentile_ms(self, q: float) -> float:
        return percentile(self.latencies_s, q) * 1000

    @property
    def p50_ms(self) -> float:
        return self.percentile_ms(50)

    @property
    def p99_ms(self) -> float:
        return self.percentile_ms(99)

    def holds(self, p99_limit_ms: float = _SLOW_S * 1000) -> bool:
        """Every planned request answered without error, and p99 under the limit."""
        complete = self.completed == self.planned and not self.errors and not self.aborted
        return complete and self.p99_ms < p99_limit_ms


def percentile(values: tuple[float, ...] | list[float], q: float) -> float:
    """Nearest-rank percentile of sorted or unsorted values; NaN when there are none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def response_length(buffer: bytearray) -> int:
    """Bytes of the first complete HTTP response in `buffer` (Content-Length framed), or 0 if incomplete."""
    end = buffer.find(_HEAD_END)
    if end < 0:
        return 0
    head = bytes(buffer[:end]).lower()
    start = head.find(b"\r\ncontent-length:")
    if start < 0:
        raise ValueError("response without content-length")
    stop = head.find(b"\r\n", start + 2)
    length = int(head[start + 17 : stop if stop >= 0 else len(head)])
    total = end + 4 + length
    return total if len(buffer) >= total else 0


class _Client(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, on_done: Callable[[_Client, bool], None]) -> None:
        self._on_done = on_done
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.sent_at = 0.0
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    @property
    def alive(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, payload: bytes) -> None:
        assert self.transport is not None
        self.busy = True
        self.sent_at = time.perf_counter()
        self.transport.write(payload)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            length = response_length(self._buffer)
        except ValueError:
            # An unframed answer leaves the stream unreadable: drop the connection.
            assert self.transport is not None
            self.transport.close()
            self._finish(ok=False)
            return
        if length:
            ok = self._buffer.startswith(b"HTTP/1.1 200")
            del self._buffer[:length]
            self._finish(ok)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.busy:
            self._finish(ok=False)

    def _finish(self, ok: bool) -> None:
        self.busy = False
        self._on_done(self, ok)


class _Step:
    """The bookkeeping of one fixed-rate step."""

    def __init__(self, host: str, port: int, payload: bytes, max_connections: int) -> None:
        self.host, self.port, self.payload = host, port, payload
        self.max_connections = max_connections
        self.idle: deque[_Client] = deque()
        self.clients: list[_Client] = []
        self.queued: deque[float] = deque()
        self.connections = 0
        self.latencies: list[float] = []
        self.lags: list[float] = []
        self.sent = self.errors = self.slow = 0
        self.done = asyncio.Event()
        self.outstanding = 0
        self._growing: set[asyncio.Task[None]] = set()

    async def open(self, count: int) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(count):
            _, client = await loop.create_connection(lambda: _Client(self.on_done), self.host, self.port)
            self.connections += 1
            self.clients.append(client)
            self.idle.append(client)

    def submit(self, due: float) -> None:
        self.outstanding += 1
        self.done.clear()
        while self.idle and not self.idle[0].alive:
            self.idle.popleft()
            self.connections -= 1
        if self.idle:
            self._send(self.idle.popleft(), due)
        else:
            self.queued.append(due)
            if self.connections < self.max_connections:
                self.connections += 1
                task = asyncio.get_running_loop().create_task(self._grow())
                self._growing.add(task)
                task.add_done_callback(self._growing.discard)

    async def _grow(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, client = await loop.create_connection(lambda: _Client(self.on_done), self.host, self.port)
        except OSError:
            self.connections -= 1
            if self.queued:
                self.queued.popleft()
                self._count(ok=False, latency=0.0)
            return
        self.clients.append(client)
        self._release(client)

    def _send(self, client: _Client, due: float) -> None:
        client.send(self.payload)
        self.lags.append(client.sent_at - due)
        self.sent += 1

    def on_done(self, client: _Client, ok: bool) -> None:
        self._count(ok, time.perf_counter() - client.sent_at)
        if not client.alive:
            self.connections -= 1
        else:
            self._release(client)

    def _release(self, client: _Client) -> None:
        if self.queued:
            self._send(client, self.queued.popleft())
        else:
            self.idle.append(client)

    def _count(self, ok: bool, latency: float) -> None:
        self.outstanding -= 1
        if ok:
            self.latencies.append(latency)
            self.slow += latency >= _SLOW_S
        else:
            self.errors += 1
        if self.outstanding == 0:
            self.done.set()

    def forget_queued(self) -> None:
        self.outstanding -= len(self.queued)
        self.queued.clear()
        if self.outstanding == 0:
            self.done.set()

    def close(self) -> None:
        for client in self.clients:
            if client.transport is not None:
                client.transport.close()


async def run_load(
    host: str,
    port: int,
    payload: bytes,
    rate: float,
    duration_s: float,
    *,
    max_connections: int = 256,
    drain_s: float = 2.0,
    give_up_early: bool = False,
) -> LoadResult:
    """Send `payload` (a whole HTTP/1.1 request) at `rate` per second for `duration_s`.

    With `give_up_early`, the step stops once more than 1% of its planned requests took 10 ms or
    more (its p99 can no longer pass), so a search through overloaded rates costs little time.
    """
    planned = max(1, round(rate * duration_s))
    step = _Step(host, port, payload, max_connections)
    await step.open(min(max_connections, max(4, math.ceil(rate / 200))))
    loop = asyncio.get_running_loop()
    interval = 1.0 / rate
    start, loop_start = time.perf_counter() + _LEAD_S, loop.time() + _LEAD_S
    # One timer per request, so no coroutine wakes up between sends; scheduled a short window
    # ahead at a time, because thousands of timers set at once would make the first ones late.
    timers: list[asyncio.TimerHandle] = []
    next_request = 0
    aborted = False
    while next_request < planned and not aborted:
        horizon = loop.time() + 2 * _WINDOW_S
        timers.clear()
        while next_request < planned and loop_start + next_request * interval < horizon:
            due = next_request * interval
            timers.append(loop.call_at(loop_start + due, step.submit, start + due))
            next_request += 1
        await asyncio.sleep(_WINDOW_S)
        aborted = give_up_early and step.slow > planned / 100
    if aborted:
        for timer in timers:
            timer.cancel()
        step.forget_queued()
    else:
        await asyncio.sleep(max(0.0, loop_start + planned * interval - loop.time()))
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(step.done.wait(), drain_s)
    elapsed = time.perf_counter() - start
    step.close()
    return LoadResult(
        rate=rate,
        planned=planned,
        sent=step.sent,
        completed=len(step.latencies),
        errors=step.errors,
        elapsed_s=elapsed,
        latencies_s=tuple(step.latencies),
        lag_p99_s=percentile(step.lags, 99),
        aborted=aborted,
    )


class Connection:
    """One keep-alive connection for closed-loop requests: each exchange waits for its answer."""

    def __init__(self, client: _Client) -> None:
        self._client = client
        self._answered: asyncio.Future[bool] | None = None
        self._finished = 0.0

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        made: list[Connection] = []
        _, client = await loop.create_connection(
            lambda: _Client(lambda _c, ok: made[0]._done(ok)), host, port
        )
        made.append(cls(client))
        return made[0]

    def _done(self, ok: bool) -> None:
        self._finished = time.perf_counter()
        if self._answered is not None and not self._answered.done():
            self._answered.set_result(ok)

    async def exchange(self, payload: bytes, timeout_s: float = 30.0) -> float:
        """Seconds from the request's write to its answer's last byte; raises on a failed answer."""
        if not self._client.alive:
            raise ConnectionError("the connection was closed")
        self._answered = asyncio.get_running_loop().create_future()
        self._client.send(payload)
        async with asyncio.timeout(timeout_s):
            ok = await self._answered
        if not ok:
            raise ConnectionError("the server did not answer 200")
        return self._finished - self._client.sent_at

    def close(self) -> None:
        if self._client.transport is not None:
            self._client.transport.close()


def http_request(path: str, body: bytes, host: str = "127.0.0.1") -> bytes:
    """A keep-alive JSON POST as raw bytes, built once and sent many times."""
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Upstream(asyncio.Protocol):
    """Answers every request with a small fixed JSON body naming its pool and the pool header it got.

    Reads in linear time whatever the body's size: the head is searched for in what arrived since the
    last search, and a body's bytes are counted, not kept (a 16 MB prompt arrives in some hundred
    reads; searching all that arrived at every read would cost more than the proxies being measured).
    """

    def __init__(self, pool: str) -> None:
        self._pool = pool
        self._buffer = bytearray()
        self._searched = 0  # bytes of the buffer already searched for the end of a head
        self._body_left = 0
        self._head = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._body_left:
                taken = min(self._body_left, len(view))
                self._body_left -= taken
                view = view[taken:]
                if not self._body_left:
                    self._answer(self._head)
                continue
            self._buffer += view
            view = view[len(view) :]
            end = self._buffer.find(_HEAD_END, max(0, self._searched - len(_HEAD_END) + 1))
            if end < 0:
                self._searched = len(self._buffer)
                return
            head = bytes(self._buffer[:end]).lower()
            start = head.find(b"\r\ncontent-length:")
            length = 0
            if start >= 0:
                stop = head.find(b"\r\n", start + 2)
                length = int(head[start + 17 : stop if stop >= 0 else len(head)])
            rest = memoryview(bytes(self._buffer[end + 4 :]))
            self._buffer.clear()
            self._searched = 0
            self._head, self._body_left = head, length
            if not length:
                self._answer(head)
            view = rest

    def _answer(self, head: bytes) -> None:
        start = head.find(b"\r\nx-kvgate-pool:")
        header = b"-"
        if start >= 0:
            stop = head.find(b"\r\n", start + 2)
            header = head[start + 16 : stop if stop >= 0 else len(head)].strip()
        body = b'{"pool":"%s","x-kvgate-pool":"%s"}' % (self._pool.encode(), header)
        assert self._transport is not None
        self._transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(body), body)
        )


async def _serve_upstreams(ports: dict[str, int]) -> None:
    loop = asyncio.get_running_loop()
    for pool, port in ports.items():
        await loop.create_server(lambda pool=pool: _Upstream(pool), "127.0.0.1", port)  # type: ignore[misc]
    await asyncio.Event().wait()


def serve_upstreams(ports: dict[str, int]) -> None:
    """Serve one fixed-answer upstream per pool until the process is terminated."""
    uvloop.run(_serve_upstreams(ports))
