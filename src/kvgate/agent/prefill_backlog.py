"""The prompt work a node's engine has yet to do for the reservations it granted: its prefill backlog.

Pure. Each grant adds its uncached prompt tokens; the backlog drains as a fluid queue at the node's
prefill rate (`kvgate agent --prefill-tokens-per-s`) from each grant on, the way Dynamo's
`active_prefill_tokens` and llm-d's token-load scorer count a worker's queued prefill
(ai-dynamo/dynamo lib/llm/src/kv_router, llm-d-inference-scheduler pkg/plugins/scorer). A new
request's first token on this node waits for that work first: the engine schedules waiting prompts
first come first served (vllm/v1/core/sched/scheduler.py, `schedule`; kvgate.sim.engine does the
same), so the backlog is what placement compares between nodes (kvgate.policy.nodes) and what an
interactive node's in-flight prefill budget bounds (kvgate.agent.lending). Draining first come first
served, it also says how many granted prompts are still being prefilled (`prompts`), which an
interactive node's limit on lent prefills at once bounds.

The rate is the node's nominal prefill rate: an engine that runs decode steps beside its prefill
drains slower, so the figure errs low on a busy node. It ranks nodes of one pool against each other,
which share the error, and it never admits anything on its own: KV is the ledger's.
"""

from __future__ import annotations

import math
from collections import deque

from kvgate.headroom.snapshot import prefill_left


class PrefillBacklog:
    def __init__(self, tokens_per_s: float) -> None:
        if tokens_per_s <= 0:
            raise ValueError(f"a prefill rate must be > 0 tokens a second, got {tokens_per_s}")
        self.tokens_per_s = tokens_per_s
        self._tokens = 0.0  # as of `_at`
        self._at = -math.inf
        self._granted = 0  # prompt tokens granted in all
        # Where each prompt still being prefilled ends, counted in `_granted`'s tokens: the first has
        # been prefilled once that many of all granted tokens have drained.
        self._ends: deque[int] = deque()

    def tokens(self, now: float) -> float:
        """Granted prompt tokens still to prefill at `now`."""
        if self._at == -math.inf:
            return 0.0
        return prefill_left(self._tokens, now - self._at, self.tokens_per_s)

    def follow(self, now: float, tokens_per_s: float) -> None:
        """Drain at `tokens_per_s` from `now` on (the engine's measured rate, kvgate.agent.prefill_rate)."""
        if tokens_per_s <= 0:
            raise ValueError(f"a prefill rate must be > 0 tokens a second, got {tokens_per_s}")
        if tokens_per_s == self.tokens_per_s:
            return
        if self._at != -math.inf:  # what is left now drains at the new rate
            self._tokens, self._at = self.tokens(now), now
        self.tokens_per_s = tokens_per_s

    def prompts(self, now: float) -> int:
        """Granted prompts not yet prefilled at `now`."""
        drained = self._granted - round(self.tokens(now))  # whole tokens: no float residue
        while self._ends and self._ends[0] <= drained:
            self._ends.popleft()
        return len(self._ends)

    def granted(self, now: float, uncached_prompt_tokens: int) -> None:
        """A reservation was granted: its uncached prompt joins the queue behind what is left."""
        self.prompts(now)  # forget the prompts already prefilled
        self._tokens = self.tokens(now) + uncached_prompt_tokens
        self._at = now
        if uncached_prompt_tokens > 0:
            self._granted += uncached_prompt_tokens
            self._ends.append(self._granted)
