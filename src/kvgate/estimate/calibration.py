"""A tokenizer's calibration: the fast estimator's weights and error band, stored as a small JSON file.

`kvgate calibrate` writes one; the gate finds the one for its tokenizer by the file's SHA-256, first
among the calibrations shipped in this package, then beside the tokenizer (`<file>.calibration.json`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvgate.errors import ConfigError
from kvgate.estimate.exact import TokenizerFile
from kvgate.estimate.features import FEATURES

SHIPPED = Path(__file__).parent / "calibrations"
# Used when a model names no tokenizer: Llama/Mistral-style sentencepiece, the most common family.
DEFAULT_SHIPPED = "mistral_instruct_tokenizer_240323.model.v3.json"
SUFFIX = ".calibration.json"


@dataclass(frozen=True, slots=True)
class Band:
    min_tokens: int
    under: float  # how far above the estimate the exact count was seen, relative (times a margin)
    over: float  # how far below


@dataclass(frozen=True, slots=True)
class Calibration:
    tokenizer: str  # the file name it was fitted on, for people reading the JSON
    sha256: str
    weights: tuple[float, ...]  # tokens per occurrence of each FEATURES entry
    per_text: float  # tokens every text costs by itself (a dummy prefix, a first-word piece)
    trap_density: float  # tokens per byte of base64, the point estimate of a blob window
    run_density: float  # tokens per byte of runs of common characters, the point estimate of a run
    # Tokens one 4-byte character (emoji) takes, fewest and most; the weight holds the mean.
    fourbyte_min: float
    fourbyte_max: float
    # Band: estimate - over * estimate - absolute_error <= exact <= estimate + under * estimate +
    # absolute_error, with (under, over) from the last tier whose min_tokens the estimate reaches:
    # errors shrink as texts grow.
    bands: tuple[Band, ...]
    absolute_error: float
    # Certainty rule: exact <= max_tokens_per_byte * bytes + 1 for every text seen while fitting.
    max_tokens_per_byte: float
    max_piece_bytes: int  # lower bound: exact >= bytes / max_piece_bytes
    samples: int  # how many pieces of text the fit saw
    # |relative error| of held-back pieces of 4k tokens and more, for people reading the JSON.
    mean_error: float
    worst_error: float

    def band_for(self, tokens: float) -> Band:
        chosen = self.bands[0]
        for band in self.bands:
            if tokens >= band.min_tokens:
                chosen = band
        return chosen

    def to_json(self) -> str:
        document: dict[str, Any] = asdict(self)
        document["weights"] = dict(zip(FEATURES, self.weights, strict=True))
        return json.dumps(document, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> Calibration:
        try:
            document = json.loads(text)
            weights = document["weights"]
            if set(weights) != set(FEATURES):
                raise ConfigError(
                    f"{source}: calibration features do not match this kvgate version; "
                    "run `kvgate calibrate` again"
                )
            document["weights"] = tuple(float(weights[name]) for name in FEATURES)
            document["bands"] = tuple(Band(**band) for band in document["bands"])
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


def default() -> Calibration:
    return load(SHIPPED / DEFAULT_SHIPPED)
