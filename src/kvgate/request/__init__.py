"""Request understanding: from path, headers and body bytes to a RequestShape (pure, no I/O)."""

from kvgate.request.apis import api_for_path
from kvgate.request.body import Body, decompress, is_json_content_type
from kvgate.request.parse import ParseLimits, parse_body
from kvgate.request.shape import Api, RequestShape

__all__ = [
    "Api",
    "Body",
    "ParseLimits",
    "RequestShape",
    "api_for_path",
    "decompress",
    "is_json_content_type",
    "parse_body",
]
