"""A throwaway PKI for TLS tests, made with the openssl command line: CAs and the certificates they sign.

EC P-256 keys keep it fast (a few milliseconds per certificate). Re-issuing into existing paths writes
new files beside them and renames them over the old ones, the way rotation tools do.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Authority:
    name: str
    cert: Path
    key: Path

    @classmethod
    def create(cls, directory: Path, name: str) -> Authority:
        cert, key = directory / f"{name}.crt", directory / f"{name}.key"
        _openssl(
            "req", "-x509", *_EC, "-keyout", str(key), "-out", str(cert), "-days", "2",
            "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        )  # fmt: skip
        return cls(name, cert, key)

    def issue(self, directory: Path, name: str, sans: str, into: Issued | None = None) -> Issued:
        """A certificate for `name` (server and client use) with subjectAltName `sans`.

        With `into`, the new key and certificate replace those files (key first, as a rotation would).
        """
        staging = directory / f".{name}.{secrets.token_hex(4)}"
        key, csr, cert, ext = (staging.with_suffix(s) for s in (".key", ".csr", ".crt", ".ext"))
        ext.write_text(
            f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth\n"
            "keyUsage=critical,digitalSignature\nbasicConstraints=critical,CA:FALSE\n"
        )
        _openssl("req", "-new", *_EC, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={name}")
        _openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(self.cert), "-CAkey", str(self.key),
            "-set_serial", str(secrets.randbits(63)), "-days", "2", "-out", str(cert), "-extfile", str(ext),
        )  # fmt: skip
        csr.unlink()
        ext.unlink()
        target = into or Issued(directory / f"{name}.crt", directory / f"{name}.key")
        os.replace(key, target.key)
        os.replace(cert, target.cert)
        return target
