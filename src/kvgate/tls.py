"""TLS settings and the PEM files behind them: the `tls:` config section, read again when they change.

Two links can be encrypted (docs/tls.md):
- Envoy -> gate (`tls.server`): the gate serves `cert` + `key`; with `client_ca` it also demands a client
  certificate signed by that CA (mTLS), so only an Envoy holding one can call it.
- gate -> agents (`tls.agents`): the gate checks the agents' certificates against `ca` and, with `cert` +
  `key`, presents a client certificate. An agent started with `--tls-client-ca` accepts only gates that
  do: every RPC on its port, Reserve and Release included, needs one.

Certificates rotate (cert-manager, a renewed Secret) without a restart: PemFiles notices a change by the
files' stat signature (inode, size, mtime) and reads them again. A rotation caught half-way (a key that
does not match its certificate, a file replaced during the read, a missing file) is logged and the
previous files stay in use until the next look. This module is stdlib only, since the config imports
it; the gRPC credentials built from it live in kvgate.headroom.credentials.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass, field

from kvgate.bounds import at_least
from kvgate.errors import ConfigError

log = logging.getLogger(__name__)

# (inode, size, mtime_ns) of each file, in a fixed order; None for a file that is not configured.
Signature = tuple[tuple[int, int, int] | None, ...]


@dataclass(frozen=True, slots=True)
class ServerTls:
    """A TLS listener: the gate's ext_proc port, or an agent's port."""

    cert: str | None = None
    key: str | None = None
    # Set: every client must present a certificate signed by this CA, checked at the handshake (mTLS).
    client_ca: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("cert and key must be given together")
        if self.client_ca is not None and self.cert is None:
            raise ConfigError("client_ca needs cert and key: client certificates are checked over TLS")

    @property
    def enabled(self) -> bool:
        return self.cert is not None

    def open_files(self, where: str) -> PemFiles:
        return PemFiles(self.cert, self.key, self.client_ca, where)


def describe(tls: ServerTls | None) -> str:
    """How a listener is secured, for the line that says it started."""
    if tls is None or not tls.enabled:
        return "plaintext"
    if tls.client_ca is not None:
        return "mTLS: client certificates required"
    return "TLS"


@dataclass(frozen=True, slots=True)
class ClientTls:
    """The gate's channels to agents."""

    # Set: TLS to every agent, whose certificate must be signed by this CA.
    ca: str | None = None
    # The gate's client certificate, for agents started with --tls-client-ca.
    cert: str | None = None
    key: str | None = None
    # Name the agents' certificates carry, when it is not the host of their address (agents found by IP).
    server_name: str | None = None
    # How often the gate looks at these files; a change reconnects every agent channel.
    reload_interval_s: float = field(default=10.0, metadata=at_least(0.01))

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("cert and key must be given together")
        if self.ca is None and (self.cert is not None or self.server_name is not None):
            raise ConfigError(
                "cert, key and server_name need ca: without it the agent channels are plaintext"
            )

    @property
    def enabled(self) -> bool:
        return self.ca is not None

    def open_files(self, where: str) -> PemFiles:
        return PemFiles(self.cert, self.key, self.ca, where)


@dataclass(frozen=True, slots=True)
class TlsConfig:
    server: ServerTls = ServerTls()
    agents: ClientTls = ClientTls()

    def check_files(self) -> None:
        """ConfigError now, before workers start, when a configured file is missing or unusable."""
        if self.server.enabled:
            self.server.open_files("tls.server")
        if self.agents.enabled:
            self.agents.open_files("tls.agents")


@dataclass(frozen=True, slots=True)
class Pem:
    """The contents of one set of files, read together."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None


class PemFiles:
    """A certificate, its key and a CA bundle (each optional), checked and read as one unit.

    The constructor reads them and raises ConfigError naming the file; `refresh` reads them again only
    when their signature changed, and never raises: a failed look keeps `current`.
    """

    def __init__(self, cert: str | None, key: str | None, ca: str | None, where: str) -> None:
        self._paths = (cert, key, ca)
        self._where = where
        self._signature, self.current = self._read()
        self._rejected: Signature | None = None
        self._warned: object = None

    def refresh(self) -> Pem | None:
        """The new contents when a file changed and the new set is usable; otherwise None."""
        try:
            signature = self._stat()
        except ConfigError as exc:
            self._warn_once(str(exc), exc)
            return None
        if signature in (self._signature, self._rejected):
            return None
        try:
            self._signature, self.current = self._read()
        except ConfigError as exc:
            # Not read again until a file changes once more: refresh runs on every new connection.
            self._rejected = signature
            self._warn_once(signature, exc)
            return None
        self._rejected = self._warned = None
        log.info("%s: certificate files changed; new connections use them", self._where)
        return self.current

    def _warn_once(self, state: object, exc: ConfigError) -> None:
        # One warning per broken state, not one per handshake while it lasts.
        if state != self._warned:
            log.warning("%s; keeping the certificates loaded before", exc)
        self._warned = state

    def _read(self) -> tuple[Signature, Pem]:
        before = self._stat()
        self._check()
        cert, key, ca = (None if path is None else self._bytes(path) for path in self._paths)
        after = self._stat()
        if before != after:
            raise ConfigError(f"{self._where}: certificate files changed while being read (a rotation?)")
        return after, Pem(cert, key, ca)

    def _check(self) -> None:
        """Let OpenSSL parse the files: a key that does not match its certificate fails here, not in gRPC."""
        cert, key, ca = self._paths
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            if cert is not None:
                # An empty password makes an encrypted key fail instead of prompting on the terminal.
                context.load_cert_chain(cert, key, password=b"")
            if ca is not None:
                context.load_verify_locations(cafile=ca)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"{self._where}: {cert} / {key} / {ca}: not a usable PEM set ({exc.reason or exc}; "
                "keys must be unencrypted and match their certificate)"
            ) from exc
        except OSError as exc:
            raise ConfigError(f"{self._where}: cannot read {exc.filename}: {exc.strerror}") from exc

    def _stat(self) -> Signature:
        return tuple(None if path is None else self._stat_one(path) for path in self._paths)

    def _stat_one(self, path: str) -> tuple[int, int, int]:
        try:
            # Follows symlinks: a Kubernetes Secret volume rotates by swapping a link to new files.
            status = os.stat(path)
        except OSError as exc:
            raise ConfigError(f"{self._where}: cannot read {path}: {exc.strerror}") from exc
        return status.st_ino, status.st_size, status.st_mtime_ns

    def _bytes(self, path: str) -> bytes:
        try:
            with open(path, "rb") as file:
                return file.read()
        except OSError as exc:
            raise ConfigError(f"{self._where}: cannot read {path}: {exc.strerror}") from exc
