"""A prompt's prefix blocks as the gate cuts them: chained, full blocks only, model-scoped (what a cut
costs is `python -m bench prefix`'s figure)."""

from __future__ import annotations

import random

import pytest

from kvgate.request.prefix import prefix_chain, renders_definitions_first
from kvgate.sim.tokens import make_prompt

DOC = make_prompt(30_000, random.Random(1))


def test_prompts_share_the_blocks_of_their_common_beginning_and_no_more() -> None:
    one = prefix_chain([DOC, make_prompt(300, random.Random(10))], 30_300, 256, 1024)
    two = prefix_chain([DOC, make_prompt(300, random.Random(11))], 30_300, 256, 1024)
    assert one is not None and two is not None
    inside = 30_000 // 256  # blocks wholly inside the document: 117
    assert len(one.blocks) == len(two.blocks) == inside + 1
    assert one.blocks[:inside] == two.blocks[:inside]
    assert one.blocks[inside] != two.blocks[inside], "it holds the document's end and each question"
    other = prefix_chain([make_prompt(30_000, random.Random(2))], 30_000, 256, 1024)
    assert other is not None and not set(other.blocks) & set(one.blocks)


def test_a_block_hash_names_everything_before_it() -> None:
    shifted = prefix_chain([" and" + DOC], 30_001, 256, 1024)
    split = prefix_chain([DOC[:1000], DOC[1000:]], 30_000, 256, 1024)
    whole = prefix_chain([DOC], 30_000, 256, 1024)
    assert shifted is not None and split is not None and whole is not None
    assert not set(shifted.blocks) & set(whole.blocks)
    assert split.blocks[0] != whole.blocks[0], "the boundary between texts is part of the prompt"


def test_prompts_for_different_models_share_nothing() -> None:
    a = prefix_chain([DOC], 30_000, 256, 1024, "llama")
    b = prefix_chain([DOC], 30_000, 256, 1024, "mistral")
    assert a is not None and b is not None and not set(a.blocks) & set(b.blocks)


def test_a_block_stands_for_its_share_of_the_estimate_and_the_chain_never_exceeds_it() -> None:
    chain = prefix_chain([DOC], 33_000, 256, 1024)  # an estimate 10% above bytes / 4
    assert chain is not None
    assert chain.block_tokens == 33_000 * 1024 // len(DOC.encode())
    assert chain.tokens <= 33_000
    capped = prefix_chain([DOC], 30_000, 256, 10)
    assert capped is not None and len(capped.blocks) == 10
    assert prefix_chain(["too short"], 3, 256, 1024) is None
    with pytest.raises(ValueError, match="block_tokens"):
        prefix_chain([DOC], 30_000, 0, 1024)


def test_bodies_with_tool_definitions_are_recognised() -> None:
    assert renders_definitions_first(b'{"messages": [], "tools": [{"type": "function"}]}')
    assert renders_definitions_first(b'{"functions": [], "messages": []}')
    # Text that mentions tools is escaped inside a JSON string and is not a key.
    assert not renders_definitions_first(b'{"messages": [{"role": "user", "content": "say \\"tools\\""}]}')
