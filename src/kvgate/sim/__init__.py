"""A simulated GPU inference node: an OpenAI-compatible server over a vLLM-like KV-cache engine model.

The engine model (`engine`, pure and clock-driven) is apart from its HTTP adapter (`server`), so the
scheduler's KV accounting can be tested by hand-computed cases and the same model serves the demo,
the tests and the benchmarks.
"""

from kvgate.sim.engine import Engine, EngineConfig, EngineStats, Step, TokenEvent
from kvgate.sim.tokens import count_text_tokens, make_prompt

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineStats",
    "Step",
    "TokenEvent",
    "count_text_tokens",
    "make_prompt",
]
