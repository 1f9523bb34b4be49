"""The routing decision: one pure rule over the estimate and the model's limits."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvgate.config import Config, ModelConfig, PoolNames, parse_config
from kvgate.policy import Reason, Refusal, Route, TokenClass, classify, decide
from kvgate.policy.models import ModelMatcher

MODEL = ModelConfig()


def test_defaults_from_the_field_report() -> None:
    assert classify(4096, MODEL) is TokenClass.INTERACTIVE
    assert classify(4097, MODEL) is TokenClass.LONG
    assert classify(16384, MODEL) is TokenClass.LONG
    assert classify(16385, MODEL) is TokenClass.TOO_LONG


def test_output_budget_counts_toward_the_total() -> None:
    assert decide(100, 6000, MODEL) == Route("long", Reason.LONG, 6100)
    assert decide(100, 500, MODEL) == Route("interactive", Reason.SHORT, 600)


def test_too_long_is_refused_naming_both_numbers() -> None:
    refusal = decide(20000, 1024, MODEL)
    assert isinstance(refusal, Refusal)
    assert (refusal.reason, refusal.tokens) == (Reason.TOO_LONG, 21024)
    assert "21024" in refusal.message and "16384" in refusal.message


def test_limits_and_pool_names_are_configurable() -> None:
    model = ModelConfig(interactive_max_tokens=8192, max_total_tokens=131072, pools=PoolNames(long="big"))
    assert decide(8200, 100, model) == Route("big", Reason.LONG, 8300)
    assert decide(100000, 0, model) == Route("big", Reason.LONG, 100000)


@given(st.integers(0, 10**6), st.integers(0, 10**6))
def test_every_total_gets_exactly_the_class_its_thresholds_say(prompt: int, output: int) -> None:
    decision = decide(prompt, output, MODEL)
    total = prompt + output
    if total > MODEL.max_total_tokens:
        assert isinstance(decision, Refusal) and decision.reason is Reason.TOO_LONG
    else:
        assert isinstance(decision, Route)
        assert decision.pool == ("interactive" if total <= MODEL.interactive_max_tokens else "long")


def test_model_matching_exact_then_glob_then_default() -> None:
    config = parse_config(
        """
models:
  - {match: "llama-*", max_total_tokens: 32768}
  - {match: "llama-3.1-8b", max_total_tokens: 65536}
  - {match: "*-embed", max_total_tokens: 512, interactive_max_tokens: 512}
"""
    )
    matcher = ModelMatcher(config)
    assert matcher.lookup("llama-3.1-8b").max_total_tokens == 65536
    assert matcher.lookup("llama-3.1-70b").max_total_tokens == 32768
    assert matcher.lookup("bge-embed").max_total_tokens == 512
    assert matcher.lookup("mistral") is config.default_model
    assert matcher.lookup(None) is config.default_model
    assert Config().default_model == config.default_model
