"""Which waiting job runs next: priority first, then a token-fair share across tenants, then age.

Within one priority, tenants share the pool by estimated tokens with start-time fair queuing, the
exact form of what deficit round-robin approximates: each tenant's next job gets a virtual start tag,
max(the level's virtual time, the finish tag of that tenant's last dispatched job), and its finish
tag is start + tokens; the smallest start tag goes first (ties: the older job). The level's virtual
time is the start tag of the job dispatched last, so a tenant that was idle starts level with the
others instead of cashing in credit, and a tenant that just arrived is ahead of every tenant that
has a job running: it waits at most for one of their jobs to end. One tenant's thirty 30k-token
prompts then take turns with another's two 1k-token ones by tokens, not by count: the second
tenant's jobs run before the first tenant's second prompt.

A tenant's jobs are charged their tokens divided by its weight (`fairness.tenants.NAME.weight` of
kvgate.yaml, `fairness.default_weight` for the rest: the gate's weights, kvgate.policy.fair_share), so a
tenant of weight 3 gets three times the tokens of a tenant of weight 1 while both wait.

Pure and in memory: the dispatcher feeds it the heads of each (priority, tenant) group read from the
store and tells it what it dispatched. Each replica keeps its own tags; with several replicas the
share is fair per replica, and close to fair overall.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container, Iterable

from kvgate.queue.jobs import Waiting

_Group = tuple[int, str]


class FairQueue:
    def __init__(self, weight: Callable[[str], float] = lambda tenant: 1.0) -> None:
        self._weight = weight
        self._groups: dict[_Group, deque[Waiting]] = {}
        # Groups the store may hold more of than it handed over: once one empties, read again.
        self._truncated: set[_Group] = set()
        self._finish: dict[_Group, float] = {}
        self._virtual: dict[int, float] = {}
        self.needs_reload = True

    def load(self, waiting: Iterable[Waiting], per_group: int) -> None:
        """Replace what is waiting with the store's heads (at most `per_group` per priority and tenant)."""
        groups: dict[_Group, deque[Waiting]] = {}
        for job in sorted(waiting, key=lambda j: j.seq):
            groups.setdefault((job.priority, job.tenant), deque()).append(job)
        self._groups = groups
        self._truncated = {key for key, jobs in groups.items() if len(jobs) >= per_group}
        # A finish tag at or below its level's virtual time no longer changes any start tag.
        self._finish = {key: tag for key, tag in self._finish.items() if tag > self._virtual.get(key[0], 0.0)}
        self.needs_reload = False

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._groups.values())

    def next(self, passed: Container[str] = frozenset()) -> Waiting | None:
        """The job to dispatch next (it stays waiting until `dispatched` or `drop`), leaving out the
        ids in `passed` (jobs this round found no room for, which later ones may go beside)."""
        best: tuple[int, float, int, Waiting] | None = None
        for (priority, tenant), jobs in self._groups.items():
            head = next((job for job in jobs if job.id not in passed), None)
            if head is None:
                continue
            candidate = (priority, self._start(priority, tenant), head.seq, head)
            if best is None or candidate[:3] < best[:3]:
                best = candidate
        return best[3] if best is not None else None

    def dispatched(self, job: Waiting) -> None:
        """`job` was sent to a node: charge its tenant its tokens."""
        start = self._start(job.priority, job.tenant)
        self._virtual[job.priority] = start
        self._finish[(job.priority, job.tenant)] = start + job.tokens / self._weight(job.tenant)
        self._remove(job)

    def drop(self, job: Waiting) -> None:
        """`job` left the queue without this replica running it (cancelled, claimed elsewhere, failed)."""
        self._remove(job)

    def _start(self, priority: int, tenant: str) -> float:
        return max(self._virtual.get(priority, 0.0), self._finish.get((priority, tenant), 0.0))

    def _remove(self, job: Waiting) -> None:
        key = (job.priority, job.tenant)
        jobs = self._groups.get(key)
        if jobs is None or job not in jobs:
            return
        jobs.remove(job)
        if not jobs:
            del self._groups[key]
            if key in self._truncated:
                self.needs_reload = True
