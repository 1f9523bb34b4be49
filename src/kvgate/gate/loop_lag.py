"""How far behind the gate's event loop runs: the time every answer waits before the gate can even
start on it.

Envoy gives the gate `message_timeout` (5 s in the shipped configs) per message and then fails open,
sending the request on undecided. A gate whose loop is seconds behind (a CPU-starved pod, a burst of
big bodies) would let that timeout decide for it. So the gate measures its own lag and, past
admission.max_loop_lag_s, answers long requests at once, before any Reserve round trip (each costs a few
more turns of a slow loop): 503 `gateway_overloaded` with Retry-After, or the async pool for
requests that may go there (kvgate.policy.overflow). Short requests are still routed: their answer
costs no more than a refusal would.

A probe sleeps one interval over and over; how late it wakes is the lag. The lag read by a request is
the larger of the last probe's and how overdue the current probe already is, so a loop that was just
blocked for a second reads at least a second less one interval behind at once, not one interval later.

The interval is a quarter of admission.max_loop_lag_s (`PROBES_PER_LIMIT`; 125 ms for the default
0.5 s), so a lag reads at most a quarter of the limit short. Every wake-up of the process costs CPU:
a bare uvloop process that sleeps 50 ms over and over spends 3.5 ms of CPU a second on this project's
2-vCPU VM (about 175 µs a wake-up), and a probe every 50 ms was 4 of an idle gate's 4.5 ms/s
(2026-12-05; docs/benchmarks.md, "What a wake-up costs").
"""

from __future__ import annotations

import asyncio

PROBES_PER_LIMIT = 4


class LoopLag:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last_s = 0.0
        self._due = 0.0  # the loop time the probe should wake at; 0 before it runs
        self._loop: asyncio.AbstractEventLoop | None = None

    def current_s(self) -> float:
        """The lag now. Safe from any thread (the metrics exporter reads it from its own): the loop's
        clock is the monotonic clock."""
        if self._loop is None or not self._due:
            return 0.0
        return max(self._last_s, self._loop.time() - self._due)

    async def run(self) -> None:
        """Forever: probe the loop."""
        self._loop = loop = asyncio.get_running_loop()
        while True:
            self._due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self._last_s = max(0.0, loop.time() - self._due)
