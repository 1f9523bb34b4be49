"""What the simulator answers about a prompt's tokens: vLLM's /tokenize and render endpoints (pure).

The ids come from the simulator's tokenizer (kvgate.sim.tokens), part by part in prompt order, so
their number is the prompt tokens the simulator charges for the same request (its chat template adds
no tokens; an empty prompt is charged one token but has no ids). Shapes, as vLLM serves them:
- POST /tokenize (vllm/entrypoints/serve/tokenize/protocol.py @ 030ea52): `{"prompt": str}` or
  `{"messages": [...]}`, with `return_token_strs`; answers `{"count", "max_model_len", "tokens",
  "token_strs"}`.
- POST /v1/chat/completions/render and /v1/completions/render (vllm/entrypoints/serve/render/
  api_router.py @ 1c608d6): the request a chat or completions call would make, validated as the call
  is (a 400 for what the call refuses), answered as a GenerateRequest (vllm/entrypoints/serve/disagg/
  protocol.py @ 0640893: request_id, token_ids, features, sampling_params, model, stream,
  stream_options, cache_salt, priority, kv_transfer_params), one for chat, a list of one for
  completions. vllm-router's cache_aware and kv_aware policies route on these token_ids.
"""

from __future__ import annotations

from typing import Any

from kvgate.sim.api import CompletionRequest, bad_request, chat_parts
from kvgate.sim.tokens import SimTokenizer

# vLLM's SamplingParams defaults for the fields a render answer spells out (vllm/sampling_params.py).
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}


def prompt_ids(request: CompletionRequest, tokenizer: SimTokenizer) -> list[int]:
    """The token ids of a parsed request's prompt: its own ids, or its text parts' in order."""
    if request.prompt_ids is not None:
        return list(request.prompt_ids)
    ids: list[int] = []
    for _, text, _ in request.parts:
        ids += tokenizer.ids(text)
    return ids


def tokenize(body: object, tokenizer: SimTokenizer, max_model_len: int) -> dict[str, Any]:
    """The /tokenize answer for a request body; EngineError (400) for a malformed one."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    if "messages" in body:
        texts = [text for _, text, _ in chat_parts(body["messages"], tokenizer.count)]
    elif isinstance(body.get("prompt"), str):
        texts = [body["prompt"]]
    else:
        raise bad_request("a tokenize request needs 'prompt' (a string) or 'messages'")
    ids = [i for text in texts for i in tokenizer.ids(text)]
    strs = tokenizer.pieces(ids) if body.get("return_token_strs") is True else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def generate_request(
    request: CompletionRequest,
    body: dict[str, Any],
    *,
    ids: list[int],
    request_id: str,
    model: str,
    budget: int,
) -> dict[str, Any]:
    """The GenerateRequest a render endpoint answers: the prompt's ids and the sampling the call would
    run with (`budget`: its output tokens, the request's or vLLM's default)."""
    sampling = {
        key: default if body.get(key) is None else body[key] for key, default in _SAMPLING_DEFAULTS.items()
    }
    sampling["max_tokens"] = budget
    sampling["ignore_eos"] = request.ignore_eos
    return {
        "request_id": request_id,
        "token_ids": ids,
        "features": None,
        "sampling_params": sampling,
        "model": model,
        "stream": request.stream,
        "stream_options": body.get("stream_options"),
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0),
        "kv_transfer_params": None,
    }
