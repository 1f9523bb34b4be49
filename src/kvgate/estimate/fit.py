"""Fit a Calibration from real text and a real tokenizer (what `kvgate calibrate` runs).

Texts are cut into pieces of several sizes; each piece's features are read the way the gate reads
them (whole, or through windows when long), so the fitted error band includes the sampling error.
Weights minimise the squared relative error (small and large pieces count alike) under a
non-negativity constraint, so no feature can pull an estimate down; a feature the corpus never shows
keeps a cautious prior instead of collapsing to zero. The band is measured two-fold (each half of the
pieces against weights fitted on the other half); the shipped weights then come from all pieces.
"""

from __future__ import annotations

import dataclasses
import random
from base64 import b64encode
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvgate.estimate.calibration import Band, Calibration
from kvgate.estimate.exact import TokenCounter, TokenizerFile, count_chunk
from kvgate.estimate.fast import FastEstimator
from kvgate.estimate.features import FEATURES, Sample, sample

PIECE_CHARS = (256, 1024, 4096, 16384, 65536)
PIECES_PER_SIZE = 60
# Tokens per occurrence when the corpus says nothing: about one token per character for scripts,
# a fraction of a token for ASCII letters, which words share.
PRIORS = {
    "lower": 0.2, "upper": 0.4, "digit": 1.0, "space": 0.1, "newline": 1.0, "control": 1.0,
    "punct": 0.7, "quote": 0.7, "bracket": 0.7, "separator": 0.7, "latin2": 1.0, "other2": 0.7,
    "script3": 1.5, "symbol3": 1.0, "cjk": 1.0, "hangul": 1.0, "fullwidth": 1.0, "fourbyte": 4.0,
}  # fmt: skip
RIDGE = 1e-4
SWEEPS = 400
BAND_MARGIN = 1.25
# Band tiers by exact tokens; pieces under the first tier set the absolute part of the band.
BAND_TIERS = (500, 2000, 8000)
SUMMARY_MIN_TOKENS = 4000
MIN_ABSOLUTE_ERROR = 8.0
# A corpus only shows so much: number tables and ID-heavy JSON stray about 5% from the weights.
MIN_RELATIVE_ERROR = 0.06
EMOJI = range(0x1F300, 0x1FA00)
RUN_CHARACTERS = " \t=-_*#.~+0a\u2500\u00e9"


@dataclass(frozen=True, slots=True)
class Observation:
    features: Sample
    tokens: int


def observations(texts: Iterable[str], counter: TokenCounter) -> list[Observation]:
    """Pieces of every text at every size in PIECE_CHARS, with their exact counts."""
    found = []
    for text in texts:
        for size in PIECE_CHARS:
            # Big pieces overlap by half: the band of the largest tier needs enough of them.
            step = size if size < PIECE_CHARS[-2] else size // 2
            starts = range(0, len(text) - size + 1, step)[:PIECES_PER_SIZE]
            for start in starts:
                piece = text[start : start + size]
                found.append(Observation(sample(piece), counter.count(piece)))
    return found


def fourbyte_tokens(counter: TokenCounter) -> tuple[float, float, float]:
    """Fewest, mean and most tokens an emoji takes: corpora hold too few emoji to fit a weight."""
    counts = [count_chunk(counter, chr(code), first=False, last=True) for code in EMOJI]
    return float(min(counts)), sum(counts) / len(counts), float(max(counts))


def run_density(counter: TokenCounter) -> float:
    """Mean tokens per byte of long runs of characters that get repeated in real text."""
    runs = [character * 4096 for character in RUN_CHARACTERS]
    return sum(counter.count(run) / len(run.encode("utf-8")) for run in runs) / len(runs)


def trap_density(counter: TokenCounter) -> float:
    """Tokens per byte of base64 (random bytes, so no vocabulary luck)."""
    blob = b64encode(random.Random(7).randbytes(48_000)).decode("ascii")
    return counter.count(blob) / len(blob)


def _rows(data: Sequence[Observation], fixed: dict[int, float]) -> tuple[list[list[float]], list[float]]:
    """Normal equations of the relative least squares, with the fixed weights moved to the target."""
    width = len(FEATURES) + 1
    a = [[0.0] * width for _ in range(width)]
    b = [0.0] * width
    for item in data:
        x = [*item.features.counts, 1.0]
        target = item.tokens - sum(w * x[i] for i, w in fixed.items())
        scale = 1.0 / max(item.tokens, 1) ** 2
        for i in range(width):
            if x[i] == 0.0:
                continue
            b[i] += x[i] * target * scale
            for j in range(width):
                a[i][j] += x[i] * x[j] * scale
    return a, b


def solve(data: Sequence[Observation], fixed: dict[int, float]) -> list[float]:
    """Non-negative weights (the last one per text) by coordinate descent, pulled towards PRIORS."""
    a, b = _rows(data, fixed)
    priors = [PRIORS.get(name, 0.0) for name in FEATURES] + [1.0]
    ridge = RIDGE * len(data)
    w = priors[:]
    for i, value in fixed.items():
        w[i] = value
    free = [i for i in range(len(w)) if i not in fixed]
    for _ in range(SWEEPS):
        for i in free:
            gradient = sum(a[i][j] * w[j] for j in free) - b[i] + ridge * (w[i] - priors[i])
            w[i] = max(0.0, w[i] - gradient / (a[i][i] + ridge))
    return w


def relative_errors(calibration: Calibration, data: Sequence[Observation]) -> list[tuple[int, float]]:
    """(exact tokens, estimate - exact) per piece."""
    fast = FastEstimator(calibration)
    return [(item.tokens, fast.band(item.features).tokens - item.tokens) for item in data]


@dataclass(frozen=True, slots=True)
class Traits:
    """What the tokenizer itself says, apart from the corpus."""

    trap_density: float
    run_density: float
    fourbyte: tuple[float, float, float]  # fewest, mean, most tokens per emoji
    densest: float  # most tokens per byte seen anywhere
    max_piece_bytes: int


def traits(counter: TokenCounter, data: Sequence[Observation]) -> Traits:
    trap = trap_density(counter)
    densest = max([(o.tokens - 1) / o.features.size for o in data if o.features.size] + [trap, 1.0])
    return Traits(trap, run_density(counter), fourbyte_tokens(counter), densest, counter.max_piece_bytes())


def fit(tokenizer: TokenizerFile, counter: TokenCounter, texts: Sequence[str]) -> Calibration:
    data = observations(texts, counter)
    measured = traits(counter, data)
    emoji = FEATURES.index("fourbyte")
    fixed = {emoji: measured.fourbyte[1]}
    # Weights and band describe ordinary text: trap windows and emoji carry their own bounds, and a
    # piece with a trap in it has tokens the weights never see.
    plain = [o for o in data if o.features.trap_bytes == 0 and o.features.counts[emoji] == 0]
    # Two-fold: each half's errors come from weights fitted on the other half.
    errors = []
    for fitted, held_back in ((plain[0::2], plain[1::2]), (plain[1::2], plain[0::2])):
        trial = _calibration(tokenizer, measured, solve(fitted, fixed), len(fitted))
        errors += relative_errors(trial, held_back)
    small = [abs(e) for t, e in errors if t < BAND_TIERS[0]]
    sizes = [abs(e) / t for t, e in errors if t >= SUMMARY_MIN_TOKENS]
    return dataclasses.replace(
        _calibration(tokenizer, measured, solve(plain, fixed), len(plain)),
        bands=tuple(_band(minimum, errors) for minimum in BAND_TIERS),
        absolute_error=round(max([MIN_ABSOLUTE_ERROR] + [e * BAND_MARGIN for e in small]), 3),
        mean_error=round(sum(sizes) / len(sizes), 6),
        worst_error=round(max(sizes), 6),
    )


def _band(minimum: int, errors: Sequence[tuple[int, float]]) -> Band:
    """The widest errors seen at this size and above, with a margin."""
    seen = [e / t for t, e in errors if t >= minimum]
    under = max([MIN_RELATIVE_ERROR] + [-r * BAND_MARGIN for r in seen])
    over = max([MIN_RELATIVE_ERROR] + [r * BAND_MARGIN for r in seen])
    return Band(minimum, round(under, 6), round(over, 6))


def _calibration(
    tokenizer: TokenizerFile, measured: Traits, weights: list[float], samples: int
) -> Calibration:
    """A calibration with these weights and no error band yet."""
    return Calibration(
        tokenizer=tokenizer.path.name,
        sha256=tokenizer.sha256,
        weights=tuple(round(w, 6) for w in weights[:-1]),
        per_text=round(weights[-1], 6),
        trap_density=round(measured.trap_density, 6),
        run_density=round(measured.run_density, 6),
        fourbyte_min=measured.fourbyte[0],
        fourbyte_max=measured.fourbyte[2],
        bands=(Band(0, 0.0, 0.0),),
        absolute_error=0.0,
        max_tokens_per_byte=round(measured.densest, 6),
        max_piece_bytes=measured.max_piece_bytes,
        samples=samples,
        mean_error=0.0,
        worst_error=0.0,
    )
