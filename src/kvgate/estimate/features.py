"""Byte-pair features of a text: what the fast estimator's weights multiply.

Every byte and the byte after it form a pair (the last byte pairs with a NUL). The estimate is a sum
over a text's pairs of one number per pair value (with the runs of whitespace, below): one
`bytes.translate` turns each byte into a code (an ASCII byte's class, any other byte itself), numpy
reads the codes as overlapping big-endian 16-bit numbers and takes them from a table, with no
arithmetic per byte. The table is not fitted entry by entry; it is built from features that pairs
share, so what the corpus shows of a feature carries over to pairs it rarely shows:

- the class of the first byte (`lower`, `digit`, `dquote`, `colon`, `open`, ..., each UTF-8 lead
  byte on its own, `continuation`): what one character of that kind costs;
- the end of a run of one class (`lower*`: a word, `digit*`: a number, `space*`: an indentation);
- the pair of classes (`dquote>colon`: a JSON key's end, `colon>dquote`: a string value's start,
  `newline>space`: indentation, `backslash>dquote`: an escaped quote inside a JSON string, `slash>
  lower`: a URL path or an identifier, `upper>lower`: a case change);
- the lead byte and first continuation byte of a non-ASCII character (`e0b6`: a 64-code-point block
  of Sinhala): which script, which Latin letters, which symbols, each tokenized its own way;
- runs of 4, 8 and 16 spaces and of 2, 4 and 8 tabs (`STRETCHES`): indentation and aligned columns,
  which tokenizers spend a piece on per run rather than per character.

Digits and numbers are `digit` and `digit*`, JSON's punctuation its class pairs, identifiers and
URLs their case changes and slashes, emoji and rare scripts their lead bytes and blocks. The texts
are what the request body's JSON decodes to, so a tool result's own JSON is seen as JSON, never the
body's escapes.

Texts up to FULL_SCAN_BYTES are read whole; longer ones through a fixed number of windows, one at a
random place in each of as many equal stretches of the text, drawn afresh for every read, so the cost
is the same for 100 KB and 100 MB (a long non-ASCII text is sampled as characters, so it is not even
encoded whole). A window that looks like a trap (base64, hex: ASCII with
almost no whitespace or JSON punctuation and many digits and capitals; or a run of one character) is
left out of the counts and only its size is reported: no weight fitted on real text says what such a
stretch costs, so the estimator gives it a wide band. Runs and blobs no trap window holds are found
byte by byte (`stray_stretches`) and stay in the counts; the band's high takes them at their most.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

# Classes of ASCII bytes; every UTF-8 lead byte is a class of its own ("c3", "e4", ...).
_ASCII_NAMES = {
    " ": "space", "\t": "tab", "\n": "newline", "\r": "newline", '"': "dquote", "'": "squote",
    ":": "colon", ",": "comma", ".": "period", ";": "semicolon", "(": "open", "[": "open", "{": "open",
    ")": "close", "]": "close", "}": "close", "\\": "backslash", "/": "slash", "-": "dash",
    "_": "underscore", "=": "equals", "<": "angle", ">": "angle",
}  # fmt: skip
LEADS = range(0xC2, 0xF5)
FOURBYTE_LEADS = range(0xF0, 0xF5)
CONTINUATIONS = range(0x80, 0xC0)


def _class_name(byte: int) -> str:
    if byte >= 0x80:
        if byte in LEADS:
            return f"{byte:02x}"
        return "continuation" if byte in CONTINUATIONS else "invalid"
    char = chr(byte)
    if char.islower():
        return "lower"
    if char.isupper():
        return "upper"
    if char.isdigit():
        return "digit"
    if char in _ASCII_NAMES:
        return _ASCII_NAMES[char]
    return "punct" if char.isprintable() else "control"


CLASSES = tuple(dict.fromkeys(_class_name(byte) for byte in range(256)))
BYTE_CLASS = np.array([CLASSES.index(_class_name(byte)) for byte in range(256)], dtype=np.intp)
# Runs and class pairs are features only where they add something: a lead byte is always followed by
# a continuation byte (its count says it all), and a continuation byte followed by another one is the
# inside of a character (which the lead's count and the block already price).
_ASCII_CLASSES = tuple(dict.fromkeys(_class_name(byte) for byte in range(0x80)))
_PAIR_FIRST = (*_ASCII_CLASSES, "continuation")
_BLOCK_LEADS = tuple(lead for lead in LEADS if lead not in FOURBYTE_LEADS)
BLOCKS = tuple(f"{lead:02x}{cont:02x}" for lead in _BLOCK_LEADS for cont in CONTINUATIONS)
CLASS_PAIRS = tuple(
    f"{a}>{b}" for a in _PAIR_FIRST for b in CLASSES if not (a == "continuation" and b == "continuation")
)
PAIR_FEATURES = CLASSES + tuple(f"{name}*" for name in _ASCII_CLASSES) + CLASS_PAIRS + BLOCKS
# Long runs of spaces and tabs (indentation, aligned columns): how many times each of these fits in
# the text without overlap. A tokenizer spends one piece on a run of whitespace up to some length, so
# a run's cost grows in steps a pair's weight cannot follow alone.
STRETCHES = (b" " * 4, b" " * 8, b" " * 16, b"\t" * 2, b"\t" * 4, b"\t" * 8)
STRETCH_NAMES = ("4 spaces", "8 spaces", "16 spaces", "2 tabs", "4 tabs", "8 tabs")
FEATURES = PAIR_FEATURES + STRETCH_NAMES
PAIR_VALUES = 1 << 16
_Index = np.ndarray[tuple[int], np.dtype[np.intp]]


def _feature_maps() -> tuple[_Index, ...]:
    """Per pair value (first byte * 256 + second): the index in FEATURES of its class, its run end,
    its class pair and its block, each -1 where the pair has no such feature."""
    index = {name: i for i, name in enumerate(PAIR_FEATURES)}
    run_of = np.array([index.get(f"{name}*", -1) for name in CLASSES])
    pair_of = np.array([[index.get(f"{a}>{b}", -1) for b in CLASSES] for a in CLASSES])
    block_of = np.array([[index.get(f"{a:02x}{b:02x}", -1) for b in range(256)] for a in range(256)])
    first, second = np.divmod(np.arange(PAIR_VALUES), 256)
    a, b = BYTE_CLASS[first], BYTE_CLASS[second]
    return a, np.where(a != b, run_of[a], -1), pair_of[a, b], block_of[first, second]


FEATURE_MAPS = _feature_maps()


# Texts are read through codes: an ASCII byte's code is its class (every ASCII pair of the same two
# classes has the same features), any other byte's code stands for the byte itself. A table over code
# pairs gives the same sums as the table over pair values, and the pairs of ordinary text fall in a
# small, cache-friendly corner of it.
_CODES = bytes(
    _ASCII_CLASSES.index(_class_name(byte)) if byte < 0x80 else len(_ASCII_CLASSES) + byte - 0x80
    for byte in range(256)
)
_CODE_END = bytes((_CODES[0],))  # the NUL after the last byte
_CODE_COUNT = len(_ASCII_CLASSES) + 0x80
_REPRESENTATIVE = [_CODES.index(bytes((code,))) for code in range(_CODE_COUNT)]
# The pair value each code pair index (first code * 256 + second code) stands for.
CODE_PAIR_VALUES = np.array(
    [
        _REPRESENTATIVE[a] * 256 + (_REPRESENTATIVE[b] if b < _CODE_COUNT else 0)
        for a in range(_CODE_COUNT)
        for b in range(256)
    ]
)


def code_pair_index(data: bytes) -> PairIndex:
    """Per byte of `data`: its code and the next byte's (a NUL after the last) read as one big-endian
    16-bit number, with no arithmetic per byte; indexes tables laid out by CODE_PAIR_VALUES."""
    return np.ndarray((len(data),), dtype=">u2", buffer=data.translate(_CODES) + _CODE_END, strides=(1,))


def pair_table(
    weights: np.ndarray[tuple[int], np.dtype[np.float64]],
) -> np.ndarray[tuple[int], np.dtype[np.float64]]:
    """The value of each pair: the sum of the weights (one per PAIR_FEATURES entry) of its features."""
    padded = np.append(weights, 0.0)  # index -1: no such feature
    table: np.ndarray[tuple[int], np.dtype[np.float64]] = np.zeros(PAIR_VALUES)
    for feature_of in FEATURE_MAPS:
        table += padded[feature_of]
    return table


WINDOWS = 32
WINDOW_BYTES = 256
# Where the windows of a long text fall: at a random place in each of WINDOWS equal stretches of it,
# drawn afresh for every read. Windows at fixed places (evenly spaced from the first character to the
# last, before 2026-12-06) let a client put cheap text where they fall and costly text between them:
# 120 KB of random characters with English at the 32 places read as 33,864 tokens for 89,445, so the
# gate reserved 2.6 times less KV than the engine then took, and 40,000 CJK characters laid out the
# same way as 11,288 for 34,112 (docs/estimation.md). Drawn at random, a window lands in whatever
# fills its share of its stretch, so the read is unbiased whatever the text's layout; drawn afresh, a
# text that happened to read short reads otherwise when it is sent again. The tests seed it
# (tests/conftest.py).
WINDOW_RANDOM = random.Random()
# Texts up to this size are read whole: past it, ordinary text is about 24k tokens or more, beyond
# the interactive threshold, and a sample of it is unbiased (WINDOW_RANDOM) with its error in the band
# (fast.SAMPLING_Z).
FULL_SCAN_BYTES = 96 * 1024
# Non-ASCII texts up to this many characters are encoded whole, so their byte size is exact; longer
# ones are sampled as characters and only the windows are encoded.
ENCODE_CHARS = 32768
# An ASCII window is a blob when it has less than one whitespace per TRAP_BYTES_PER_SPACE bytes (prose
# has one every ~6 bytes, code one every ~4), less than one JSON or code delimiter per
# TRAP_BYTES_PER_DELIMITER (compact JSON has one every ~5), and at least a quarter digits and capitals
# (base64: ~45%, hex: ~60%, a URL or an identifier: a few).
TRAP_BYTES_PER_SPACE = 40
TRAP_BYTES_PER_DELIMITER = 32
TRAP_DIGIT_SHARE = 4
# Runs and blobs no trap window covers (shorter than a window, sharing one with other text, or in the
# partial window at the end) are read with the rest of the text, and the band's high takes them at
# what they could cost: a stretch repeating one character (or a short pattern) from STRAY_RUN_BYTES
# on, spaces and tabs excepted (their runs have features of their own); a stretch of base64's and
# hex's alphabet from STRAY_BLOB_BYTES on, a quarter or more of it digits and capitals. Shorter ones
# cost at most about a token per byte more than their weights say, which the band's absolute part
# covers.
STRAY_RUN_BYTES = 24
STRAY_BLOB_BYTES = 32
UTF8_MAX_BYTES = 4

_Sliceable = TypeVar("_Sliceable", str, bytes)
_Counts = np.ndarray[tuple[int, ...], np.dtype[np.intp]]
PairIndex = np.ndarray[tuple[int], np.dtype[np.uint16]]
# Every 12th byte: the same byte of each character in a run of 1-, 2-, 3- or 4-byte characters.
_PROBE_STEP = 12
_BLOB, _RUN = 1, 2
_SPACE_BYTE = ord(" ")
# Up to this size the trap windows are found with bytes methods, past it with numpy.
_SMALL_TEXT_BYTES = 16 * WINDOW_BYTES
# 1 for space, newline, tab and control characters (none of them occurs in a blob), 0 for the rest.
_WHITESPACE_ONES = bytes(int(byte <= _SPACE_BYTE) for byte in range(256))
# 1 for what separates JSON values and code tokens; base64 and hex have none of them.
_DELIMITER_ONES = bytes(int(chr(byte) in "\"',:;{}[]()<>") if byte < 0x80 else 0 for byte in range(256))
# 1 for digits and capitals.
_DIGIT_UPPER_ONES = bytes(
    int(chr(byte).isdigit() or chr(byte).isupper()) if byte < 0x80 else 0 for byte in range(256)
)
# For numpy: one code per byte, so a window's counts are comparisons of one array.
_DELIMITER, _DIGIT_UPPER, _NON_ASCII = 1, 2, 3
_BLOB_CODES = bytes(
    _NON_ASCII
    if byte >= 0x80
    else _DELIMITER
    if _DELIMITER_ONES[byte]
    else _DIGIT_UPPER
    if _DIGIT_UPPER_ONES[byte]
    else 0
    for byte in range(256)
)
# A run repeats with the period of its character (1 to 4 bytes), so every byte equals the one
# _RUN_LAG bytes before it. Spaces and tabs, compared as NUL, equal nothing but a NUL.
_RUN_LAG = 12
_SPACE_TAB_AS_NUL = bytes(0 if byte in b" \t" else byte for byte in range(256))
_RUN_MARKS = b"\x01" * (STRAY_RUN_BYTES - _RUN_LAG)
# "a" for the bytes of base64's and hex's alphabets, " " for the rest.
_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/="
_ALPHABET_MARKS = bytes(ord("a") if byte in _ALPHABET else ord(" ") for byte in range(256))
_BLOB_MARKS = b"a" * STRAY_BLOB_BYTES
_NOT_DIGIT_UPPER = bytes(byte for byte in range(256) if not _DIGIT_UPPER_ONES[byte])
# What every stray and every blob window holds, so a text without it has none (`is_plain`): this many
# bytes in a row, none a space or a tab. A stray blob is STRAY_BLOB_BYTES of base64's alphabet; a
# stray run repeats its character with a period of up to UTF8_MAX_BYTES, and `_runs` compares spaces
# and tabs with NUL, so none is in one; a blob window has fewer than WINDOW_BYTES /
# TRAP_BYTES_PER_SPACE bytes up to a space, and the others, split by them, leave a stretch of
# _BLOB_WINDOW_STRETCH at least.
_BLOB_WINDOW_SPACES = -(-WINDOW_BYTES // TRAP_BYTES_PER_SPACE) - 1
_BLOB_WINDOW_STRETCH = -(-(WINDOW_BYTES - _BLOB_WINDOW_SPACES) // (_BLOB_WINDOW_SPACES + 1))
_SCREEN_BYTES = min(STRAY_RUN_BYTES, STRAY_BLOB_BYTES, _BLOB_WINDOW_STRETCH)
_SPACE_TAB_SPLITS = bytes(ord(" ") if byte in b" \t" else ord("x") for byte in range(256))
_SCREEN_STRETCH = b"x" * _SCREEN_BYTES
# A stray stretch: (start, end, the ASCII byte a run repeats, or -1 for a blob or any other run).
Stray = tuple[int, int, int]


NO_PAIRS: PairIndex = np.zeros(0, dtype=np.uint16)


@dataclass(frozen=True, slots=True, eq=False)
class Sample:
    """The byte pairs a text was read by (through windows when it was sampled), and its sizes."""

    size: float  # UTF-8 bytes of the whole text (estimated when a long non-ASCII text was sampled)
    min_size: int  # certainly at least this many UTF-8 bytes
    max_size: int  # certainly no more than this many
    blob_bytes: float  # bytes of the whole text in blob windows (base64, hex)
    run_bytes: float  # bytes of the whole text in runs of one character
    # The code pair index (see `code_pair_index`) of every byte read outside trap windows, and what
    # one of them stands for in the whole text.
    index: PairIndex = field(default_factory=lambda: NO_PAIRS)
    scale: float = 1.0
    fourbyte: float = 0.0  # 4-byte characters (emoji, rare ideographs) outside trap windows
    stretches: tuple[float, ...] = (0.0,) * len(STRETCHES)  # counts of STRETCHES outside trap windows
    # Stray runs and blobs (see STRAY_RUN_BYTES), read with the rest: their pairs (also in `index`),
    # the bytes of runs of each ASCII character, (byte, bytes), the bytes of the others, how many.
    stray_index: PairIndex = field(default_factory=lambda: NO_PAIRS)
    stray_runs: tuple[tuple[int, float], ...] = ()
    stray_bytes: float = 0.0
    strays: float = 0.0
    # Bytes of a sampled text whose kind no window showed: between a trap window and an ordinary one.
    unsure_bytes: float = 0.0
    # Bytes a long non-ASCII text sampled as characters may hold beyond `size`, which is what its
    # windows' characters weigh on average: each stretch between two windows taken to be as wide as
    # the wider of the two (256 base64 characters at each end of 32k three-byte ones read 3% short
    # when windows sat at both ends).
    wide_bytes: float = 0.0

    @property
    def trap_bytes(self) -> float:
        return self.blob_bytes + self.run_bytes

    def histogram(
        self,
    ) -> tuple[np.ndarray[tuple[int], np.dtype[np.intp]], np.ndarray[tuple[int], np.dtype[np.float64]]]:
        """The pair values seen, and how often, for the whole text."""
        counts = np.bincount(self.index, minlength=len(CODE_PAIR_VALUES))
        seen = np.flatnonzero(counts)
        pairs: np.ndarray[tuple[int], np.dtype[np.intp]] = CODE_PAIR_VALUES[seen]
        scaled: np.ndarray[tuple[int], np.dtype[np.float64]] = counts[seen].astype(np.float64) * self.scale
        return pairs, scaled

    def features(self) -> np.ndarray[tuple[int], np.dtype[np.float64]]:
        """Counts of every FEATURES entry (what a calibration's weights multiply)."""
        pairs, counts = self.histogram()
        totals = np.zeros(len(PAIR_FEATURES) + 1)
        for feature_of in FEATURE_MAPS:
            np.add.at(totals, feature_of[pairs], counts)
        return np.concatenate((totals[:-1], self.stretches))


EMPTY_SAMPLE = Sample(0.0, 0, 0, 0.0, 0.0)


def sample(text: str, whole: bool = False) -> Sample:
    """The pairs of the whole of `text`: read whole up to FULL_SCAN_BYTES (or `whole`: always, as a fit
    wants them), through windows beyond."""
    if not text:
        return EMPTY_SAMPLE
    if whole:
        data = text.encode("utf-8", "surrogatepass")
        return _sample(data, len(data), len(data), len(data))
    if text.isascii():
        # One byte per character: the size is known without encoding, and only windows are encoded.
        read = text if len(text) <= FULL_SCAN_BYTES else "".join(_windows(text, _window_starts(len(text))))
        return _sample(read.encode("ascii"), len(text), len(text), len(text))
    if len(text) <= ENCODE_CHARS:
        data = text.encode("utf-8", "surrogatepass")
        size = len(data)
        read_bytes = data if size <= FULL_SCAN_BYTES else b"".join(_windows(data, _window_starts(size)))
        return _sample(read_bytes, size, size, size)
    starts = _window_starts(len(text))
    windows = [window.encode("utf-8", "surrogatepass") for window in _windows(text, starts)]
    data = b"".join(windows)
    estimated = len(text) * len(data) / (WINDOWS * WINDOW_BYTES)
    widths = [len(window) / WINDOW_BYTES for window in windows]
    # The text between two windows taken as wide as the wider of them; before the first and after the
    # last, as that window.
    ends = [start + WINDOW_BYTES for start in starts]
    between = (start - end for end, start in zip(ends[:-1], starts[1:], strict=True))
    gaps = [starts[0], *between, len(text) - ends[-1]]
    beside = [widths[0], *map(max, widths, widths[1:]), widths[-1]]
    wide = len(data) + sum(gap * width for gap, width in zip(gaps, beside, strict=True))
    return _sample(data, estimated, len(text), len(text) * UTF8_MAX_BYTES, max(0.0, wide - estimated))


def _window_starts(length: int) -> list[int]:
    """Where the windows of a sequence of `length` items (at least WINDOWS * WINDOW_BYTES) start: one
    at a random place in each of WINDOWS equal stretches (see WINDOW_RANDOM)."""
    stretch = length / WINDOWS
    slack = stretch - WINDOW_BYTES
    draw = WINDOW_RANDOM.random
    return [int(i * stretch + draw() * slack) for i in range(WINDOWS)]


def _windows(sequence: _Sliceable, starts: list[int]) -> list[_Sliceable]:
    return [sequence[start : start + WINDOW_BYTES] for start in starts]


_NO_STRETCHES = (0,) * len(STRETCHES)
_SPACES_4, _SPACES_8, _SPACES_16, _TABS_2, _TABS_4, _TABS_8 = STRETCHES


def stretch_counts(data: bytes) -> tuple[int, ...]:
    """How many times each of STRETCHES fits in `data` without overlap (a longer run is only looked
    for where a shorter one was found: most texts have neither)."""
    spaces = data.count(_SPACES_4)
    # A tab is found by memchr, much faster than a count of two: most texts have none.
    tabs = data.count(_TABS_2) if b"\t" in data else 0
    if not spaces and not tabs:
        return _NO_STRETCHES
    eight = data.count(_SPACES_8) if spaces else 0
    sixteen = data.count(_SPACES_16) if eight else 0
    four_tabs = data.count(_TABS_4) if tabs else 0
    eight_tabs = data.count(_TABS_8) if four_tabs else 0
    return spaces, eight, sixteen, tabs, four_tabs, eight_tabs


_FOURBYTE_LEAD_BYTES = bytes(FOURBYTE_LEADS)


def fourbyte_count(data: bytes) -> int:
    """4-byte characters in `data` (their lead bytes)."""
    if data.isascii():
        return 0
    return len(data) - len(data.translate(None, _FOURBYTE_LEAD_BYTES))


def _sample(data: bytes, size: float, min_size: int, max_size: int, wide_bytes: float = 0.0) -> Sample:
    index = code_pair_index(data)
    trap_kind = _trap_kinds(data)
    blob_bytes = run_bytes = unsure_bytes = 0
    read = data
    if trap_kind.any():
        # The partial window at the end goes with the last whole one: a run or a blob that reaches the
        # end of the text must not have its last bytes priced at ordinary-text weights.
        tail = len(data) - len(trap_kind) * WINDOW_BYTES
        tail_kind = int(trap_kind[-1])
        regular = np.repeat(trap_kind == 0, WINDOW_BYTES)
        regular = np.concatenate((regular, np.full(tail, tail_kind == 0, dtype=bool)))
        index = index[regular]
        blob_bytes = int(np.count_nonzero(trap_kind == _BLOB)) * WINDOW_BYTES + (
            tail if tail_kind == _BLOB else 0
        )
        run_bytes = int(np.count_nonzero(trap_kind == _RUN)) * WINDOW_BYTES + (
            tail if tail_kind == _RUN else 0
        )
        read = np.frombuffer(data, dtype=np.uint8)[regular].tobytes()
        if len(data) < size:
            # Sampled: where a trap window and an ordinary one meet, the text between them (what a
            # window stands for) may be either.
            ordinary = trap_kind == 0
            unsure_bytes = int(np.count_nonzero(ordinary[1:] != ordinary[:-1])) * WINDOW_BYTES
    scale = size / len(data)
    strays = stray_stretches(read)
    stray_index, stray_bytes = NO_PAIRS, 0
    stray_runs: dict[int, int] = {}
    if strays:
        stray = np.zeros(len(index), dtype=bool)
        for start, end, character in strays:
            stray[start:end] = True
            if character < 0:
                stray_bytes += end - start
            else:
                stray_runs[character] = stray_runs.get(character, 0) + end - start
        stray_index = index[stray]
    return Sample(
        size,
        min_size,
        max_size,
        blob_bytes * scale,
        run_bytes * scale,
        index,
        scale,
        fourbyte_count(read) * scale,
        tuple(count * scale for count in stretch_counts(read)),
        stray_index,
        tuple((character, count * scale) for character, count in sorted(stray_runs.items())),
        stray_bytes * scale,
        len(strays) * scale,
        unsure_bytes * scale,
        wide_bytes,
    )


def is_plain(data: bytes) -> bool:
    """Whether the estimator may read `data`'s pairs directly: short enough to read whole, no trap
    window (which `sample` prices apart) and no stray run or blob (which widen the band).

    Most texts are screened in one translation and one find: every stray and every blob window holds
    _SCREEN_BYTES bytes in a row without a space or a tab (see _SCREEN_BYTES), so a text without such
    a stretch can only hold run windows, which the probes alone tell."""
    if len(data) > FULL_SCAN_BYTES:
        return False
    if _SCREEN_STRETCH not in data.translate(_SPACE_TAB_SPLITS):
        return not _has_run_window(data)
    return not _has_trap(data) and not stray_stretches(data)


def _has_run_window(data: bytes) -> bool:
    """Whether a whole window of `data` is a run (numpy past a few windows: a 70 KB text's 280
    windows cost about 110 µs one by one and 20 µs at once)."""
    if len(data) > _SMALL_TEXT_BYTES:
        return bool(_run_windows(_whole_windows(data)).any())
    starts = range(0, len(data) - WINDOW_BYTES + 1, WINDOW_BYTES)
    return any(_is_run_window(data, start) for start in starts)


def _is_run_window(data: bytes, start: int) -> bool:
    """Whether the window of `data` from `start` repeats one character (see `_trap_windows`)."""
    probes = data[start : start + WINDOW_BYTES : _PROBE_STEP]
    return probes.count(probes[len(probes) // 2]) * 4 >= len(probes) * 3


def stray_stretches(data: bytes) -> list[Stray]:
    """The stray runs and blobs of `data` (see STRAY_RUN_BYTES): a few passes over the bytes (two
    translations, one numpy comparison, finds), then one step per stretch. A run inside a blob is the
    blob's."""
    blobs = _blobs(data)
    runs = _runs(data)
    if blobs and runs:
        runs = [run for run in runs if not any(start <= run[0] < end for start, end, _ in blobs)]
    return blobs + runs


def _runs(data: bytes) -> list[Stray]:
    """Stretches that repeat one character, or a pattern of up to UTF8_MAX_BYTES bytes: periodic with
    _RUN_LAG first (one numpy comparison), then with the shortest period that holds throughout (a
    longer pattern, such as a JSON list of the same word, is left to the weights)."""
    found: list[Stray] = []
    if len(data) < STRAY_RUN_BYTES:
        return found
    later = np.frombuffer(data.translate(_SPACE_TAB_AS_NUL), dtype=np.uint8)[_RUN_LAG:]
    marks = (later == np.frombuffer(data, dtype=np.uint8)[:-_RUN_LAG]).tobytes()
    start = marks.find(_RUN_MARKS)
    while start >= 0:
        end = marks.find(b"\x00", start)
        end = len(marks) if end < 0 else end
        stretch = data[start : end + _RUN_LAG]
        period = next((p for p in range(1, UTF8_MAX_BYTES + 1) if stretch[p:] == stretch[:-p]), 0)
        if period:
            one_ascii = period == 1 and stretch[0] < 0x80
            found.append((start, end + _RUN_LAG, stretch[0] if one_ascii else -1))
        start = marks.find(_RUN_MARKS, end)
    return found


def _blobs(data: bytes) -> list[Stray]:
    """Stretches of base64's and hex's alphabet a quarter or more digits and capitals (a run of one
    character among them is a run)."""
    found: list[Stray] = []
    if len(data) < STRAY_BLOB_BYTES:
        return found
    marks = data.translate(_ALPHABET_MARKS)
    start = marks.find(_BLOB_MARKS)
    while start >= 0:
        end = marks.find(b" ", start)
        end = len(marks) if end < 0 else end
        stretch = data[start:end]
        single = stretch.count(stretch[0]) == len(stretch)  # a run of one character: see `_runs`
        if not single and len(stretch.translate(None, _NOT_DIGIT_UPPER)) * TRAP_DIGIT_SHARE >= len(stretch):
            found.append((start, end, -1))
        start = marks.find(_BLOB_MARKS, end)
    return found


def _trap_kinds(data: bytes) -> _Counts:
    """Per whole window of `data`: 0, _BLOB or _RUN (see `_trap_windows`)."""
    if len(data) > _SMALL_TEXT_BYTES:
        return _trap_windows(data)
    return np.array(_trap_windows_small(data), dtype=np.intp)


def _has_trap(data: bytes) -> bool:
    """Whether any whole window of `data` is a trap (a short text's without building an array)."""
    if len(data) <= _SMALL_TEXT_BYTES:
        return any(_trap_windows_small(data))
    return bool(_trap_kinds(data).any())


def _trap_windows_small(data: bytes) -> list[int]:
    """`_trap_windows` for a few windows, with bytes methods: a dozen numpy calls on small arrays cost
    more than the work itself (about 40 µs for a 2 KB chat message against about 5 µs here)."""
    if len(data) < WINDOW_BYTES:
        return []
    whitespace = data.translate(_WHITESPACE_ONES)
    codes = b""
    kinds = []
    for start in range(0, len(data) - WINDOW_BYTES + 1, WINDOW_BYTES):
        end = start + WINDOW_BYTES
        if _is_run_window(data, start):
            kinds.append(_RUN)
            continue
        if whitespace.count(1, start, end) * TRAP_BYTES_PER_SPACE >= WINDOW_BYTES:
            kinds.append(0)
            continue
        codes = codes or data.translate(_BLOB_CODES)
        blob = (
            codes.count(_NON_ASCII, start, end) == 0
            and codes.count(_DELIMITER, start, end) * TRAP_BYTES_PER_DELIMITER < WINDOW_BYTES
            and codes.count(_DIGIT_UPPER, start, end) * TRAP_DIGIT_SHARE >= WINDOW_BYTES
        )
        kinds.append(_BLOB if blob else 0)
    return kinds


def _trap_windows(data: bytes) -> _Counts:
    """Per whole window: _BLOB when it is a blob (ASCII, little whitespace, almost no delimiters, a
    quarter or more digits and capitals), _RUN when one character repeats
    (every 12th byte probed: that lands on the same byte of each 1-, 2-, 3- or 4-byte character), else
    0. A last, partial window is never a trap. Only windows with little whitespace are read further."""
    windows = _whole_windows(data)
    whole = windows.size
    kinds = np.where(_run_windows(windows), _RUN, 0)
    whitespace = (windows <= _SPACE_BYTE).view(np.uint8).sum(axis=1, dtype=np.uint16)
    candidates = np.flatnonzero(
        (whitespace.astype(np.intp) * TRAP_BYTES_PER_SPACE < WINDOW_BYTES) & (kinds == 0)
    )
    if len(candidates):
        codes = np.frombuffer(data[:whole].translate(_BLOB_CODES), dtype=np.uint8).reshape(-1, WINDOW_BYTES)
        chosen = codes[candidates]
        blob = (
            (_per_window(chosen, _NON_ASCII) == 0)
            & (_per_window(chosen, _DELIMITER) * TRAP_BYTES_PER_DELIMITER < WINDOW_BYTES)
            & (_per_window(chosen, _DIGIT_UPPER) * TRAP_DIGIT_SHARE >= WINDOW_BYTES)
        )
        kinds[candidates[blob]] = _BLOB
    return kinds


def _whole_windows(data: bytes) -> np.ndarray[tuple[int, int], np.dtype[np.uint8]]:
    """`data`'s whole windows, one a row (a last, partial window left out)."""
    whole = len(data) // WINDOW_BYTES * WINDOW_BYTES
    return np.frombuffer(data, dtype=np.uint8, count=whole).reshape(-1, WINDOW_BYTES)


def _run_windows(
    windows: np.ndarray[tuple[int, int], np.dtype[np.uint8]],
) -> np.ndarray[tuple[int], np.dtype[np.bool_]]:
    """Per window: whether it is a run (see `_is_run_window`)."""
    probes = windows[:, ::_PROBE_STEP]
    middle = probes[:, probes.shape[1] // 2 : probes.shape[1] // 2 + 1]
    same = (probes == middle).view(np.uint8).sum(axis=1, dtype=np.uint16)
    runs: np.ndarray[tuple[int], np.dtype[np.bool_]] = same.astype(np.intp) * 4 >= probes.shape[1] * 3
    return runs


def _per_window(windows: np.ndarray[tuple[int, int], np.dtype[np.uint8]], code: int) -> _Counts:
    """How many bytes of each window have this code."""
    counts: _Counts = (windows == code).view(np.uint8).sum(axis=1, dtype=np.uint16).astype(np.intp)
    return counts
