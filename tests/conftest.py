"""Shared fixtures: real tokenizer files and token-exact texts."""

from __future__ import annotations

from pathlib import Path

import mistral_common
import pytest

TOKENIZER_DIR = Path(mistral_common.__file__).parent / "data"


@pytest.fixture(scope="session")
def sp_model_path() -> Path:
    return TOKENIZER_DIR / "mistral_instruct_tokenizer_240323.model.v3"
