"""Parse an inference API body into a RequestShape. Pure: no I/O, no configuration beyond its arguments.

Every piece of text the model will read counts toward the prompt: message contents, tool and function
definitions, JSON-schema response formats, instructions and system prompts. Structured pieces (tool
schemas, tool-call arguments given as objects) are counted on their compact JSON text, which is what
chat templates render.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.errors import InvalidRequestError
from kvgate.request.shape import Api, RequestShape

_IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})


@dataclass(frozen=True, slots=True)
class ParseLimits:
    """Bounds on what one body may contain; beyond them the request is a 400 that names the limit."""

    max_messages: int = 10_000
    max_json_depth: int = 64


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether nested arrays/objects go deeper than `limit`; iterative, so no recursion limit applies."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def load_json(body: bytes) -> dict[str, Any]:
    """Decode a JSON object body, mapping every failure to a 400 that says what was wrong."""
    try:
        document = json.loads(body)
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}."
        ) from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})."
        ) from exc
    except RecursionError as exc:
        raise InvalidRequestError("The request body is nested too deeply.") from exc
    if not isinstance(document, dict):
        raise InvalidRequestError(f"The request body must be a JSON object, got {type(document).__name__}.")
    return document


def _compact(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except RecursionError as exc:
        raise InvalidRequestError("The request body is nested too deeply.") from exc


class _Collector:
    """Accumulates prompt pieces while walking a body."""

    __slots__ = ("images", "limits", "messages", "texts", "token_ids")

    def __init__(self, limits: ParseLimits) -> None:
        self.limits = limits
        self.texts: list[str] = []
        self.token_ids = 0
        self.images = 0
        self.messages = 0

    def text(self, value: Any, where: str) -> None:
        if value is None:
            return
        if not isinstance(value, str):
            raise InvalidRequestError(f"'{where}' must be a string, got {type(value).__name__}.")
        if value:
            self.texts.append(value)

    def structured(self, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, str):
            self.texts.append(value)
            return
        if _depth_exceeds(value, self.limits.max_json_depth):
            raise InvalidRequestError(
                f"A schema or tool argument is nested deeper than {self.limits.max_json_depth} levels."
            )
        self.texts.append(_compact(value))

    def content(self, content: Any, where: str) -> None:
        """A message content: a string, or a list of typed parts (text, images, tool results)."""
        if content is None or isinstance(content, str):
            self.text(content, where)
            return
        if not isinstance(content, list):
            raise InvalidRequestError(f"'{where}' must be a string or an array of content parts.")
        for i, part in enumerate(content):
            self.part(part, f"{where}[{i}]")

    def part(self, part: Any, where: str) -> None:
        if isinstance(part, str):
            self.text(part, where)
            return
        if not isinstance(part, dict):
            raise InvalidRequestError(f"'{where}' must be an object.")
        kind = part.get("type")
        if kind in _IMAGE_PART_TYPES:
            self.images += 1
        elif kind == "tool_use":
            self.structured(part.get("input"))
        elif kind == "tool_result":
            self.content(part.get("content"), f"{where}.content")
        elif "text" in part:
            self.text(part["text"], f"{where}.text")

    def message_list(self, messages: Any, where: str) -> None:
        if not isinstance(messages, list):
            raise InvalidRequestError(f"'{where}' must be an array of messages.")
        if len(messages) > self.limits.max_messages:
            raise InvalidRequestError(
                f"'{where}' has {len(messages)} messages, "
                f"more than this gateway's limit of {self.limits.max_messages}."
            )
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidRequestError(f"'{where}[{i}]' must be an object.")
            self.messages += 1
            self.content(message.get("content"), f"{where}[{i}].content")
            calls = message.get("tool_calls") or ()
            if not isinstance(calls, list | tuple):
                raise InvalidRequestError(f"'{where}[{i}].tool_calls' must be an array.")
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict):
                    self.structured(function.get("name"))
                    self.structured(function.get("arguments"))

    def prompt(self, prompt: Any, where: str) -> None:
        """A completions/embeddings input: string, strings, token ids, or lists of token ids."""
        if isinstance(prompt, str):
            self.text(prompt, where)
        elif isinstance(prompt, list):
            if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
                self.token_ids += len(prompt)
                return
            for i, item in enumerate(prompt):
                if isinstance(item, list):
                    self.prompt(item, f"{where}[{i}]")
                else:
                    self.text(item, f"{where}[{i}]")
        elif prompt is not None:
            raise InvalidRequestError(
                f"'{where}' must be a string, an array of strings or an array of token ids."
            )

    def definitions(self, body: dict[str, Any], *keys: str) -> None:
        for key in keys:
            value = body.get(key)
            if value is None:
                continue
            if not isinstance(value, list):
                raise InvalidRequestError(f"'{key}' must be an array.")
            for item in value:
                self.structured(item)


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


def _shape(api: Api, body: dict[str, Any], collected: _Collector, output: int | None, n: int) -> RequestShape:
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
    collected = _Collector(limits)
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
    collected = _Collector(limits)
    collected.prompt(body["prompt"], "prompt")
    collected.text(body.get("suffix"), "suffix")
    n = _count(body, "n", 1) or 1
    best_of = _count(body, "best_of", 1) or 1
    copies = max(n, best_of)
    output = _output_budget(body, ("max_tokens",), copies)
    return _shape(Api.COMPLETIONS, body, collected, output, copies)


def _responses(body: dict[str, Any], limits: ParseLimits) -> RequestShape:
    collected = _Collector(limits)
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
    collected = _Collector(limits)
    collected.prompt(body["input"], "input")
    # Embeddings generate nothing: no output budget to charge.
    return _shape(Api.EMBEDDINGS, body, collected, 0, 1)


def _anthropic_messages(body: dict[str, Any], limits: ParseLimits) -> RequestShape:
    if "messages" not in body:
        raise InvalidRequestError("'messages' is required.")
    collected = _Collector(limits)
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


def parse_body(api: Api, body: bytes, limits: ParseLimits = _DEFAULT_LIMITS) -> RequestShape:
    """Parse a JSON body of the given API. Raises InvalidRequestError for anything malformed."""
    return _PARSERS[api](load_json(body), limits)
