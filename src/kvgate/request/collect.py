"""Decoded JSON values to prompt pieces: the JSON decode of a body and the collector of its texts.

Both ways of reading a body use these: the per-API readers over a decoded document
(`kvgate.request.parse`) and the typed fast path (`kvgate.request.typed`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from kvgate.errors import InvalidRequestError
from kvgate.request.body import Body

_IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
# msgspec's decoder: the same values as json.loads for every body both accept, in half the time.
_DECODER = msgspec.json.Decoder()
# What msgspec refuses that the standard library may accept (NaN, 1e400, a byte-order mark, UTF-16,
# lone surrogates) or refuses with another message: json.loads decides those.
_MSGSPEC_REFUSALS = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


@dataclass(frozen=True, slots=True)
class ParseLimits:
    """Bounds on what one body may contain; beyond them the request is a 400 that names the limit."""

    max_messages: int = 10_000
    max_json_depth: int = 64


def is_image(kind: object) -> bool:
    return kind in _IMAGE_PART_TYPES


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


def load_json(body: Body) -> dict[str, Any]:
    """Decode a JSON object body, mapping every failure to a 400 that says what was wrong.

    msgspec decodes; a body it refuses is decoded again by json.loads, whose answer (a document, or
    the message of its error) is the one this function has always given.
    """
    try:
        document = _DECODER.decode(body)
    except _MSGSPEC_REFUSALS:
        document = _standard_load(body)
    if not isinstance(document, dict):
        raise InvalidRequestError(f"The request body must be a JSON object, got {type(document).__name__}.")
    return document


def _standard_load(body: Body) -> Any:
    try:
        return json.loads(body)
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


def _compact(value: Any) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    except RecursionError as exc:
        raise InvalidRequestError("The request body is nested too deeply.") from exc


class Collector:
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
        if is_image(kind):
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
        self.check_count(messages, where)
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise InvalidRequestError(f"'{where}[{i}]' must be an object.")
            self.messages += 1
            self.content(message.get("content"), f"{where}[{i}].content")
            calls = message.get("tool_calls") or ()
            if not isinstance(calls, list | tuple):
                raise InvalidRequestError(f"'{where}[{i}].tool_calls' must be an array.")
            self.tool_calls(calls)

    def check_count(self, messages: list[Any], where: str) -> None:
        if len(messages) > self.limits.max_messages:
            raise InvalidRequestError(
                f"'{where}' has {len(messages)} messages, "
                f"more than this gateway's limit of {self.limits.max_messages}."
            )

    def tool_calls(self, calls: list[Any] | tuple[Any, ...]) -> None:
        """A message's tool calls: each function's name and arguments (calls of other shapes are
        not the gate's to judge)."""
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
            self.definition_list(body.get(key), key)

    def definition_list(self, value: Any, key: str) -> None:
        if value is None:
            return
        if not isinstance(value, list):
            raise InvalidRequestError(f"'{key}' must be an array.")
        for item in value:
            self.structured(item)
