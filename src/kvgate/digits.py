"""Whole numbers read from text someone else wrote: a header, a query string, gRPC metadata, a label
on an engine's metrics page. One reader, so that no caller meets the traps twice.

The traps: `str.isdigit()` is true for '²' (which `int()` then refuses: the 0xB2 byte of a latin-1
header) and for the digits of other scripts, Arabic-Indic or full-width (which `int()` quietly reads
as ASCII ones); and `int()` of a few thousand digits raises (Python's limit on integer string
conversion). Here only ASCII digits count, with optional spaces or tabs around them (HTTP's optional
whitespace); no sign, no decimal point, no underscore, and the length is checked before anything is
converted, so reading never raises.
"""

from __future__ import annotations

from dataclasses import dataclass

# Long enough to show what the value was, short enough for a log line or an error message.
_SHOWN = 40
# The bound of a number that has no smaller natural one (a label on an engine's metrics page).
INT64_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class NotWhole:
    """Why a text is not a whole number in range: for a log line, or the message of a 400."""

    text: str
    minimum: int
    maximum: int

    def describe(self, name: str) -> str:
        """`limit: 'lots' is not a whole number from 1 to 10000`."""
        shown = self.text if len(self.text) <= _SHOWN else self.text[:_SHOWN] + "…"
        return f"{name}: {shown!r} is not a whole number from {self.minimum} to {self.maximum}"


def read_whole(text: str, *, maximum: int, minimum: int = 0) -> int | NotWhole:
    """`text` as a whole number from `minimum` to `maximum`, or why it is not one."""
    digits = text.strip(" \t")
    significant = digits.lstrip("0") or "0"
    if (
        not digits
        or not (digits.isascii() and digits.isdigit())
        or len(significant) > len(str(maximum))
        or not minimum <= int(significant) <= maximum
    ):
        return NotWhole(text, minimum, maximum)
    return int(significant)


def whole_number(text: str | None, *, maximum: int, minimum: int = 0) -> int | None:
    """`text` as a whole number from `minimum` to `maximum`; None when it is absent or anything else
    (empty, signed, decimal, out of range, digits of another script)."""
    if text is None:
        return None
    value = read_whole(text, maximum=maximum, minimum=minimum)
    return value if isinstance(value, int) else None
