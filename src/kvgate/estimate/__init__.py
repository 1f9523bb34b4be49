"""Token estimation: a fast estimate for every request, an exact count only near a threshold.

Pure (no I/O beyond reading the tokenizer and calibration files they are given): the features and
fast estimate, the exact counters, the decision of how far to count, the calibration fit. The
estimator runs exact counts in worker processes (`pool`) off the event loop (`estimator`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvgate.estimate import calibration
from kvgate.estimate.estimator import Estimator, PromptCosts, TokenEstimate, Unavailable
from kvgate.estimate.exact import TokenizerFile
from kvgate.estimate.fast import FastEstimator
from kvgate.estimate.pool import CountingPool


def build_estimator(tokenizer_path: Path | None, costs: PromptCosts) -> Estimator:
    """The estimator for one model: exact counts come from the tokenizer file when one is configured.

    The tokenizer's calibration is found by the file's hash (see `calibration.for_tokenizer`), and its
    exact counts run in a worker process that starts now. A model without a tokenizer gets the fast
    estimate alone, with the calibrations of every shipped tokenizer family, settled on the safe side
    near a threshold (see `estimator`). Close the estimator at shutdown (`close()`, or use it in a
    `with` block): that stops its worker.
    """
    if tokenizer_path is None:
        return _without_tokenizer(costs)
    tokenizer = TokenizerFile.open(tokenizer_path)
    fast = FastEstimator(calibration.for_tokenizer(tokenizer))
    return Estimator(fast, tokenizer, costs, CountingPool(tokenizer))


def local_estimator(tokenizer_path: Path | None, costs: PromptCosts, *, notice: bool = True) -> Estimator:
    """The same estimator for commands and benchmarks: `estimate_sync` counts in the calling thread
    (there is no event loop to protect), and no worker process is started. `notice`: whether running
    without a tokenizer is announced in the log, as a server's operator needs; `kvgate estimate`, run by
    hand with its `--tokenizer` help in view, is spared the paragraph on every call."""
    if tokenizer_path is None:
        return _without_tokenizer(costs, notice=notice)
    tokenizer = TokenizerFile.open(tokenizer_path)
    return Estimator(FastEstimator(calibration.for_tokenizer(tokenizer)), tokenizer, costs)


log = logging.getLogger(__name__)
# English prose of about 4,000 tokens: how wide the band is without a tokenizer, for the notice below.
_PROSE = (
    "The gateway estimates how many tokens each request will hold before it reaches a model. "
    "Short chats go to the interactive pool, long documents to the long-context pool, and requests "
    "over the limit are refused with a clear message, so that one long prompt cannot push a node "
    "out of memory while everyone else waits.\n"
) * 70
_noticed = False


def _without_tokenizer(costs: PromptCosts, *, notice: bool = True) -> Estimator:
    fast = FastEstimator(*calibration.generic())
    if notice:
        _notice_once(fast)
    return Estimator(fast, None, costs)


def _notice_once(fast: FastEstimator) -> None:
    """Say once per process what running without a tokenizer costs."""
    global _noticed  # noqa: PLW0603 - one notice per process, however many models lack a tokenizer
    if _noticed:
        return
    _noticed = True
    band = fast.estimate(_PROSE)
    log.warning(
        "no tokenizer configured: token counts are estimates spanning the %s tokenizer families "
        "(about -%.0f%%/+%.0f%% for English prose, more for code, JSON and other scripts); a request whose "
        "band reaches across interactive_max_tokens goes to the long pool, and one is refused as too long "
        "only when its whole band is above max_total_tokens. Set the model's tokenizer for exact counts "
        "near the thresholds.",
        " and ".join(c.tokenizer for c in fast.calibrations),
        100 * (band.tokens - band.low) / band.tokens,
        100 * (band.high - band.tokens) / band.tokens,
    )


__all__ = ["Estimator", "PromptCosts", "TokenEstimate", "Unavailable", "build_estimator", "local_estimator"]
