"""A first fast estimator: UTF-8 bytes over a fitted bytes-per-token ratio, with a wide band.

Tokens never exceed UTF-8 bytes + 1 for byte-fallback sentencepiece and BPE tokenizers, which gives a
hard upper bound; the lower bound assumes the densest text seen (long words, ~6 bytes a token).
"""

from __future__ import annotations

from kvgate.estimate.estimator import TextBand

BYTES_PER_TOKEN = 3.3
MAX_BYTES_PER_TOKEN = 8.0


class ByteRatioEstimator:
    def estimate(self, text: str) -> TextBand:
        size = len(text.encode("utf-8", "surrogatepass"))
        return TextBand(
            tokens=round(size / BYTES_PER_TOKEN),
            low=int(size / MAX_BYTES_PER_TOKEN),
            high=size + 1,
        )
