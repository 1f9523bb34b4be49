"""RS256 JSON Web Tokens made with the openssl command line, for the tests and the demo's tenants.

An RS256 signature is RSASSA-PKCS1-v1_5 over SHA-256 (RFC 7518 section 3.3), which is what
`openssl dgst -sha256 -sign` writes; the JWKS holds the key's modulus and exponent (RFC 7518 6.3.1).
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _openssl(*args: str, data: bytes | None = None) -> bytes:
    done = subprocess.run(["openssl", *args], input=data, check=True, capture_output=True, timeout=30)
    return done.stdout


@dataclass(frozen=True)
class Signer:
    key: Path
    kid: str

    @classmethod
    def create(cls, directory: Path, kid: str = "test-key") -> Signer:
        key = directory / f"{kid}.pem"
        _openssl("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key))
        return cls(key, kid)

    def jwks(self) -> str:
        modulus = _openssl("rsa", "-in", str(self.key), "-noout", "-modulus").decode().strip()
        n = bytes.fromhex(modulus.removeprefix("Modulus="))
        key = {"kty": "RSA", "alg": "RS256", "use": "sig", "kid": self.kid, "n": _b64url(n), "e": "AQAB"}
        return json.dumps({"keys": [key]})

    def token(self, issuer: str, lifetime_s: int = 600, **claims: Any) -> str:
        now = int(time.time())
        header = {"alg": "RS256", "typ": "JWT", "kid": self.kid}
        payload = {"iss": issuer, "iat": now, "exp": now + lifetime_s, **claims}
        signed = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(payload).encode())}"
        signature = _openssl("dgst", "-sha256", "-sign", str(self.key), data=signed.encode())
        return f"{signed}.{_b64url(signature)}"
