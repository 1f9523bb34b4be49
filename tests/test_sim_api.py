"""The simulator's prompt-token rule, request parsing and vLLM's 400 on context overflow."""

from __future__ import annotations

import random

import pytest

from kvgate.sim.api import EngineError, check_context, error_body, parse_request
from kvgate.sim.tokens import count_text_tokens, make_prompt


def test_tokens_are_utf8_bytes_over_four_rounded_up() -> None:
    assert count_text_tokens("") == 0
    assert count_text_tokens("abcd") == 1
    assert count_text_tokens("abcde") == 2
    assert count_text_tokens("日本") == 2  # 6 bytes


@pytest.mark.parametrize("size", [0, 1, 537, 32000])
def test_make_prompt_has_exactly_the_requested_size(size: int) -> None:
    assert count_text_tokens(make_prompt(size, random.Random(size))) == size


def test_chat_prompt_sums_text_parts_and_ignores_images() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "x" * 40},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "y" * 9},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            },
            {"role": "assistant", "content": None},
        ],
        "max_completion_tokens": 7,
        "max_tokens": 99,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request = parse_request("chat", body)
    assert (request.prompt_tokens, request.max_tokens, request.stream, request.include_usage) == (
        13,
        7,
        True,
        True,
    )


def test_completions_accept_text_and_token_ids_and_default_to_16_tokens() -> None:
    assert parse_request("completion", {"prompt": "abcdefgh"}).prompt_tokens == 2
    assert parse_request("completion", {"prompt": ["abcd"]}).prompt_tokens == 1
    request = parse_request("completion", {"prompt": [1, 2, 3]})
    assert (request.prompt_tokens, request.max_tokens) == (3, 16)
    assert parse_request("chat", {"messages": [{"role": "user", "content": "hi"}]}).max_tokens is None


@pytest.mark.parametrize(
    ("api", "body"),
    [
        ("chat", {"messages": []}),
        ("chat", "not an object"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "max_tokens": True}),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": "yes"}),
        ("completion", {"prompt": ["a", "b"]}),
        ("completion", {}),
    ],
)
def test_malformed_requests_are_400(api: str, body: object) -> None:
    with pytest.raises(EngineError) as info:
        parse_request(api, body)  # type: ignore[arg-type]
    assert info.value.status == 400


def test_prompt_plus_max_tokens_over_the_model_len_is_vllms_400() -> None:
    request = parse_request("chat", {"messages": [{"role": "user", "content": "w" * 4000}], "max_tokens": 97})
    check_context(request, max_model_len=1097)
    with pytest.raises(EngineError) as info:
        check_context(request, max_model_len=1096)
    assert error_body(info.value) == {
        "error": {
            "message": (
                "This model's maximum context length is 1096 tokens. However, you requested 1097 tokens "
                "(1000 in the messages, 97 in the completion). Please reduce the length of the messages or "
                "completion."
            ),
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }


def test_prompt_alone_at_the_model_len_is_400_when_no_max_tokens() -> None:
    request = parse_request("chat", {"messages": [{"role": "user", "content": "w" * 400}]})
    check_context(request, max_model_len=101)
    with pytest.raises(EngineError, match="your request has 100 input tokens"):
        check_context(request, max_model_len=100)
