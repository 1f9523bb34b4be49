"""The fast estimate's error band, measured on held-back pieces (the last step of `fit`).

A band must be honest per kind of text: narrow where the corpus showed the weights to be right (prose,
code), wide where they strayed (scripts, symbols, punctuation the corpus knew less well), widest for
pairs it never showed. So the width of a text is a sum over its pairs: each pair's tokens times the
relative error of the class of its first byte, and a fixed width for pairs never seen.

The relative errors come from the held-back errors: most pieces under the first tier (BASE_QUANTILE)
set the absolute part; every class gets the relative error that most pieces of 2,000 tokens and more
stay within (BASE_QUANTILE, with the margin); the classes that explain the pieces beyond it get more,
chosen the way a covering problem is solved greedily (see `_cover`). Last, each size tier gets the multiplier
most of its own pieces need (BASE_QUANTILE): small texts stray further than their pairs' widths
say. Small texts decide a class only with large output budgets, and a few held-back pieces stray far
only because their half of the corpus lacked their script; covering every one would widen the band of
every text of that size.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from kvgate.estimate.calibration import Band, Calibration
from kvgate.estimate.features import BYTE_CLASS, CLASSES, STRETCH_NAMES, Sample

BAND_MARGIN = 1.5
# Relative errors are measured on pieces of at least this many tokens.
WIDTH_MIN_TOKENS = 2000
BAND_TIERS = (0, 500, 2000, 8000)
SUMMARY_MIN_TOKENS = 4000
MIN_ABSOLUTE_ERROR = 8.0
# A corpus only shows so much: no class of pairs is trusted closer than this.
MIN_RELATIVE_ERROR = 0.04
MAX_RELATIVE_ERROR = 1.0
BASE_QUANTILE = 0.95
# Tokens of band per pair the corpus never showed: as if any byte could be a token of its own.
UNSEEN_WIDTH = 1.0
COVER_ROUNDS = 50_000
# The most one round raises a class's relative error: small steps let the next shortest piece choose
# again, so the raises spread over the classes that explain several pieces.
COVER_STEP = 0.01
_SPACE = CLASSES.index("space")
_TAB = CLASSES.index("tab")
_SPACE_RUNS = np.array(["space" in name for name in STRETCH_NAMES])
_Vector = np.ndarray[tuple[int], np.dtype[np.float64]]
_Matrix = np.ndarray[tuple[int, int], np.dtype[np.float64]]
_Mask = np.ndarray[tuple[int], np.dtype[np.bool_]]


def banded(calibration: Calibration, held_back: Sequence[tuple[int, float, Sample]]) -> Calibration:
    """`calibration` with the band that covers the held-back errors: (exact tokens, estimate - exact,
    the piece's pairs) per piece."""
    unset = replace(calibration, uncertainty=(), unseen_width=UNSEEN_WIDTH)
    tokens, unseen = unset.tables()  # no relative errors yet: only unseen pairs have a width
    stretches, _ = unset.stretches()
    rows = [_class_tokens(tokens, unseen, stretches, features) for _, _, features in held_back]
    share = np.array([per_class for per_class, _ in rows])
    fixed = np.array([width for _, width in rows])
    exact = np.array([t for t, _, _ in held_back], dtype=float)
    error = np.array([e for _, e, _ in held_back])
    small = exact < BAND_TIERS[1]
    absolute = max(MIN_ABSOLUTE_ERROR, BAND_MARGIN * _quantile(np.abs(error[small])))
    needed = np.maximum(np.abs(error) * BAND_MARGIN - absolute, 0.0)
    large = exact >= WIDTH_MIN_TOKENS
    quantile = _quantile(np.abs(error[large]) / exact[large])
    present: _Mask = np.asarray(share.any(axis=0), dtype=bool)
    base = np.where(present, max(MIN_RELATIVE_ERROR, BAND_MARGIN * quantile), 0.0)
    relative = _cover(share[large], fixed[large], needed[large], exact[large], base)
    width = share @ relative + fixed
    bounds = (*BAND_TIERS, np.inf)
    bands = tuple(
        _tier(low, (exact >= low) & (exact < high), error, needed, width)
        for low, high in itertools.pairwise(bounds)
    )
    summary = np.abs(error[exact >= SUMMARY_MIN_TOKENS]) / exact[exact >= SUMMARY_MIN_TOKENS]
    if not len(summary):
        summary = np.abs(error) / np.maximum(exact, 1.0)
    return replace(
        unset,
        uncertainty=tuple(
            (name, round(float(r), 6))
            for name, r, seen in zip(CLASSES, relative, present, strict=True)
            if seen
        ),
        bands=bands,
        absolute_error=round(absolute, 3),
        mean_error=round(float(summary.mean()), 6),
        worst_error=round(float(summary.max()), 6),
    )


def _quantile(values: _Vector) -> float:
    """BASE_QUANTILE of `values`; 0 when a small corpus gave none."""
    return float(np.quantile(values, BASE_QUANTILE)) if len(values) else 0.0


def _class_tokens(
    tokens: _Vector, unseen_width: _Vector, stretches: _Vector, features: Sample
) -> tuple[_Vector, float]:
    """A piece's tokens (their size: refinements may be negative) by class of first byte, over the
    pairs seen while fitting (runs of spaces with the spaces), and the width of the pairs never seen."""
    pairs, counts = features.histogram()
    size = np.abs(tokens[pairs]) * counts
    per_class: _Vector = np.bincount(BYTE_CLASS[pairs >> 8], weights=size, minlength=len(CLASSES)).astype(
        float
    )
    runs = np.abs(stretches) * np.array(features.stretches)
    per_class[_SPACE] += float(runs[_SPACE_RUNS].sum())
    per_class[_TAB] += float(runs[~_SPACE_RUNS].sum())
    return per_class, float(unseen_width[pairs] @ counts)


def _cover(share: _Matrix, fixed: _Vector, needed: _Vector, tokens: _Vector, base: _Vector) -> _Vector:
    """Relative errors per class, from `base` up to at most MAX_RELATIVE_ERROR, such that every
    piece's width (its tokens by class times their relative errors, plus the fixed part) reaches the
    error it needs covered, at little cost to the band of the corpus as a whole.

    Greedy, as for a covering problem: the piece furthest short (relative to its size) gets a step
    more width from the class that buys the most of it per unit of width added to the whole corpus
    (relative to each piece's size), so an error in a Thai piece widens the band of Thai text, not
    of the spaces and letters every piece has."""
    relative = base.copy()
    cost = (share / tokens[:, None]).sum(axis=0)
    for _ in range(COVER_ROUNDS if len(tokens) else 0):
        short = needed - (share @ relative + fixed)
        worst = int(np.argmax(short / tokens))
        if short[worst] <= 1e-9:
            break
        room = (share[worst] > 0) & (relative < MAX_RELATIVE_ERROR)
        if not room.any():
            break
        value = np.where(room, share[worst] / np.maximum(cost, 1e-12), -1.0)
        chosen = int(np.argmax(value))
        step = min(short[worst] / share[worst, chosen], COVER_STEP)
        relative[chosen] = min(MAX_RELATIVE_ERROR, relative[chosen] + step)
    return relative


def _tier(minimum: float, members: _Mask, error: _Vector, needed: _Vector, width: _Vector) -> Band:
    """How many widths the errors of most of this tier's pieces reach past the absolute part."""
    reach = needed[members] / np.maximum(width[members], 1e-9)
    under = max(1.0, _quantile(reach[error[members] < 0]))
    over = max(1.0, _quantile(reach[error[members] > 0]))
    return Band(int(minimum), round(under, 6), round(over, 6))
