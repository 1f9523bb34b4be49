"""Exact token counts from a real tokenizer file: sentencepiece `.model` or Hugging Face `tokenizer.json`."""

from __future__ import annotations

from pathlib import Path

from kvgate.errors import ConfigError


class SentencePieceCounter:
    def __init__(self, path: Path) -> None:
        import sentencepiece

        self._processor = sentencepiece.SentencePieceProcessor(model_file=str(path))

    def count(self, text: str) -> int:
        return len(self._processor.encode(text))


class HuggingFaceCounter:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(path))

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


def load_counter(path: Path) -> SentencePieceCounter | HuggingFaceCounter:
    """Pick the tokenizer library by the file's extension."""
    if not path.is_file():
        raise ConfigError(f"tokenizer file not found: {path}")
    if path.name.endswith(".json"):
        return HuggingFaceCounter(path)
    return SentencePieceCounter(path)
