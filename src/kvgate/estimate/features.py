"""Byte-class features of a text: what the fast estimator's weights multiply.

One `bytes.translate` maps every UTF-8 byte to its class; one `numpy.bincount` then counts every
class pair, and the classes with them. Runs and pairs carry what single classes cannot: a
run of letters is a word (sentencepiece spends about one piece per word plus one per few letters), a
run of digits is a number, case changes split identifiers. Continuation bytes of multi-byte characters
are not a feature: the lead byte already says what the character is.

Texts up to FULL_SCAN_BYTES are read whole; longer ones through a fixed number of evenly spaced
windows, so the cost is the same for 100 KB and 100 MB (a long non-ASCII text is sampled as
characters, so it is not even encoded whole). A window that looks like a trap (pure ASCII without
whitespace: base64, data URLs, hex; or a run of one character) is left out of the counts and only its
size is reported: no weight fitted on real text says what such a stretch costs, so the estimator gives
it a wide band.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

CLASSES = (
    "lower",
    "upper",
    "digit",
    "space",
    "newline",
    "control",
    "punct",  # other ASCII punctuation
    "quote",  # " and ', JSON's and Python's string delimiters
    "bracket",  # ( ) [ ] { }
    "separator",  # , . : ;
    "latin2",  # 2-byte lead C2-CF: Latin-1 supplement, Latin extended, IPA, Greek
    "other2",  # 2-byte lead D0-DF: Cyrillic, Armenian, Hebrew, Arabic
    "script3",  # 3-byte lead E0-E1: Indic, Thai, Georgian, …
    "symbol3",  # 3-byte lead E2: typographic punctuation, arrows, box drawing
    "cjk",  # 3-byte lead E3-E9: kana and CJK ideographs
    "hangul",  # 3-byte lead EA-ED
    "fullwidth",  # 3-byte lead EE-EF: private use, fullwidth forms
    "fourbyte",  # 4-byte lead F0-F4: emoji, rare ideographs
)
_CONTINUATION = len(CLASSES)

# Runs of a class (a word, a number, an indentation) cost about one piece each plus their length.
RUNS = ("lower", "upper", "digit", "space", "punct", "quote", "bracket", "separator", "newline")
PAIRS = (
    ("space", "lower"),
    ("space", "upper"),
    ("upper", "lower"),
    ("lower", "upper"),
    ("lower", "digit"),
    ("digit", "lower"),
    ("quote", "separator"),
    ("separator", "space"),
    ("newline", "space"),
    # Words in other scripts: a space before a Cyrillic or Hangul letter, accents inside Latin words.
    ("space", "other2"),
    ("space", "hangul"),
    ("lower", "latin2"),
    ("continuation", "lower"),
    ("continuation", "space"),
)

FEATURES = CLASSES + tuple(f"{name}*" for name in RUNS) + tuple(f"{a}>{b}" for a, b in PAIRS)

WINDOWS = 32
WINDOW_BYTES = 256
# Texts up to this size are read whole: past it, ordinary text is about 24k tokens or more, beyond
# the thresholds, so what sampling could miss there can only add to a total that is already too long.
FULL_SCAN_BYTES = 96 * 1024
# Non-ASCII texts up to this many characters are encoded whole, so their byte size is exact; longer
# ones are sampled as characters and only the windows are encoded.
ENCODE_CHARS = 32768
# An ASCII window with less than one whitespace per this many bytes is a trap candidate; prose has
# one every ~6 bytes, code one every ~4, so only blob-like stretches get flagged.
TRAP_BYTES_PER_SPACE = 40
UTF8_MAX_BYTES = 4


def _class_of(byte: int) -> int:
    ranges = (
        (0x61, 0x7A, "lower"),
        (0x41, 0x5A, "upper"),
        (0x30, 0x39, "digit"),
        (0x20, 0x20, "space"),
        (0x0A, 0x0A, "newline"),
        (0x0D, 0x0D, "newline"),
        (0x22, 0x22, "quote"),
        (0x27, 0x27, "quote"),
        (0x28, 0x29, "bracket"),
        (0x5B, 0x5B, "bracket"),
        (0x5D, 0x5D, "bracket"),
        (0x7B, 0x7B, "bracket"),
        (0x7D, 0x7D, "bracket"),
        (0x2C, 0x2E, "separator"),
        (0x3A, 0x3B, "separator"),
        (0x21, 0x7E, "punct"),
        (0x00, 0x7F, "control"),
        (0xC2, 0xCF, "latin2"),
        (0xD0, 0xDF, "other2"),
        (0xE0, 0xE1, "script3"),
        (0xE2, 0xE2, "symbol3"),
        (0xE3, 0xE9, "cjk"),
        (0xEA, 0xED, "hangul"),
        (0xEE, 0xEF, "fullwidth"),
        (0xF0, 0xF4, "fourbyte"),
    )
    for low, high, name in ranges:
        if low <= byte <= high:
            return CLASSES.index(name)
    return _CONTINUATION


_TABLE = bytes(_class_of(b) for b in range(256))
_STRIDE = 32  # > number of class codes, so a pair (a, b) is the single number a * _STRIDE + b (a << 5)
_Bytes = np.ndarray[tuple[int], np.dtype[np.uint8]]
_Sliceable = TypeVar("_Sliceable", str, bytes)
_Counts = np.ndarray[tuple[int, ...], np.dtype[np.intp]]
PairIndex = np.ndarray[tuple[int], np.dtype[np.uint16]]
PairTable = np.ndarray[tuple[int], np.dtype[np.float64]]
# Every 12th byte: the same byte of each character in a run of 1-, 2-, 3- or 4-byte characters.
_PROBE_STEP = 12
_BLOB, _RUN = 1, 2
_SPACE_BYTE = ord(" ")
_END = _STRIDE - 1  # a class code no byte has: what follows the last byte
_END_BYTE = bytes((_END,))
_CODES = {name: code for code, name in enumerate((*CLASSES, "continuation"))}


def _pairs_to_features() -> np.ndarray[tuple[int, int], np.dtype[np.float64]]:
    """The matrix that turns a histogram of class pairs into FEATURES counts (features = M @ pairs).

    Each byte is the first of exactly one pair (the last one's pair ends in a sentinel), so a class's
    count is its row of pairs; a run of class c starts wherever c follows anything but c."""
    matrix = np.zeros((len(FEATURES), _STRIDE * _STRIDE))
    for code in range(len(CLASSES)):
        matrix[code, code * _STRIDE : (code + 1) * _STRIDE] = 1.0
    for row, name in enumerate(RUNS, start=len(CLASSES)):
        code = _CODES[name]
        matrix[row, code * _STRIDE : (code + 1) * _STRIDE] = 1.0
        matrix[row, code * _STRIDE + code] = 0.0
    for row, (first, second) in enumerate(PAIRS, start=len(CLASSES) + len(RUNS)):
        matrix[row, _CODES[first] * _STRIDE + _CODES[second]] = 1.0
    return matrix


PAIRS_TO_FEATURES = _pairs_to_features()
# Up to this size the trap windows are found with bytes methods, past it with numpy.
_SMALL_TEXT_BYTES = 16 * WINDOW_BYTES
# 1 for space, newline, tab and control characters (none of them occurs in a blob), 0 for the rest.
_WHITESPACE_ONES = bytes(int(byte <= _SPACE_BYTE) for byte in range(256))


@dataclass(frozen=True, slots=True)
class Sample:
    """Feature counts of a text (scaled up from its windows when it was sampled)."""

    size: float  # UTF-8 bytes of the whole text (estimated when a long non-ASCII text was sampled)
    min_size: int  # certainly at least this many UTF-8 bytes
    max_size: int  # certainly no more than this many
    counts: tuple[float, ...]  # one per FEATURES entry, for the whole text outside trap windows
    blob_bytes: float  # bytes of the whole text in blob windows (base64, hex, URLs)
    run_bytes: float  # bytes of the whole text in runs of one character

    @property
    def trap_bytes(self) -> float:
        return self.blob_bytes + self.run_bytes


EMPTY_SAMPLE = Sample(0.0, 0, 0, (0.0,) * len(FEATURES), 0.0, 0.0)


def sample(text: str) -> Sample:
    """Features of the whole of `text`: read whole up to FULL_SCAN_BYTES, through windows beyond."""
    if not text:
        return EMPTY_SAMPLE
    if text.isascii():
        # One byte per character: the size is known without encoding, and only windows are encoded.
        read = text if len(text) <= FULL_SCAN_BYTES else "".join(_windows(text))
        return _features(read.encode("ascii"), len(text), len(text), len(text))
    if len(text) <= ENCODE_CHARS:
        data = text.encode("utf-8", "surrogatepass")
        size = len(data)
        read_bytes = data if size <= FULL_SCAN_BYTES else b"".join(_windows(data))
        return _features(read_bytes, size, size, size)
    data = "".join(_windows(text)).encode("utf-8", "surrogatepass")
    estimated = len(text) * len(data) / (WINDOWS * WINDOW_BYTES)
    return _features(data, estimated, len(text), len(text) * UTF8_MAX_BYTES)


def _windows(sequence: _Sliceable) -> list[_Sliceable]:
    """WINDOWS slices of WINDOW_BYTES items, evenly spaced from the start to the end."""
    step = (len(sequence) - WINDOW_BYTES) / (WINDOWS - 1)
    return [sequence[round(i * step) : round(i * step) + WINDOW_BYTES] for i in range(WINDOWS)]


def _features(data: bytes, size: float, min_size: int, max_size: int) -> Sample:
    raw = np.frombuffer(data, dtype=np.uint8)
    codes = _pair_codes(data)
    trap_kind = _trap_kinds(data)
    blob_bytes = run_bytes = 0
    if trap_kind.any():
        # The partial window at the end goes with the last whole one: a run or a blob that reaches the
        # end of the text must not have its last bytes priced at ordinary-text weights.
        tail = len(raw) - len(trap_kind) * WINDOW_BYTES
        tail_kind = int(trap_kind[-1])
        regular = np.repeat(trap_kind == 0, WINDOW_BYTES)
        regular = np.concatenate((regular, np.full(tail, tail_kind == 0, dtype=bool)))
        codes = codes[regular]
        blob_bytes = int(np.count_nonzero(trap_kind == _BLOB)) * WINDOW_BYTES + (
            tail if tail_kind == _BLOB else 0
        )
        run_bytes = int(np.count_nonzero(trap_kind == _RUN)) * WINDOW_BYTES + (
            tail if tail_kind == _RUN else 0
        )
    scale = size / len(raw)
    counts = PAIRS_TO_FEATURES @ np.bincount(codes, minlength=_STRIDE * _STRIDE) * scale
    return Sample(size, min_size, max_size, tuple(counts.tolist()), blob_bytes * scale, run_bytes * scale)


def pair_index_table(per_pair: np.ndarray[tuple[int], np.dtype[np.float64]]) -> PairTable:
    """A value per class pair (indexed first class * _STRIDE + second, as PAIRS_TO_FEATURES' columns)
    laid out for `plain_pair_index`: first class * 256 + second."""
    table = np.zeros(len(_CODES) * 256)
    for first in range(len(_CODES)):
        table[first * 256 : first * 256 + _STRIDE] = per_pair[first * _STRIDE : (first + 1) * _STRIDE]
    return table


def plain_pair_index(data: bytes) -> tuple[PairIndex, bytes] | None:
    """A text's class pairs, for the estimator's shortcut, or None when the text has a trap window
    (which `sample` prices apart) or is too long to read whole. Returns the pair index of every byte
    (its class * 256 + the next byte's class: the class bytes read as overlapping big-endian 16-bit
    numbers, so numpy does no arithmetic per byte) and the class bytes themselves."""
    if len(data) > FULL_SCAN_BYTES or _has_trap(data):
        return None
    classes = data.translate(_TABLE) + _END_BYTE
    return np.ndarray((len(data),), dtype=">u2", buffer=classes, strides=(1,)), classes


def _pair_codes(data: bytes) -> np.ndarray[tuple[int], np.dtype[np.uint16]]:
    """Per byte: its class * _STRIDE + the next byte's class (a sentinel after the last byte)."""
    classes = np.frombuffer(data.translate(_TABLE), dtype=np.uint8)
    codes = np.left_shift(classes, 5, dtype=np.uint16)
    codes[:-1] += classes[1:]
    codes[-1] += _END
    return codes


def _trap_kinds(data: bytes) -> _Counts:
    """Per whole window of `data`: 0, _BLOB or _RUN (see `_trap_windows`)."""
    if len(data) > _SMALL_TEXT_BYTES:
        return _trap_windows(np.frombuffer(data, dtype=np.uint8))
    return np.array(_trap_windows_small(data), dtype=np.intp)


def _has_trap(data: bytes) -> bool:
    """Whether any whole window of `data` is a trap (a short text's without building an array)."""
    if len(data) <= _SMALL_TEXT_BYTES:
        return any(_trap_windows_small(data))
    return bool(_trap_kinds(data).any())


def _trap_windows_small(data: bytes) -> list[int]:
    """`_trap_windows` for a few windows, with bytes methods: a dozen numpy calls on small arrays cost
    more than the work itself (about 40 µs for a 2 KB chat message against about 5 µs here)."""
    whitespace = data.translate(_WHITESPACE_ONES)
    ascii_text = data.isascii()
    kinds = []
    for start in range(0, len(data) - WINDOW_BYTES + 1, WINDOW_BYTES):
        end = start + WINDOW_BYTES
        probes = data[start:end:_PROBE_STEP]
        middle = probes[len(probes) // 2]
        if probes.count(middle) * 4 >= len(probes) * 3:
            kinds.append(_RUN)
        elif whitespace.count(1, start, end) * TRAP_BYTES_PER_SPACE < WINDOW_BYTES and (
            ascii_text or data[start:end].isascii()
        ):
            kinds.append(_BLOB)
        else:
            kinds.append(0)
    return kinds


def _trap_windows(raw: _Bytes) -> _Counts:
    """Per whole window: _BLOB when pure ASCII with almost no whitespace (base64, hex, URLs), _RUN when
    one character repeats (every 12th byte probed: that lands on the same byte of each 1-, 2-, 3- or
    4-byte character), else 0. A last, partial window is never a trap."""
    windows = raw[: len(raw) // WINDOW_BYTES * WINDOW_BYTES].reshape(-1, WINDOW_BYTES)
    # Space, newline, tab and control characters: none of them occurs in a blob.
    whitespace = (windows <= _SPACE_BYTE).view(np.uint8).sum(axis=1, dtype=np.uint16)
    blob = (windows.max(axis=1, initial=0) < 0x80) & (whitespace * TRAP_BYTES_PER_SPACE < WINDOW_BYTES)
    probes = windows[:, ::_PROBE_STEP]
    middle = probes[:, probes.shape[1] // 2 : probes.shape[1] // 2 + 1]
    same = (probes == middle).view(np.uint8).sum(axis=1, dtype=np.uint16)
    run = same.astype(np.intp) * 4 >= probes.shape[1] * 3
    return np.where(run, _RUN, np.where(blob, _BLOB, 0))
