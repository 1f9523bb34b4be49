"""Shared fixtures: real tokenizer files, recording upstream pools."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mistral_common
import pytest

from kvgate.harness.upstreams import Upstreams
from kvgate.localports import free_port

TOKENIZER_DIR = Path(mistral_common.__file__).parent / "data"


@pytest.fixture(scope="session")
def sp_model_path() -> Path:
    return TOKENIZER_DIR / "mistral_instruct_tokenizer_240323.model.v3"


@pytest.fixture
def pools() -> Iterator[tuple[dict[str, int], Upstreams]]:
    """Recording upstreams for the interactive, long-context and async pools, on free ports."""
    ports = {name: free_port() for name in ("interactive", "long", "async")}
    upstreams = Upstreams(dict(ports))
    upstreams.start()
    try:
        yield ports, upstreams
    finally:
        upstreams.stop()
