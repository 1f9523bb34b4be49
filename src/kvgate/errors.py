"""kvgate's exceptions.

    KvgateError
    ├── ConfigError        the kvgate YAML file or a CLI flag is wrong; names the key and the line
    ├── RequestError       a client request the gate refuses to interpret (carries HTTP status and code)
    └── HeadroomError      talking to an agent failed (the gate treats the node as unknown)

Running out of capacity is not an exception: it is a refusal returned by the policy.
"""

from __future__ import annotations


class KvgateError(Exception):
    """Base of every error kvgate raises on purpose."""


class ConfigError(KvgateError):
    """Invalid configuration. The message names the file, line and key when they are known."""


class RequestError(KvgateError):
    """A request body the gate cannot interpret, mapped to an OpenAI-style error response."""

    def __init__(
        self, status: int, code: str, message: str, error_type: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.error_type = error_type


class HeadroomError(KvgateError):
    """An agent could not be reached or answered something unusable."""
