"""Turn the raw HTTP body into JSON bytes: content-type checks and bounded decompression."""

from __future__ import annotations

import zlib
from typing import overload

from kvgate.errors import BodyTooLargeError, InvalidRequestError, UnsupportedEncodingError

_CHUNK = 256 * 1024

# A request body as the gate holds it: one message's bytes, or the pieces of a streamed body gathered
# in one buffer (not copied again to make bytes of them).
Body = bytes | bytearray


def is_json_content_type(content_type: str | None) -> bool:
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


@overload
def decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes: ...
@overload
def decompress(body: Body, content_encoding: str | None, max_bytes: int) -> Body: ...
def decompress(body: Body, content_encoding: str | None, max_bytes: int) -> Body:
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
    compressed = memoryview(body)
    data: memoryview | bytes = b""
    try:
        # The input goes in by slices: what zlib has not consumed yet comes back as a copy
        # (unconsumed_tail), so handing it the whole body would copy the rest of it at every step.
        for start in range(0, len(compressed), _CHUNK):
            data = compressed[start : start + _CHUNK]
            while data and not inflater.eof:
                chunk = inflater.decompress(data, _CHUNK)
                produced += len(chunk)
                if produced > max_bytes:
                    raise _too_big(max_bytes)
                parts.append(chunk)
                data = inflater.unconsumed_tail
            if inflater.eof:
                break
        tail = inflater.flush()
    except zlib.error as exc:
        raise InvalidRequestError(f"The {encoding} body could not be decompressed: {exc}.") from exc
    finally:
        # A refusal's traceback keeps this frame: a view left in it would pin the caller's buffer,
        # which a body that comes in pieces grows.
        data = b""
        compressed.release()
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
