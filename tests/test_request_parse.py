"""Request understanding: every API shape, the output budget, malformed input, bounded decompression."""

from __future__ import annotations

import contextlib
import gzip
import json
import random
import zlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.errors import BodyTooLargeError, InvalidRequestError, UnsupportedEncodingError
from kvgate.request import Api, ParseLimits, api_for_path, decompress, is_json_content_type, parse_body
from kvgate.request.parse import parse_document
from kvgate.request.typed import typed_shape


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


# The typed fast path (kvgate.request.typed) against the standard one: json.loads and the readers of
# a decoded document, the way every body was read before it.


DEFAULT_LIMITS = ParseLimits()


def standard_outcome(api: Api, body: bytes, limits: ParseLimits = DEFAULT_LIMITS) -> Any:
    """What parse_body answered when every body went through json.loads (its messages as they were)."""
    try:
        document = json.loads(body)
    except UnicodeDecodeError as exc:
        return f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}."
    except json.JSONDecodeError as exc:
        return f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})."
    except RecursionError:
        return "The request body is nested too deeply."
    if not isinstance(document, dict):
        return f"The request body must be a JSON object, got {type(document).__name__}."
    try:
        return parse_document(api, document, limits)
    except InvalidRequestError as exc:
        return exc.message


def outcome(api: Api, body: bytes, limits: ParseLimits = DEFAULT_LIMITS) -> Any:
    try:
        return parse_body(api, body, limits)
    except InvalidRequestError as exc:
        return exc.message


parts = st.deferred(
    lambda: st.one_of(
        st.text(max_size=6),
        st.fixed_dictionaries(
            {},
            optional={
                "type": st.sampled_from(
                    ["text", "input_text", "image_url", "input_image", "image", "tool_use", "tool_result"]
                )
                | st.none()
                | st.integers(),
                "text": st.text(max_size=6) | st.none() | st.integers(),
                "input": json_values,
                "content": st.text(max_size=6) | st.none() | st.lists(parts, max_size=3),
                "image_url": st.fixed_dictionaries({"url": st.text(max_size=10)}),
            },
        ),
        json_values,
    )
)
contents = st.text(max_size=8) | st.none() | st.lists(parts, max_size=3) | json_values
tool_calls = st.lists(
    st.fixed_dictionaries(
        {"function": st.fixed_dictionaries({}, optional={"name": json_values, "arguments": json_values})}
    )
    | json_values,
    max_size=2,
)
typed_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"])},
        optional={"content": contents, "tool_calls": tool_calls | json_values, "name": st.text(max_size=4)},
    )
    | json_values,
    max_size=4,
)
counts = st.integers(min_value=-2, max_value=5) | st.booleans() | st.none() | st.floats(allow_nan=False)
request_bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.text(max_size=4) | st.none() | st.integers(),
        "messages": typed_messages | json_values,
        "system": contents,
        "prompt": json_values | st.lists(st.integers(min_value=0, max_value=9), max_size=3),
        "input": json_values | st.lists(parts, max_size=3),
        "suffix": st.text(max_size=4) | json_values,
        "instructions": st.text(max_size=4) | json_values,
        "tools": st.lists(json_values, max_size=2) | json_values,
        "functions": st.lists(json_values, max_size=2) | json_values,
        "response_format": st.fixed_dictionaries({"json_schema": json_values}) | json_values,
        "text": st.fixed_dictionaries({"format": json_values}) | json_values,
        "n": counts,
        "best_of": counts,
        "max_tokens": counts,
        "max_completion_tokens": counts,
        "max_output_tokens": counts,
        "stream": st.booleans() | json_values,
        "temperature": json_values,
    },
)


@settings(max_examples=600, deadline=None)
@given(
    api=st.sampled_from(list(Api)),
    body=request_bodies,
    ascii_only=st.booleans(),
    depth=st.sampled_from([2, 64]),
)
def test_the_typed_path_reads_every_body_as_the_standard_path_does(
    api: Api, body: dict[str, Any], ascii_only: bool, depth: int
) -> None:
    raw = json.dumps(body, ensure_ascii=ascii_only).encode()
    limits = ParseLimits(max_messages=3, max_json_depth=depth)
    assert outcome(api, raw, limits) == standard_outcome(api, raw, limits)


def test_the_typed_path_takes_the_usual_requests() -> None:
    chat_body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}],
            },
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "max_tokens": 10,
    }
    for api, body in (
        (Api.CHAT, chat_body),
        (
            Api.ANTHROPIC_MESSAGES,
            {"system": "s", "messages": [{"role": "user", "content": "q"}], "max_tokens": 5},
        ),
        (
            Api.RESPONSES,
            {
                "instructions": "i",
                "input": [{"role": "user", "content": "q"}, {"type": "input_text", "text": "t"}],
            },
        ),
        (Api.COMPLETIONS, {"prompt": ["a", "b"], "n": 2, "max_tokens": 3}),
        (Api.EMBEDDINGS, {"input": [[1, 2], [3]]}),
    ):
        raw = json.dumps(body).encode()
        assert typed_shape(api, raw, ParseLimits()) == parse_document(api, body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": [], "temperature": NaN}',  # json.loads accepts NaN and Infinity, msgspec does not
        b'{"messages": [], "temperature": 1e400}',
        b'\xef\xbb\xbf{"messages": []}',  # a UTF-8 byte-order mark
        '{"messages": [{"role": "user", "content": "hi"}]}'.encode("utf-16"),
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate, escaped
        b'{"messages": [], "user": "\xed\xa0\x80"}',  # an encoded surrogate
        b'{"messages": [], "user": "\xff"}',  # not UTF-8, in a field the typed path skips
        b'{"messages": [], "user": "caf\xc3\xa9"}',
        b'{"messages": [], "messages": [{"role": "user", "content": "the last one counts"}]}',
        b'{"messages": [], "max_tokens": ' + b"1" * 5000 + b"}",
    ],
)
def test_bodies_the_decoders_disagree_on_get_the_standard_answer(body: bytes) -> None:
    try:
        expected = standard_outcome(Api.CHAT, body)
    except ValueError:  # an integer past Python's digit limit: json.loads's own error, as before
        with pytest.raises(ValueError, match="Exceeds the limit"):
            parse_body(Api.CHAT, body)
        return
    assert outcome(Api.CHAT, body) == expected


short_text = st.text(max_size=6)
# JSON as RFC 8259 has it (no Infinity, which json.dumps writes for inf and json.loads reads back).
rfc_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=30,
)
valid_parts = st.deferred(
    lambda: (
        short_text
        | st.fixed_dictionaries(
            {},
            optional={
                "type": st.sampled_from(
                    ["text", "input_text", "image_url", "image", "tool_use", "tool_result"]
                ),
                "text": short_text | st.none(),
                "input": rfc_json_values,
                "content": valid_contents,
                "image_url": st.fixed_dictionaries({"url": short_text}),
            },
        )
    )
)
valid_contents = short_text | st.none() | st.lists(valid_parts, max_size=3)
valid_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"])},
        optional={
            "content": valid_contents,
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {
                        "function": st.fixed_dictionaries(
                            {}, optional={"name": rfc_json_values, "arguments": rfc_json_values}
                        )
                    }
                )
                | rfc_json_values,
                max_size=2,
            ),
            "name": short_text,
        },
    ),
    max_size=4,
)
budgets = st.none() | st.integers(min_value=0, max_value=100)
copies = st.none() | st.integers(min_value=1, max_value=4)
prompts = (
    short_text
    | st.lists(short_text, max_size=3)
    | st.lists(st.integers(min_value=0, max_value=9), max_size=3)
    | st.lists(st.lists(st.integers(min_value=0, max_value=9), max_size=3), max_size=2)
)
common = {
    "model": short_text | st.none(),
    "stream": rfc_json_values,
    "temperature": rfc_json_values,
    "user": short_text,
}
definitions = st.none() | st.lists(rfc_json_values, max_size=2)
valid_bodies = {
    Api.CHAT: st.fixed_dictionaries(
        {"messages": valid_messages},
        optional={
            **common,
            "tools": definitions,
            "functions": definitions,
            "response_format": st.none()
            | st.fixed_dictionaries({"type": short_text}, optional={"json_schema": rfc_json_values}),
            "n": copies,
            "max_tokens": budgets,
            "max_completion_tokens": budgets,
        },
    ),
    Api.COMPLETIONS: st.fixed_dictionaries(
        {"prompt": prompts},
        optional={
            **common,
            "suffix": short_text | st.none(),
            "n": copies,
            "best_of": copies,
            "max_tokens": budgets,
        },
    ),
    Api.EMBEDDINGS: st.fixed_dictionaries({"input": prompts}, optional=common),
    Api.RESPONSES: st.fixed_dictionaries(
        {},
        optional={
            **common,
            "instructions": short_text | st.none(),
            "input": short_text
            | st.none()
            | st.lists(
                short_text
                | st.fixed_dictionaries(
                    {"role": short_text}, optional={"type": st.just("message"), "content": valid_contents}
                )
                | valid_parts,
                max_size=3,
            ),
            "tools": definitions,
            "text": st.none() | st.fixed_dictionaries({}, optional={"format": rfc_json_values}),
            "max_output_tokens": budgets,
        },
    ),
    Api.ANTHROPIC_MESSAGES: st.fixed_dictionaries(
        {"messages": valid_messages},
        optional={**common, "system": valid_contents, "tools": definitions, "max_tokens": budgets},
    ),
}


@settings(max_examples=500, deadline=None)
@given(data=st.data(), api=st.sampled_from(list(Api)))
def test_the_typed_path_reads_every_well_formed_request_and_as_the_standard_path_does(
    data: st.DataObject, api: Api
) -> None:
    body = data.draw(valid_bodies[api])
    raw = json.dumps(body).encode()
    shape = typed_shape(api, raw, ParseLimits())
    assert shape is not None
    assert shape == parse_document(api, json.loads(raw))


def test_a_body_compressed_past_one_input_slice_inflates_whole() -> None:
    noise = random.Random(0).randbytes(700_000).hex()  # compresses to about half: several input slices
    data = json.dumps({"messages": [{"role": "user", "content": noise}]})
    for packed, encoding in (
        (gzip.compress(data.encode(), 1), "gzip"),
        (zlib.compress(data.encode(), 1), "deflate"),
    ):
        assert len(packed) > 600_000  # more than two of decompress's slices
        assert decompress(packed, encoding, 1 << 24) == data.encode()
        assert decompress(packed + b"trailing", encoding, 1 << 24) == data.encode()
        with pytest.raises(InvalidRequestError, match="truncated"):
            decompress(packed[: len(packed) // 2], encoding, 1 << 24)
        with pytest.raises(BodyTooLargeError):
            decompress(packed, encoding, len(data) - 1)
