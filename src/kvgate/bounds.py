"""Bounds on numeric config fields, read by the config loader (`kvgate.config`) from field metadata.

A leaf module so that every section dataclass (config, headroom settings, TLS) can declare its bounds
without importing the loader.
"""

from __future__ import annotations


def at_least(minimum: float) -> dict[str, float]:
    """`field(metadata=at_least(1))`: the loader rejects smaller values, naming the key and line."""
    return {"min": minimum}
