"""The fast estimate corrected by the exact counts the gate runs anyway, on the traffic it serves.

Pure. A calibration is fitted on a corpus; live traffic is other text. On the Mooncake replay's prompts
the tekken calibration reads every long prompt 5.7-7.1 % short (fast / exact 0.929-0.943 over 60
prompts, every one inside its band), so each reservation charged the engine's KV about 6 % less than
the prompt wrote, the ledger learnt it only at the next scrape, and a node at a 0.97 share preempted.
The gate already counts exactly every request whose band reaches across a threshold (near the
interactive limit, near max-model-len), off the event loop. Each complete count is a measurement of
the estimator on this traffic: exact text tokens / fast estimate.

A long request's fast estimate is then scaled by a high quantile (`QUANTILE`) of the last `WINDOW`
such ratios, once `MIN_SAMPLES` are in, and kept inside the estimate's own band: never below the
estimate (a calibration that reads this traffic long keeps its margin) and never past the band's high
(which held the truth for every prompt above). A fast answer is given only where no threshold lies
inside the band, so a value inside it keeps the class the band decided: only what the request
reserves moves. Texts under `MIN_TOKENS` teach nothing: a few tokens' rounding is a large ratio there.
"""

from __future__ import annotations

import math
from collections import deque

from kvgate.estimate.fast import TextBand
from kvgate.quantiles import nearest_rank

WINDOW = 256
MIN_SAMPLES = 16
QUANTILE = 0.9
MIN_TOKENS = 256
# Ratios are kept in thousandths: nearest_rank answers one of the values seen.
_SCALE = 1000


class LiveCorrection:
    def __init__(
        self, window: int = WINDOW, min_samples: int = MIN_SAMPLES, quantile: float = QUANTILE
    ) -> None:
        self._ratios: deque[int] = deque(maxlen=window)
        self._min_samples = min_samples
        self._quantile = quantile
        self._factor = 1.0

    def observe(self, estimated_text_tokens: int, exact_text_tokens: int) -> None:
        """One complete exact count of texts the fast estimator read as `estimated_text_tokens`."""
        if estimated_text_tokens < MIN_TOKENS:
            return
        self._ratios.append(math.ceil(exact_text_tokens * _SCALE / estimated_text_tokens))
        if len(self._ratios) >= self._min_samples:
            self._factor = max(1.0, nearest_rank(self._ratios, self._quantile) / _SCALE)

    @property
    def factor(self) -> float:
        """What the fast estimate is multiplied by now (1.0 until enough counts are in)."""
        return self._factor

    def corrected(self, band: TextBand) -> int:
        """The band's estimate scaled by the factor, kept within [estimate, high]."""
        return min(band.high, max(band.tokens, math.ceil(band.tokens * self._factor)))
