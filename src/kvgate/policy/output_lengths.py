"""What requests that name no `max_tokens` really generate, per model and route: the output budget the
gate charges the next ones.

Pure. A request without `max_tokens` is charged the model's `default_output_tokens` (1,024 unless set),
a guess: chat answers are often a few hundred tokens, a reasoning model's several thousand. Where the
gate sees the answers (as an endpoint picker, kvgate.gate.picker, it reads each response's `usage`),
it keeps the output lengths of the last KEEP such requests per model and route, and charges the next
ones their QUANTILE (the high quantile, as the agents project output: kvgate.agent.output_budget),
once MIN_SAMPLES have been seen, within [FLOOR, the model's max_total_tokens / 2]. The engine's usage
still bounds admission, so a request that writes more than it was charged shows up as drift at its
node's agent, not as a preemption.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable

from kvgate.quantiles import nearest_rank

KEEP = 1000  # output lengths remembered per model and route
MIN_SAMPLES = 50  # before the quantile replaces the configured default
QUANTILE = 0.99
FLOOR = 64  # no learned budget below this, whatever the history says
# The quantile is read again after this many new lengths, not on every request.
REFRESH_EVERY = 20
MAX_KEYS = 256  # models x routes followed; the least recently used goes first


class _History:
    __slots__ = ("budget", "lengths", "unread")

    def __init__(self) -> None:
        self.lengths: deque[int] = deque(maxlen=KEEP)
        self.budget: int | None = None
        self.unread = 0


class OutputLengths:
    def __init__(self) -> None:
        self._histories: OrderedDict[Hashable, _History] = OrderedDict()

    def observe(self, key: Hashable, completion_tokens: int) -> None:
        """One answer to a request of `key` that named no budget: it generated `completion_tokens`."""
        history = self._histories.get(key)
        if history is None:
            history = self._histories[key] = _History()
            if len(self._histories) > MAX_KEYS:
                self._histories.popitem(last=False)
        self._histories.move_to_end(key)
        history.lengths.append(max(0, completion_tokens))
        history.unread += 1
        if len(history.lengths) >= MIN_SAMPLES and (
            history.budget is None or history.unread >= REFRESH_EVERY
        ):
            history.budget = nearest_rank(history.lengths, QUANTILE)
            history.unread = 0

    def budget(self, key: Hashable, ceiling: int) -> int | None:
        """The budget to charge a request of `key` that names none, at most `ceiling`; None until
        enough answers have been seen."""
        history = self._histories.get(key)
        if history is None or history.budget is None:
            return None
        return max(1, min(ceiling, max(FLOOR, history.budget)))
