"""The demo's open-loop load generator: sends each planned request at its time, whatever came before.

Every request streams (as chat clients do) and ends in exactly one outcome:
- `ok`: the stream ended with `data: [DONE]`; `async` when the node that served it is an async node.
- `413` / `429` / `503`: an explicit refusal, i.e. a JSON error body (what the gate answers). Envoy's
  own plain-text 503 for a dead upstream is not a refusal: the client got nothing it can act on.
- `other`: any other HTTP error with a JSON error body (a node's 400, say).
- `lost`: no response, a cut stream, a timeout, or a refusal nobody explained.
Everything is bounded: per-request timeouts, a cap on requests in flight, a drain deadline.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, overload

import aiohttp

from kvgate.demo.prompts import BLOCK_TOKENS
from kvgate.demo.scenario import Planned, Scenario
from kvgate.demo.tokenizer import prompt_blocks
from kvgate.names import JOB_ID_HEADER
from kvgate.sim.api import SIM_EOS_AFTER
from kvgate.sim.server import GATE_REASON_HEADER, NODE_HEADER
from kvgate.sim.tokens import make_prompt

Outcome = Literal["ok", "async", "413", "429", "503", "other", "lost"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "async", "413", "429", "503", "other", "lost")
_REFUSALS: dict[int, Outcome] = {413: "413", 429: "429", 503: "503"}


@dataclass(frozen=True, slots=True)
class Result:
    planned: Planned
    sent_s: float
    outcome: Outcome
    status: int | None = None
    ttft_s: float | None = None
    finished_s: float | None = None  # after sent_s: the stream's [DONE], an error's answer, or the loss
    completion_tokens: int = 0
    node: str | None = None
    detail: str = ""
    queued: bool = False  # answered by kvgate's queue (held until a node reserved for it)
    prompt_tokens: int = 0  # what the engine counted, from the stream's usage (0 when it sent none)
    # How the gate routed it, as the node saw it (its x-kvgate-reason); "" for a request that reached
    # the node without the gate's answer (Envoy failed open); None when no node answered.
    gate_reason: str | None = None


def classify_response(status: int, body: bytes) -> Outcome:
    """The outcome of a non-200 answer: explicit refusals carry an OpenAI-style JSON error. A 429 is one
    by its status alone (RFC 6585: too many requests, try later): Envoy's local rate limit answers it
    with a plain-text body."""
    if status == 429:
        return "429"
    try:
        parsed = json.loads(body)
    except ValueError:
        return "lost"
    if not isinstance(parsed, dict) or "error" not in parsed:
        return "lost"
    return _REFUSALS.get(status, "other")


def request_body(scenario: Scenario, planned: Planned) -> bytes:
    """The request's chat body: one user message of its own, or its parts, each drawn from its key (so
    a document, or a session's history, is the same text in every request that carries it), or a
    trace request's blocks as one user message, its output exact (`ignore_eos`, as vLLM reads it).
    Under a scenario's tokenizer every text is exact under it (`_text`)."""
    exact: dict[str, bool | int] = {}
    if planned.blocks:
        text = prompt_blocks(scenario.tokenizer).prompt(planned.blocks, planned.prompt_tokens)
        messages = [{"role": "user", "content": text}]
        exact = {"ignore_eos": True}
    elif planned.parts:
        messages = [
            {"role": role, "content": _text(scenario, f"{scenario.seed}/{key}", tokens)}
            for role, key, tokens in planned.parts
        ]
    else:
        prompt = _text(scenario, f"{scenario.seed}/prompt/{planned.index}", planned.prompt_tokens)
        messages = [{"role": "user", "content": prompt}]
    if 0 < planned.output_tokens < planned.max_tokens:
        exact = {SIM_EOS_AFTER: planned.output_tokens}  # the simulated answer ends before its budget
    body = {
        "model": scenario.model,
        "messages": messages,
        "max_tokens": planned.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **exact,
    }
    return json.dumps(body).encode()


def _text(scenario: Scenario, key: str, tokens: int) -> str:
    """`tokens` tokens of text drawn from `key`. Without a tokenizer, three-letter words the simulators
    count as one token each (kvgate.sim.tokens). Under the scenario's tokenizer, the trace prompts'
    English words (kvgate.demo.prompts), exact under it, in blocks whose ids come from `key`: a real
    engine counts what was planned, and the gate's fast estimate reads them as prose (within 4% for
    tokenizer.model.v1, where it reads a run of three-letter words 17% short)."""
    if scenario.tokenizer is None or tokens < 1:
        return make_prompt(tokens, random.Random(key))
    first = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    blocks = tuple(first + i for i in range(-(-tokens // BLOCK_TOKENS)))
    return prompt_blocks(scenario.tokenizer).prompt(blocks, tokens)


class LazyBodies(Sequence[bytes]):
    """The bodies of a plan, each built as it is sent: a long trace's prompts (hundreds of megabytes in
    all) are never held at once, and one takes about a millisecond to build."""

    def __init__(self, scenario: Scenario, plan: Sequence[Planned]) -> None:
        self._scenario = scenario
        self._plan = plan

    def __len__(self) -> int:
        return len(self._plan)

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | Sequence[bytes]:
        if isinstance(index, slice):
            return LazyBodies(self._scenario, self._plan[index])
        return request_body(self._scenario, self._plan[index])


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:200]


def _usage(data: bytes) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a stream's usage chunk, as the engine counted them."""
    usage = json.loads(data).get("usage") or {}
    counts = [usage.get(key, 0) for key in ("prompt_tokens", "completion_tokens")]
    prompt, completion = (count if isinstance(count, int) else 0 for count in counts)
    return prompt, completion


def _chunk_text(data: bytes) -> str:
    choices = json.loads(data).get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
    return text or ""


class LoadGenerator:
    def __init__(
        self,
        url: str,
        scenario: Scenario,
        async_nodes: frozenset[str] = frozenset(),
        clock: Callable[[], float] = time.monotonic,
        credentials: Mapping[str, str] | None = None,
    ) -> None:
        """`credentials`: each tenant's bearer token (kvgate.demo.tenants); without, every request is
        sent without one (anonymous)."""
        self._url = url
        self._credentials = credentials or {}
        self._scenario = scenario
        self._async_nodes = async_nodes
        self._clock = clock
        self._counts: Counter[str] = Counter()
        self._in_flight = 0
        self._sent = 0

    def progress(self) -> Mapping[str, int]:
        return {"sent": self._sent, "in_flight": self._in_flight, **{o: self._counts[o] for o in OUTCOMES}}

    def prepare(self, plan: list[Planned]) -> list[bytes]:
        """The request bodies, built before the clock starts so that building them delays no send."""
        return [request_body(self._scenario, p) for p in plan]

    async def run(self, plan: list[Planned], bodies: Sequence[bytes], start: float) -> list[Result]:
        """Send `plan` open-loop, each request `at_s` after `start` (a value of the clock)."""
        timing = self._scenario.timing
        timeout = aiohttp.ClientTimeout(total=timing.request_timeout_s, sock_connect=timing.connect_timeout_s)
        connector = aiohttp.TCPConnector(limit=timing.max_in_flight)
        results: dict[int, Result] = {}
        tasks: list[asyncio.Task[None]] = []
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            for planned, body in zip(plan, bodies, strict=True):
                delay = start + planned.at_s - self._clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                self._sent += 1
                if self._in_flight >= timing.max_in_flight:
                    self._record(
                        results, Result(planned, planned.at_s, "lost", detail="client in-flight cap")
                    )
                    continue
                tasks.append(asyncio.create_task(self._send(session, planned, body, start, results)))
            if tasks:
                _done, pending = await asyncio.wait(tasks, timeout=timing.drain_s)
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        for planned in plan:
            if planned.index not in results:
                self._record(
                    results, Result(planned, planned.at_s, "lost", detail="still running at drain deadline")
                )
        return [results[p.index] for p in plan]

    def _record(self, results: dict[int, Result], result: Result) -> None:
        results[result.planned.index] = result
        self._counts[result.outcome] += 1

    async def _send(
        self,
        session: aiohttp.ClientSession,
        planned: Planned,
        body: bytes,
        start: float,
        results: dict[int, Result],
    ) -> None:
        self._in_flight += 1
        sent = self._clock()
        try:
            result = await self._exchange(session, planned, body, sent, start)
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            result = Result(
                planned, sent - start, "lost", finished_s=self._clock() - sent, detail=_describe(exc)
            )
        finally:
            self._in_flight -= 1
        self._record(results, result)

    async def _exchange(
        self, session: aiohttp.ClientSession, planned: Planned, body: bytes, sent: float, start: float
    ) -> Result:
        headers = {"Content-Type": "application/json"}
        token = self._credentials.get(planned.tenant)
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        async with session.post(self._url, data=body, headers=headers) as response:
            node = response.headers.get(NODE_HEADER)
            routed = response.headers.get(GATE_REASON_HEADER)
            queued = JOB_ID_HEADER in response.headers
            if response.status != 200:
                payload = await response.read()
                outcome = classify_response(response.status, payload)
                return Result(
                    planned,
                    sent - start,
                    outcome,
                    response.status,
                    finished_s=self._clock() - sent,
                    node=node,
                    detail=payload[:200].decode(errors="replace"),
                    gate_reason=routed,
                )
            try:
                ttft, (prompt, tokens), done = await self._read_stream(response.content, sent)
            except (aiohttp.ClientError, OSError, ValueError) as exc:
                cut_after = self._clock() - sent
                return Result(
                    planned,
                    sent - start,
                    "lost",
                    200,
                    finished_s=cut_after,
                    node=node,
                    detail=_describe(exc),
                    gate_reason=routed,
                )
        if done is None:
            cut = "stream ended without [DONE]"
            return Result(
                planned, sent - start, "lost", 200, ttft, None, tokens, node, cut, gate_reason=routed
            )
        served: Outcome = "async" if node in self._async_nodes else "ok"
        return Result(
            planned,
            sent - start,
            served,
            200,
            ttft,
            done,
            tokens,
            node,
            queued=queued,
            prompt_tokens=prompt,
            gate_reason=routed,
        )

    async def _read_stream(
        self, content: aiohttp.StreamReader, sent: float
    ) -> tuple[float | None, tuple[int, int], float | None]:
        """(TTFT, (prompt, completion) tokens, time to `data: [DONE]` or None when the stream ended
        without it)."""
        ttft: float | None = None
        tokens = (0, 0)
        async for line in content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                return ttft, tokens, self._clock() - sent
            # Only the first content chunk and the usage chunk are parsed: decoding every chunk of
            # the long streams would slow this client's loop and inflate the short requests' TTFT.
            if ttft is None:
                if _chunk_text(data):
                    ttft = self._clock() - sent
            elif b'"usage":{' in data:
                tokens = _usage(data)
        return ttft, tokens, None
