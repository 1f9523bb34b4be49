"""Parse an inference API body into a RequestShape. Pure: no I/O, no configuration beyond its arguments.

Every piece of text the model will read counts toward the prompt: message contents, tool and function
definitions, JSON-schema response formats, instructions and system prompts. Structured pieces (tool
schemas, tool-call arguments given as objects) are counted on their compact JSON text, which is what
chat templates render.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvgate.errors import InvalidRequestError
from kvgate.request.body import Body
from kvgate.request.collect import Collector, ParseLimits, load_json
from kvgate.request.shape import Api, RequestShape
from kvgate.request.typed import typed_shape

__all__ = ["ParseLimits", "load_json", "parse_body", "parse_document"]


def _count(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidRequestError(f"'{key}' must be an integer >= {minimum}, got {value!r}.")
    return value


def _output_budget(body: dict[str, Any], keys: tuple[str, ...], n: int) -> int | None:
    for key in keys:
        budget = _count(body, key, 0)
        if budget is not None:
            return budget * n
    return None


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError(f"'model' must be a string, got {type(model).__name__}.")
    return model


def _shape(api: Api, body: dict[str, Any], collected: Collector, output: int | None, n: int) -> RequestShape:
    return RequestShape(
        api=api,
        model=_model(body),
        texts=tuple(collected.texts),
        token_ids=collected.token_ids,
        images=collected.images,
        messages=collected.messages,
        output_budget=output,
        n=n,
        stream=body.get("stream") is True,
    )


def _chat(body: dict[str, Any], limits: ParseLimits) -> RequestShape:
    if "messages" not in body:
        raise InvalidRequestError("'messages' is required.")
    collected = Collector(limits)
    collected.message_list(body["messages"], "messages")
    collected.definitions(body, "tools", "functions")
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and "json_schema" in response_format:
        collected.structured(response_format["json_schema"])
    n = _count(body, "n", 1) or 1
    output = _output_budget(body, ("max_completion_tokens", "max_tokens"), n)
    return _shape(Api.CHAT, body, collected, output, n)


def _completions(body: dict[str, Any], limits: ParseLimits) -> RequestShape:
    if "prompt" not in body:
        raise InvalidRequestError("'prompt' is required.")
    collected = Collector(limits)
    collected.prompt(body["prompt"], "prompt")
    collected.text(body.get("suffix"), "suffix")
    n = _count(body, "n", 1) or 1
    best_of = _count(body, "best_of", 1) or 1
    copies = max(n, best_of)
    output = _output_budget(body, ("max_tokens",), copies)
    return _shape(Api.COMPLETIONS, body, collected, output, copies)


def _responses(body: dict[str, Any], limits: ParseLimits) -> RequestShape:
    collected = Collector(limits)
    collected.text(body.get("instructions"), "instructions")
    items = body.get("input")
    if isinstance(items, list):
        for i, item in enumerate(items):
            if isinstance(item, dict) and item.get("type", "message") == "message":
                collected.messages += 1
                collected.content(item.get("content"), f"input[{i}].content")
            elif isinstance(item, dict):
                collected.part(item, f"input[{i}]")
            else:
                collected.text(item, f"input[{i}]")
    else:
        collected.text(items, "input")
    collected.definitions(body, "tools")
    text_format = body.get("text")
    if isinstance(text_format, dict):
        collected.structured(text_format.get("format"))
    output = _output_budget(body, ("max_output_tokens",), 1)
    return _shape(Api.RESPONSES, body, collected, output, 1)


def _embeddings(body: dict[str, Any], limits: ParseLimits) -> RequestShape:
    if "input" not in body:
        raise InvalidRequestError("'input' is required.")
    collected = Collector(limits)
    collected.prompt(body["input"], "input")
    # Embeddings generate nothing: no output budget to charge.
    return _shape(Api.EMBEDDINGS, body, collected, 0, 1)


def _anthropic_messages(body: dict[str, Any], limits: ParseLimits) -> RequestShape:
    if "messages" not in body:
        raise InvalidRequestError("'messages' is required.")
    collected = Collector(limits)
    collected.content(body.get("system"), "system")
    collected.message_list(body["messages"], "messages")
    collected.definitions(body, "tools")
    output = _output_budget(body, ("max_tokens",), 1)
    return _shape(Api.ANTHROPIC_MESSAGES, body, collected, output, 1)


_PARSERS: dict[Api, Callable[[dict[str, Any], ParseLimits], RequestShape]] = {
    Api.CHAT: _chat,
    Api.COMPLETIONS: _completions,
    Api.RESPONSES: _responses,
    Api.EMBEDDINGS: _embeddings,
    Api.ANTHROPIC_MESSAGES: _anthropic_messages,
}


_DEFAULT_LIMITS = ParseLimits()


def parse_body(api: Api, body: Body, limits: ParseLimits = _DEFAULT_LIMITS) -> RequestShape:
    """Parse a JSON body of the given API. Raises InvalidRequestError for anything malformed.

    The typed fast path (kvgate.request.typed) reads what it can; the rest, malformed bodies among
    them, is decoded whole and read here.
    """
    shape = typed_shape(api, body, limits)
    return shape if shape is not None else parse_document(api, load_json(body), limits)


def parse_document(api: Api, document: dict[str, Any], limits: ParseLimits = _DEFAULT_LIMITS) -> RequestShape:
    """The shape of a body already decoded into a JSON object."""
    return _PARSERS[api](document, limits)
