"""Texts of a known exact token count, built with a real tokenizer."""

from __future__ import annotations

from pathlib import Path

import sentencepiece

_SENTENCES = (
    "The scheduler admits a request only when the node can hold its whole context in KV cache. ",
    "Long documents arrive in bursts, and every chat user waits when one node runs out of memory. ",
    "def admit(request):\n    return request.tokens <= headroom - reserved\n",
    "Le cache des clés et des valeurs grandit avec chaque jeton généré par le modèle. ",
    "請求在進入推理引擎之前必須先估計其長度。",
)


def text_with_tokens(model: Path, tokens: int) -> str:
    """A mixed-language text whose exact token count (no BOS) is `tokens`."""
    processor = sentencepiece.SentencePieceProcessor(model_file=str(model))
    pieces: list[str] = []
    count = 0
    i = 0
    while True:
        sentence = _SENTENCES[i % len(_SENTENCES)]
        i += 1
        n = len(processor.encode(sentence))
        if count + n > tokens:
            break
        pieces.append(sentence)
        count += n
    text = "".join(pieces)
    while len(processor.encode(text)) < tokens:
        text += " a"
    while len(processor.encode(text)) > tokens:
        text = text[:-1]
    return text
