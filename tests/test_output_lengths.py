"""Output lengths learned from answers' usage (kvgate.request.usage, kvgate.policy.output_lengths): each
API's shape read, and the budget charged once enough answers were seen."""

from __future__ import annotations

import json

import pytest

from kvgate.policy.output_lengths import FLOOR, MIN_SAMPLES, REFRESH_EVERY, OutputLengths
from kvgate.request.usage import output_tokens


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("body", "streamed", "tokens"),
    [
        (json.dumps({"usage": {"prompt_tokens": 9, "completion_tokens": 31}}).encode(), False, 31),
        (
            json.dumps({"type": "message", "usage": {"input_tokens": 9, "output_tokens": 12}}).encode(),
            False,
            12,
        ),
        (json.dumps({"object": "response", "usage": {"output_tokens": 7}}).encode(), False, 7),
        (
            sse(
                {"choices": [{"delta": {"content": "a"}}]},
                {"choices": [], "usage": {"completion_tokens": 40}},
            ),
            True,
            40,
        ),
        (sse({"type": "message_delta", "usage": {"output_tokens": 15}}, {"type": "message_stop"}), True, 15),
        (sse({"type": "response.completed", "response": {"usage": {"output_tokens": 5}}}), True, 5),
        (json.dumps({"usage": {"completion_tokens": 0}}).encode(), False, 0),
    ],
    ids=[
        "openai",
        "anthropic",
        "responses",
        "openai-stream",
        "anthropic-stream",
        "responses-stream",
        "none-out",
    ],
)
def test_each_apis_usage_is_read(body: bytes, streamed: bool, tokens: int) -> None:
    assert output_tokens(body, streamed=streamed) == tokens


@pytest.mark.parametrize(
    ("body", "streamed"),
    [
        (b"not json", False),
        (b'{"error": {"message": "x"}}', False),
        (b'{"usage": {"completion_tokens": true}}', False),
        (sse({"choices": [{"delta": {"content": "a"}}]}), True),
        (b"[1, 2]", False),
    ],
)
def test_an_answer_without_usage_says_nothing(body: bytes, streamed: bool) -> None:
    assert output_tokens(body, streamed=streamed) is None


def test_the_budget_is_the_high_quantile_of_what_was_produced_once_enough_was_seen() -> None:
    lengths = OutputLengths()
    for tokens in range(1, MIN_SAMPLES):
        lengths.observe("chat", tokens * 10)
    assert lengths.budget("chat", 100_000) is None, "too few answers: the configured default holds"
    lengths.observe("chat", MIN_SAMPLES * 10)
    assert lengths.budget("chat", 100_000) == MIN_SAMPLES * 10, "q99 of 50 is their largest"
    assert lengths.budget("chat", 300) == 300, "never past the ceiling"
    assert lengths.budget("other", 100_000) is None, "each model and route learns on its own"
    for _ in range(REFRESH_EVERY):
        lengths.observe("chat", 1)
    assert lengths.budget("chat", 100_000) == MIN_SAMPLES * 10
    short = OutputLengths()
    for _ in range(MIN_SAMPLES):
        short.observe("chat", 3)
    assert short.budget("chat", 100_000) == FLOOR
