"""The fast estimate of one text: fitted byte-pair weights, an error band that follows the text's
make-up, and hard bounds.

One table holds, per pair, the tokens it adds (real part) and how far that may be off (imaginary part),
so a single `take` and `sum` over a text's pairs gives both the estimate and its band's width.
A pair's width is its class's relative error (measured while fitting, see `fit`) times its tokens,
and a full token per byte for pairs the fit never saw: ordinary prose and code get a narrow band,
scripts, symbols and punctuation the corpus knew less well a wider one, and text made of pairs nobody
measured a band wide enough that the class is counted exactly (or, without a tokenizer, rounded to
the safe side).

The band is [estimate - over * width - absolute, estimate + under * width + absolute], with (under,
over) the multipliers the calibration measured for texts of that size, then clipped to what holds
whatever the text: a text never takes more tokens than `max_tokens_per_byte` * its UTF-8 bytes + 1
(so a text of fewer bytes than a threshold is certainly under it), nor fewer than its bytes over the
longest piece of the vocabulary. A text read through windows (`features`: past FULL_SCAN_BYTES, at
random places) is a sample of itself: its band reaches SAMPLING_Z standard errors of the sample's sum
further, in quadrature with the fit's width.

Without a tokenizer the estimator is given several calibrations, one per tokenizer family: each
prices the text, and the band spans them all (their lowest low to their highest high), the estimate
being their mean (one `take` per calibration).

Trap windows (see `features`) and emoji are uncertain by nature: the band spans everything they could
cost (from a vocabulary's longest piece per byte up to a token per byte; from the fewest to the most
tokens any emoji takes), so a trap can send a request to an exact count, never make a too-long
request look short, nor a long one look too long. A trap no window holds (a stray run or blob:
shorter than a window, or sharing one with other text) is read as ordinary text, whose weights price
base64 about 30% low and some runs of one character at a fraction of their count (255 "J": 48 tokens
for 255); the high takes it at its most instead (a run of an ASCII character at the most its
tokenizer spends on such runs, anything else at a token per byte), and so it takes the text between
a trap window and an ordinary one of a sampled text.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvgate.estimate.calibration import Calibration
from kvgate.estimate.features import (
    CODE_PAIR_VALUES,
    FULL_SCAN_BYTES,
    NO_PAIRS,
    UTF8_MAX_BYTES,
    WINDOW_BYTES,
    WINDOWS,
    PairIndex,
    Sample,
    code_pair_index,
    fourbyte_count,
    is_plain,
    sample,
    stretch_counts,
)

# Texts up to this many characters (ASCII ones up to FULL_SCAN_BYTES: one byte a character) are
# encoded whole and, when they hold no trap, estimated straight from their pairs: a chat turn costs a
# few numpy calls. Reading a plain text whole gives the same band as `sample`, whose trap and stray
# searches find nothing in it, at about half the cost for a 70 KB prompt (the Mooncake replay's mean).
_DIRECT_CHARS = FULL_SCAN_BYTES // UTF8_MAX_BYTES
# A text read through windows is read from a random sample of it: its band reaches this many standard
# errors of that sample's sum further on each side (one side is past it about once in 740 reads of a
# text whose windows vary normally).
SAMPLING_Z = 3.0


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
    __slots__ = ("_coded", "_stretch_values", "calibrations")

    def __init__(self, calibration: Calibration, *others: Calibration) -> None:
        self.calibrations = (calibration, *others)
        # Per calibration, one table laid out by code pairs: tokens + 1j * width, in single precision
        # (it halves what the cache must hold; a sum of tokens needs no more). One flat table each:
        # a numpy `take` from it costs less than from one table with a column per calibration.
        self._coded = tuple(
            (tokens + 1j * width).astype(np.complex64)[CODE_PAIR_VALUES]
            for tokens, width in (c.tables() for c in self.calibrations)
        )
        # Per calibration, per run of whitespace counted: tokens + 1j * width.
        self._stretch_values = tuple(
            tuple(complex(t, w) for t, w in zip(*c.stretches(), strict=True)) for c in self.calibrations
        )

    @property
    def calibration(self) -> Calibration:
        return self.calibrations[0]

    def __reduce__(self) -> tuple[object, tuple[tuple[Calibration, ...]]]:
        # A count job carries the estimator to the worker: send the calibrations, not the tables, and
        # build the tables once per worker.
        return _estimator_for, (self.calibrations,)

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
        if len(text) <= _DIRECT_CHARS or (len(text) <= FULL_SCAN_BYTES and text.isascii()):
            data = text.encode("utf-8", "surrogatepass")
            if is_plain(data):
                size = len(data)
                sums = self._sums(code_pair_index(data), 1.0)
                features = Sample(size, size, size, 0.0, 0.0, NO_PAIRS, 1.0, fourbyte_count(data))
                return self._envelope(sums, texts, features, stretch_counts(data))
        return self.band(sample(text), texts)

    def band(self, features: Sample, texts: int = 1) -> TextBand:
        """The band of `texts` texts whose pairs, read together, are `features`."""
        if features.scale > 1:
            sums, errors = self._sampled_sums(features.index, features.scale)
        else:
            sums, errors = self._sums(features.index, features.scale), None
        strays = self._sums(features.stray_index, features.scale) if features.strays else None
        return self._envelope(sums, texts, features, features.stretches, strays=strays, errors=errors)

    def _sums(self, index: PairIndex, scale: float) -> list[complex]:
        """Per calibration: its tokens (real part) and width (imaginary part) summed over `index`."""
        # np.add.reduce is what ndarray.sum calls, without its Python wrapper (a frame per request).
        return [complex(np.add.reduce(table.take(index))) * scale for table in self._coded]

    def _sampled_sums(self, index: PairIndex, scale: float) -> tuple[list[complex], list[float]]:
        """`_sums` of a text read through windows, and per calibration the standard error of its
        tokens. The windows are a sample of the text, one at a random place in each stretch (see
        `features.WINDOW_RANDOM`), so a sum over n of them, scaled, is off by about scale * sqrt(n) *
        the spread of a window within its stretch. That spread is taken from the differences between
        neighbouring windows, half their mean square (the successive-difference estimate of a
        systematic sample): a text that changes along its length (code, then prose) varies between
        stretches, which the sample does not draw from, and a spread about the mean would count it.
        A long non-ASCII text's windows are 256 characters, several pieces of WINDOW_BYTES each: its
        pieces are summed by as many as a window spans on average."""
        span = max(1, round(len(index) / (WINDOWS * WINDOW_BYTES))) * WINDOW_BYTES
        units = len(index) // span
        if units < 2:
            return self._sums(index, scale), [0.0] * len(self._coded)
        whole = units * span
        sums, errors = [], []
        for table in self._coded:
            taken = table.take(index)
            per_unit = np.add.reduce(taken[:whole].reshape(units, span), axis=1)
            sums.append(complex(np.add.reduce(per_unit) + np.add.reduce(taken[whole:])) * scale)
            steps = np.diff(per_unit.real)
            errors.append(scale * math.sqrt(units * float(np.dot(steps, steps)) / (2 * len(steps))))
        return sums, errors

    def _envelope(
        self,
        sums: list[complex],
        texts: int,
        features: Sample,
        stretches: Sequence[float],
        *,
        strays: list[complex] | None = None,
        errors: list[float] | None = None,
    ) -> TextBand:
        """The band over every calibration, from each one's weighted pair sum and width (plus the runs
        of whitespace, in plain Python: a few products cost less than a numpy call), what its
        stray runs and blobs were priced at, and the sampling error of a text read through windows."""
        if any(stretches):
            runs = self._stretch_values
            sums = [_plus_runs(total, stretches, values) for total, values in zip(sums, runs, strict=True)]
        priced = [total.real for total in strays] if strays else [0.0] * len(sums)
        errors = errors or [0.0] * len(sums)
        if len(sums) == 1:
            return _band(
                self.calibration,
                sums[0].real,
                sums[0].imag,
                texts,
                features,
                stray_price=priced[0],
                sampling_error=errors[0],
            )
        bands = [
            _band(c, total.real, total.imag, texts, features, stray_price=stray, sampling_error=error)
            for c, total, stray, error in zip(self.calibrations, sums, priced, errors, strict=True)
        ]
        low = min(b.low for b in bands)
        high = max(b.high for b in bands)
        tokens = round(sum(b.tokens for b in bands) / len(bands))
        return TextBand(min(max(tokens, low), high), low, high)


def _plus_runs(total: complex, counts: Sequence[float], values: Sequence[complex]) -> complex:
    for count, value in zip(counts, values, strict=True):
        if count:
            total += count * value
    return total


@functools.lru_cache(maxsize=8)
def _estimator_for(calibrations: tuple[Calibration, ...]) -> FastEstimator:
    return FastEstimator(*calibrations)


def _band(
    c: Calibration,
    weighted: float,
    width: float,
    texts: int,
    features: Sample,
    *,
    stray_price: float = 0.0,
    sampling_error: float = 0.0,
) -> TextBand:
    """The band from the weighted pair sum and its width; `features` gives the sizes, emoji, trap
    bytes and stray runs and blobs (its pairs are not read), which the weights priced at
    `stray_price`; `sampling_error` is the standard error of a sum read through windows."""
    emoji = features.fourbyte
    linear = c.per_text * texts + weighted
    regular = linear - emoji * c.fourbyte_mean
    tokens = linear + features.blob_bytes * c.trap_density + features.run_bytes * c.run_density
    band = c.band_for(regular)
    # The fit's error and the sampling's are independent: they add in quadrature.
    under = math.hypot(width * band.under, SAMPLING_Z * sampling_error)
    over = math.hypot(width * band.over, SAMPLING_Z * sampling_error)
    high = (
        regular
        + under
        + c.absolute_error
        + emoji * c.fourbyte_max
        + features.trap_bytes * c.max_tokens_per_byte
    )
    low = regular - over - c.absolute_error + emoji * c.fourbyte_min + features.trap_bytes / c.max_piece_bytes
    if features.strays:
        # The weights priced stray runs and blobs as ordinary text: the high takes them at their most.
        most = c.stray_max(features.stray_runs, features.stray_bytes, features.strays)
        high += max(0.0, most - stray_price)
    high += features.unsure_bytes * c.max_tokens_per_byte
    if features.max_size > features.min_size:
        # The size was estimated from windows of a long non-ASCII text: the text between two windows
        # may be as wide as the wider of them, and one such stretch may hide characters wider than
        # any window showed.
        gap_chars = max(0, features.min_size - WINDOWS * WINDOW_BYTES) / (WINDOWS - 1)
        high += (features.wide_bytes + gap_chars * (UTF8_MAX_BYTES - 1)) * c.max_tokens_per_byte
    ceiling = math.floor(c.max_tokens_per_byte * features.max_size) + texts
    floor = math.ceil(features.min_size / c.max_piece_bytes)
    high_tokens = max(floor, min(ceiling, math.ceil(high)))
    low_tokens = min(high_tokens, max(floor, math.floor(low)))
    return TextBand(min(max(round(tokens), low_tokens), high_tokens), low_tokens, high_tokens)
