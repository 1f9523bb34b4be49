"""Token estimation: a fast estimate for every request, an exact count only near a threshold.

Pure (no I/O beyond reading the tokenizer and calibration files they are given): the features and
fast estimate, the exact counters, the decision of how far to count, the calibration fit. The
estimator runs exact counts in worker processes (`pool`) off the event loop (`estimator`).
"""

from __future__ import annotations

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
    estimate alone, with the default calibration. Call `close()` on the estimator at shutdown.
    """
    if tokenizer_path is None:
        return Estimator(FastEstimator(calibration.default()), None, costs)
    tokenizer = TokenizerFile.open(tokenizer_path)
    fast = FastEstimator(calibration.for_tokenizer(tokenizer))
    return Estimator(fast, tokenizer, costs, CountingPool(tokenizer))


def local_estimator(tokenizer_path: Path | None, costs: PromptCosts) -> Estimator:
    """The same estimator for commands and benchmarks: `estimate_sync` counts in the calling thread
    (there is no event loop to protect), and no worker process is started."""
    if tokenizer_path is None:
        return Estimator(FastEstimator(calibration.default()), None, costs)
    tokenizer = TokenizerFile.open(tokenizer_path)
    return Estimator(FastEstimator(calibration.for_tokenizer(tokenizer)), tokenizer, costs)


__all__ = ["Estimator", "PromptCosts", "TokenEstimate", "Unavailable", "build_estimator", "local_estimator"]
