"""Requests built from the held-out corpus (never seen by the shipped calibrations).

Used by the estimation tests (bench/bench_estimate.py reads the same files). Sizes are nominal token
counts: a slice is cut at the kind's average characters per token, and whoever uses it counts it
exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvgate.request.shape import Api, RequestShape

HELDOUT = Path(__file__).resolve().parent / "heldout"
KINDS = ("english", "code", "chinese", "compact_json", "pretty_json", "tools", "other", "mixed")
SIZES = (500, 4000, 16000, 32000)
# The parts of an agent's chat and each one's share of its tokens: tool definitions, a system prompt,
# code, a tool result, a question in another language.
CHAT_PARTS = (
    ("tools", 0.2),
    ("english", 0.1),
    ("code", 0.3),
    ("compact_json", 0.2),
    ("chinese", 0.1),
    ("other", 0.1),
)


@dataclass(frozen=True, slots=True)
class Case:
    kind: str
    size: int  # nominal prompt tokens
    texts: tuple[str, ...]

    def shape(self, output_budget: int | None = None) -> RequestShape:
        return RequestShape(
            api=Api.CHAT, model=None, texts=self.texts, messages=len(self.texts), output_budget=output_budget
        )


@cache
def text(kind: str) -> str:
    return (HELDOUT / f"{kind}.txt").read_text("utf-8")


def chars_per_token(kind: str, count: Callable[[str], int]) -> float:
    return len(text(kind)) / count(text(kind))


def _slice(kind: str, tokens: int, offset: int, ratio: float) -> str | None:
    length = round(tokens * ratio)
    body = text(kind)
    start = offset * length // 2
    if start + length > len(body):
        return None
    return body[start : start + length]


def cases(count: Callable[[str], int], offsets: int = 3) -> Iterator[Case]:
    """Every kind (and agent chats) at every size in SIZES, at up to `offsets` places in the text."""
    ratios = {kind: chars_per_token(kind, count) for kind in KINDS}
    for size in SIZES:
        for offset in range(offsets):
            for kind in KINDS:
                piece = _slice(kind, size, offset, ratios[kind])
                if piece is not None:
                    yield Case(kind, size, (piece,))
            parts = [_slice(kind, round(size * share), offset, ratios[kind]) for kind, share in CHAT_PARTS]
            if all(part is not None for part in parts):
                yield Case("chat", size, tuple(part for part in parts if part))
