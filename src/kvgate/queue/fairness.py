"""Which waiting job runs next: priority first, then the tenant with the least weighted attained
service, then age.

Within one priority, tenants share the pool as the gate's line shares it (kvgate.policy.fair_share,
the Virtual Token Counter): each tenant's counter is the service it attained, divided by its weight
(`fairness.tenants.NAME.weight` of kvgate.yaml, else that of the class its latest job's Envoy route
gave it, `fairness.classes.NAME`, else `fairness.default_weight`: kvgate.policy.tenant_book), and the head
job of the tenant with the least counter goes first (ties: the older job). A tenant that starts
waiting is lifted to the least counter of those waiting, so a tenant that was idle starts level with
the others instead of cashing in credit. One tenant's thirty 30k-token prompts then take turns with
another's 1k-token ones by tokens, not by count, and a tenant of weight 3 gets three times the tokens
of a tenant of weight 1 while both wait.

A dispatched job is charged as the gate charges a request: its likeliest prompt count + `output_weight`
x its output budget (the JobCharge the store keeps), and the agent settles the output part on what the
engine generated when the job's reservation is released. A job stored by a kvgate that kept no charge
(schema 2) is charged its tokens, once, with nothing to settle. Each Reserve carries that charge to the
agent (kvgate.agent.tenant_service), and once the agents publish their
totals (`observe`) the counters are their sum over the agents: the gates' grants and every queue
replica's count alike, so the gates' lines and every queue replica order tenants by the same service,
and a queue restart loses nobody's share.

Pure and in memory: the dispatcher feeds it the heads of each (priority, tenant) group read from the
store, the agents' totals, and tells it what it dispatched.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Container, Iterable, Mapping, Sequence

from kvgate.config import FairnessConfig
from kvgate.headroom.snapshot import TenantCharge
from kvgate.policy.fair_share import FairShare
from kvgate.policy.tenant_book import TenantBook
from kvgate.queue.jobs import Waiting

_Group = tuple[int, str]
# A job whose charge the store does not keep (schema 2) is charged its whole estimate once, its output
# budget included, so the agent must settle nothing on top of it: at weight 0 it adds nothing for the
# output it measures over the hold.
NOTHING_TO_SETTLE = 0.0


class FairQueue:
    def __init__(
        self, fairness: FairnessConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        config = fairness or FairnessConfig()
        self._book = TenantBook(config)
        self._fair = FairShare(config, clock=clock, book=self._book)
        self._output_weight = config.output_weight
        self._groups: dict[_Group, deque[Waiting]] = {}
        # Groups the store may hold more of than it handed over: once one empties, read again.
        self._truncated: set[_Group] = set()
        self._backlogged: set[_Group] = set()  # (priority, tenant) with a job here: waiting, for the lifts
        self.needs_reload = True

    def load(self, waiting: Iterable[Waiting], per_group: int) -> None:
        """Replace what is waiting with the store's heads (at most `per_group` per priority and tenant)."""
        groups: dict[_Group, deque[Waiting]] = {}
        for job in sorted(waiting, key=lambda j: j.seq):
            groups.setdefault((job.priority, job.tenant), deque()).append(job)
            # Oldest first, so each tenant keeps the class of its latest job, as the gate keeps its
            # latest request's.
            self._book.learn(job.tenant, job.tenant_class)
        self._groups = groups
        self._truncated = {key for key, jobs in groups.items() if len(jobs) >= per_group}
        self._sync_backlog()
        self.needs_reload = False

    def observe(
        self,
        totals: Mapping[str, float],
        lifts: Mapping[str, float] | None = None,
        heads: Sequence[tuple[int, float]] = (),
    ) -> None:
        """Each tenant's service summed over the agents' messages, its largest lift, and the heads the
        agents hold room for: the counters and the lifts follow them from now."""
        self._fair.observe(totals, lifts, heads)

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._groups.values())

    def fair_service(self, tenant: str) -> float:
        """`tenant`'s place in the fair order (its weighted attained service, lifts included), as the
        agents order waiters of one rank by it (ReserveRequest.fair_service)."""
        return self._fair.counter(tenant)

    def next(
        self, passed: Container[str] = frozenset(), held_back: Container[_Group] = frozenset()
    ) -> Waiting | None:
        """The job to dispatch next (it stays waiting until `dispatched` or `drop`), leaving out the
        ids in `passed` (jobs this round found no room for, which later ones may go beside) and the
        (priority, tenant) groups `held_back` (too far ahead to go beside them: `may_pass`)."""
        best: tuple[int, float, float, int, Waiting] | None = None
        for group, jobs in self._groups.items():
            if group in held_back:
                continue
            priority, tenant = group
            head = next((job for job in jobs if job.id not in passed), None)
            if head is None:
                continue
            candidate = (priority, *self._fair.order(tenant), head.seq, head)
            if best is None or candidate[:4] < best[:4]:
                best = candidate
        return best[4] if best is not None else None

    def may_pass(self, job: Waiting, elsewhere: Iterable[float]) -> bool:
        """Whether `job` may go ahead of the jobs waiting here before it, and of the heads waiting at
        the counters `elsewhere` (other replicas' and the gates' lines), by the gate's rule: its
        tenant's counter with its cost stays within the largest cost of theirs
        (kvgate.policy.fair_share)."""
        return self._fair.may_pass(job.tenant, self.charge_of(job).cost, job.priority, elsewhere)

    def charge_of(self, job: Waiting) -> TenantCharge:
        """What `job`'s tenant is charged when it is dispatched, as its Reserve carries it."""
        lift = self._fair.lift_cost(job.tenant)
        if job.charge is None:
            return TenantCharge(job.tenant, float(job.tokens), NOTHING_TO_SETTLE, lift)
        cost = self._fair.cost(job.charge.prompt_tokens, job.charge.output_tokens)
        return TenantCharge(job.tenant, cost, self._output_weight, lift)

    def dispatched(self, job: Waiting) -> None:
        """`job` was sent to a node: charge its tenant."""
        self._fair.charge(job.tenant, self.charge_of(job).cost)
        self._remove(job)

    def drop(self, job: Waiting) -> None:
        """`job` left the queue without this replica running it (cancelled, claimed elsewhere, failed)."""
        self._remove(job)

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
            self._sync_backlog()

    def _sync_backlog(self) -> None:
        """A tenant that now has a job here starts waiting at its priority (lifted); one with none
        stops."""
        groups = {key: jobs[0].seq for key, jobs in self._groups.items()}
        for priority, tenant in sorted(
            groups.keys() - self._backlogged, key=groups.__getitem__
        ):  # as they arrived
            self._fair.waits(tenant, priority)
        for priority, tenant in self._backlogged - groups.keys():
            self._fair.done_waiting(tenant, priority)
        self._backlogged = set(groups)
