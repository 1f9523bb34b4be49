"""A blocking HTTP client for tests and checks: one request per connection, every header lowercased."""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass
from typing import Any


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post(
    port: int, path: str, body: bytes | None, headers: dict[str, str] | None = None, timeout: float = 30
) -> Reply:
    """POST `body` (JSON unless `headers` say otherwise) to 127.0.0.1:port; GET when `body` is None."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        all_headers = {"content-type": "application/json", **(headers or {})}
        conn.request("POST" if body is not None else "GET", path, body=body, headers=all_headers)
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()


def post_until_admitted(port: int, body: bytes, timeout: float = 10.0) -> Reply:
    """POST a chat until it is answered 200 or `timeout` s pass; the last reply. A gate's first
    Subscribe to its agents may still be in its (TLS) handshake: 429/503 until it sees them."""
    deadline = time.monotonic() + timeout
    while True:
        reply = post(port, "/v1/chat/completions", body)
        if reply.status == 200 or time.monotonic() > deadline:
            return reply
        time.sleep(0.2)


def chat(text: str, **extra: Any) -> bytes:
    return json.dumps(
        {"model": "test-model", "messages": [{"role": "user", "content": text}], **extra}
    ).encode()
