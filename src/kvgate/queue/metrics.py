"""The queue's metrics: jobs by state, oldest job age, tokens waiting per tenant, dispatch wait,
requests the queue failed on.

Store-wide figures (every replica's jobs) come from one `QueueStats` read every few seconds by the
service, never from a query at scrape time; the rest count what this replica did. Tenants come from
clients, so the per-tenant gauge shows the `TENANT_LABELS` tenants with the most tokens waiting and
sums the others under `_other`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.names import OTHER_TENANTS
from kvgate.queue.store import QueueStats
from kvgate.telemetry import (
    QUEUE_ABANDONED,
    QUEUE_ADMISSIONS,
    QUEUE_ATTEMPTS,
    QUEUE_DISPATCH_WAIT,
    QUEUE_INTERNAL_ERRORS,
    QUEUE_JOBS,
    QUEUE_OLDEST_JOB_AGE,
    QUEUE_RUNNING,
    QUEUE_TOKENS_WAITING,
    Tally,
    histogram,
    meter,
    observe,
)

TENANT_LABELS = 20
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class QueueMetrics:
    def __init__(self, stats: Callable[[], QueueStats | None], running: Callable[[], int]) -> None:
        m = meter("kvgate.queue")

        def jobs() -> list[tuple[float, dict[str, str]]]:
            current = stats()
            return [(float(n), {"state": state}) for state, n in current.jobs.items()] if current else []

        def oldest() -> list[tuple[float, dict[str, str]]]:
            current = stats()
            if current is None:
                return []
            return [(current.oldest_queued_s or 0.0, {})]

        def tenants() -> list[tuple[float, dict[str, str]]]:
            current = stats()
            return tenant_series(current.tokens_waiting) if current else []

        observe(m, QUEUE_JOBS, "{job}", "Jobs in the store by state (every replica's)", jobs)
        observe(m, QUEUE_OLDEST_JOB_AGE, "s", "Age of the oldest queued job (0 when none)", oldest)
        observe(m, QUEUE_TOKENS_WAITING, "{token}", "Estimated tokens of queued jobs, per tenant", tenants)
        observe(m, QUEUE_RUNNING, "{job}", "Jobs this replica is running", lambda: [(float(running()), {})])
        self._admissions = Tally(
            m,
            QUEUE_ADMISSIONS,
            "{request}",
            "Requests and batch lines by contract and result",
            ("contract", "result"),
        )
        self._attempts = Tally(
            m, QUEUE_ATTEMPTS, "{attempt}", "Engine calls of this replica by how they ended", ("result",)
        )
        self._abandoned = Tally(
            m,
            QUEUE_ABANDONED,
            "{job}",
            "Held jobs cancelled because their client left before they started (queue.reattach_s)",
            (),
        )
        self._internal_errors = Tally(
            m,
            QUEUE_INTERNAL_ERRORS,
            "{request}",
            "Requests answered 503 internal_error because the queue failed on them, by route",
            ("route",),
        )
        self._wait = histogram(
            QUEUE_DISPATCH_WAIT,
            "Time from a job's arrival to its dispatch to a node",
            "priority",
            _WAIT_BUCKETS,
        )

    def admitted(self, contract: str, result: str) -> None:
        self._admissions.add(contract, result)

    def dispatched(self, wait_s: float, priority: str) -> None:
        self._wait.record(wait_s, priority)

    def ended(self, result: str) -> None:
        self._attempts.add(result)

    def abandoned(self, jobs: int) -> None:
        self._abandoned.add(n=jobs)

    def internal_error(self, route: str) -> None:
        """`route`: the path pattern the request matched (a bounded set), never the path itself."""
        self._internal_errors.add(route)


def tenant_series(tokens: dict[str, int]) -> list[tuple[float, dict[str, str]]]:
    ranked = sorted(tokens.items(), key=lambda item: -item[1])
    series = [(float(n), {"tenant": tenant}) for tenant, n in ranked[:TENANT_LABELS]]
    rest = sum(n for _, n in ranked[TENANT_LABELS:])
    if rest:
        series.append((float(rest), {"tenant": OTHER_TENANTS}))
    return series
