"""The HTTP adapter of a simulated node: aiohttp handlers around the engine models, in real time.

One task per engine drives it: schedule a step, sleep its duration, commit it, hand the sampled
tokens to the waiting handlers. With data parallelism (`Layout.data_parallel`) several engines sit
behind the one endpoint and each request goes to the one with the fewest requests in flight, ties
to the lowest rank, as vLLM's front-end balances them (vllm/v1/engine/core_client.py,
DPLBAsyncMPClient.get_core_engine_for_request @ v0.33.0: in-flight count first; SGLang's
`total_requests` balancing is the same idea). While an engine is down after a simulated OOM, the
node behaves like a dead process: every connection is cut without an answer, /metrics and
in-flight streams included.

Besides the OpenAI endpoints, a node answers what the engine it plays answers about itself and about
tokens, so routers treat it as that engine (kvgate.sim.identity, kvgate.sim.render): as vLLM, /version,
/tokenize, the two render endpoints, /server_info, /get_server_info and /kv_event_sources; as SGLang,
/tokenize, /server_info, /get_server_info, /model_info, /get_model_info and /get_load. With a KV-event
endpoint each engine publishes its prefix cache's changes on a ZMQ PUB socket, one batch per step
that changed it, as vLLM does (kvgate.sim.kv_events).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from aiohttp import web

from kvgate.errors import ConfigError
from kvgate.sim import api, kv_events, render
from kvgate.sim.blocks import prompt_block_hashes, token_block_hashes
from kvgate.sim.engine import Engine, EngineConfig, EngineStats, TokenEvent
from kvgate.sim.identity import Identity
from kvgate.sim.layout import Finished, Layout
from kvgate.sim.metrics import metrics_page
from kvgate.sim.tokens import ByteQuads, SimTokenizer, output_word, vocabulary_size

NODE_HEADER = "x-kvgate-sim-node"
# Every answer says how the gate routed the request (its x-kvgate-reason upstream header, "" when the
# request came without one: Envoy failed open past a gate that did not answer). The demo's fault report
# counts long prompts that reached an interactive node that way (kvgate.demo.faults).
GATE_REASON_HEADER = "x-kvgate-sim-gate-reason"
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _EngineDied(Exception):
    """The engine crashed while this request was in flight."""


@dataclass(slots=True)
class _Admitted:
    engine: int
    prompt_tokens: int
    started: float
    first_token: float | None = None


class SimServer:
    def __init__(
        self,
        config: EngineConfig,
        model_name: str = "kvgate-sim",
        node_name: str = "sim",
        clock: Callable[[], float] = time.monotonic,
        *,
        layout: Layout | None = None,
        tokenizer: SimTokenizer | None = None,
        kv_events_endpoint: str | None = None,
        stream_interval: int = 1,
    ) -> None:
        """`kv_events_endpoint` (tcp://HOST:PORT, port 0 for a free one) turns the KV-event feed on;
        `stream_interval` is vLLM's and SGLang's option of that name: a stream sends its first token at
        once, then a chunk every `stream_interval` tokens, and the last."""
        if stream_interval < 1:
            raise ConfigError(f"the stream interval must be >= 1 token, got {stream_interval}")
        self._stream_interval = stream_interval
        self.layout = layout or Layout()
        if kv_events_endpoint is not None:
            config = dataclasses.replace(config, kv_events=True)
        # Each DP rank is an engine of the configured size; their outputs differ by seed.
        self.engines = [
            Engine(dataclasses.replace(config, seed=config.seed + rank), clock)
            for rank in range(self.layout.data_parallel)
        ]
        self.config = config
        self.page = metrics_page(config, self.layout, model_name, clock)
        self._tokenizer = tokenizer or ByteQuads()
        self._counted = _Counted(self._tokenizer)
        self._publisher = (
            None
            if kv_events_endpoint is None
            else _KvPublisher(kv_events_endpoint, len(self.engines), topic="")
        )
        endpoints = () if self._publisher is None else tuple(self._publisher.endpoints)
        self.identity = Identity(config, self.layout, model_name, node_name, endpoints)
        self._clock = clock
        self.model_name = model_name
        self.node_name = node_name
        self._streams: dict[str, asyncio.Queue[TokenEvent | None]] = {}
        self._admitted: dict[str, _Admitted] = {}
        self._in_flight = [0] * len(self.engines)
        self._ids = itertools.count()
        self._wakes = [asyncio.Event() for _ in self.engines]
        self._drivers: list[asyncio.Task[None]] = []

    def is_down(self) -> bool:
        """An engine that crashed takes its API server down with it, as vLLM's does."""
        return any(engine.is_down() for engine in self.engines)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._dead_engine])
        app.on_response_prepare.append(self._say_who)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        info = self.identity
        if self.layout.engine == "vllm":
            app.router.add_get("/version", self._json(lambda: {"version": info.version}))
            app.router.add_post("/v1/chat/completions/render", self._render_chat)
            app.router.add_post("/v1/completions/render", self._render_completions)
            app.router.add_get("/server_info", self._json(info.vllm_server_info))
            app.router.add_get("/get_server_info", self._json(info.kv_identity))
            app.router.add_get(
                "/kv_event_sources",
                self._json(lambda: kv_events.sources(info.kv_event_endpoints, topic="")),
            )
        else:
            for path in ("/server_info", "/get_server_info"):
                app.router.add_get(path, self._json(lambda: info.sglang_server_info(self._stats())))
            for path in ("/model_info", "/get_model_info"):
                app.router.add_get(path, self._json(info.sglang_model_info))
            app.router.add_get("/get_load", self._json(lambda: info.sglang_load(self._stats())))
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self._drivers = [
            asyncio.create_task(self._drive(rank), name=f"sim-engine-{self.node_name}-{rank}")
            for rank in range(len(self.engines))
        ]

    async def _stop(self, _app: web.Application) -> None:
        for driver in self._drivers:
            driver.cancel()
        await asyncio.gather(*self._drivers, return_exceptions=True)
        if self._publisher is not None:
            self._publisher.close()

    async def _drive(self, rank: int) -> None:
        engine = self.engines[rank]
        wake = self._wakes[rank]
        # Steps end on the model's timeline, not "sleep after the work": the time spent handling a
        # step and the event loop's lateness are made up in the next sleep, so a busy host does not
        # silently make the node slower than its configured throughput.
        step_end = self._clock()
        while True:
            if engine.is_down():
                await asyncio.sleep(engine.restart_in())
                continue
            step = engine.schedule()
            for request_id in step.crashed:
                self._streams[request_id].put_nowait(None)
            if step.crashed:
                self._publish(rank)
                continue
            if not step.batch:
                wake.clear()
                await wake.wait()
                step_end = self._clock()
                continue
            # Never more than one step behind: a stalled host must not be followed by a burst of steps.
            # What it forgives is engine time the host lost, counted as kvgate_sim_stalled_seconds.
            lost = self._clock() - step.duration_s - step_end
            if lost > 0:
                self.page.stalled(rank, lost)
            step_end = max(step_end, self._clock() - step.duration_s) + step.duration_s
            await asyncio.sleep(max(0.0, step_end - self._clock()))
            for event in engine.complete(step):
                self._account(event)
                if self._due(event):
                    self._streams[event.request_id].put_nowait(event)
            self._publish(rank)
            self.page.stepped(rank, step, engine.stats())

    def _due(self, event: TokenEvent) -> bool:
        """Whether a chunk goes out for this token: the first, every `stream_interval`-th, the last."""
        tokens = event.output_tokens
        return event.finished or tokens == 1 or tokens % self._stream_interval == 0

    def _publish(self, rank: int) -> None:
        """The step's prefix-cache changes, published after its output as vLLM's scheduler does."""
        if self._publisher is not None:
            self._publisher.publish(rank, self.engines[rank].take_kv_events())

    def _account(self, event: TokenEvent) -> None:
        admitted = self._admitted[event.request_id]
        now = self._clock()
        if admitted.first_token is None:
            admitted.first_token = now
        if event.finish_reason is not None:
            self.page.finished(
                Finished(
                    admitted.engine,
                    admitted.prompt_tokens,
                    event.output_tokens,
                    event.finish_reason,
                    admitted.first_token - admitted.started,
                    now - admitted.started,
                )
            )

    @web.middleware
    async def _dead_engine(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        if self.is_down():
            _cut(request)
        try:
            return await handler(request)
        except _EngineDied:
            _cut(request)
        raise AssertionError("unreachable")

    async def _say_who(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[NODE_HEADER] = self.node_name
        response.headers[GATE_REASON_HEADER] = request.headers.get("x-kvgate-reason", "")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, "completion")

    async def _completion(self, request: web.Request, kind: api.Api) -> web.StreamResponse:
        raw = await request.read()
        if self.is_down():
            raise _EngineDied  # the engine crashed while the body arrived
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(api.bad_request("the request body is not valid JSON"))
        try:
            parsed = self._parse(kind, body)
        except api.EngineError as exc:
            return _error(exc)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        request_id = f"{prefix}-{self.node_name}-{next(self._ids)}"
        queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        self._streams[request_id] = queue
        rank = min(range(len(self.engines)), key=self._in_flight.__getitem__)
        self._in_flight[rank] += 1
        self._admitted[request_id] = _Admitted(rank, parsed.prompt_tokens, self._clock())
        hashes, ids = self._blocks(parsed)
        self.engines[rank].add(
            request_id,
            parsed.prompt_tokens,
            parsed.max_tokens,
            hashes,
            token_ids=tuple(ids),
            ignore_eos=parsed.ignore_eos,
            eos_after=parsed.eos_after,
        )
        self._wakes[rank].set()
        words = _Words(self.config.seed, request_id)
        reply = api.Reply(parsed, request_id, int(time.time()), self.model_name)
        try:
            if parsed.stream:
                return await self._stream(request, reply, queue, words)
            return await self._collect(reply, queue, words)
        finally:
            del self._streams[request_id]
            del self._admitted[request_id]
            self._in_flight[rank] -= 1
            self.engines[rank].abort(request_id)

    async def _stream(
        self, request: web.Request, reply: api.Reply, queue: asyncio.Queue[TokenEvent | None], words: _Words
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", NODE_HEADER: self.node_name}
        )
        await response.prepare(request)
        produced = 0
        while True:
            last = (await _next_events(queue))[-1]
            if produced == 0 and reply.request.api == "chat":
                # vLLM sends the role chunk with the first token, so it does not shorten TTFT.
                await _send(response, reply.role_chunk())
            text = words.take(last.output_tokens - produced)
            produced = last.output_tokens
            await _send(response, reply.chunk(text, last.finish_reason))
            if last.finished:
                break
        if reply.request.include_usage:
            await _send(response, reply.usage_chunk(produced))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _collect(
        self, reply: api.Reply, queue: asyncio.Queue[TokenEvent | None], words: _Words
    ) -> web.StreamResponse:
        while True:
            last = (await _next_events(queue))[-1]
            if last.finish_reason is not None:
                break
        body = reply.full(words.take(last.output_tokens), last.finish_reason, last.output_tokens)
        return web.json_response(body, headers={NODE_HEADER: self.node_name})

    def _blocks(self, parsed: api.CompletionRequest) -> tuple[tuple[int, ...], list[int]]:
        """The prompt's block hashes for the prefix cache and, with KV events on, its token ids.

        Without a tokenizer file a token is four bytes of text, so blocks are keyed by their bytes;
        with one, tokens are not equal shares of the text, so blocks are keyed by their ids (those the
        parse just counted, not tokenized again)."""
        caching = self.config.enable_prefix_caching
        if isinstance(self._tokenizer, ByteQuads) or parsed.prompt_ids is not None:
            hashes = prompt_block_hashes(parsed.parts, self.config.block_size) if caching else ()
            ids = render.prompt_ids(parsed, self._counted) if self._publisher is not None else []
            return hashes, ids
        by_part = [(role, self._counted.ids(text)) for role, text, _ in parsed.parts]
        hashes = token_block_hashes(by_part, self.config.block_size) if caching else ()
        return hashes, [i for _, part in by_part for i in part] if self._publisher is not None else []

    def _parse(self, kind: api.Api, body: object) -> api.CompletionRequest:
        """A request as its call would read it: EngineError for what vLLM refuses."""
        self._counted.parsing()
        parsed = api.parse_request(kind, body, self._counted.count)
        api.check_context(parsed, self.config.max_model_len)
        if parsed.model is not None and parsed.model != self.model_name:
            raise api.EngineError(404, "NotFoundError", f"The model `{parsed.model}` does not exist.")
        return parsed

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        try:
            answer = render.tokenize(await _json_body(request), self._tokenizer, self.config.max_model_len)
        except api.EngineError as exc:
            return _error(exc)
        return web.json_response(answer)

    async def _render_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._render(request, "chat")

    async def _render_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._render(request, "completion")

    async def _render(self, request: web.Request, kind: api.Api) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            parsed = self._parse(kind, body)
        except api.EngineError as exc:
            return _error(exc)
        assert isinstance(body, dict), "a parsed request is a JSON object"
        budget = parsed.max_tokens or self.config.max_model_len - parsed.prompt_tokens
        ids = render.prompt_ids(parsed, self._counted)
        answer = render.generate_request(
            parsed,
            body,
            ids=ids,
            request_id=f"render-{self.node_name}-{next(self._ids)}",
            model=self.model_name,
            budget=budget,
        )
        return web.json_response(answer if kind == "chat" else [answer])

    def _stats(self) -> list[EngineStats]:
        return [engine.stats() for engine in self.engines]

    @staticmethod
    def _json(answer: Callable[[], object]) -> _Handler:
        async def handle(_request: web.Request) -> web.StreamResponse:
            return web.json_response(answer())

        return handle

    async def _models(self, _request: web.Request) -> web.StreamResponse:
        return web.json_response(self.identity.models(int(time.time())))

    async def _health(self, _request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def _metrics(self, _request: web.Request) -> web.StreamResponse:
        text = self.page.render(self._stats())
        return web.Response(text=text, content_type="text/plain", charset="utf-8")


class _KvPublisher:
    """One ZMQ PUB socket per engine (DP rank), bound at start-up; a batch per call, never blocking (a
    subscriber too far behind loses batches, as with vLLM's publisher, and sees the gap in sequence)."""

    def __init__(self, endpoint: str, ranks: int, topic: str) -> None:
        self._context = zmq.Context()
        self._topic = topic
        self._sockets: list[zmq.Socket[bytes]] = []
        self.endpoints: list[str] = []
        for rank in range(ranks):
            socket = self._context.socket(zmq.PUB)
            socket.setsockopt(zmq.SNDHWM, kv_events.DEFAULT_HWM)
            socket.setsockopt(zmq.LINGER, 0)
            try:
                socket.bind(kv_events.rank_endpoint(endpoint, rank))
            except zmq.ZMQError as exc:
                self.close()
                raise ConfigError(f"cannot publish KV events on {endpoint} (rank {rank}): {exc}") from exc
            self._sockets.append(socket)
            self.endpoints.append(socket.getsockopt_string(zmq.LAST_ENDPOINT))
        self._sequence = [0] * ranks

    def publish(self, rank: int, events: list[kv_events.KvEvent]) -> None:
        if not events:
            return
        payload = kv_events.encode_batch(events, time.time(), rank)
        self._sockets[rank].send_multipart(kv_events.message(self._topic, self._sequence[rank], payload))
        self._sequence[rank] += 1

    def close(self) -> None:
        for socket in self._sockets:
            socket.close()
        self._context.term()


class _Words:
    """The generated text of one request, reproducible from the seed and the request id."""

    def __init__(self, seed: int, request_id: str) -> None:
        self._rng = random.Random(f"{seed}/{request_id}")

    def take(self, count: int) -> str:
        return "".join(output_word(self._rng.randrange(vocabulary_size())) for _ in range(count))


class _Counted:
    """The server's tokenizer, keeping the ids of the request parsed last (`parsing` starts one), so
    its prefix-cache blocks, KV events and render answer do not tokenize its prompt again. A parse
    and what reads its ids run without yielding to the event loop, so no other request comes between.
    """

    def __init__(self, tokenizer: SimTokenizer) -> None:
        self._tokenizer = tokenizer
        self._keep = not isinstance(tokenizer, ByteQuads)  # bytes / 4 costs nothing to redo
        self._ids: dict[str, list[int]] = {}

    def parsing(self) -> None:
        self._ids.clear()

    def count(self, text: str) -> int:
        if not self._keep:
            return self._tokenizer.count(text)
        ids = self._ids.get(text)
        if ids is None:
            ids = self._ids[text] = self._tokenizer.ids(text)
        return len(ids)

    def ids(self, text: str) -> list[int]:
        found = self._ids.get(text)
        return found if found is not None else self._tokenizer.ids(text)

    def pieces(self, ids: Sequence[int]) -> list[str]:
        return self._tokenizer.pieces(ids)


async def _next_events(queue: asyncio.Queue[TokenEvent | None]) -> list[TokenEvent]:
    """The next event and any already queued behind it (a slow writer sends them as one chunk)."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    if any(item is None for item in items):
        raise _EngineDied
    return [item for item in items if item is not None]


async def _send(response: web.StreamResponse, chunk: dict[str, Any]) -> None:
    await response.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")


async def _json_body(request: web.Request) -> object:
    try:
        return json.loads(await request.read())
    except ValueError as exc:
        raise api.bad_request("the request body is not valid JSON") from exc


def _error(error: api.EngineError) -> web.Response:
    return web.json_response(api.error_body(error), status=error.status)


def _cut(request: web.Request) -> None:
    """Drop the connection without an answer, as a dead engine process would."""
    if request.transport is not None:
        request.transport.abort()
    raise asyncio.CancelledError
