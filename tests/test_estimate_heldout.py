"""The gate's class decisions in auto mode agree with exact counts on the held-out corpus.

English, code, Chinese, JSON, other languages and mixed chats at 500 / 4k / 16k / 32k tokens, with
output budgets that put the total just under and just over each threshold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from corpus.cases import cases

from kvgate.config import ModelConfig
from kvgate.estimate import PromptCosts, local_estimator
from kvgate.estimate.exact import TokenizerFile, load_counter
from kvgate.policy.classify import classify, thresholds

MODEL = ModelConfig()
# Where the exact total lands relative to a threshold.
OFFSETS = (-0.08, -0.03, -0.01, -0.002, 0.002, 0.01, 0.03, 0.08)


@pytest.mark.slow
def test_auto_mode_never_disagrees_with_the_exact_class(sp_model_path: Path) -> None:
    counter = load_counter(TokenizerFile.open(sp_model_path))
    estimator = local_estimator(sp_model_path, PromptCosts())
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
    assert checked > 300
    # The fast estimate must settle most requests on its own, or auto mode would be no cheaper.
    assert fast_answers > checked // 4
