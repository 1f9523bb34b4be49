"""kvgate's exceptions.

    KvgateError
    ├── ConfigError                 the kvgate YAML file or a CLI flag is wrong; names the key and the line
    ├── RequestError                a client request the gate cannot interpret (its kind says why)
    │   ├── InvalidRequestError       not JSON, not UTF-8, a missing or mistyped field, too deep
    │   ├── BodyTooLargeError         the body, or what it inflates to, is past the configured limit
    │   └── UnsupportedEncodingError  a Content-Encoding the gate cannot undo
    ├── ListenError                 a server cannot listen where it was told: its port is taken, say
    ├── HeadroomError               talking to an agent failed (the gate treats the node as unknown)
    └── StoreError                  the async queue's store could not be read or written

Running out of capacity is not an exception: it is a refusal returned by the policy. So is the
gateway's own overload (its token counter or body readers busy), which is not the client's fault.
The gate turns a RequestError into a refusal by its class (`kvgate.gate.pipeline.refusal_for`).
"""

from __future__ import annotations


class KvgateError(Exception):
    """Base of every error kvgate raises on purpose."""


class ConfigError(KvgateError):
    """Invalid configuration. The message names the file, line and key when they are known."""


class RequestError(KvgateError):
    """A request body the gate cannot interpret; the message says what was wrong, for the client."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(RequestError):
    """The body is not a JSON request of the API its path names."""


class BodyTooLargeError(RequestError):
    """The body, or what it inflates to, is past the gateway's limit."""


class UnsupportedEncodingError(RequestError):
    """The body's Content-Encoding is not one the gate can undo."""


class ListenError(KvgateError):
    """A server cannot listen on its address; the message names the flag or key that gave it."""


class HeadroomError(KvgateError):
    """An agent could not be reached or answered something unusable."""


class AgentCallError(HeadroomError):
    """A call to an agent went out and got no usable answer (deadline, connection, the agent's own
    error): unlike an agent the caller does not know, the agent may have acted on it."""


class StoreError(KvgateError):
    """The queue's store could not be read or written (unreachable, locked, corrupt)."""
