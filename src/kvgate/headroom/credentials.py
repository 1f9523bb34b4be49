"""gRPC credentials from kvgate.tls's PEM files, for the gate's and the agents' listeners and the gate's
channels to agents.

Servers use grpc's dynamic SSL credentials: gRPC asks for a certificate configuration at every new
connection's handshake, and the fetcher answers with the files read again when they changed (or None,
"keep the current one"). Open connections keep the certificate they were made with.
Client credentials cannot change under a channel, so ChannelSecurity rebuilds them when the files
change and whoever owns the channels (the headroom view) reopens them.
`speaks_tls` asks a port whether it serves TLS at all, for the error of a client that could not connect
(gRPC then says only "Socket closed").
"""

from __future__ import annotations

import contextlib
import socket
import ssl

import grpc

from kvgate.errors import ListenError
from kvgate.tls import ClientTls, Pem, ServerTls

# A TLS record's first bytes: its content type (handshake or alert) and the major version, 3 since SSL 3.0.
_TLS_RECORD_TYPES = frozenset({22, 21})
_TLS_MAJOR_VERSION = 3


def _server_configuration(pem: Pem) -> grpc.ServerCertificateConfiguration:
    assert pem.cert is not None and pem.key is not None, "ServerTls pairs cert and key"
    return grpc.ssl_server_certificate_configuration([(pem.key, pem.cert)], root_certificates=pem.ca)


def server_credentials(tls: ServerTls, where: str) -> grpc.ServerCredentials:
    """Credentials that re-read `tls`'s files on change; raises ConfigError when they are unusable now."""
    files = tls.open_files(where)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        pem = files.refresh()
        return None if pem is None else _server_configuration(pem)

    return grpc.dynamic_ssl_server_credentials(
        _server_configuration(files.current),
        fetch,
        require_client_authentication=tls.client_ca is not None,
    )


def add_port(server: grpc.aio.Server, listen: str, key: str, tls: ServerTls | None, where: str) -> int:
    """Listen on `listen` (given by the flag or config key `key`) with TLS when `tls` is enabled, in
    plaintext otherwise; returns the bound port. ListenError when gRPC cannot bind it."""
    credentials = None if tls is None or not tls.enabled else server_credentials(tls, where)
    try:
        if credentials is None:
            return int(server.add_insecure_port(listen))
        return int(server.add_secure_port(listen, credentials))
    except RuntimeError as exc:
        # gRPC says only "Failed to bind" (its own log line has the errno).
        raise ListenError(
            f"{key} {listen}: cannot listen there (the port in use, or the address not this machine's)"
        ) from exc


class ChannelSecurity:
    """Credentials for TLS channels to agents, rebuilt by `refresh` when their files changed."""

    def __init__(self, tls: ClientTls, where: str = "tls.agents") -> None:
        assert tls.enabled, "plaintext channels need no ChannelSecurity"
        self.settings = tls
        self._files = tls.open_files(where)
        self.credentials = _channel_credentials(self._files.current)

    def refresh(self) -> bool:
        """True when the files changed and `credentials` now hold the new ones."""
        pem = self._files.refresh()
        if pem is None:
            return False
        self.credentials = _channel_credentials(pem)
        return True

    def options(self) -> list[tuple[str, str]]:
        if self.settings.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.settings.server_name)]


def _channel_credentials(pem: Pem) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=pem.ca, private_key=pem.key, certificate_chain=pem.cert
    )


def open_channel(
    address: str, options: list[tuple[str, int]], security: ChannelSecurity | None
) -> grpc.aio.Channel:
    if security is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, security.credentials, options=[*options, *security.options()])


def speaks_tls(host: str, port: int, timeout_s: float) -> bool | None:
    """Whether the server at host:port answers a TLS ClientHello with a TLS record (its handshake, or an
    alert); None when it cannot be reached. Nothing is verified: it tells TLS from plaintext, no more."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    outgoing = ssl.MemoryBIO()
    client = context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname=host)
    # The handshake stops at once for want of the server's answer, its ClientHello written.
    with contextlib.suppress(ssl.SSLWantReadError):
        client.do_handshake()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as connection:
            connection.sendall(outgoing.read())
            first = connection.recv(2, socket.MSG_WAITALL)
    except OSError:
        return None
    # A plaintext gRPC server answers with an HTTP/2 frame, or closes the connection.
    return len(first) == 2 and first[0] in _TLS_RECORD_TYPES and first[1] == _TLS_MAJOR_VERSION
