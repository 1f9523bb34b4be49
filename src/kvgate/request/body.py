"""Turn the raw HTTP body into JSON bytes: content-type checks and bounded decompression."""

from __future__ import annotations

import zlib

from kvgate.errors import BodyTooLargeError, InvalidRequestError, UnsupportedEncodingError

_CHUNK = 256 * 1024


def is_json_content_type(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """Undo `Content-Encoding`, never producing more than `max_bytes` (a zip bomb gets 413)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    elif encoding == "deflate":
        wbits = zlib.MAX_WBITS
    else:
        raise UnsupportedEncodingError(
            f"Content-Encoding {encoding!r} is not supported; send identity, gzip or deflate."
        )
    inflater = zlib.decompressobj(wbits)
    parts: list[bytes] = []
    produced = 0
    data = body
    try:
        while data:
            chunk = inflater.decompress(data, _CHUNK)
            produced += len(chunk)
            if produced > max_bytes:
                raise _too_big(max_bytes)
            parts.append(chunk)
            data = inflater.unconsumed_tail
        tail = inflater.flush()
    except zlib.error as exc:
        raise InvalidRequestError(f"The {encoding} body could not be decompressed: {exc}.") from exc
    if produced + len(tail) > max_bytes:
        raise _too_big(max_bytes)
    if not inflater.eof:
        raise InvalidRequestError(f"The {encoding} body is truncated.")
    parts.append(tail)
    return b"".join(parts)


def _too_big(max_bytes: int) -> BodyTooLargeError:
    return BodyTooLargeError(
        f"The request body decompresses to more than {max_bytes} bytes, the gateway's limit."
    )
