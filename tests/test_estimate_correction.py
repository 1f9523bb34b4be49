"""The fast estimate learns from the exact counts the gate runs anyway (kvgate.estimate.correction): on
the Mooncake replay's text the tekken calibration reads long prompts about 6 % short, so reservations
charged less KV than the prompts wrote; once near-threshold requests were counted, a long request's
estimate is at or above its exact count, and never outside its band."""

from __future__ import annotations

from kvgate.demo.tokenizer import prompt_blocks, tokenizer_file
from kvgate.estimate import PromptCosts
from kvgate.estimate.cli import local_estimator
from kvgate.estimate.correction import MIN_SAMPLES, MIN_TOKENS, LiveCorrection
from kvgate.estimate.fast import TextBand
from kvgate.request.shape import Api, RequestShape

TOKENIZER = "tekken_240911.json"  # the replay's: its synthesised prompts are exact under it


def test_no_correction_until_enough_counts_then_a_high_quantile() -> None:
    correction = LiveCorrection()
    band = TextBand(10_000, 9_000, 11_500)
    for _ in range(MIN_SAMPLES - 1):
        correction.observe(1_000, 1_070)
    assert correction.factor == 1.0 and correction.corrected(band) == 10_000
    correction.observe(1_000, 1_070)
    assert correction.factor == 1.07
    assert correction.corrected(band) == 10_700
    # Nine in ten counts at 1.07 and one in ten higher: the high quantile is taken, not the mean.
    for _ in range(MIN_SAMPLES):
        correction.observe(1_000, 1_100)
    assert correction.factor == 1.1


def test_the_correction_stays_inside_the_band_and_never_lowers_the_estimate() -> None:
    short = LiveCorrection()
    for _ in range(MIN_SAMPLES):
        short.observe(1_000, 1_400)  # 40 % past the estimate: more than the band allows
    assert short.corrected(TextBand(10_000, 9_000, 11_500)) == 11_500
    long = LiveCorrection()
    for _ in range(MIN_SAMPLES):
        long.observe(1_000, 900)  # a calibration that reads this traffic long keeps its margin
    assert long.factor == 1.0
    assert long.corrected(TextBand(10_000, 9_000, 11_500)) == 10_000


def test_small_texts_teach_nothing() -> None:
    correction = LiveCorrection()
    for _ in range(4 * MIN_SAMPLES):
        correction.observe(MIN_TOKENS - 1, 2 * MIN_TOKENS)
    assert correction.factor == 1.0


def ids(first: int, tokens: int) -> list[int]:
    """The block ids of a prompt of `tokens` tokens (one per 512), from `first` on."""
    return list(range(first, first - (-tokens // 512)))


def chat_shape(text: str, budget: int) -> RequestShape:
    return RequestShape(Api.CHAT, None, (text,), messages=1, output_budget=budget)


def test_the_replays_long_prompts_are_charged_their_exact_size_after_the_near_threshold_counts() -> None:
    blocks = prompt_blocks(TOKENIZER)
    costs = PromptCosts()
    estimator = local_estimator(tokenizer_file(TOKENIZER), costs)
    sizes = [20_000 - 3_000 * i for i in range(5)]
    longs = [(blocks.prompt(ids(100 * i, tokens), tokens), tokens) for i, tokens in enumerate(sizes)]
    thresholds = (4096, 131_072)

    def charged(text: str) -> int:
        estimate = estimator.estimate_sync(chat_shape(text, 500), thresholds)
        assert estimate.method == "fast"
        return estimate.prompt_tokens - estimator.fixed_prompt_tokens(chat_shape(text, 500))

    before = [charged(text) / exact for text, exact in longs]
    assert max(before) < 0.97, "the calibration reads this text short: nothing to learn"
    # Chat requests right at the interactive limit: the gate counts each one exactly.
    for i in range(MIN_SAMPLES):
        tokens = 3_550 + 10 * i
        text = blocks.prompt(ids(1_000 + 8 * i, tokens), tokens)
        estimate = estimator.estimate_sync(chat_shape(text, 4096 - tokens - 4), thresholds)
        assert estimate.method == "exact" and estimate.complete
    after = [charged(text) / exact for text, exact in longs]
    assert min(after) >= 0.99, after
    for text, _ in longs:
        band = estimator.fast_band(chat_shape(text, 500))
        assert band.tokens <= charged(text) <= band.high
