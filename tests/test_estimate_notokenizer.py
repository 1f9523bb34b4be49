"""Without a tokenizer: the estimate spans every tokenizer family, and a request near a threshold is
settled on its safe side. Never interactive when it is longer; never refused when it fits."""

from __future__ import annotations

import json
import logging
from functools import cache
from pathlib import Path

import pytest
from conftest import TOKENIZER_DIR
from corpus.cases import chars_per_token, text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvgate.estimate
from kvgate.config import ModelConfig
from kvgate.estimate import PromptCosts, local_estimator
from kvgate.estimate.decide import safe_total
from kvgate.estimate.estimator import Estimator
from kvgate.estimate.exact import TokenizerFile, load_counter
from kvgate.policy.classify import TokenClass, classify, thresholds
from kvgate.request.parse import parse_body
from kvgate.request.shape import Api

MODEL = ModelConfig()
LIMITS = thresholds(MODEL)
# One real tokenizer of each family the generic calibrations cover: the truth a deployment may have.
FAMILIES = ("mistral_instruct_tokenizer_240323.model.v3", "tekken_240718.json")
KINDS = ("english", "code", "chinese", "compact_json", "pretty_json", "tools", "other", "mixed")


def test_safe_total_goes_long_across_a_pool_boundary_and_never_over_the_limit() -> None:
    limits = (4096, 16384)
    assert safe_total(3000, 2500, 3500, limits) == 3000  # wholly interactive
    assert safe_total(4000, 3600, 4400, limits) == 4097  # across the pool boundary: long
    assert safe_total(4200, 3800, 4600, limits) == 4200  # already long
    assert safe_total(16000, 15000, 17000, limits) == 16000  # across the limit: kept, not refused
    assert safe_total(17000, 16000, 18000, limits) == 16384  # estimated over, might fit: not refused
    assert safe_total(17000, 16385, 18000, limits) == 17000  # surely over: refused
    assert safe_total(9000, 3000, 20000, limits) == 9000  # across both: long
    assert safe_total(2000, 1000, 20000, limits) == 4097
    assert safe_total(5000, 4000, 6000, ()) == 5000
    # A limit under the pool boundary (a route's metadata lowers it): the boundary no longer matters.
    assert safe_total(2100, 1800, 4500, (4096, 2000)) == 2000
    assert safe_total(2500, 2100, 4500, (4096, 2000)) == 2500


@cache
def truth(name: str) -> Estimator:
    return local_estimator(TOKENIZER_DIR / name, PromptCosts())


@cache
def ratio(kind: str) -> float:
    counter = load_counter(TokenizerFile.open(TOKENIZER_DIR / FAMILIES[0]))
    return chars_per_token(kind, counter.count)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A chat body whose total lands within 25% of a threshold: messages (and sometimes tool
    definitions, as compact JSON in a system message) cut from held-out text, and an output budget."""
    limit = draw(st.sampled_from(LIMITS))
    total = round(limit * draw(st.floats(0.75, 1.25)))
    budget = draw(st.integers(0, total // 3))
    parts = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=4))
    shares = [draw(st.floats(0.1, 1.0)) for _ in parts]
    messages = []
    for kind, share in zip(parts, shares, strict=True):
        length = round((total - budget) * share / sum(shares) * ratio(kind))
        body = text(kind)
        start = draw(st.integers(0, max(0, len(body) - length)))
        role = "system" if kind == "tools" else draw(st.sampled_from(["user", "assistant", "tool"]))
        messages.append({"role": role, "content": body[start : start + length]})
    return json.dumps({"model": "m", "messages": messages, "max_tokens": budget}).encode()


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(bodies())
def test_the_class_never_errs_on_the_unsafe_side_without_a_tokenizer(body: bytes) -> None:
    shape = parse_body(Api.CHAT, body)
    estimated = classify(local_estimator(None, PromptCosts()).estimate_sync(shape, LIMITS).total, MODEL)
    for name in FAMILIES:
        exact = classify(truth(name).count_sync(shape).total, MODEL)
        # Unsafe: a longer request in the interactive pool, or a request that fits refused.
        if exact is not TokenClass.INTERACTIVE:
            assert estimated is not TokenClass.INTERACTIVE, (name, exact)
        if exact is not TokenClass.TOO_LONG:
            assert estimated is not TokenClass.TOO_LONG, (name, exact)


def test_a_request_near_the_interactive_limit_goes_long_and_says_it_was_rounded() -> None:
    estimator = local_estimator(None, PromptCosts())
    prose = text("english")
    counted = truth(FAMILIES[0])
    content = prose[: round(3900 * ratio("english"))]
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 100})
    shape = parse_body(Api.CHAT, body.encode())
    assert abs(counted.count_sync(shape).total - 4096) < 300
    estimate = estimator.estimate_sync(shape, LIMITS)
    assert estimate.rounded
    assert classify(estimate.total, MODEL) is TokenClass.LONG
    # A tenant's fair-share charge counts the likeliest count, not the distance to the threshold.
    assert estimate.likely_prompt_tokens < estimate.prompt_tokens
    assert abs(estimate.likely_prompt_tokens - counted.count_sync(shape).prompt_tokens) < 300
    far = parse_body(Api.CHAT, json.dumps({"messages": [{"role": "user", "content": prose[:2000]}]}).encode())
    assert not estimator.estimate_sync(far, LIMITS).rounded


def test_no_tokenizer_is_announced_once_with_its_cost(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kvgate.estimate, "_noticed", False)
    with caplog.at_level(logging.WARNING, logger="kvgate.estimate"):
        local_estimator(None, PromptCosts())
        local_estimator(None, PromptCosts(default_output_tokens=10))
        local_estimator(Path(TOKENIZER_DIR / FAMILIES[0]), PromptCosts())
    notices = [r.getMessage() for r in caplog.records if "no tokenizer configured" in r.getMessage()]
    assert len(notices) == 1
    assert "long pool" in notices[0]
    assert "%" in notices[0]
