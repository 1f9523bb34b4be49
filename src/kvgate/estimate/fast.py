"""The fast estimate of one text: fitted byte-class weights, an error band, and hard bounds.

The band is [estimate * (1 - over) - absolute, estimate * (1 + under) + absolute], with the errors
the tokenizer's calibration measured for texts of that size, then clipped to what holds whatever the
text: a text never takes more tokens than `max_tokens_per_byte` * its UTF-8 bytes + 1 (so a text of
fewer bytes than a threshold is certainly under it), nor fewer than its bytes over the longest piece
of the vocabulary.

Trap windows (see `features`) and emoji are uncertain by nature: the band spans everything they could
cost (from a vocabulary's longest piece per byte up to a token per byte; from the fewest to the most
tokens any emoji takes), so a trap can send a request to an exact count, never make a too-long
request look short, nor a long one look too long.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvgate.estimate.calibration import Calibration
from kvgate.estimate.features import (
    FEATURES,
    FULL_SCAN_BYTES,
    PAIRS_TO_FEATURES,
    UTF8_MAX_BYTES,
    WINDOW_BYTES,
    WINDOWS,
    Sample,
    pair_index_table,
    plain_pair_index,
    sample,
)

_FOURBYTE = FEATURES.index("fourbyte")
# Texts up to this many characters are encoded whole and, when they hold no trap, estimated straight
# from their class pairs: a chat turn costs three numpy calls instead of a feature tuple.
_DIRECT_CHARS = FULL_SCAN_BYTES // UTF8_MAX_BYTES


@dataclass(frozen=True, slots=True)
class TextBand:
    """An estimate of one text's tokens with bounds the true count is expected to lie within."""

    tokens: int
    low: int
    high: int

    def __add__(self, other: TextBand) -> TextBand:
        return TextBand(self.tokens + other.tokens, self.low + other.low, self.high + other.high)


EMPTY = TextBand(0, 0, 0)


class FastEstimator:
    __slots__ = ("_pair_tokens", "calibration")

    def __init__(self, calibration: Calibration) -> None:
        self.calibration = calibration
        # What each class pair adds to the linear estimate: the weights folded into the features.
        self._pair_tokens = pair_index_table(np.array(calibration.weights) @ PAIRS_TO_FEATURES)

    def estimate(self, text: str) -> TextBand:
        return self.estimate_all((text,))

    def estimate_all(self, texts: Sequence[str]) -> TextBand:
        """One band for several texts. Short ones are read as one text, so a chat of 500 short
        messages costs one read, not 500; long ones are read apart, so none is copied."""
        short = [t for t in texts if 0 < len(t) <= FULL_SCAN_BYTES]
        band = self._read("".join(short), len(short)) if short else EMPTY
        for text in texts:
            if len(text) > FULL_SCAN_BYTES:
                band = band + self.band(sample(text))
        return band

    def _read(self, text: str, texts: int) -> TextBand:
        """The band of `texts` texts joined into `text`."""
        if len(text) <= _DIRECT_CHARS:
            data = text.encode("utf-8", "surrogatepass")
            pairs = plain_pair_index(data)
            if pairs is not None:
                index, classes = pairs
                weighted = float(self._pair_tokens.take(index).sum())
                # Class codes come first in FEATURES: the emoji count is the fourbyte class's bytes.
                emoji = classes.count(_FOURBYTE)
                return self._band(weighted, emoji, texts, Sample(len(data), len(data), len(data), (), 0, 0))
        return self.band(sample(text), texts)

    def band(self, features: Sample, texts: int = 1) -> TextBand:
        """The band of `texts` texts whose features, read together, are `features`."""
        linear = sum(w * x for w, x in zip(self.calibration.weights, features.counts, strict=True))
        return self._band(linear, features.counts[_FOURBYTE], texts, features)

    def _band(self, weighted: float, emoji: float, texts: int, features: Sample) -> TextBand:
        """The band from the weighted feature sum and the emoji count; `features` gives the sizes and
        trap bytes (its counts are not read)."""
        c = self.calibration
        linear = c.per_text * texts + weighted
        regular = linear - emoji * c.weights[_FOURBYTE]
        tokens = linear + features.blob_bytes * c.trap_density + features.run_bytes * c.run_density
        band = c.band_for(regular)
        high = (
            regular * (1 + band.under)
            + c.absolute_error
            + emoji * c.fourbyte_max
            + features.trap_bytes * c.max_tokens_per_byte
        )
        low = (
            regular * (1 - band.over)
            - c.absolute_error
            + emoji * c.fourbyte_min
            + features.trap_bytes / c.max_piece_bytes
        )
        if features.max_size > features.min_size:
            # The size was estimated from windows of a long non-ASCII text: one gap between two
            # windows may hide characters wider than the windows showed.
            gap_chars = max(0, features.min_size - WINDOWS * WINDOW_BYTES) / (WINDOWS - 1)
            high += gap_chars * (UTF8_MAX_BYTES - 1) * c.max_tokens_per_byte
        ceiling = math.floor(c.max_tokens_per_byte * features.max_size) + texts
        floor = math.ceil(features.min_size / c.max_piece_bytes)
        high_tokens = max(floor, min(ceiling, math.ceil(high)))
        low_tokens = min(high_tokens, max(floor, math.floor(low)))
        return TextBand(min(max(round(tokens), low_tokens), high_tokens), low_tokens, high_tokens)
