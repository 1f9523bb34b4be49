"""The fast path of `parse_body`: decode only the fields the gate reads, straight from the body bytes.

One msgspec decode per body against structs that name what the gate reads (message contents and
their parts, tool calls, definitions, budgets, the model): whatever else a body carries (roles, names,
sampling settings, an image's base64 data) is skipped without a Python object being built for it,
and a message is a struct, not a dict. On a chat of 2,000 short messages the decode takes about 0.7
of an untyped one; on one long text the two are the same (the text is the work).

It answers only for a body it reads whole: a body that strays from the structs (a wrong type
anywhere, a limit passed, JSON that msgspec refuses and the standard library accepts: NaN, 1e400,
a byte-order mark, lone surrogates) gets None, and `parse_body` reads it the standard way, which
gives its shape or the exact message it has always given. Where both answer, the shapes are equal
(tests/test_request_parse.py checks it on generated bodies).

msgspec skips the fields it is not asked for without checking their UTF-8, which json.loads checks:
only an ASCII body (`bytes.isascii`, a fraction of a millisecond per megabyte) comes here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from kvgate.errors import InvalidRequestError
from kvgate.request.body import Body
from kvgate.request.collect import Collector, ParseLimits, is_image
from kvgate.request.shape import Api, RequestShape

Budget = Annotated[int, Meta(ge=0)]
Copies = Annotated[int, Meta(ge=1)]


class Block(Struct):
    """A chat content part, an Anthropic content block or a Responses input item."""

    type: str | UnsetType | None = UNSET
    text: str | None = None
    input: Any = None
    content: str | list[str | Block] | None = None


Content = str | list[str | Block] | None


class Message(Struct):
    content: Content = None
    tool_calls: list[Any] | None = None


class ResponseFormat(Struct):
    json_schema: Any = None


class TextFormat(Struct):
    format: Any = None


class _Body(Struct):
    model: str | None = None
    stream: Any = None


class Chat(_Body):
    messages: list[Message] | UnsetType = UNSET
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    response_format: ResponseFormat | None = None
    n: Copies | None = None
    max_completion_tokens: Budget | None = None
    max_tokens: Budget | None = None


class Completions(_Body):
    prompt: Any = UNSET
    suffix: str | None = None
    n: Copies | None = None
    best_of: Copies | None = None
    max_tokens: Budget | None = None


class Responses(_Body):
    instructions: str | None = None
    input: str | list[str | Block] | None = None
    tools: list[Any] | None = None
    text: TextFormat | None = None
    max_output_tokens: Budget | None = None


class Embeddings(_Body):
    input: Any = UNSET


class AnthropicMessages(_Body):
    system: Content = None
    messages: list[Message] | UnsetType = UNSET
    tools: list[Any] | None = None
    max_tokens: Budget | None = None


class _NotHere(Exception):
    """The body strays from the structs: the standard path reads it."""


def _text(collected: Collector, value: str | None) -> None:
    if value:
        collected.texts.append(value)


def _content(collected: Collector, content: Content) -> None:
    if content is None or isinstance(content, str):
        _text(collected, content)
        return
    for part in content:
        _part(collected, part)


def _part(collected: Collector, part: str | Block) -> None:
    if isinstance(part, str):
        _text(collected, part)
        return
    kind = None if part.type is UNSET else part.type
    if is_image(kind):
        collected.images += 1
    elif kind == "tool_use":
        collected.structured(part.input)
    elif kind == "tool_result":
        _content(collected, part.content)
    else:
        _text(collected, part.text)


def _messages(collected: Collector, messages: list[Message] | UnsetType) -> None:
    if messages is UNSET:
        raise _NotHere  # "'messages' is required"
    collected.check_count(messages, "messages")
    for message in messages:
        collected.messages += 1
        _content(collected, message.content)
        if message.tool_calls:
            collected.tool_calls(message.tool_calls)


def _definitions(collected: Collector, definitions: list[Any] | None) -> None:
    for item in definitions or ():
        collected.structured(item)


def _shape(api: Api, body: _Body, collected: Collector, output: int | None, n: int) -> RequestShape:
    return RequestShape(
        api=api,
        model=body.model,
        texts=tuple(collected.texts),
        token_ids=collected.token_ids,
        images=collected.images,
        messages=collected.messages,
        output_budget=output,
        n=n,
        stream=body.stream is True,
    )


def _budget(budget: int | None, n: int) -> int | None:
    return None if budget is None else budget * n


def _chat(body: Chat, collected: Collector) -> RequestShape:
    _messages(collected, body.messages)
    _definitions(collected, body.tools)
    _definitions(collected, body.functions)
    if body.response_format is not None:
        collected.structured(body.response_format.json_schema)
    n = body.n or 1
    budget = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _shape(Api.CHAT, body, collected, _budget(budget, n), n)


def _completions(body: Completions, collected: Collector) -> RequestShape:
    if body.prompt is UNSET:
        raise _NotHere
    collected.prompt(body.prompt, "prompt")
    _text(collected, body.suffix)
    copies = max(body.n or 1, body.best_of or 1)
    return _shape(Api.COMPLETIONS, body, collected, _budget(body.max_tokens, copies), copies)


def _responses(body: Responses, collected: Collector) -> RequestShape:
    _text(collected, body.instructions)
    if isinstance(body.input, list):
        for item in body.input:
            if isinstance(item, Block) and item.type in (UNSET, "message"):
                collected.messages += 1
                _content(collected, item.content)
            else:
                _part(collected, item)
    else:
        _text(collected, body.input)
    _definitions(collected, body.tools)
    if body.text is not None:
        collected.structured(body.text.format)
    return _shape(Api.RESPONSES, body, collected, _budget(body.max_output_tokens, 1), 1)


def _embeddings(body: Embeddings, collected: Collector) -> RequestShape:
    if body.input is UNSET:
        raise _NotHere
    collected.prompt(body.input, "input")
    return _shape(Api.EMBEDDINGS, body, collected, 0, 1)


def _anthropic_messages(body: AnthropicMessages, collected: Collector) -> RequestShape:
    _content(collected, body.system)
    _messages(collected, body.messages)
    _definitions(collected, body.tools)
    return _shape(Api.ANTHROPIC_MESSAGES, body, collected, _budget(body.max_tokens, 1), 1)


B = TypeVar("B", bound=_Body)


class _Reader:
    """One API's struct decoder and the walk over what it decodes."""

    __slots__ = ("_decode", "_walk")

    def __init__(self, kind: type[B], walk: Callable[[B, Collector], RequestShape]) -> None:
        self._decode = msgspec.json.Decoder(kind).decode
        self._walk: Callable[[Any, Collector], RequestShape] = walk

    def read(self, body: Body, limits: ParseLimits) -> RequestShape:
        return self._walk(self._decode(body), Collector(limits))


_READERS = {
    Api.CHAT: _Reader(Chat, _chat),
    Api.COMPLETIONS: _Reader(Completions, _completions),
    Api.RESPONSES: _Reader(Responses, _responses),
    Api.EMBEDDINGS: _Reader(Embeddings, _embeddings),
    Api.ANTHROPIC_MESSAGES: _Reader(AnthropicMessages, _anthropic_messages),
}


def typed_shape(api: Api, body: Body, limits: ParseLimits) -> RequestShape | None:
    """The body's shape read through the structs, or None where the standard path must read it."""
    if not body.isascii():
        return None
    try:
        return _READERS[api].read(body, limits)
    except (msgspec.DecodeError, RecursionError, InvalidRequestError, _NotHere):
        return None
