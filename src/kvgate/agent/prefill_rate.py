"""How fast a node's engine prefills a request's prompt, as measured: what turns the lending rule's
prefill budget into the seconds chat waits behind a lent prompt.

Pure. Fed every scrape with the engine's per-request histogram sums (vLLM's
`vllm:request_prompt_tokens` and `vllm:request_prefill_time_seconds`, both observed as each request
finishes: vllm/v1/metrics/stats.py @ v0.32.0, `update_from_finished_request`, prefill time from first
scheduled to first token), it answers prompt tokens per second of prefill over the requests that
finished in the last `window_s`. Requests prefilled side by side each count their own time, so on a
busy engine the figure is what one request sees, below the engine's throughput: the side that keeps
chat's wait short.

The rate outlives a quiet spell (the last measure is the best guess for the next prompt); until a
request has finished it is unknown (None), never zero. Sums that go back (the engine restarted)
start the measure again from that sample.
"""

from __future__ import annotations

from collections import deque

# Prefill time the window must hold before its rate is believed: a few chat prompts on a fast node.
MIN_PREFILL_S = 0.05


class PrefillRate:
    def __init__(self, window_s: float = 60.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self._window_s = window_s
        self._samples: deque[tuple[float, float, float]] = deque()  # time, prompt tokens, prefill s
        self._rate: float | None = None

    @property
    def tokens_per_s(self) -> float | None:
        """Prompt tokens per second of one request's prefill; None until measured."""
        return self._rate

    def observe(self, now: float, prompt_tokens_sum: float | None, prefill_seconds_sum: float | None) -> None:
        """One scrape: the engine's sums over finished requests (None when the page has none)."""
        if prompt_tokens_sum is None or prefill_seconds_sum is None:
            return
        if self._samples and (
            prompt_tokens_sum < self._samples[-1][1] or prefill_seconds_sum < self._samples[-1][2]
        ):
            self._samples.clear()
        self._samples.append((now, prompt_tokens_sum, prefill_seconds_sum))
        # Keep the newest sample older than the window: the window's start.
        while len(self._samples) > 2 and self._samples[1][0] <= now - self._window_s:
            self._samples.popleft()
        _, tokens_then, seconds_then = self._samples[0]
        seconds, tokens = prefill_seconds_sum - seconds_then, prompt_tokens_sum - tokens_then
        if seconds >= MIN_PREFILL_S and tokens > 0:
            self._rate = tokens / seconds
