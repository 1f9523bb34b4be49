"""The gate's class decisions in auto mode agree with exact counts on the held-out corpus.

Every kind (English, code, Chinese, compact and pretty JSON, tool definitions, other languages, mixed)
and agent chats at 500 / 4k / 16k / 32k tokens, with output budgets that put the total just under and
just over each threshold, for a sentencepiece and a tekken tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TOKENIZER_DIR
from corpus.cases import cases

from kvgate.config import ModelConfig
from kvgate.estimate import PromptCosts, local_estimator
from kvgate.estimate.exact import TokenizerFile, load_counter
from kvgate.policy.classify import classify, thresholds

MODEL = ModelConfig()
# Where the exact total lands relative to a threshold.
OFFSETS = (-0.08, -0.03, -0.01, -0.002, 0.002, 0.01, 0.03, 0.08)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral_instruct_tokenizer_240323.model.v3", "tekken_240718.json"])
def test_auto_mode_never_disagrees_with_the_exact_class(name: str) -> None:
    path = TOKENIZER_DIR / name
    counter = load_counter(TokenizerFile.open(path))
    estimator = local_estimator(path, PromptCosts())
    limits = thresholds(MODEL)
    checked = fast_answers = 0
    disagreements = []
    for case in cases(counter.count):
        exact_prompt = estimator.count_sync(case.shape()).prompt_tokens
        budgets: list[int | None] = [None]
        budgets += [round(limit * (1 + offset)) - exact_prompt for limit in limits for offset in OFFSETS]
        for budget in budgets:
            if budget is not None and budget < 0:
                continue
            shape = case.shape(budget)
            auto = estimator.estimate_sync(shape, limits)
            truth = classify(exact_prompt + estimator.output_tokens(shape), MODEL)
            checked += 1
            fast_answers += auto.method == "fast"
            if classify(auto.total, MODEL) is not truth:
                disagreements.append((case.kind, case.size, budget, auto, exact_prompt))
    assert not disagreements
    assert checked > 500
    # Every case but the unbudgeted ones sits within 8% of a threshold, so most need a count; still
    # the fast estimate must settle a good share on its own, or auto mode would be no cheaper.
    assert fast_answers > checked // 5


def test_the_cases_cover_every_kind_at_every_size(sp_model_path: Path) -> None:
    counter = load_counter(TokenizerFile.open(sp_model_path))
    seen = {(case.kind, case.size) for case in cases(counter.count)}
    assert {kind for kind, _ in seen} >= {"english", "compact_json", "tools", "other", "mixed", "chat"}
    assert {size for _, size in seen} == {500, 4000, 16000, 32000}
