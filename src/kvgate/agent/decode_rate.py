"""How fast a node's engine writes each running request's output: the rate its reservations end at.

Pure. Fed every scrape with the engine's generation counter (output tokens, summed over its engines)
and its running requests, it answers output tokens per second per running request over the last
`window_s`: the tokens generated over the request-seconds the engine ran. Prefill steps count as time
in which a request produced nothing, so the rate is what a request sees end to end, not the decode
kernel's speed.

The rate outlives a quiet spell: an idle engine keeps its last measured rate (the best guess for its
next requests). Until the engine has generated anything it is unknown (None), never zero. A counter
that goes back (the engine restarted) starts the measure again from that sample.

Tokens generated with no request running at either scrape came from requests that began and ended in
between. They count as one request running the whole interval: too slow a rate for a lone request (a
later release forecast, the safe side), too fast only when several ran in the gap. Left out, an engine
whose requests all fit between two scrapes would never have a rate; a CI run on 2026-12-05 met one, a
200-token answer from the tiny vLLM model inside one 0.5 s idle scrape.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class _Span:
    end: float
    tokens: int
    request_seconds: float


class DecodeRate:
    def __init__(self, window_s: float = 10.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._last: tuple[float, int, int] | None = None  # time, generation counter, running
        self._spans: deque[_Span] = deque()
        self._tokens = 0
        self._request_seconds = 0.0
        self._rate: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens per second per running request; None until measured."""
        return self._rate

    def observe(self, now: float, generation_total: int | None, running: int | None) -> None:
        """One scrape: the engine's generation counter and running requests (None when not shown)."""
        if generation_total is None or running is None:
            return
        last, self._last = self._last, (now, generation_total, running)
        if last is None:
            return
        then, generated_before, running_before = last
        if generation_total < generated_before or now <= then:
            return
        generated = generation_total - generated_before
        # Requests running over the interval: those at its start and its end, on average; or, for
        # tokens with none running at either end, one request over all of it (see the module's doc).
        unseen = generated > 0 and running_before == running == 0
        request_seconds = (now - then) * (1 if unseen else (running_before + running) / 2)
        if request_seconds > 0:
            self._add(_Span(now, generated, request_seconds))
        while self._spans and self._spans[0].end < now - self._window_s:
            self._remove(self._spans.popleft())
        if not self._spans:  # no float drift left behind by adding and taking away
            self._tokens, self._request_seconds = 0, 0.0
        if self._tokens > 0 and self._request_seconds > 0:
            self._rate = self._tokens / self._request_seconds

    def _add(self, span: _Span) -> None:
        self._spans.append(span)
        self._tokens += span.tokens
        self._request_seconds += span.request_seconds

    def _remove(self, span: _Span) -> None:
        self._tokens -= span.tokens
        self._request_seconds -= span.request_seconds
