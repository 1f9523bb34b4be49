"""What a pool could serve at full use, from the same engine model the simulated nodes run.

"Full use" means: each node holds as many long requests as its KV cache physically fits, and a new
one starts the moment one finishes. Replaying that closed loop on the pure engine model, in simulated
time, gives the tokens per second (prompt + generated) against which the demo's goodput is compared.
"""

from __future__ import annotations

from kvgate.demo.scenario import NodeProfile
from kvgate.sim.engine import Engine, EngineConfig


class _SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def node_capacity_tokens_per_s(
    node: NodeProfile, prompt_tokens: int, max_tokens: int, horizon_s: float = 600.0
) -> float:
    """Tokens per second one node serves with its KV cache full of these requests, back to back."""
    per_request = prompt_tokens + max_tokens
    slots = node.kv_capacity_tokens // per_request
    if slots == 0:
        return 0.0
    clock = _SimClock()
    config = EngineConfig(
        kv_capacity_tokens=node.kv_capacity_tokens,
        max_model_len=node.max_model_len,
        prefill_tokens_per_s=node.prefill_tokens_per_s,
        decode_tokens_per_s=node.decode_tokens_per_s,
        on_exhaustion="preempt",
    )
    engine = Engine(config, clock)
    started = 0
    for _ in range(slots):
        engine.add(f"r{started}", prompt_tokens, max_tokens)
        started += 1
    served = 0
    while clock.now < horizon_s:
        step = engine.schedule()
        clock.now += step.duration_s
        for event in engine.complete(step):
            if event.finished:
                served += per_request
                engine.add(f"r{started}", prompt_tokens, max_tokens)
                started += 1
    return served / clock.now
