"""A tokenizer's calibration: the fast estimator's weights and error band, stored as a small JSON file.

`kvgate calibrate` writes one; the gate finds the one for its tokenizer by the file's SHA-256, first
among the calibrations shipped in this package, then beside the tokenizer (`<file>.calibration.json`).
A model without a tokenizer is estimated with the calibrations of every shipped tokenizer family at
once (`generic`): its band spans them all.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.errors import ConfigError
from kvgate.estimate.exact import TokenizerFile
from kvgate.estimate.features import (
    BYTE_CLASS,
    CLASSES,
    FEATURE_MAPS,
    FEATURES,
    FOURBYTE_LEADS,
    PAIR_FEATURES,
    STRETCH_NAMES,
    pair_table,
)

SHIPPED = Path(__file__).parent / "calibrations"
# Used together when a model names no tokenizer: one per tokenizer family (the sentencepiece models
# v1 to v7 count text alike, and so do both tekken files).
GENERIC = ("mistral_instruct_tokenizer_240323.model.v3.json", "tekken_240718.json")
SUFFIX = ".calibration.json"
# Version of the feature set; a calibration of another version must be fitted again.
FORMAT = 2
_FEATURE_INDEX = {name: i for i, name in enumerate(FEATURES)}
ASCII_CODES = 0x80
_Table = np.ndarray[tuple[int], np.dtype[np.float64]]


@dataclass(frozen=True, slots=True)
class Band:
    min_tokens: int
    under: float  # how many band widths above the estimate the exact count was seen (with a margin)
    over: float  # how many below


@dataclass(frozen=True, slots=True)
class Calibration:
    tokenizer: str  # the file name it was fitted on, for people reading the JSON
    sha256: str  # empty for the generic calibration
    # Tokens per occurrence of each FEATURES entry the corpus showed enough of; the others are
    # absent, and pairs made of them count as never seen.
    weights: tuple[tuple[str, float], ...]
    per_text: float  # tokens every text costs by itself (a dummy prefix, a first-word piece)
    trap_density: float  # tokens per byte of base64, the point estimate of a blob window
    run_density: float  # tokens per byte of runs of common characters, the point estimate of a run
    # Tokens one 4-byte character (emoji) takes: fewest, mean (its weight), most.
    fourbyte_min: float
    fourbyte_mean: float
    fourbyte_max: float
    # Relative error of the tokens of pairs whose first byte is of this class (held-back pieces,
    # with a margin); a pair never seen is given `unseen_width` tokens of width instead.
    uncertainty: tuple[tuple[str, float], ...]
    unseen_width: float
    # Band: estimate - over * width - absolute_error <= exact <= estimate + under * width +
    # absolute_error, with (under, over) from the last tier whose min_tokens the estimate reaches:
    # small texts stray further than their pairs' widths say.
    bands: tuple[Band, ...]
    absolute_error: float
    # Certainty rule: exact <= max_tokens_per_byte * bytes + 1 for every text seen while fitting.
    max_tokens_per_byte: float
    max_piece_bytes: int  # lower bound: exact >= bytes / max_piece_bytes
    samples: int  # how many pieces of text the fit saw
    # |relative error| of held-back pieces of 4k tokens and more, for people reading the JSON.
    mean_error: float
    worst_error: float
    # Per ASCII character (by its code): the most tokens per byte a run of it takes, from
    # `features.STRAY_RUN_BYTES` on. Empty (a calibration from before): max_tokens_per_byte for all.
    run_max: tuple[float, ...] = ()

    def band_for(self, tokens: float) -> Band:
        chosen = self.bands[0]
        for band in self.bands:
            if tokens >= band.min_tokens:
                chosen = band
        return chosen

    def stray_max(self, runs: Sequence[tuple[int, float]], other_bytes: float, strays: float) -> float:
        """The most tokens `strays` stray runs and blobs can take: runs of ASCII characters ((code,
        bytes)) at their runs' most per byte, other runs and blobs at a vocabulary's most, a token
        more each where it meets its neighbours."""
        per_byte = self.run_max or (self.max_tokens_per_byte,) * ASCII_CODES
        most = other_bytes * self.max_tokens_per_byte + strays
        for code, count in runs:
            most += count * per_byte[code]
        return most

    def weight_vector(self) -> _Table:
        vector = np.zeros(len(FEATURES))
        for name, value in self.weights:
            vector[_FEATURE_INDEX[name]] = value
        return vector

    def relative_error(self, name: str) -> float:
        return dict(self.uncertainty).get(name, 0.0)

    def stretches(self) -> tuple[_Table, _Table]:
        """Per run of whitespace counted (`features.STRETCHES`): the tokens each occurrence adds, and
        the width it adds (a space's or a tab's relative error)."""
        weights = self.weight_vector()[len(PAIR_FEATURES) :]
        relative = [self.relative_error("tab" if "tab" in name else "space") for name in STRETCH_NAMES]
        return weights, np.abs(weights) * np.array(relative)

    def tables(self) -> tuple[_Table, _Table]:
        """Per pair value: the tokens it adds, and the width it adds to the band."""
        # Refinements can make a pair worth less than nothing (a Thai letter after another one costs
        # less than the letter alone): only a text's sum needs to be positive, which it is for text
        # like the corpus; `fast` never lets an estimate fall below the certain floor.
        tokens = pair_table(self.weight_vector()[: len(PAIR_FEATURES)])
        known = np.zeros(len(PAIR_FEATURES) + 1, dtype=bool)
        known[
            [_FEATURE_INDEX[name] for name, _ in self.weights if _FEATURE_INDEX[name] < len(PAIR_FEATURES)]
        ] = True
        known[-1] = True  # index -1: a pair that is no block
        _, _, class_pairs, blocks = FEATURE_MAPS
        seen = known[class_pairs] & known[blocks]
        relative = np.zeros(len(CLASSES))
        for name, value in self.uncertainty:
            relative[CLASSES.index(name)] = value
        first_class = BYTE_CLASS[np.arange(len(tokens)) >> 8]
        width = np.where(seen, relative[first_class] * np.abs(tokens), self.unseen_width)
        # Emoji carry their own band (fourbyte_min..fourbyte_max per character).
        width[FOURBYTE_LEADS[0] << 8 : (FOURBYTE_LEADS[-1] + 1) << 8] = 0.0
        return tokens, width

    def to_json(self) -> str:
        document: dict[str, Any] = {"format": FORMAT, **asdict(self)}
        document["weights"] = dict(self.weights)
        document["uncertainty"] = dict(self.uncertainty)
        document["run_max"] = {chr(code): value for code, value in enumerate(self.run_max)}
        return json.dumps(document, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> Calibration:
        try:
            document = json.loads(text)
            if document.pop("format", None) != FORMAT:
                raise ConfigError(
                    f"{source}: calibration features do not match this kvgate version; "
                    "run `kvgate calibrate` again"
                )
            unknown_features = set(document["weights"]) - set(_FEATURE_INDEX)
            unknown_classes = set(document["uncertainty"]) - set(CLASSES)
            if unknown_features or unknown_classes:
                unknown_names = ", ".join(sorted(unknown_features | unknown_classes))
                raise ConfigError(f"{source}: unknown features {unknown_names}; run `kvgate calibrate` again")
            document["weights"] = tuple((str(k), float(v)) for k, v in document["weights"].items())
            document["uncertainty"] = tuple((str(k), float(v)) for k, v in document["uncertainty"].items())
            document["bands"] = tuple(Band(**band) for band in document["bands"])
            run_max = document.pop("run_max", {})
            if run_max and set(run_max) != {chr(code) for code in range(ASCII_CODES)}:
                raise ConfigError(f"{source}: run_max must name every ASCII character")
            document["run_max"] = (
                tuple(float(run_max[chr(code)]) for code in range(ASCII_CODES)) if run_max else ()
            )
            names = {f.name for f in fields(cls)}
            unknown = set(document) - names
            if unknown:
                raise ConfigError(f"{source}: unknown calibration keys: {', '.join(sorted(unknown))}")
            return cls(**document)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{source}: not a kvgate calibration: {exc}") from exc


def load(path: Path) -> Calibration:
    try:
        return Calibration.from_json(path.read_text("utf-8"), str(path))
    except OSError as exc:
        raise ConfigError(f"cannot read calibration {path}: {exc}") from exc


def most_tokens_per_byte() -> float:
    """The most tokens a byte of text took under any shipped tokenizer (their certainty rules): where
    the tokenizer is not known, a text of b bytes takes at most this * b + 1 tokens."""
    return max(load(path).max_tokens_per_byte for path in sorted(SHIPPED.glob("*.json")))


def for_tokenizer(tokenizer: TokenizerFile) -> Calibration:
    """The calibration fitted for exactly this tokenizer file."""
    for candidate in sorted(SHIPPED.glob("*.json")):
        calibration = load(candidate)
        if calibration.sha256 == tokenizer.sha256:
            return calibration
    beside = tokenizer.path.with_name(tokenizer.path.name + SUFFIX)
    if beside.is_file():
        calibration = load(beside)
        if calibration.sha256 == tokenizer.sha256:
            return calibration
        raise ConfigError(f"{beside} was fitted for another tokenizer file (sha256 {calibration.sha256})")
    raise ConfigError(
        f"no calibration for tokenizer {tokenizer.path} (sha256 {tokenizer.sha256}); run "
        f"`kvgate calibrate --tokenizer {tokenizer.path} --corpus DIR --out {beside}`"
    )


def generic() -> tuple[Calibration, ...]:
    """The calibrations a model whose tokenizer is not configured is estimated with."""
    return tuple(load(SHIPPED / name) for name in GENERIC)
