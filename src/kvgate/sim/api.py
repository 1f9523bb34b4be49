"""The OpenAI-compatible surface of the simulator, as vLLM's server shapes it (pure; no I/O).

Requests are read into a `CompletionRequest`; a request vLLM would refuse raises `EngineError`
with the status and message vLLM uses, and `error_body` renders it as vLLM's error JSON.
Prompt tokens are counted per text part and summed, by the counter the server is given: a real
tokenizer (`kvgate sim --tokenizer`) or `kvgate.sim.tokens`' ceil(UTF-8 bytes / 4); image parts are
not charged; a completions prompt given as token ids counts one token per id (and keeps them). The
parts are kept, in order with their message's role, for the prefix cache's block hashes
(kvgate.sim.blocks). `ignore_eos` is vLLM's sampling field of the same name (a boolean, default false).
`kvgate_sim_eos_after`, the simulator's own, is where the simulated model ends its answer when
max_tokens allows it: a replay that over-declares max_tokens, as reasoning clients do, says how long
each answer really is (a real engine ignores the field, as vLLM does fields it does not know).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvgate.errors import KvgateError
from kvgate.sim.tokens import count_text_tokens

Api = Literal["chat", "completion"]
TokenCount = Callable[[str], int]
Part = tuple[str, str, int]  # (role or "prompt", text, tokens)

# vLLM's completions endpoint generates 16 tokens when max_tokens is absent, like OpenAI's.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
SIM_EOS_AFTER = "kvgate_sim_eos_after"


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    api: Api
    model: str | None
    prompt_tokens: int
    max_tokens: int | None
    stream: bool
    include_usage: bool
    parts: tuple[Part, ...] = ()
    ignore_eos: bool = False
    prompt_ids: tuple[int, ...] | None = None  # a completions prompt given as token ids
    eos_after: int | None = None  # kvgate_sim_eos_after: the simulated answer's natural length


class EngineError(KvgateError):
    """A request the simulated engine refuses, with vLLM's status and error type (`BadRequestError`, …)."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message


def bad_request(message: str) -> EngineError:
    return EngineError(400, "BadRequestError", message)


def error_body(error: EngineError) -> dict[str, Any]:
    return {
        "error": {"message": error.message, "type": error.error_type, "param": None, "code": error.status}
    }


def parse_request(api: Api, body: object, count: TokenCount = count_text_tokens) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string")
    prompt_ids = None
    if api == "chat":
        parts = chat_parts(body.get("messages"), count)
        max_tokens = _positive_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _positive_int(body, "max_tokens")
    else:
        prompt_ids = _prompt_ids(body.get("prompt"))
        parts = (_completion_part(body.get("prompt"), count),)
        max_tokens = _positive_int(body, "max_tokens")
        if max_tokens is None:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false")
    options = body.get("stream_options") or {}
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad_request("'ignore_eos' must be true or false")
    prompt_tokens = max(sum(tokens for _, _, tokens in parts), 1)
    eos_after = _positive_int(body, SIM_EOS_AFTER)
    return CompletionRequest(
        api, model, prompt_tokens, max_tokens, stream, include_usage, parts, ignore_eos, prompt_ids, eos_after
    )


def check_context(request: CompletionRequest, max_model_len: int) -> None:
    """Refuse what vLLM refuses: a prompt plus output budget beyond max-model-len."""
    prompt = request.prompt_tokens
    if request.max_tokens is None:
        if prompt >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, your request has "
                f"{prompt} input tokens. Please reduce the length of the input messages."
            )
        return
    total = prompt + request.max_tokens
    if total > max_model_len:
        where = "messages" if request.api == "chat" else "prompt"
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({prompt} in the {where}, {request.max_tokens} in the completion). "
            f"Please reduce the length of the {where} or completion."
        )


def _positive_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"'{key}' must be a positive integer, got {value!r}")
    return value


def chat_parts(messages: object, count: TokenCount) -> tuple[Part, ...]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list")
    parts: list[Part] = []
    for message in messages:
        if not isinstance(message, dict):
            raise bad_request("each message must be an object")
        role = str(message.get("role", ""))
        content = message.get("content")
        if isinstance(content, str):
            parts.append((role, content, count(content)))
        elif isinstance(content, list):
            for part in content:
                if (
                    isinstance(part, dict)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    parts.append((role, part["text"], count(part["text"])))
        elif content is not None:
            raise bad_request("a message's 'content' must be a string or a list of parts")
    return tuple(parts)


def _completion_part(prompt: object, count: TokenCount) -> Part:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return ("prompt", prompt, max(count(prompt), 1))
    ids = _prompt_ids(prompt)
    if ids is not None:
        return ("prompt", ",".join(map(str, ids)), len(ids))
    raise bad_request("'prompt' must be a string, a list of one string, or a list of token ids")


def _prompt_ids(prompt: object) -> tuple[int, ...] | None:
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return tuple(prompt)
    return None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True, slots=True)
class Reply:
    """Builds the response objects of one request, streamed as vLLM chunks them or whole."""

    request: CompletionRequest
    request_id: str
    created: int
    model: str

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.request.api == "chat" else "text_completion"

    def role_chunk(self) -> dict[str, Any]:
        """vLLM's first chat chunk: the assistant role with empty content."""
        delta = {"role": "assistant", "content": ""}
        return self._envelope(
            self._chunk_object, [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
        )

    def chunk(self, text: str, finish: str | None) -> dict[str, Any]:
        if self.request.api == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {"content": text} if text else {}}
        else:
            choice = {"index": 0, "text": text}
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        return self._envelope(self._chunk_object, [choice])

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        body = self._envelope(self._chunk_object, [])
        body["usage"] = usage(self.request.prompt_tokens, completion_tokens)
        return body

    def full(self, text: str, finish: str, completion_tokens: int) -> dict[str, Any]:
        if self.request.api == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text}
            obj = "text_completion"
        choice["logprobs"] = None
        choice["finish_reason"] = finish
        body = self._envelope(obj, [choice])
        body["usage"] = usage(self.request.prompt_tokens, completion_tokens)
        return body
