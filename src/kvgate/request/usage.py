"""The output tokens an answer reports in its `usage`, whichever API shape it has.

Pure. The shapes, as the engines and the official APIs write them:
- OpenAI chat and completions (vLLM, SGLang): `usage.completion_tokens`. Streamed, only in the last
  event, and only when the client asked `stream_options.include_usage` (vLLM
  vllm/entrypoints/openai/chat_completion/serving.py, `include_usage`).
- Anthropic messages: `usage.output_tokens`; streamed, in the `message_delta` event, cumulative.
- OpenAI responses: `usage.output_tokens`; streamed, in `response.completed` as `response.usage`.
A streamed answer is read from its tail: the usage is in its last events. None where the answer says
nothing (a stream without usage, an error, a body that is not JSON).
"""

from __future__ import annotations

import json
from typing import Any

SSE_DATA = b"data:"


def output_tokens(body: bytes, *, streamed: bool) -> int | None:
    if not streamed:
        return _from_json(body)
    for raw in reversed(body.split(b"\n")):
        line = raw.strip()
        if not line.startswith(SSE_DATA):
            continue
        found = _from_json(line[len(SSE_DATA) :])
        if found is not None:
            return found
    return None


def _from_json(text: bytes) -> int | None:
    try:
        document = json.loads(text)
    except ValueError:
        return None
    if not isinstance(document, dict):
        return None
    usage = document.get("usage")
    if not isinstance(usage, dict) and isinstance(document.get("response"), dict):
        usage = document["response"].get("usage")
    if not isinstance(usage, dict):
        return None
    found = _count(usage, "completion_tokens")
    return found if found is not None else _count(usage, "output_tokens")


def _count(usage: dict[str, Any], key: str) -> int | None:
    value = usage.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
