"""Fit a Calibration from real text and a real tokenizer (what `kvgate calibrate` runs).

Texts are cut into pieces of several sizes; each piece's pairs are read the way the gate reads them
(whole, or through windows when long), so the fitted error band includes the sampling error.

Weights minimise the squared relative error, weighted towards pieces of thousands of tokens (the
sizes near the thresholds), with a ridge penalty that keeps the class-pair and block refinements
small unless the corpus asks for them and pulls a class's weight towards a cautious prior when the
corpus never shows it. The band is measured two-fold: each half of every text is estimated with
weights fitted on the other halves (see `band`). The shipped weights then come from all pieces.
"""

from __future__ import annotations

import random
from base64 import b64encode
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvgate.estimate.band import banded
from kvgate.estimate.calibration import ASCII_CODES, Band, Calibration
from kvgate.estimate.exact import TokenCounter, TokenizerFile, count_chunk
from kvgate.estimate.fast import FastEstimator
from kvgate.estimate.features import (
    BLOCKS,
    CLASS_PAIRS,
    CLASSES,
    FEATURES,
    FOURBYTE_LEADS,
    PAIR_FEATURES,
    STRAY_RUN_BYTES,
    WINDOW_BYTES,
    Sample,
    sample,
)

PIECE_CHARS = (256, 1024, 4096, 16384, 65536)
PIECES_PER_SIZE = 60
# Tokens per character when the corpus says nothing: a fraction of a token for ASCII letters, which
# words share; about one token per character of other scripts (on their lead byte).
PRIORS = {
    "lower": 0.2, "upper": 0.4, "digit": 1.0, "space": 0.1, "tab": 0.5, "newline": 1.0, "control": 1.0,
    "punct": 0.7, "dquote": 0.7, "squote": 0.7, "colon": 0.7, "comma": 0.7, "period": 0.7,
    "semicolon": 0.7, "open": 0.7, "close": 0.7, "backslash": 0.7, "slash": 0.7, "dash": 0.7,
    "underscore": 0.7, "equals": 0.7, "angle": 0.7, "invalid": 1.0, "continuation": 0.0,
}  # fmt: skip
LEAD_PRIOR = 1.0
# Ridge strength per fitted row, by feature family: classes and runs move freely, class pairs and
# blocks only as far as the corpus shows they must. Chosen on a small grid (1e-7 to 3e-5) by the
# held-out corpus's errors on both tokenizer families, which makes those errors a little optimistic.
RIDGE_CLASS = 1e-6
RIDGE_PAIR = 1e-5
RIDGE_BLOCK = 1e-6
# A class pair or block needs this many occurrences in the corpus to get a weight of its own.
MIN_SUPPORT = 40
# A held-back piece with more than this share of its bytes in pairs its training half hardly shows is
# left out of the band's measurement (see `fit`).
NOVEL_SHARE = 0.02
# Rows weigh by their exact tokens up to this many: decisions are taken at thousands of tokens.
WEIGHT_CAP_TOKENS = 8000
EMOJI = range(0x1F300, 0x1FA00)
RUN_CHARACTERS = " \t=-_*#.~+0a\u2500\u00e9"
_FOURBYTE_CLASSES = [CLASSES.index(f"{lead:02x}") for lead in FOURBYTE_LEADS]
# FEATURES from this index on are refinements (class pairs, then blocks); before it, classes and runs.
_REFINEMENTS = FEATURES.index(CLASS_PAIRS[0])
_BLOCKS = FEATURES.index(BLOCKS[0])
_Vector = np.ndarray[tuple[int], np.dtype[np.float64]]
_Matrix = np.ndarray[tuple[int, int], np.dtype[np.float64]]


@dataclass(frozen=True, slots=True)
class Observation:
    features: Sample  # as the gate reads the piece (through windows when long)
    whole: Sample  # every pair of the piece: what the weights are fitted on
    tokens: int
    fold: int  # 0: the piece lies mostly in the first half of its text, 1: in the second


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
                fold = int(start + size // 2 >= len(text) // 2)
                found.append(
                    Observation(sample(piece), sample(piece, whole=True), counter.count(piece), fold)
                )
    return found


def fourbyte_tokens(counter: TokenCounter) -> tuple[float, float, float]:
    """Fewest, mean and most tokens an emoji takes: corpora hold too few emoji to fit a weight."""
    counts = [count_chunk(counter, chr(code), first=False, last=True) for code in EMOJI]
    return float(min(counts)), sum(counts) / len(counts), float(max(counts))


def run_density(counter: TokenCounter) -> float:
    """Mean tokens per byte of long runs of characters that get repeated in real text."""
    runs = [character * 4096 for character in RUN_CHARACTERS]
    return sum(counter.count(run) / len(run.encode("utf-8")) for run in runs) / len(runs)


def run_max(counter: TokenCounter) -> tuple[float, ...]:
    """Per ASCII character: the most tokens per byte a run of it takes from STRAY_RUN_BYTES on. Runs of
    STRAY_RUN_BYTES to twice that give the most: a run's last, partial piece weighs most in a short
    run, and they meet every remainder of a piece of up to STRAY_RUN_BYTES characters. A long run is
    measured too."""
    lengths = [*range(STRAY_RUN_BYTES, 2 * STRAY_RUN_BYTES), 2 * WINDOW_BYTES]
    return tuple(
        round(max(count_chunk(counter, chr(code) * n, first=False, last=True) / n for n in lengths), 6)
        for code in range(ASCII_CODES)
    )


def trap_density(counter: TokenCounter) -> float:
    """Tokens per byte of base64 (random bytes, so no vocabulary luck)."""
    blob = b64encode(random.Random(7).randbytes(48_000)).decode("ascii")
    return counter.count(blob) / len(blob)


def _columns(data: Sequence[Observation]) -> tuple[_Matrix, list[int]]:
    """Every piece's counts of the features that get a weight: every class and run, and the class
    pairs and blocks the corpus shows at least MIN_SUPPORT times."""
    support = np.zeros(len(FEATURES))
    for o in data:
        support += o.whole.features()
    fitted = [
        i
        for i in range(len(FEATURES))
        if i < _REFINEMENTS or i >= len(PAIR_FEATURES) or support[i] >= MIN_SUPPORT
    ]
    return np.array([o.whole.features()[fitted] for o in data]), fitted


def _prior(feature: int) -> float:
    if feature >= len(CLASSES):
        return 0.0
    return PRIORS.get(CLASSES[feature], LEAD_PRIOR)


def _ridge(feature: int) -> float:
    if feature < _REFINEMENTS:
        return RIDGE_CLASS
    if feature < _BLOCKS or feature >= len(PAIR_FEATURES):
        return RIDGE_PAIR  # class pairs and runs of spaces
    return RIDGE_BLOCK


def solve(matrix: _Matrix, tokens: _Vector, fitted: Sequence[int], fixed: dict[int, float]) -> _Vector:
    """Weights for the fitted features and the per-text constant (last): weighted relative least
    squares with a ridge towards the priors. Classes and runs cannot go below zero (a class whose
    count would lower an estimate is one the corpus explains by collinear features); refinements can
    (a Thai letter after another costs less than one alone)."""
    columns = len(fitted) + 1
    priors = np.array([_prior(i) for i in fitted] + [1.0])
    ridge = np.array([_ridge(i) for i in fitted] + [RIDGE_CLASS])
    weight = np.minimum(tokens, WEIGHT_CAP_TOKENS)
    scale = np.sqrt(weight / weight.mean()) / np.maximum(tokens, 1.0)
    x = np.hstack([matrix, np.ones((len(tokens), 1))]) * scale[:, None]
    y = tokens * scale
    penalty = np.sqrt(ridge * len(tokens))
    solved = np.zeros(columns)
    pinned = {k: fixed[i] for k, i in enumerate(fitted) if i in fixed}
    for _ in range(columns):
        free = [k for k in range(columns) if k not in pinned]
        pinned_columns = list(pinned)
        target = y - x[:, pinned_columns] @ np.array([pinned[k] for k in pinned_columns])
        a = np.vstack([x[:, free], np.diag(penalty[free])])
        b = np.concatenate([target, penalty[free] * priors[free]])
        solved[free] = np.linalg.lstsq(a, b, rcond=None)[0]
        solved[pinned_columns] = [pinned[k] for k in pinned_columns]
        negative = [k for k in free if k < len(fitted) and fitted[k] < _REFINEMENTS and solved[k] < 0]
        if not negative:
            break
        pinned.update(dict.fromkeys(negative, 0.0))
    return solved


def fit(tokenizer: TokenizerFile, counter: TokenCounter, texts: Sequence[str]) -> Calibration:
    data = observations(texts, counter)
    trap = trap_density(counter)
    fewest, mean, most = fourbyte_tokens(counter)
    base = Calibration(
        tokenizer=tokenizer.path.name,
        sha256=tokenizer.sha256,
        weights=(),
        per_text=0.0,
        trap_density=round(trap, 6),
        run_density=round(run_density(counter), 6),
        fourbyte_min=fewest,
        fourbyte_mean=round(mean, 6),
        fourbyte_max=most,
        run_max=run_max(counter),
        uncertainty=(),
        unseen_width=0.0,
        bands=(Band(0, 1.0, 1.0),),
        absolute_error=0.0,
        # The certainty rule's constant: the most tokens per byte anything showed.
        max_tokens_per_byte=round(max([(o.tokens - 1) / o.features.size for o in data] + [trap, 1.0]), 6),
        max_piece_bytes=counter.max_piece_bytes(),
        samples=0,
        mean_error=0.0,
        worst_error=0.0,
    )
    # Weights and band describe ordinary text: trap windows and emoji carry their own bounds, and a
    # piece with a trap in it has tokens the weights never see.
    plain = [j for j, o in enumerate(data) if o.features.trap_bytes == 0 and o.features.fourbyte == 0]
    matrix, fitted = _columns(data)
    tokens = np.array([o.tokens for o in data], dtype=float)
    fixed = dict.fromkeys(_FOURBYTE_CLASSES, mean)

    def weighted(rows: Sequence[int]) -> Calibration:
        solved = solve(matrix[rows], tokens[rows], fitted, fixed)
        weights = tuple((FEATURES[i], round(float(w), 6)) for i, w in zip(fitted, solved[:-1], strict=True))
        return replace(base, weights=weights, per_text=round(float(solved[-1]), 6), samples=len(plain))

    # Two-fold: each half's errors come from weights fitted on the other half. A held-back piece made
    # in good part of refinements the other half shows too little of is left out: its error says what
    # unseen pairs cost, which the shipped calibration prices as unseen (with `unseen_width`), not
    # what the pairs it knows cost.
    refinements = np.array([_REFINEMENTS <= i < len(PAIR_FEATURES) for i in fitted])
    held_back: list[tuple[int, float, Sample]] = []
    for fold in (0, 1):
        training = [j for j in plain if data[j].fold != fold]
        rare = refinements & (matrix[training].sum(axis=0) < MIN_SUPPORT)
        fast = FastEstimator(weighted(training))
        for j in plain:
            novel = matrix[j][rare].sum() > NOVEL_SHARE * data[j].whole.size
            if data[j].fold == fold and not novel:
                estimate = fast.band(data[j].features).tokens
                held_back.append((data[j].tokens, estimate - data[j].tokens, data[j].features))
    return banded(weighted(plain), held_back)
