"""Which inference API a request path belongs to."""

from __future__ import annotations

from kvgate.request.shape import Api

# Suffix match so that prefixed mounts (`/openai/v1/chat/completions`) are recognised too.
_SUFFIXES: tuple[tuple[str, Api], ...] = (
    ("/v1/chat/completions", Api.CHAT),
    ("/v1/completions", Api.COMPLETIONS),
    ("/v1/responses", Api.RESPONSES),
    ("/v1/embeddings", Api.EMBEDDINGS),
    ("/v1/messages", Api.ANTHROPIC_MESSAGES),
)


def api_for_path(path: str) -> Api | None:
    """The API a request path addresses, or None for paths the gate does not interpret."""
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, api in _SUFFIXES:
        if path.endswith(suffix):
            return api
    return None
