"""The model's tokenizer in a demo scenario (`tokenizer:`): the simulated nodes count prompts with it,
the gate is configured with it (exact counts near its thresholds), and trace prompts are synthesised
to exact lengths under it (kvgate.demo.prompts).

A scenario names a tokenizer file by path, or by the bare file name of one that mistral-common ships
(`tekken_240911.json`, `tokenizer.model.v1`, …; installed with kvgate's dev dependencies). Without
one the nodes count ceil(UTF-8 bytes / 4) and the gate runs on its fast estimate alone.
"""

from __future__ import annotations

import functools
from pathlib import Path

from kvgate.demo.prompts import PromptBlocks
from kvgate.errors import ConfigError
from kvgate.sim.tokens import ByteQuads, SimTokenizer, load_tokenizer


@functools.cache
def tokenizer_file(name: str) -> Path:
    """The file a scenario's `tokenizer:` names; ConfigError when there is none."""
    path = Path(name)
    if path.is_file():
        return path.resolve()
    if path.name == name:
        try:
            import mistral_common  # a dev dependency: looked for only when a scenario names a file
        except ModuleNotFoundError:
            pass
        else:
            shipped = Path(mistral_common.__file__).parent / "data" / name
            if shipped.is_file():
                return shipped
    raise ConfigError(
        f"tokenizer {name!r}: no such file, nor one of mistral-common's tokenizers (`make setup` "
        "installs mistral-common with the dev dependencies)"
    )


@functools.cache
def prompt_blocks(name: str | None) -> PromptBlocks:
    """The prompt synthesiser for the tokenizer `name` (None: the simulators' bytes / 4 rule)."""
    tokenizer: SimTokenizer = ByteQuads() if name is None else load_tokenizer(tokenizer_file(name))
    return PromptBlocks(tokenizer)
