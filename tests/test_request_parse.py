"""Request understanding: every API shape, the output budget, malformed input, bounded decompression."""

from __future__ import annotations

import contextlib
import gzip
import json
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.errors import BodyTooLargeError, InvalidRequestError, UnsupportedEncodingError
from kvgate.request import Api, ParseLimits, api_for_path, decompress, is_json_content_type, parse_body


def parse(api: Api, body: dict[str, Any]) -> Any:
    return parse_body(api, json.dumps(body).encode())


def test_paths_map_to_apis() -> None:
    assert api_for_path("/v1/chat/completions") is Api.CHAT
    assert api_for_path("/openai/v1/chat/completions?x=1") is Api.CHAT
    assert api_for_path("/v1/completions") is Api.COMPLETIONS
    assert api_for_path("/v1/responses") is Api.RESPONSES
    assert api_for_path("/v1/embeddings") is Api.EMBEDDINGS
    assert api_for_path("/v1/messages/") is Api.ANTHROPIC_MESSAGES
    assert api_for_path("/v1/models") is None
    assert api_for_path("/healthz") is None


def test_chat_collects_every_prompt_piece() -> None:
    shape = parse(
        Api.CHAT,
        {
            "model": "llama",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "describe"},
                        {"type": "image_url", "image_url": {"url": "https://x/y.png"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"function": {"name": "lookup", "arguments": '{"q": "kv"}'}}],
                },
            ],
            "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {}}},
            "max_completion_tokens": 100,
            "n": 2,
            "stream": True,
        },
    )
    assert shape.model == "llama"
    assert shape.messages == 3
    assert shape.images == 1
    assert shape.output_budget == 200
    assert shape.stream is True
    joined = "\n".join(shape.texts)
    for piece in ("be brief", "describe", "lookup", '{"q": "kv"}', '"parameters"', '"answer"'):
        assert piece in joined


def test_chat_without_budget_leaves_it_to_the_default() -> None:
    shape = parse(Api.CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    assert shape.output_budget is None
    assert shape.n == 1


def test_max_tokens_is_used_when_max_completion_tokens_is_absent() -> None:
    assert parse(Api.CHAT, {"messages": [], "max_tokens": 7}).output_budget == 7


def test_completions_prompt_forms() -> None:
    assert parse(Api.COMPLETIONS, {"prompt": "once upon"}).texts == ("once upon",)
    assert parse(Api.COMPLETIONS, {"prompt": ["a", "b"]}).texts == ("a", "b")
    ids = parse(Api.COMPLETIONS, {"prompt": [1, 2, 3, 4]})
    assert ids.token_ids == 4
    assert ids.texts == ()
    batch = parse(Api.COMPLETIONS, {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 10, "n": 3})
    assert batch.token_ids == 5
    assert batch.output_budget == 30


def test_responses_api() -> None:
    shape = parse(
        Api.RESPONSES,
        {
            "instructions": "you are terse",
            "input": [
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hello"}, {"type": "input_image"}],
                }
            ],
            "max_output_tokens": 50,
        },
    )
    assert shape.texts == ("you are terse", "hello")
    assert shape.images == 1
    assert shape.output_budget == 50
    assert parse(Api.RESPONSES, {"input": "plain"}).texts == ("plain",)


def test_embeddings_charge_no_output() -> None:
    shape = parse(Api.EMBEDDINGS, {"input": ["a", "b"]})
    assert shape.output_budget == 0
    assert shape.texts == ("a", "b")


def test_anthropic_messages() -> None:
    shape = parse(
        Api.ANTHROPIC_MESSAGES,
        {
            "system": [{"type": "text", "text": "sys"}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "image", "source": {}}]},
                {"role": "assistant", "content": [{"type": "tool_use", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "content": "sunny"}]},
            ],
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
            "max_tokens": 512,
        },
    )
    assert shape.output_budget == 512
    assert shape.images == 1
    assert shape.messages == 3
    joined = " ".join(shape.texts)
    for piece in ("sys", "q", "Paris", "sunny", "weather"):
        assert piece in joined


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"messages": "hi"}', "'messages' must be an array"),
        (b'{"model": 5, "messages": []}', "'model' must be a string"),
        (b'{"messages": [], "max_tokens": -1}', "'max_tokens' must be an integer >= 0"),
        (b'{"messages": [], "max_tokens": true}', "'max_tokens'"),
        (b'{"messages": [], "n": 0}', "'n' must be an integer >= 1"),
        (b'{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
        (b'{"model": "m"}', "'messages' is required"),
        (b'{"messages": []}\xff', "not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    ],
)
def test_malformed_bodies_name_the_problem(body: bytes, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        parse_body(Api.CHAT, body)
    assert fragment in raised.value.message


def test_json_content_types() -> None:
    assert is_json_content_type("application/json; charset=utf-8")
    assert is_json_content_type("application/vnd.api+json")
    assert not is_json_content_type("text/plain")
    assert not is_json_content_type(None)


def test_gzip_and_deflate_round_trip() -> None:
    data = b'{"messages": []}' * 1000
    assert decompress(gzip.compress(data), "gzip", 1 << 20) == data
    assert decompress(zlib.compress(data), "deflate", 1 << 20) == data
    assert decompress(data, None, 1 << 20) == data


def test_zip_bomb_is_413_without_inflating_it_all() -> None:
    bomb = gzip.compress(bytes(50 * 1024 * 1024))
    with pytest.raises(BodyTooLargeError):
        decompress(bomb, "gzip", 1024 * 1024)


def test_truncated_and_unknown_encodings() -> None:
    with pytest.raises(InvalidRequestError, match="truncated"):
        decompress(gzip.compress(b"x" * 10000)[:-20], "gzip", 1 << 20)
    with pytest.raises(UnsupportedEncodingError, match="'br' is not supported"):
        decompress(b"x", "br", 1 << 20)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(
    api=st.sampled_from(list(Api)),
    body=st.dictionaries(
        st.sampled_from(
            [
                "model",
                "messages",
                "prompt",
                "input",
                "instructions",
                "system",
                "tools",
                "max_tokens",
                "n",
                "max_completion_tokens",
                "max_output_tokens",
                "response_format",
                "functions",
                "text",
                "best_of",
            ]
        ),
        json_values,
        max_size=6,
    ),
)
def test_any_json_object_parses_or_is_a_clean_400(api: Api, body: dict[str, Any]) -> None:
    try:
        shape = parse(api, body)
    except InvalidRequestError:
        return
    assert shape.token_ids >= 0 and shape.images >= 0
    assert shape.output_budget is None or shape.output_budget >= 0
    assert all(isinstance(t, str) for t in shape.texts)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_crash_the_parser(raw: bytes) -> None:
    for api in Api:
        with contextlib.suppress(InvalidRequestError):
            parse_body(api, raw)


messages = st.lists(
    st.dictionaries(st.sampled_from(["role", "content", "tool_calls", "name"]), json_values, max_size=4)
    | json_values,
    max_size=4,
)


@settings(max_examples=300, deadline=None)
@given(api=st.sampled_from([Api.CHAT, Api.ANTHROPIC_MESSAGES]), messages=messages, system=json_values)
def test_any_message_list_parses_or_is_a_clean_400(api: Api, messages: Any, system: Any) -> None:
    with contextlib.suppress(InvalidRequestError):
        parse(api, {"messages": messages, "system": system})


def test_message_count_and_schema_depth_limits_name_the_limit() -> None:
    limits = ParseLimits(max_messages=3, max_json_depth=4)
    many = json.dumps({"messages": [{"role": "user", "content": "x"}] * 4}).encode()
    with pytest.raises(InvalidRequestError, match="4 messages, more than this gateway's limit of 3"):
        parse_body(Api.CHAT, many, limits)
    deep_tool = {"messages": [], "tools": [{"a": {"b": {"c": {"d": {"e": 1}}}}}]}
    with pytest.raises(InvalidRequestError, match="nested deeper than 4 levels"):
        parse_body(Api.CHAT, json.dumps(deep_tool).encode(), limits)
    shallow_tool = {"messages": [], "tools": [{"a": {"b": {"c": 1}}}]}
    assert parse_body(Api.CHAT, json.dumps(shallow_tool).encode(), limits).texts
