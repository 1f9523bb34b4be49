"""How often the agent scrapes its engine and ticks: every period under pressure, every `idle_s`
otherwise (a Reserve or Release brings the next tick forward, so its message still goes out within a
period).

Pure. A scrape and its parse cost about 0.5 ms of the agent's CPU and make the engine render its
page (shared/research/admission-efficiency.md, section 2). Fresh figures matter where the next grant
could overfill the node, so the engine is scraped every period while the node is under pressure:
- its committed KV (max(engine used, reserved)) is at `KV_LEVEL` (0.85) of admissible or more;
- the engine queues requests, a request was refused room here within the last `RECENT_S` (1 s), or
  one holds its place here (the head claim the node publishes): a waiter's next grant hangs on what
  frees;
- the node's figures are unknown or unhealthy: recovery shows within a period.
Grants and releases alone are no pressure: the ledger charges a grant in full from the moment it is
made, and the engine's figures only ever tighten admission (max(used, reserved)), so a scrape after
each one buys no safety; on the Mooncake replay, where each long node sees a grant every quarter
second, it kept every agent on the fast cadence for the whole run. Nor is a grant to a try that names
the time it waits since: a gate names its request's arrival on every try, the first included, and
counting those as waits kept the replay's agents on the fast cadence for 95% of their ticks (a 150 s
window, 2026-12-04), long nodes at half their KV included.

Otherwise every `idle_s` (500 ms by default). What keeps this safe is unchanged: figures older than
--engine-stale-after-s (1 s) still make the node unhealthy, and that must stay above the slow interval
plus a scrape's timeout (kvgate.agent.node.NodeSettings checks it).
"""

from __future__ import annotations

from kvgate.headroom.snapshot import NodeHeadroom

KV_LEVEL = 0.85
RECENT_S = 1.0


def pressure(latest: NodeHeadroom | None, now: float, waited_at: float) -> str:
    """Why the engine is to be scraped every period ("" when it need not be), from the latest sample
    and the time a request last waited for room."""
    if latest is None or not latest.healthy or latest.used_tokens is None:
        return "no healthy figures"
    if now - waited_at < RECENT_S:
        return "a request waited"
    if latest.head is not None:
        return "a request holds its place"
    if latest.waiting:
        return "engine queue"
    committed = max(latest.used_tokens, latest.reserved_tokens)
    if committed >= KV_LEVEL * latest.admissible_tokens:
        return "KV above the level"
    return ""


class ScrapeCadence:
    def __init__(self, period_s: float, idle_s: float) -> None:
        self._period_s = period_s
        self._idle_s = max(idle_s, period_s)
        self._scraped_at = float("-inf")

    def due(self, now: float, latest: NodeHeadroom | None, waited_at: float) -> bool:
        # Ticks come on the period's grid: half a period of slack keeps a 500 ms interval at 500 ms.
        if now - self._scraped_at + self._period_s / 2 >= self._idle_s:
            return True
        return bool(pressure(latest, now, waited_at))

    def tick_interval_s(self, now: float, latest: NodeHeadroom | None, waited_at: float) -> float:
        """The longest the agent waits for its next tick: a period under pressure, the idle interval
        otherwise (a Reserve or Release brings a tick forward: kvgate.agent.server)."""
        return self._period_s if pressure(latest, now, waited_at) else self._idle_s

    def scraped(self, now: float) -> None:
        self._scraped_at = now
